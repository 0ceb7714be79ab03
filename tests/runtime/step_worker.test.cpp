// SPDX-License-Identifier: Apache-2.0
// step_worker, the thread that runs early optimizer updates: jobs run in order on one thread that
// is not the caller's, wait() returns once all have run and rethrows the first failure once, and
// the destructor runs what is queued; a background worker's thread (and the threads it starts)
// run at the OS's idle priority, the caller's untouched. next_job, its choice: by priority among
// the jobs whose inputs have arrived; where none has, the earliest submitted.
#include <chunkstar/runtime/step_worker.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
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

TEST_CASE(
    "next_job: of the ready jobs the lowest priority, the earliest of equals; none ready, the earliest submitted") {
  using W = waiting_job;
  const std::vector<W> all_ready{{5, 0, true}, {2, 1, true}, {2, 2, true}, {9, 3, true}};
  CHECK(next_job(all_ready) == 1);
  // The first by priority still waits for its inputs: the first ready one in the same order goes.
  const std::vector<W> top_waits{{5, 0, true}, {2, 1, false}, {7, 2, true}, {3, 3, true}, {3, 4, true}};
  CHECK(next_job(top_waits) == 3);
  // None ready: the earliest submitted (its inputs were sent first), not the first by priority.
  const std::vector<W> none_ready{{4, 2, false}, {1, 1, false}, {1, 3, false}, {6, 0, false}};
  CHECK(next_job(none_ready) == 3);
  CHECK(next_job(std::vector<W>{{0, 7, false}}) == 0);
  // Equal priorities: submission order decides among the ready ones too.
  const std::vector<W> equal{{1, 3, false}, {1, 5, true}, {1, 4, true}};
  CHECK(next_job(equal) == 2);
}

TEST_CASE(
    "step_worker: a job whose inputs have not arrived waits behind ready ones, and none ready, the earliest goes") {
  step_worker w;
  std::mutex m;
  std::condition_variable cv;
  bool release = false;
  std::atomic<bool> arrived{false};
  std::vector<int> order;
  const auto hold = [&] {  // holds the worker until the others are queued, so that it chooses among all
    std::unique_lock lock(m);
    cv.wait(lock, [&] { return release; });
  };
  const auto go = [&] {
    {
      const std::lock_guard lock(m);
      release = true;
    }
    cv.notify_one();
    w.wait();
  };
  w.submit(hold);
  w.submit([&] { order.push_back(0); }, 0, [&] { return arrived.load(); });  // first by priority, not ready
  w.submit([&] { order.push_back(1); }, 1);
  w.submit(
      [&] {
        order.push_back(2);
        arrived = true;  // its inputs arrive while the others run
      },
      2);
  go();
  CHECK(order == std::vector<int>{1, 2, 0});
  // None ready: the one submitted first runs first (and waits for its inputs itself).
  order.clear();
  {
    const std::lock_guard lock(m);
    release = false;
  }
  w.submit(hold);
  w.submit([&] { order.push_back(5); }, 5, [] { return false; });
  w.submit([&] { order.push_back(0); }, 0, [] { return false; });
  go();
  CHECK(order == std::vector<int>{5, 0});
  // A ready() that throws counts as not ready; the job still runs.
  bool ran = false;
  w.submit([&] { ran = true; }, 0, []() -> bool { throw std::runtime_error("cannot tell"); });
  w.wait();
  CHECK(ran);
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
