// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `cuda::pinned_host_space`: page-locked host memory (cudaHostAlloc), reachable from host
 *         code and CUDA kernels, the source and target of truly asynchronous device copies (Tier 1).
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/memory_report.hpp>
#include <chunkstar/cuda/cuda_error.hpp>
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
  /** @brief Hard cap in bytes; SIZE_MAX = unlimited (pinning too much starves the OS: cap it). */
  std::size_t capacity = std::numeric_limits<std::size_t>::max();
  /** @brief Name in reports and errors. */
  std::string name = "pinned_host";
};

/** @brief Page-locked host memory, portable across devices. Thread-safe. Models `MemorySpace`.
 *  `used()` counts requested bytes. */
class pinned_host_space {
 public:
  static constexpr memory_kind kind = memory_kind::pinned_host;
  /** @brief Alignment cudaHostAlloc always gives; larger ones over-allocate. */
  static constexpr std::size_t native_alignment = 4096;

  pinned_host_space() : pinned_host_space(pinned_host_options{}) {}
  explicit pinned_host_space(pinned_host_options options)
      : options_(std::move(options)), accounting_(options_.capacity) {}
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
    chunkstar::detail::check_alignment(a, options_.name);
    const bool over = a > native_alignment;
    if (over && n > std::numeric_limits<std::size_t>::max() - a) return nullptr;
    if (!accounting_.try_reserve(n)) return nullptr;
    void* base = nullptr;
    const cudaError_t status = cudaHostAlloc(&base, (over ? n + a : n) + (n == 0 ? 1 : 0), cudaHostAllocPortable);
    if (status != cudaSuccess) {
      accounting_.release(n);
      if (status == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        return nullptr;
      }
      detail::throw_cuda_failure(status, "cudaHostAlloc(&p, n, cudaHostAllocPortable)", __FILE__, __LINE__);
    }
    if (!over) return base;
    const auto b = reinterpret_cast<std::uintptr_t>(base);
    void* aligned = reinterpret_cast<void*>((b + a - 1) & ~static_cast<std::uintptr_t>(a - 1));
    try {
      over_aligned_.insert(aligned, base);
    } catch (...) {
      (void)cudaFreeHost(base);
      accounting_.release(n);
      throw;
    }
    return aligned;
  }

  /** @brief Return a block; `n` and `a` as passed to allocate. */
  void deallocate(void* p, std::size_t n, std::size_t a = alignof(std::max_align_t)) noexcept {
    if (p == nullptr) return;
    void* base = a > native_alignment ? over_aligned_.take(p) : p;
    (void)cudaFreeHost(base);
    accounting_.release(n);
  }

  [[nodiscard]] std::size_t capacity() const noexcept { return accounting_.capacity(); }
  [[nodiscard]] std::size_t used() const noexcept { return accounting_.used(); }
  [[nodiscard]] std::size_t peak() const noexcept { return accounting_.peak(); }
  void reset_peak() noexcept { accounting_.reset_peak(); }
  /** @brief Largest free block: `capacity - used` (virtual address space does not fragment at
   *  these sizes; the real limit, locked memory, is only known by trying). */
  [[nodiscard]] space_usage usage() const { return accounting_.snapshot(options_.name); }
  [[nodiscard]] const std::string& name() const noexcept { return options_.name; }

 private:
  pinned_host_options options_;
  chunkstar::detail::space_accounting accounting_;
  chunkstar::detail::over_aligned_blocks over_aligned_;
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
