// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `caching_space<Raw>`: the accounting and block cache of a memory space whose raw free is
 *         expensive — cudaFree and cudaFreeHost synchronise the whole device, cutting short every
 *         overlap of copies, kernels and host work — so freed blocks are kept by size and handed
 *         to the next request of that size: a steady-state step allocates and frees nothing raw.
 *
 *  Chunks have one size per list and a step's activations repeat from step to step, so exact-size
 *  reuse is enough (no binning, no splitting: nothing is rounded up). The CUDA spaces
 *  (`cuda::device_space`, `cuda::pinned_host_space`) are this class over cudaMalloc and
 *  cudaHostAlloc; tests run it over a counting allocator on the CPU.
 *
 *  Why not the CUDA runtime's stream-ordered pool (cudaMallocAsync)? Its frees are ordered on a
 *  stream, but the runtime frees a block only once every copy and kernel that used it is known to
 *  be done (the chunk store's retirement, the stream contract), so the ordering it would add is
 *  already there; it also hands back memory whose size the driver rounds, which would make the
 *  budgets' byte counts approximate. A raw allocator over it is one `Raw` away.
 */
#pragma once

#include <chunkstar/core/memory_report.hpp>
#include <chunkstar/memory/detail/block_cache.hpp>
#include <chunkstar/memory/detail/space_accounting.hpp>

#include <atomic>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

namespace chunkstar {

/** @brief The allocator under a caching_space: `allocate(n)` is null when out of memory (other
 *  failures throw); `deallocate(p)` never throws; blocks are aligned to `native_alignment`. */
template <class R>
concept RawBlocks = requires(R& r, void* p, std::size_t n) {
  { R::native_alignment } -> std::convertible_to<std::size_t>;
  { r.allocate(n) } -> std::same_as<void*>;
  { r.deallocate(p) }
  noexcept;
};

/** @brief Numeric knobs of a caching_space. */
struct caching_space_options {
  /** @brief Hard cap on bytes in use plus bytes cached; SIZE_MAX = unlimited. */
  std::size_t capacity = std::numeric_limits<std::size_t>::max();
  /** @brief Most bytes of freed blocks kept for reuse (0: none, every free is a raw free). */
  std::size_t cache_limit = std::numeric_limits<std::size_t>::max();
  /** @brief Name in reports and errors. */
  std::string name = "cached";
};

/** @brief Accounting, alignment and an exact-size cache of freed blocks over a raw allocator.
 *  Thread-safe. `used()` counts the bytes requested and not yet returned; `cached_bytes()` the
 *  requested sizes of blocks kept for reuse; `used() + cached_bytes()` never exceeds the capacity
 *  (a request that does not fit releases cached blocks first). */
template <RawBlocks Raw>
class caching_space {
 public:
  explicit caching_space(caching_space_options options, Raw raw = {})
      : options_(std::move(options)), raw_(std::move(raw)), accounting_(options_.capacity), cache_(release{this}) {}
  caching_space(const caching_space&) = delete;
  caching_space& operator=(const caching_space&) = delete;

  /** @brief `n` bytes aligned to `a` (a power of two), or null when the capacity or the raw
   *  allocator says no; a cached block of exactly `n` bytes at that alignment comes first. */
  [[nodiscard]] void* try_allocate(std::size_t n, std::size_t a) {
    detail::check_alignment(a, options_.name);
    const bool over = a > Raw::native_alignment;
    if (over && n > std::numeric_limits<std::size_t>::max() - a) return nullptr;
    if (!accounting_.try_reserve(n)) return nullptr;
    if (void* p = cache_.take(n, a)) return p;
    // Keep in use + cached within the capacity, then ask the raw allocator; where it is out of
    // memory, the cached blocks are what the device could give back.
    cache_.shrink_to(options_.capacity - accounting_.used());
    const std::size_t size = (over ? n + a : n) + (n == 0 ? 1 : 0);  // never hand out null
    void* base = raw_.allocate(size);
    if (base == nullptr && cache_.bytes() > 0) {
      cache_.trim();
      base = raw_.allocate(size);
    }
    if (base == nullptr) {
      accounting_.release(n);
      return nullptr;
    }
    raw_allocations_.fetch_add(1, std::memory_order_relaxed);
    if (!over) return base;
    const auto b = reinterpret_cast<std::uintptr_t>(base);
    void* aligned = reinterpret_cast<void*>((b + a - 1) & ~static_cast<std::uintptr_t>(a - 1));
    try {
      over_aligned_.insert(aligned, base);
    } catch (...) {
      raw_.deallocate(base);
      accounting_.release(n);
      throw;
    }
    return aligned;
  }

  /** @brief Returns a block (`n` and `a` as requested): kept for reuse while the cache holds at
   *  most `cache_limit` bytes, else freed raw. */
  void deallocate(void* p, std::size_t n, std::size_t /*a*/) noexcept {
    if (p == nullptr) return;
    accounting_.release(n);
    cache_.put(p, n, options_.cache_limit);
  }

  /** @brief Frees every cached block raw (blocks in use are untouched). */
  void trim() noexcept { cache_.trim(); }
  [[nodiscard]] std::size_t cached_bytes() const noexcept { return cache_.bytes(); }
  /** @brief Raw allocations and raw frees so far: what a steady state keeps constant. */
  [[nodiscard]] std::size_t raw_allocations() const noexcept { return raw_allocations_.load(); }
  [[nodiscard]] std::size_t raw_frees() const noexcept { return raw_frees_.load(); }

  [[nodiscard]] std::size_t capacity() const noexcept { return accounting_.capacity(); }
  [[nodiscard]] std::size_t used() const noexcept { return accounting_.used(); }
  [[nodiscard]] std::size_t peak() const noexcept { return accounting_.peak(); }
  void reset_peak() noexcept { accounting_.reset_peak(); }
  /** @brief In use against the capacity; `largest_free_block` counts cached blocks as free (they
   *  are given back before a request is refused). */
  [[nodiscard]] space_usage usage() const { return accounting_.snapshot(options_.name); }
  [[nodiscard]] const std::string& name() const noexcept { return options_.name; }
  [[nodiscard]] Raw& raw() noexcept { return raw_; }

 private:
  struct release {
    caching_space* self;
    void operator()(void* p, std::size_t) const noexcept {
      self->raw_.deallocate(self->over_aligned_.take(p));
      self->raw_frees_.fetch_add(1, std::memory_order_relaxed);
    }
  };

  caching_space_options options_;
  Raw raw_;
  detail::space_accounting accounting_;
  detail::over_aligned_blocks over_aligned_;
  std::atomic<std::size_t> raw_allocations_{0}, raw_frees_{0};
  detail::basic_block_cache<release> cache_;  // last: released first, while the members it uses live
};

}  // namespace chunkstar
