// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `host_copy_engine`: memcpy on one worker thread per direction, optionally paced to a
 *         modelled link, so a CPU-only run sees the same overlap (or stalls) a PCIe link would give.
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/memory/copy_engine.hpp>

#include <array>
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>

namespace chunkstar {

/** @brief Completion of one job on a `host_copy_engine`. Models `CopyHandle`. */
class host_copy_handle {
 public:
  /** @brief An empty handle: ready, and wait() returns at once. */
  host_copy_handle() = default;
  explicit host_copy_handle(std::shared_future<void> done) noexcept : done_(std::move(done)) {}

  /** @brief True once the job finished (successfully or not); never blocks. */
  [[nodiscard]] bool ready() const {
    return !done_.valid() || done_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }
  /** @brief Blocks until the job finished; rethrows its exception if it failed. */
  void wait() const {
    if (done_.valid()) done_.get();
  }

 private:
  std::shared_future<void> done_;
};

/** @brief Copies bytes between host-addressable spaces (host, pinned host, simulated device).
 *
 *  One worker thread per `copy_direction`, each draining its queue in order (like a CUDA stream);
 *  the directions run concurrently (like full-duplex PCIe). With a modelled link, each `to_device`
 *  or `to_host` copy occupies its worker for max(memcpy time, latency + bytes / bandwidth):
 *  the worker sleeps until the modelled deadline after the memcpy. `host_to_host` copies are never
 *  paced (they model memory bandwidth, which memcpy already is). The destructor finishes every
 *  queued job. Thread-safe. Models `CopyEngine`.
 */
class host_copy_engine {
 public:
  /** @brief An engine whose `to_device`/`to_host` copies follow `model` (default: unmodelled). */
  explicit host_copy_engine(copy_model model = {}) : model_(model) {
    if (model_.bandwidth_bytes_per_s < 0 || model_.latency_s < 0) {
      throw config_error("host_copy_engine: copy_model bandwidth and latency must be >= 0 (0 bandwidth = unmodelled)");
    }
    std::size_t started = 0;
    try {
      for (; started < copy_direction_count; ++started) {
        lanes_[started].worker = std::thread([this, started] { run(lanes_[started], started); });
      }
    } catch (...) {
      stop(started);
      throw;
    }
  }
  host_copy_engine(const host_copy_engine&) = delete;
  host_copy_engine& operator=(const host_copy_engine&) = delete;
  /** @brief Finishes every queued job, then joins the workers. */
  ~host_copy_engine() { stop(copy_direction_count); }

  /** @brief Copies `bytes` and returns once done; ordered and paced like an async copy in `d`. */
  void copy(void* dst, const void* src, std::size_t bytes, copy_direction d) { copy_async(dst, src, bytes, d).wait(); }

  /** @brief Queues a copy behind earlier jobs in `d`. Null pointers (with bytes > 0) or overlapping
   *  ranges make the copy fail with config_error, rethrown by the handle's wait(). */
  host_copy_handle copy_async(void* dst, const void* src, std::size_t bytes, copy_direction d) {
    return enqueue(d, job{[dst, src, bytes] { checked_memcpy(dst, src, bytes); }, {}, bytes, true});
  }

  /** @brief Queues a fill of `bytes` zero bytes at `dst` on the `host_to_host` worker (never paced,
   *  not counted in stats). A null `dst` with bytes > 0 fails with config_error from wait(). */
  host_copy_handle zero_async(void* dst, std::size_t bytes) {
    return enqueue(copy_direction::host_to_host, job{[dst, bytes] { checked_memset(dst, bytes); }, {}, bytes, false});
  }

  /** @brief Jobs submitted to `d` from now on start only after `h` is ready: `d`'s worker waits
   *  for it, the caller does not. A failure of `h` is reported by `h`, not by later jobs. */
  void order_after(const host_copy_handle& h, copy_direction d) {
    if (h.ready()) return;
    auto wait_quietly = [h] {
      try {
        h.wait();
      } catch (...) {  // the job that failed reports it through its own handle
      }
    };
    (void)enqueue(d, job{wait_quietly, {}, 0, false});
  }

  /** @brief A handle for "the user's work so far": on the host that work ran on the calling
   *  thread and is complete, so the handle is ready (the stream contract, trivially). */
  [[nodiscard]] host_copy_handle record(host_stream) const noexcept { return {}; }

  /** @brief Runs `f` on `d`'s worker, in order with that direction's copies (for example a host-side
   *  conversion that must follow a copy). Not counted in stats, not paced; an exception from `f`
   *  is rethrown by the handle's wait(). */
  template <class F>
  requires std::invocable<F&> && std::copy_constructible<std::decay_t<F>> host_copy_handle submit(copy_direction d,
                                                                                                  F&& f) {
    return enqueue(d, job{std::function<void()>(std::forward<F>(f)), {}, 0, false});
  }

  /** @brief Waits until every job submitted so far, in every direction, has finished. */
  void synchronize() {
    for (auto& l : lanes_) {
      std::unique_lock lock(l.mutex);
      l.idle.wait(lock, [&] { return l.pending == 0; });
    }
  }

  /** @brief Bytes, copies and busy seconds of the copies completed so far, per direction. */
  [[nodiscard]] copy_stats stats() const {
    copy_stats s;
    for (std::size_t i = 0; i < copy_direction_count; ++i) {
      const std::lock_guard lock(lanes_[i].mutex);
      s.per_direction[i] = lanes_[i].stats;
    }
    return s;
  }

  /** @brief The modelled link (unmodelled when its bandwidth is 0). */
  [[nodiscard]] const copy_model& model() const noexcept { return model_; }

 private:
  struct job {
    std::function<void()> work;
    std::promise<void> done;
    std::size_t bytes = 0;
    bool is_copy = false;
  };
  struct lane {
    mutable std::mutex mutex;
    std::condition_variable wake;
    std::condition_variable idle;
    std::deque<job> queue;
    std::size_t pending = 0;  // queued or running
    bool stopping = false;
    copy_stats::direction stats;
    std::thread worker;
  };

  static void checked_memcpy(void* dst, const void* src, std::size_t bytes) {
    if (bytes == 0) return;
    if (dst == nullptr || src == nullptr) {
      throw config_error("host_copy_engine: copy of " + std::to_string(bytes) + " bytes with a null " +
                         (dst == nullptr ? "destination" : "source") + "; pass a block obtained from a memory space");
    }
    const auto d = reinterpret_cast<std::uintptr_t>(dst);
    const auto s = reinterpret_cast<std::uintptr_t>(src);
    if (d < s + bytes && s < d + bytes) {
      throw config_error("host_copy_engine: source and destination of a " + std::to_string(bytes) +
                         "-byte copy overlap; copy between distinct blocks");
    }
    std::memcpy(dst, src, bytes);
  }

  static void checked_memset(void* dst, std::size_t bytes) {
    if (bytes == 0) return;
    if (dst == nullptr) {
      throw config_error("host_copy_engine: zero_async of " + std::to_string(bytes) +
                         " bytes at a null address; pass a block obtained from a memory space");
    }
    std::memset(dst, 0, bytes);
  }

  host_copy_handle enqueue(copy_direction d, job j) {
    const auto i = static_cast<std::size_t>(d);
    if (i >= copy_direction_count) throw config_error("host_copy_engine: unknown copy_direction");
    host_copy_handle handle(j.done.get_future().share());
    lane& l = lanes_[i];
    {
      const std::lock_guard lock(l.mutex);
      l.queue.push_back(std::move(j));
      ++l.pending;
    }
    l.wake.notify_one();
    return handle;
  }

  void run(lane& l, std::size_t direction) {
    using clock = std::chrono::steady_clock;
    const bool paced = model_.modelled() && direction != static_cast<std::size_t>(copy_direction::host_to_host);
    for (;;) {
      job j;
      {
        std::unique_lock lock(l.mutex);
        l.wake.wait(lock, [&] { return l.stopping || !l.queue.empty(); });
        if (l.queue.empty()) return;  // stopping, and drained
        j = std::move(l.queue.front());
        l.queue.pop_front();
      }
      const auto start = clock::now();
      std::exception_ptr failure;
      try {
        j.work();
      } catch (...) {
        failure = std::current_exception();
      }
      if (paced && j.is_copy && !failure) {
        std::this_thread::sleep_until(start + std::chrono::duration_cast<clock::duration>(
                                                  std::chrono::duration<double>(model_.seconds(j.bytes))));
      }
      const double busy = std::chrono::duration<double>(clock::now() - start).count();
      if (j.is_copy && !failure) {
        const std::lock_guard lock(l.mutex);
        l.stats.bytes += j.bytes;
        l.stats.copies += 1;
        l.stats.busy_s += busy;
      }
      if (failure) j.done.set_exception(failure);
      else j.done.set_value();
      {
        const std::lock_guard lock(l.mutex);
        --l.pending;
      }
      l.idle.notify_all();
    }
  }

  void stop(std::size_t started) noexcept {
    for (std::size_t i = 0; i < started; ++i) {
      {
        const std::lock_guard lock(lanes_[i].mutex);
        lanes_[i].stopping = true;
      }
      lanes_[i].wake.notify_all();
    }
    for (std::size_t i = 0; i < started; ++i) {
      if (lanes_[i].worker.joinable()) lanes_[i].worker.join();
    }
  }

  copy_model model_;
  std::array<lane, copy_direction_count> lanes_;
};

static_assert(CopyHandle<host_copy_handle>);
static_assert(CopyEngine<host_copy_engine>);

}  // namespace chunkstar
