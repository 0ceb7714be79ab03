// SPDX-License-Identifier: Apache-2.0
// step_worker, the thread that runs early optimizer updates: jobs run in order on one thread that
// is not the caller's, wait() returns once all have run and rethrows the first failure once, and
// the destructor runs what is queued; a background worker's thread (and the threads it starts)
// run at the OS's idle priority, the caller's untouched.
#include <chunkstar/runtime/step_worker.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

namespace chunkstar {
namespace step_worker_test {

TEST_CASE("step_worker: jobs in order on another thread; wait() rethrows the first failure once") {
  step_worker w;
  std::vector<int> order;
  std::thread::id ran_on;
  for (int i = 0; i < 50; ++i)
    w.submit([&, i] {
      order.push_back(i);
      ran_on = std::this_thread::get_id();
    });
  w.wait();
  CHECK(w.in_flight() == 0);
  REQUIRE(order.size() == 50);
  for (int i = 0; i < 50; ++i) CHECK(order[static_cast<std::size_t>(i)] == i);
  CHECK(ran_on != std::this_thread::get_id());
  w.submit([] { throw std::runtime_error("first"); });
  w.submit([] { throw std::logic_error("second"); });
  int after = 0;
  w.submit([&] { after = 1; });  // a failure does not stop the jobs after it
  CHECK_THROWS_WITH_AS(w.wait(), "first", std::runtime_error);
  CHECK(after == 1);
  CHECK_NOTHROW(w.wait());  // reported once
}

TEST_CASE("step_worker: the destructor runs the jobs queued; a worker never given one starts no thread") {
  std::atomic<int> ran{0};
  {
    step_worker w;
    for (int i = 0; i < 20; ++i) w.submit([&] { ran.fetch_add(1); });
  }
  CHECK(ran.load() == 20);
  step_worker idle;
  CHECK_NOTHROW(idle.wait());
}

#if defined(__linux__) && defined(SCHED_IDLE)
namespace {
int policy_of_this_thread() {
  int policy = -1;
  sched_param p{};
  REQUIRE(::pthread_getschedparam(::pthread_self(), &policy, &p) == 0);
  return policy;
}
}  // namespace

TEST_CASE("step_worker: a background worker runs its jobs, and the threads they start, at the idle priority") {
  const int caller = policy_of_this_thread();
  int job = -1, started = -1, plain = -1;
  {
    step_worker w(true);
    CHECK(w.background());
    w.submit([&] {
      job = policy_of_this_thread();
      std::thread t([&] { started = policy_of_this_thread(); });  // an OpenMP team's threads, say
      t.join();
    });
    w.wait();
  }
  step_worker normal;
  CHECK_FALSE(normal.background());
  normal.submit([&] { plain = policy_of_this_thread(); });
  normal.wait();
  CHECK(job == SCHED_IDLE);
  CHECK(started == SCHED_IDLE);
  CHECK(plain == caller);
  CHECK(policy_of_this_thread() == caller);  // the caller's thread keeps its priority
}
#endif

}  // namespace step_worker_test
}  // namespace chunkstar
