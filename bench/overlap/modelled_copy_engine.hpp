// SPDX-License-Identifier: Apache-2.0
// modelled_copy_engine: a CopyEngine for a modelled device whose copies take the modelled link's
// time and no CPU — each direction a lane that sleeps latency + bytes / bandwidth per copy (a DMA
// engine), zero fills at the device's memory bandwidth — and move no bytes: the benchmark times
// the runtime's schedule, not values (the bits are the tests' business). Copies between host
// buffers are real memcpys. The device's compute is modelled here too, as a CUDA stream is: the
// host queues seconds of work (compute) and goes on; record() is an event on that stream, ready
// when the work queued so far is done, so a scope closed with it (scope.close(stream), as a
// trainer on CUDA closes its scopes) has the runtime order that chunk's later moves after the
// device's work without the host waiting for it.
#pragma once

#include "../modelled_wait.hpp"

#include <chunkstar/memory/copy_engine.hpp>
#include <chunkstar/memory/host_copy_engine.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

namespace chunkstar::bench {

class modelled_copy_engine {
 public:
  modelled_copy_engine(copy_model link, double device_bytes_per_s) : link_(link), device_bps_(device_bytes_per_s) {
    for (auto& l : lanes_) l.thread = std::thread([&l] { run(l); });
    device_.thread = std::thread([this] { run(device_); });
  }
  modelled_copy_engine(const modelled_copy_engine&) = delete;
  modelled_copy_engine& operator=(const modelled_copy_engine&) = delete;
  ~modelled_copy_engine() {
    for (lane* l : all_lanes()) {
      {
        const std::lock_guard lock(l->mutex);
        l->stop = true;
      }
      l->work.notify_one();
    }
    for (lane* l : all_lanes()) l->thread.join();
  }

  host_copy_handle copy_async(void* dst, const void* src, std::size_t n, copy_direction d) {
    if (d == copy_direction::host_to_host) return enqueue(d, [=] { std::memcpy(dst, src, n); });
    const double s = link_.seconds(n);
    return enqueue(d, [s] { pause(s); });
  }
  void copy(void* dst, const void* src, std::size_t n, copy_direction d) { copy_async(dst, src, n, d).wait(); }
  host_copy_handle zero_async(void*, std::size_t n) {
    const double s = static_cast<double>(n) / device_bps_;
    return enqueue(copy_direction::host_to_host, [s] { pause(s); });
  }
  void order_after(const host_copy_handle& h, copy_direction d) {
    enqueue(d, [h] { h.wait(); });
  }
  /** The device's compute: @p seconds of work queued behind what it already has; it starts when
   *  the host queues it at the earliest. Takes no CPU and does not wait. */
  void compute(double seconds) {
    const std::lock_guard lock(device_mutex_);
    device_free_ =
        std::max(device_free_, std::chrono::steady_clock::now()) +
        std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds));
  }
  /** An event on the device's stream: ready once the compute queued so far is done. */
  [[nodiscard]] host_copy_handle record(host_stream) {
    return enqueue(device_, [t = device_free()] { wait_until(t); });
  }
  /** Waits on the host for the device's queued compute (as reading the loss does). */
  void synchronize_device() { wait_until(device_free()); }
  void synchronize() {
    for (std::size_t d = 0; d < lanes_.size(); ++d) enqueue(static_cast<copy_direction>(d), [] {}).wait();
  }
  [[nodiscard]] copy_stats stats() const { return {}; }

 private:
  struct lane {
    std::mutex mutex;
    std::condition_variable work;
    std::deque<std::pair<std::function<void()>, std::promise<void>>> jobs;
    bool stop = false;
    std::thread thread;
  };
  static void pause(double s) { wait_for(s); }
  static void run(lane& l) {
    std::unique_lock lock(l.mutex);
    for (;;) {
      l.work.wait(lock, [&] { return l.stop || !l.jobs.empty(); });
      if (l.jobs.empty()) return;
      auto job = std::move(l.jobs.front());
      l.jobs.pop_front();
      lock.unlock();
      try {
        job.first();
        job.second.set_value();
      } catch (...) {
        job.second.set_exception(std::current_exception());
      }
      lock.lock();
    }
  }
  host_copy_handle enqueue(copy_direction d, std::function<void()> f) {
    return enqueue(lanes_[static_cast<std::size_t>(d)], std::move(f));
  }
  static host_copy_handle enqueue(lane& l, std::function<void()> f) {
    std::promise<void> done;
    host_copy_handle h(done.get_future().share());
    {
      const std::lock_guard lock(l.mutex);
      l.jobs.emplace_back(std::move(f), std::move(done));
    }
    l.work.notify_one();
    return h;
  }

  /** When the compute queued so far ends. */
  std::chrono::steady_clock::time_point device_free() {
    const std::lock_guard lock(device_mutex_);
    return device_free_;
  }
  std::array<lane*, copy_direction_count + 1> all_lanes() {
    std::array<lane*, copy_direction_count + 1> all{};
    for (std::size_t d = 0; d < lanes_.size(); ++d) all[d] = &lanes_[d];
    all.back() = &device_;
    return all;
  }

  copy_model link_;
  double device_bps_;
  std::array<lane, copy_direction_count> lanes_;
  lane device_;  // the compute's events (record): each waits to the device time it was recorded at
  std::mutex device_mutex_;
  std::chrono::steady_clock::time_point device_free_{};
};

static_assert(CopyEngine<modelled_copy_engine>);

}  // namespace chunkstar::bench
