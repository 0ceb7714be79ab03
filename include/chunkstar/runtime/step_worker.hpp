// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `step_worker`: one background thread that runs jobs by priority — the host updates of
 *         chunks stepped early, so the thread that queues backward's work goes on while they run
 *         (optimizer_pass's early steps) — optionally at the OS's idle priority; and `next_job`,
 *         its choice of the next job (a pure function).
 */
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

namespace chunkstar {

/** @brief A job waiting on a step_worker, as its choice of the next one sees it. */
struct waiting_job {
  std::size_t priority = 0;  ///< lower runs sooner
  std::size_t order = 0;     ///< submission order: of equal priorities, the earlier first
  bool ready = true;         ///< its inputs have arrived: it would start without waiting
};

/** @brief Which of @p waiting (not empty) runs next, as an index: of those ready, the lowest
 *  priority value, the earliest of equals — a worker with work that can start does not idle
 *  waiting for inputs still on their way (an update's lists coming down from the device); where
 *  none is ready, the earliest submitted, whose inputs were sent first and, on lanes that copy in
 *  order, land first (the lowest priority would be the gradient backward makes final last, while
 *  the one before it lands: measured in docs/performance.md, "The host ahead of the device"). */
[[nodiscard]] inline std::size_t next_job(std::span<const waiting_job> waiting) noexcept {
  const auto before = [&](std::size_t a, std::size_t b) {
    return waiting[a].priority != waiting[b].priority ? waiting[a].priority < waiting[b].priority
                                                      : waiting[a].order < waiting[b].order;
  };
  std::size_t earliest = 0, first_ready = waiting.size();
  for (std::size_t i = 0; i < waiting.size(); ++i) {
    if (waiting[i].order < waiting[earliest].order) earliest = i;
    if (waiting[i].ready && (first_ready == waiting.size() || before(i, first_ready))) first_ready = i;
  }
  return first_ready != waiting.size() ? first_ready : earliest;
}

/** @brief Runs jobs one at a time on a thread of its own, started by the first job, in the order
 *  next_job() chooses: of those waiting, the one with the lowest priority value first, equal ones
 *  in the order given (the early steps pass each chunk's next use, so the update the next forward
 *  needs first runs first), of those whose inputs have arrived where any has. A job that throws
 *  does not stop the others; wait() rethrows the first failure. The destructor waits for the jobs
 *  queued and never throws. */
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

  /** @brief Queues @p job. @p ready (empty: always) says, without blocking, whether its inputs have
   *  arrived; it is called on the worker's thread, under the worker's lock, while the job waits.
   *  @throws what starting the thread throws (std::system_error; the job is then not queued:
   *  nothing runs it). */
  void submit(std::function<void()> job, std::size_t priority = 0, std::function<bool()> ready = {}) {
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    {
      const std::lock_guard lock(mutex_);
      queue_.push_back({priority, submitted_++, std::move(job), std::move(ready)});
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
    std::function<bool()> ready;
  };
  void loop() {
    if (background_) lower_priority();
    std::unique_lock lock(mutex_);
    std::vector<waiting_job> waiting;
    for (;;) {
      work_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      const auto next = queue_.begin() + static_cast<std::ptrdiff_t>(choose(waiting));
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

  /** next_job() over the queue (a job whose ready() throws counts as not ready); where the list
   *  cannot be made (no memory), the earliest submitted. Called under the lock. */
  std::size_t choose(std::vector<waiting_job>& waiting) noexcept {
    try {
      waiting.clear();
      for (const job& j : queue_) {
        bool ready = true;
        try {
          ready = !j.ready || j.ready();
        } catch (...) {  // cannot tell: it may have to wait
          ready = false;
        }
        waiting.push_back({j.priority, j.order, ready});
      }
      return next_job(waiting);
    } catch (...) {
      return 0;  // the earliest submitted
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
