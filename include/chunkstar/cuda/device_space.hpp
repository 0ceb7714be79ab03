// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `cuda::device_space`: memory of one CUDA device (cudaMalloc, freed blocks cached for
 *         reuse), optionally capped below the device's size, and the device rows of the trait
 *         table (Tier 1).
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/memory_report.hpp>
#include <chunkstar/cuda/cuda_error.hpp>
#include <chunkstar/cuda/pinned_host_space.hpp>
#include <chunkstar/cuda/stream.hpp>
#include <chunkstar/memory/caching_space.hpp>
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
  /** @brief Hard cap in bytes on memory in use plus cached (a budget below the device's size);
   *  SIZE_MAX = the whole device. */
  std::size_t capacity = std::numeric_limits<std::size_t>::max();
  /** @brief Name in reports and errors; empty = "cuda:<device>". */
  std::string name = {};
  /** @brief Most bytes of freed blocks kept for reuse (`caching_space`): cudaFree synchronises
   *  the whole device, so a steady-state step frees nothing. 0: every free is a cudaFree. */
  std::size_t cache_limit = std::numeric_limits<std::size_t>::max();
};

namespace detail {
inline std::size_t device_total_memory(int device) {
  const device_guard g(device);
  std::size_t free = 0, total = 0;
  CHUNKSTAR_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return total;
}

/** @brief cudaMalloc and cudaFree on one device (made current, the caller's restored). */
struct device_blocks {
  static constexpr std::size_t native_alignment = 256;  ///< what cudaMalloc always gives
  int device = 0;
  [[nodiscard]] void* allocate(std::size_t n) const {
    void* p = nullptr;
    cudaError_t status = cudaSuccess;
    {
      const device_guard g(device);
      status = cudaMalloc(&p, n);
    }
    if (status == cudaSuccess) return p;
    if (status != cudaErrorMemoryAllocation) throw_cuda_failure(status, "cudaMalloc(&p, n)", __FILE__, __LINE__);
    (void)cudaGetLastError();
    return nullptr;
  }
  void deallocate(void* p) const noexcept {
    int previous = 0;
    const bool switched =
        cudaGetDevice(&previous) == cudaSuccess && previous != device && cudaSetDevice(device) == cudaSuccess;
    (void)cudaFree(p);
    if (switched) (void)cudaSetDevice(previous);
  }
};
}  // namespace detail

/** @brief Memory of one CUDA device, its freed blocks cached for reuse (`caching_space`): a
 *  steady-state step calls neither cudaMalloc nor cudaFree. Thread-safe; allocations run with the
 *  device made current and restore the caller's device. Models `MemorySpace`. `used()` counts
 *  requested bytes in use, `cached_bytes()` those kept for reuse; `capacity()` is the cap on both
 *  together, or the device's total memory without one. `trim()` gives the cached blocks back. */
class device_space {
 public:
  static constexpr memory_kind kind = memory_kind::device;
  /** @brief Alignment cudaMalloc always gives; larger ones over-allocate. */
  static constexpr std::size_t native_alignment = detail::device_blocks::native_alignment;

  device_space() : device_space(device_space_options{}) {}
  explicit device_space(device_space_options options)
      : options_(named(std::move(options))),
        space_({.capacity = std::min(options_.capacity, detail::device_total_memory(options_.device)),
                .cache_limit = options_.cache_limit,
                .name = options_.name},
               detail::device_blocks{options_.device}) {}
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
  [[nodiscard]] void* try_allocate(std::size_t n, std::size_t a = 256) { return space_.try_allocate(n, a); }
  /** @brief Return a block; `n` and `a` as passed to allocate. The caller has made sure no work
   *  queued on the device still uses it (the chunk store retires a buffer once its copies and the
   *  user's work are done): a cached block is handed out again at once. */
  void deallocate(void* p, std::size_t n, std::size_t a = 256) noexcept { space_.deallocate(p, n, a); }

  [[nodiscard]] std::size_t capacity() const noexcept { return space_.capacity(); }
  [[nodiscard]] std::size_t used() const noexcept { return space_.used(); }
  [[nodiscard]] std::size_t peak() const noexcept { return space_.peak(); }
  void reset_peak() noexcept { space_.reset_peak(); }
  [[nodiscard]] std::size_t cached_bytes() const noexcept { return space_.cached_bytes(); }
  /** @brief cudaFree of every cached block (this synchronises the device: between steps only). */
  void trim() noexcept { space_.trim(); }
  /** @brief cudaMalloc calls so far (a steady-state step adds none). */
  [[nodiscard]] std::size_t raw_allocations() const noexcept { return space_.raw_allocations(); }
  /** @brief Usage; largest free block = min(capacity - used, free device memory per cudaMemGetInfo
   *  plus the cached blocks). The driver does not report its largest contiguous range, so this is
   *  an upper bound under fragmentation; try_allocate is the authority. */
  [[nodiscard]] space_usage usage() const {
    space_usage u = space_.usage();
    std::size_t free = 0, total = 0;
    try {
      const device_guard g(options_.device);
      if (cudaMemGetInfo(&free, &total) == cudaSuccess)
        u.largest_free_block = std::min(u.largest_free_block, free + space_.cached_bytes());
      else (void)cudaGetLastError();
    } catch (const error&) {  // a report must not fail because the device is unhappy
    }
    return u;
  }
  [[nodiscard]] const std::string& name() const noexcept { return options_.name; }
  /** @brief The CUDA device ordinal. */
  [[nodiscard]] int device() const noexcept { return options_.device; }

 private:
  static device_space_options named(device_space_options o) {
    if (o.name.empty()) o.name = "cuda:" + std::to_string(o.device);
    return o;
  }

  device_space_options options_;
  caching_space<detail::device_blocks> space_;
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
