// SPDX-License-Identifier: Apache-2.0
// step_worker, the thread that runs early optimizer updates: jobs run in order on one thread that
// is not the caller's, wait() returns once all have run and rethrows the first failure once, and
// the destructor runs what is queued.
#include <chunkstar/runtime/step_worker.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

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

}  // namespace step_worker_test
}  // namespace chunkstar
