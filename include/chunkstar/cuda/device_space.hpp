// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `cuda::device_space`: memory of one CUDA device (cudaMalloc/cudaFree), optionally capped
 *         below the device's size, and the device rows of the trait table (Tier 1).
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/memory_report.hpp>
#include <chunkstar/cuda/cuda_error.hpp>
#include <chunkstar/cuda/pinned_host_space.hpp>
#include <chunkstar/cuda/stream.hpp>
#include <chunkstar/memory/detail/space_accounting.hpp>
#include <chunkstar/memory/host_space.hpp>
#include <chunkstar/memory/memory_space.hpp>
#include <chunkstar/memory/simulated_device_space.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

namespace chunkstar::cuda {

/** @brief Numeric knobs of a `device_space`. */
struct device_space_options {
  /** @brief CUDA device ordinal. */
  int device = 0;
  /** @brief Hard cap in bytes (a budget below the device's size); SIZE_MAX = the whole device. */
  std::size_t capacity = std::numeric_limits<std::size_t>::max();
  /** @brief Name in reports and errors; empty = "cuda:<device>". */
  std::string name = {};
};

namespace detail {
inline std::size_t device_total_memory(int device) {
  const device_guard g(device);
  std::size_t free = 0, total = 0;
  CHUNKSTAR_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return total;
}
}  // namespace detail

/** @brief Memory of one CUDA device. Thread-safe; allocations run with the device made current and
 *  restore the caller's device. Models `MemorySpace`. `used()` counts requested bytes;
 *  `capacity()` is the cap, or the device's total memory without one. */
class device_space {
 public:
  static constexpr memory_kind kind = memory_kind::device;
  /** @brief Alignment cudaMalloc always gives; larger ones over-allocate. */
  static constexpr std::size_t native_alignment = 256;

  device_space() : device_space(device_space_options{}) {}
  explicit device_space(device_space_options options)
      : options_(std::move(options)),
        accounting_(std::min(options_.capacity, detail::device_total_memory(options_.device))) {
    if (options_.name.empty()) options_.name = "cuda:" + std::to_string(options_.device);
  }
  device_space(const device_space&) = delete;
  device_space& operator=(const device_space&) = delete;

  /** @brief `n` bytes aligned to `a`; throws out_of_memory_error with this space's usage. */
  [[nodiscard]] void* allocate(std::size_t n, std::size_t a = 256) {
    if (void* p = try_allocate(n, a)) return p;
    throw chunkstar::detail::make_oom(options_.name, n, a, usage(),
                                      "evict or free device blocks, lower the device budget's working set, or "
                                      "raise device_space_options::capacity");
  }

  /** @brief As allocate(), but nullptr when the cap or the device says no. */
  [[nodiscard]] void* try_allocate(std::size_t n, std::size_t a = 256) {
    chunkstar::detail::check_alignment(a, options_.name);
    const bool over = a > native_alignment;
    if (over && n > std::numeric_limits<std::size_t>::max() - a) return nullptr;
    if (!accounting_.try_reserve(n)) return nullptr;
    void* base = nullptr;
    cudaError_t status = cudaSuccess;
    {
      const device_guard g(options_.device);
      status = cudaMalloc(&base, (over ? n + a : n) + (n == 0 ? 1 : 0));  // never hand out null
    }
    if (status != cudaSuccess) {
      accounting_.release(n);
      if (status == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        return nullptr;
      }
      detail::throw_cuda_failure(status, "cudaMalloc(&p, n)", __FILE__, __LINE__);
    }
    if (!over) return base;
    const auto b = reinterpret_cast<std::uintptr_t>(base);
    void* aligned = reinterpret_cast<void*>((b + a - 1) & ~static_cast<std::uintptr_t>(a - 1));
    try {
      over_aligned_.insert(aligned, base);
    } catch (...) {
      free_raw(base);
      accounting_.release(n);
      throw;
    }
    return aligned;
  }

  /** @brief Return a block; `n` and `a` as passed to allocate. */
  void deallocate(void* p, std::size_t n, std::size_t a = 256) noexcept {
    if (p == nullptr) return;
    free_raw(a > native_alignment ? over_aligned_.take(p) : p);
    accounting_.release(n);
  }

  [[nodiscard]] std::size_t capacity() const noexcept { return accounting_.capacity(); }
  [[nodiscard]] std::size_t used() const noexcept { return accounting_.used(); }
  [[nodiscard]] std::size_t peak() const noexcept { return accounting_.peak(); }
  void reset_peak() noexcept { accounting_.reset_peak(); }
  /** @brief Usage; largest free block = min(capacity - used, free device memory per
   *  cudaMemGetInfo). The driver does not report its largest contiguous range, so this is an upper
   *  bound under fragmentation; try_allocate is the authority. */
  [[nodiscard]] space_usage usage() const {
    space_usage u = accounting_.snapshot(options_.name);
    std::size_t free = 0, total = 0;
    try {
      const device_guard g(options_.device);
      if (cudaMemGetInfo(&free, &total) == cudaSuccess) u.largest_free_block = std::min(u.largest_free_block, free);
      else (void)cudaGetLastError();
    } catch (const error&) {  // a report must not fail because the device is unhappy
    }
    return u;
  }
  [[nodiscard]] const std::string& name() const noexcept { return options_.name; }
  /** @brief The CUDA device ordinal. */
  [[nodiscard]] int device() const noexcept { return options_.device; }

 private:
  void free_raw(void* base) const noexcept {
    int previous = 0;
    const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != options_.device &&
                          cudaSetDevice(options_.device) == cudaSuccess;
    (void)cudaFree(base);
    if (switched) (void)cudaSetDevice(previous);
  }

  device_space_options options_;
  chunkstar::detail::space_accounting accounting_;
  chunkstar::detail::over_aligned_blocks over_aligned_;
};

static_assert(MemorySpace<device_space>);

}  // namespace chunkstar::cuda

namespace chunkstar {

/** @brief Device memory: kernels reach it, host code does not. */
template <>
inline constexpr bool can_access_v<cuda_exec, cuda::device_space> = true;
template <>
inline constexpr bool can_access_v<host_exec, cuda::device_space> = false;

namespace detail {
/** @brief A copy engine's stream overlaps it with the caller. */
struct cuda_async_copy_traits {
  static constexpr bool possible = true;
  static constexpr bool async = true;
};
/** @brief Possible, but CUDA stages pageable memory through a bounce buffer and returns only when
 *  the source has been read: not asynchronous. */
struct cuda_pageable_copy_traits {
  static constexpr bool possible = true;
  static constexpr bool async = false;
};
}  // namespace detail

template <>
struct copy_traits<cuda::device_space, cuda::device_space> : detail::cuda_async_copy_traits {};
template <>
struct copy_traits<cuda::device_space, cuda::pinned_host_space> : detail::cuda_async_copy_traits {};
template <>
struct copy_traits<cuda::pinned_host_space, cuda::device_space> : detail::cuda_async_copy_traits {};
template <>
struct copy_traits<cuda::device_space, host_space> : detail::cuda_pageable_copy_traits {};
template <>
struct copy_traits<host_space, cuda::device_space> : detail::cuda_pageable_copy_traits {};
template <>
struct copy_traits<cuda::device_space, simulated_device_space> : detail::cuda_pageable_copy_traits {};
template <>
struct copy_traits<simulated_device_space, cuda::device_space> : detail::cuda_pageable_copy_traits {};

}  // namespace chunkstar
