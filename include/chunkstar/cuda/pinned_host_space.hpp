// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `cuda::pinned_host_space`: page-locked host memory (cudaHostAlloc, freed blocks cached for
 *         reuse), reachable from host code and CUDA kernels, the source and target of truly
 *         asynchronous device copies (Tier 1).
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/memory_report.hpp>
#include <chunkstar/cuda/cuda_error.hpp>
#include <chunkstar/memory/caching_space.hpp>
#include <chunkstar/memory/detail/space_accounting.hpp>
#include <chunkstar/memory/host_space.hpp>
#include <chunkstar/memory/memory_space.hpp>
#include <chunkstar/memory/simulated_device_space.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

namespace chunkstar::cuda {

/** @brief Numeric knobs of a `pinned_host_space`. */
struct pinned_host_options {
  /** @brief Hard cap in bytes on memory in use plus cached; SIZE_MAX = unlimited (pinning too much
   *  starves the OS: cap it). */
  std::size_t capacity = std::numeric_limits<std::size_t>::max();
  /** @brief Name in reports and errors. */
  std::string name = "pinned_host";
  /** @brief Most bytes of freed blocks kept for reuse (`caching_space`): cudaFreeHost synchronises
   *  the device, so a steady-state step frees nothing. 0: every free is a cudaFreeHost. */
  std::size_t cache_limit = std::numeric_limits<std::size_t>::max();
};

namespace detail {
/** @brief cudaHostAlloc (portable across devices) and cudaFreeHost. */
struct pinned_blocks {
  /// What CUDA's allocation routines always give. Not a page: seen on an H200 (driver 580), a small
  /// cudaHostAlloc while another small block is live shares its page (at offset 1024).
  static constexpr std::size_t native_alignment = 256;
  [[nodiscard]] static void* allocate(std::size_t n) {
    void* p = nullptr;
    const cudaError_t status = cudaHostAlloc(&p, n, cudaHostAllocPortable);
    if (status == cudaSuccess) return p;
    if (status != cudaErrorMemoryAllocation)
      throw_cuda_failure(status, "cudaHostAlloc(&p, n, cudaHostAllocPortable)", __FILE__, __LINE__);
    (void)cudaGetLastError();
    return nullptr;
  }
  static void deallocate(void* p) noexcept { (void)cudaFreeHost(p); }
};
}  // namespace detail

/** @brief Page-locked host memory, portable across devices, its freed blocks cached for reuse
 *  (`caching_space`). Thread-safe. Models `MemorySpace`. `used()` counts requested bytes in use,
 *  `cached_bytes()` those kept for reuse; `trim()` gives the cached blocks back. */
class pinned_host_space {
 public:
  static constexpr memory_kind kind = memory_kind::pinned_host;
  /** @brief Alignment cudaHostAlloc always gives (256 B, not a page); larger ones over-allocate. */
  static constexpr std::size_t native_alignment = detail::pinned_blocks::native_alignment;

  pinned_host_space() : pinned_host_space(pinned_host_options{}) {}
  explicit pinned_host_space(pinned_host_options options)
      : options_(std::move(options)),
        space_({.capacity = options_.capacity, .cache_limit = options_.cache_limit, .name = options_.name}) {}
  pinned_host_space(const pinned_host_space&) = delete;
  pinned_host_space& operator=(const pinned_host_space&) = delete;

  /** @brief `n` bytes aligned to `a`; throws out_of_memory_error with this space's usage. */
  [[nodiscard]] void* allocate(std::size_t n, std::size_t a = alignof(std::max_align_t)) {
    if (void* p = try_allocate(n, a)) return p;
    throw chunkstar::detail::make_oom(options_.name, n, a, usage(),
                                      "free pinned blocks, raise pinned_host_options::capacity, or raise the "
                                      "locked-memory limit (ulimit -l)");
  }
  /** @brief As allocate(), but nullptr when the cap or CUDA says no. */
  [[nodiscard]] void* try_allocate(std::size_t n, std::size_t a = alignof(std::max_align_t)) {
    return space_.try_allocate(n, a);
  }
  /** @brief Return a block; `n` and `a` as passed to allocate. No copy may still read or write it. */
  void deallocate(void* p, std::size_t n, std::size_t a = alignof(std::max_align_t)) noexcept {
    space_.deallocate(p, n, a);
  }

  [[nodiscard]] std::size_t capacity() const noexcept { return space_.capacity(); }
  [[nodiscard]] std::size_t used() const noexcept { return space_.used(); }
  [[nodiscard]] std::size_t peak() const noexcept { return space_.peak(); }
  void reset_peak() noexcept { space_.reset_peak(); }
  [[nodiscard]] std::size_t cached_bytes() const noexcept { return space_.cached_bytes(); }
  /** @brief cudaFreeHost of every cached block (this synchronises the device: between steps only). */
  void trim() noexcept { space_.trim(); }
  /** @brief cudaHostAlloc calls so far (a steady-state step adds none). */
  [[nodiscard]] std::size_t raw_allocations() const noexcept { return space_.raw_allocations(); }
  /** @brief Largest free block: `capacity - used` (virtual address space does not fragment at
   *  these sizes; the real limit, locked memory, is only known by trying). */
  [[nodiscard]] space_usage usage() const { return space_.usage(); }
  [[nodiscard]] const std::string& name() const noexcept { return options_.name; }

 private:
  pinned_host_options options_;
  caching_space<detail::pinned_blocks> space_;
};

static_assert(MemorySpace<pinned_host_space>);

}  // namespace chunkstar::cuda

namespace chunkstar {

/** @brief Pinned memory is mapped for host code and, through unified addressing, for kernels. */
template <>
inline constexpr bool can_access_v<host_exec, cuda::pinned_host_space> = true;
template <>
inline constexpr bool can_access_v<cuda_exec, cuda::pinned_host_space> = true;

namespace detail {
/** @brief Both host-addressable: a memcpy, asynchronous on a worker thread. */
struct host_memcpy_traits {
  static constexpr bool possible = true;
  static constexpr bool async = true;
};
}  // namespace detail

template <>
struct copy_traits<cuda::pinned_host_space, cuda::pinned_host_space> : detail::host_memcpy_traits {};
template <>
struct copy_traits<cuda::pinned_host_space, host_space> : detail::host_memcpy_traits {};
template <>
struct copy_traits<host_space, cuda::pinned_host_space> : detail::host_memcpy_traits {};
template <>
struct copy_traits<cuda::pinned_host_space, simulated_device_space> : detail::host_memcpy_traits {};
template <>
struct copy_traits<simulated_device_space, cuda::pinned_host_space> : detail::host_memcpy_traits {};

}  // namespace chunkstar
