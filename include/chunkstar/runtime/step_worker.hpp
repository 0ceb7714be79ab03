// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `step_worker`: one background thread that runs jobs in the order given — the host
 *         updates of chunks stepped early, so the thread that queues backward's work goes on
 *         while they run (optimizer_pass's early steps) — optionally at the OS's idle priority.
 */
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

namespace chunkstar {

/** @brief Runs jobs one at a time on a thread of its own, started by the first job: of those
 *  waiting, the one with the lowest priority value first, equal ones in the order given (the
 *  early steps pass each chunk's next use, so the update the next forward needs first runs first).
 *  A job that throws does not stop the others; wait() rethrows the first failure. The destructor
 *  waits for the jobs queued and never throws. */
class step_worker {
 public:
  step_worker() = default;
  /** @brief With @p background, the worker's thread runs at the OS's idle priority (Linux:
   *  SCHED_IDLE; elsewhere, or where the OS refuses, the normal one), and so do the threads it
   *  creates, an OpenMP team included where the runtime creates teams per thread (GCC's libgomp):
   *  a thread of normal priority that wakes takes a core from them at once, instead of waiting up
   *  to a scheduler slice. The jobs then run only on cores nothing else wants. */
  explicit step_worker(bool background) : background_(background) {}
  step_worker(const step_worker&) = delete;
  step_worker& operator=(const step_worker&) = delete;
  ~step_worker() {
    {
      const std::lock_guard lock(mutex_);
      stop_ = true;
    }
    work_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

  /** @brief Queues @p job. @throws what starting the thread throws (std::system_error; the job is
   *  then not queued: nothing runs it). */
  void submit(std::function<void()> job, std::size_t priority = 0) {
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    {
      const std::lock_guard lock(mutex_);
      queue_.push_back({priority, submitted_++, std::move(job)});
    }
    work_.notify_one();
  }

  /** @brief Waits until every job submitted so far has run; rethrows the first failure since the
   *  last wait (once). */
  void wait() {
    std::unique_lock lock(mutex_);
    idle_.wait(lock, [&] { return finished_ == submitted_; });
    if (auto e = std::exchange(failure_, nullptr)) std::rethrow_exception(e);
  }

  /** @brief Whether the worker's thread was asked to run at the idle priority (see the constructor). */
  [[nodiscard]] bool background() const noexcept { return background_; }

  /** @brief Jobs submitted and not yet finished. */
  [[nodiscard]] std::size_t in_flight() const {
    const std::lock_guard lock(mutex_);
    return submitted_ - finished_;
  }

 private:
  struct job {
    std::size_t priority, order;
    std::function<void()> run;
  };
  void loop() {
    if (background_) lower_priority();
    std::unique_lock lock(mutex_);
    for (;;) {
      work_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      const auto next = std::min_element(queue_.begin(), queue_.end(), [](const job& a, const job& b) {
        return a.priority != b.priority ? a.priority < b.priority : a.order < b.order;
      });
      auto run = std::move(next->run);
      queue_.erase(next);
      lock.unlock();
      std::exception_ptr failure;
      try {
        run();
      } catch (...) {
        failure = std::current_exception();
      }
      lock.lock();
      if (failure && !failure_) failure_ = failure;
      ++finished_;
      idle_.notify_all();
    }
  }

  /** The calling thread at the idle priority; best effort (an OS that refuses leaves it as it is). */
  static void lower_priority() noexcept {
#if defined(__linux__) && defined(SCHED_IDLE)
    sched_param none{};
    none.sched_priority = 0;
    (void)::pthread_setschedparam(::pthread_self(), SCHED_IDLE, &none);
#endif
  }

  bool background_ = false;
  mutable std::mutex mutex_;
  std::condition_variable work_, idle_;
  std::deque<job> queue_;
  std::size_t submitted_ = 0, finished_ = 0;
  std::exception_ptr failure_;
  bool stop_ = false;
  std::thread thread_;  // last: started after the members it uses, joined by the destructor first
};

}  // namespace chunkstar
