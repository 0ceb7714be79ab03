// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Small RAII helpers over the CUDA runtime: a current-device guard, an owned non-blocking
 *         stream and an owned event (Tier 1).
 */
#pragma once

#include <chunkstar/cuda/cuda_error.hpp>

#include <cuda_runtime_api.h>

#include <utility>

namespace chunkstar::cuda {

/** @brief Makes `device` current for a scope and restores the previous one: the library never
 *  leaves the caller's current device changed. */
class device_guard {
 public:
  /** @throws cuda_error naming @p device when it cannot be made current (no GPU, no driver, an
   *  ordinal past the last device; `detail::throw_device_unusable`). */
  explicit device_guard(int device) {
    if (const cudaError_t s = cudaGetDevice(&previous_); s != cudaSuccess)
      detail::throw_device_unusable(device, s, "cudaGetDevice(&previous)", __FILE__, __LINE__);
    if (previous_ == device) return;
    if (const cudaError_t s = cudaSetDevice(device); s != cudaSuccess)
      detail::throw_device_unusable(device, s, "cudaSetDevice(device)", __FILE__, __LINE__);
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  ~device_guard() {
    int now = previous_;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) (void)cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
};

/** @brief An owned stream that does not synchronise with the legacy default stream. */
class stream {
 public:
  explicit stream(int device) : device_(device) {
    const device_guard g(device);
    CHUNKSTAR_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking));
  }
  stream(stream&& o) noexcept : s_(std::exchange(o.s_, nullptr)), device_(o.device_) {}
  stream& operator=(stream o) noexcept {
    std::swap(s_, o.s_);
    std::swap(device_, o.device_);
    return *this;
  }
  ~stream() {
    if (s_ != nullptr) (void)cudaStreamDestroy(s_);
  }
  [[nodiscard]] cudaStream_t get() const noexcept { return s_; }
  [[nodiscard]] int device() const noexcept { return device_; }
  /** @brief Blocks until all work queued on the stream finished. */
  void synchronize() const { CHUNKSTAR_CUDA_CHECK(cudaStreamSynchronize(s_)); }

 private:
  cudaStream_t s_ = nullptr;
  int device_ = 0;
};

/** @brief An owned event (timing enabled unless `flags` say otherwise). */
class event {
 public:
  explicit event(unsigned flags = cudaEventDefault) { CHUNKSTAR_CUDA_CHECK(cudaEventCreateWithFlags(&e_, flags)); }
  event(event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  event& operator=(event o) noexcept {
    std::swap(e_, o.e_);
    return *this;
  }
  ~event() {
    if (e_ != nullptr) (void)cudaEventDestroy(e_);
  }
  [[nodiscard]] cudaEvent_t get() const noexcept { return e_; }
  void record(cudaStream_t s) { CHUNKSTAR_CUDA_CHECK(cudaEventRecord(e_, s)); }
  /** @brief Non-blocking: true once the recorded work finished; throws if it failed. */
  [[nodiscard]] bool query() const {
    const cudaError_t status = cudaEventQuery(e_);
    if (status == cudaErrorNotReady) return false;
    CHUNKSTAR_CUDA_CHECK(status);
    return true;
  }
  void synchronize() const { CHUNKSTAR_CUDA_CHECK(cudaEventSynchronize(e_)); }

 private:
  cudaEvent_t e_ = nullptr;
};

}  // namespace chunkstar::cuda
