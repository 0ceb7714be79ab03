// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `cuda::cuda_copy_engine`: one non-blocking CUDA stream per copy direction, copies with
 *         cudaMemcpyAsync, completion tracked by events (Tier 1). Models `CopyEngine`.
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/cuda/cuda_error.hpp>
#include <chunkstar/cuda/stream.hpp>
#include <chunkstar/memory/copy_engine.hpp>

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <utility>

namespace chunkstar::cuda {

namespace detail {
/** @brief One copy's start and end events, shared by its handle and the engine's stats sweep. */
struct copy_record {
  event start;
  event end;
  std::size_t bytes = 0;
};
}  // namespace detail

/** @brief Completion of one copy on a `cuda_copy_engine`. Models `CopyHandle`. */
class cuda_copy_handle {
 public:
  /** @brief An empty handle: ready, and wait() returns at once. */
  cuda_copy_handle() = default;
  explicit cuda_copy_handle(std::shared_ptr<const detail::copy_record> r) noexcept : record_(std::move(r)) {}

  /** @brief Non-blocking (cudaEventQuery); throws cuda_error if the copy failed. */
  [[nodiscard]] bool ready() const { return !record_ || record_->end.query(); }
  /** @brief Blocks until the copy finished (cudaEventSynchronize); throws cuda_error if it failed. */
  void wait() const {
    if (record_) record_->end.synchronize();
  }
  /** @brief The event recorded after the copy, for `cudaStreamWaitEvent` on a compute stream (so a
   *  kernel waits for its chunk without blocking the host); null for an empty handle. */
  [[nodiscard]] cudaEvent_t event() const noexcept { return record_ ? record_->end.get() : nullptr; }

 private:
  std::shared_ptr<const detail::copy_record> record_;
};

/** @brief Copies on the device's copy engines: `to_device`, `to_host` and `host_to_host` each get
 *  their own non-blocking stream, so copies are in order within a direction and the directions
 *  overlap (H2D and D2H use separate DMA engines). Pointers may be any CUDA-visible memory
 *  (cudaMemcpyDefault with unified addressing); copies are truly asynchronous only between device
 *  and pinned memory (see the trait table). Thread-safe. */
class cuda_copy_engine {
 public:
  /** @brief An engine whose streams belong to `device`. */
  explicit cuda_copy_engine(int device = 0)
      : device_(device), streams_{stream(device), stream(device), stream(device)} {}
  cuda_copy_engine(const cuda_copy_engine&) = delete;
  cuda_copy_engine& operator=(const cuda_copy_engine&) = delete;
  /** @brief Waits for every queued copy before the streams go away. */
  ~cuda_copy_engine() {
    for (auto& s : streams_) (void)cudaStreamSynchronize(s.get());
  }

  /** @brief Copies `bytes` and returns once they arrived; ordered after earlier copies in `d`. */
  void copy(void* dst, const void* src, std::size_t bytes, copy_direction d) { copy_async(dst, src, bytes, d).wait(); }

  /** @brief Queues a copy on `d`'s stream. */
  cuda_copy_handle copy_async(void* dst, const void* src, std::size_t bytes, copy_direction d) {
    const auto i = static_cast<std::size_t>(d);
    if (i >= copy_direction_count) throw config_error("cuda_copy_engine: unknown copy_direction");
    auto r = std::make_shared<detail::copy_record>();
    r->bytes = bytes;
    const device_guard g(device_);
    const std::lock_guard lock(mutex_);  // keeps each stream's records in submission order
    cudaStream_t s = streams_[i].get();
    r->start.record(s);
    if (bytes != 0) CHUNKSTAR_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
    r->end.record(s);
    pending_[i].push_back(r);
    if (pending_[i].size() > 64) sweep(i);  // bound the backlog when nobody asks for stats
    return cuda_copy_handle(std::move(r));
  }

  /** @brief Queues cudaMemsetAsync(dst, 0, bytes) on the `host_to_host` stream (`dst` in device
   *  or pinned memory). Not a link transfer: not counted in stats. */
  cuda_copy_handle zero_async(void* dst, std::size_t bytes) {
    auto r = std::make_shared<detail::copy_record>();
    const device_guard g(device_);
    const std::lock_guard lock(mutex_);
    cudaStream_t s = streams_[static_cast<std::size_t>(copy_direction::host_to_host)].get();
    if (bytes != 0) CHUNKSTAR_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, s));
    r->end.record(s);
    return cuda_copy_handle(std::move(r));
  }

  /** @brief Work queued on `d`'s stream from now on waits for `h` (cudaStreamWaitEvent). */
  void order_after(const cuda_copy_handle& h, copy_direction d) {
    const auto i = static_cast<std::size_t>(d);
    if (i >= copy_direction_count) throw config_error("cuda_copy_engine: unknown copy_direction");
    if (h.event() == nullptr) return;
    const device_guard g(device_);
    const std::lock_guard lock(mutex_);
    CHUNKSTAR_CUDA_CHECK(cudaStreamWaitEvent(streams_[i].get(), h.event(), 0));
  }

  /** @brief A handle ready once the work queued on the user's stream @p user so far has finished
   *  (an event recorded there): pass it to order_after so later copies of the memory that work
   *  used wait for it on the device, never on the host (the runtime's stream contract). */
  cuda_copy_handle record(cudaStream_t user) {
    auto r = std::make_shared<detail::copy_record>();
    const device_guard g(device_);
    r->end.record(user);
    return cuda_copy_handle(std::move(r));
  }

  /** @brief Makes work queued on the user's stream @p user from now on wait for @p h (a copy's
   *  completion) without blocking the host: a kernel can so consume a chunk still arriving. */
  void wait_on(cudaStream_t user, const cuda_copy_handle& h) {
    if (h.event() == nullptr) return;
    const device_guard g(device_);
    CHUNKSTAR_CUDA_CHECK(cudaStreamWaitEvent(user, h.event(), 0));
  }

  /** @brief Waits for every copy on every stream. */
  void synchronize() {
    for (auto& s : streams_) s.synchronize();
  }

  /** @brief Bytes, copies and GPU-timed busy seconds of the copies completed so far. */
  [[nodiscard]] copy_stats stats() const {
    const std::lock_guard lock(mutex_);
    for (std::size_t i = 0; i < copy_direction_count; ++i) sweep(i);
    return stats_;
  }

  /** @brief The stream of direction `d`, to order other work after (or before) its copies. */
  [[nodiscard]] cudaStream_t stream_of(copy_direction d) const noexcept {
    return streams_[static_cast<std::size_t>(d)].get();
  }
  [[nodiscard]] int device() const noexcept { return device_; }

 private:
  // Moves finished copies (a prefix: each stream completes in order) into stats_. Caller holds mutex_.
  void sweep(std::size_t i) const {
    auto& q = pending_[i];
    while (!q.empty() && q.front()->end.query()) {
      float ms = 0;
      CHUNKSTAR_CUDA_CHECK(cudaEventElapsedTime(&ms, q.front()->start.get(), q.front()->end.get()));
      auto& s = stats_.per_direction[i];
      s.bytes += q.front()->bytes;
      s.copies += 1;
      s.busy_s += static_cast<double>(ms) * 1e-3;
      q.pop_front();
    }
  }

  int device_;
  std::array<stream, copy_direction_count> streams_;
  mutable std::mutex mutex_;
  mutable std::array<std::deque<std::shared_ptr<detail::copy_record>>, copy_direction_count> pending_;
  mutable copy_stats stats_;
};

static_assert(CopyHandle<cuda_copy_handle>);
static_assert(CopyEngine<cuda_copy_engine>);

}  // namespace chunkstar::cuda
