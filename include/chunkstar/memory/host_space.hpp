// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `host_space`: aligned pageable host memory, unlimited or capped, with pre-faulted,
 *         huge-page-backed, cached large blocks.
 *
 *  Why large blocks are special. Measured on the development machine (Linux 6.18, THP mode
 *  `madvise`, 2 cores, 256 MiB buffers, memset; /tmp program, best of 3):
 *
 *  | what                                      | 4 KiB pages | MADV_HUGEPAGE |
 *  |-------------------------------------------|-------------|---------------|
 *  | first-touch write (page faults)           | 1.0-1.5 GB/s| 5.7-6.5 GB/s  |
 *  | warm write (already faulted)              | 19-21 GB/s  | 20-21 GB/s    |
 *  | warm memcpy (write side)                  | 11 GB/s     | 12-13.6 GB/s  |
 *  | prefault by touching one byte per 4 KiB   | 1.4 GB/s    | 6.8 GB/s      |
 *  | prefault by MADV_POPULATE_WRITE           | 2.6 GB/s    | 10.5 GB/s     |
 *
 *  So a chunk's first write into fresh memory runs 15-20x slower than into warm memory, which
 *  would show up as a stall inside a training step. Hence: blocks of at least
 *  `large_block_threshold` are mapped 2 MiB-aligned, marked MADV_HUGEPAGE (6x faster faulting,
 *  fewer TLB misses), pre-faulted at allocation (MADV_POPULATE_WRITE, else a touch loop), and on
 *  deallocate kept in a bounded size-bucketed cache so that the next chunk of the same size skips
 *  faulting altogether. Mid-size blocks (from `cached_block_threshold`, 256 KiB, up to the large
 *  threshold) are kept the same way but accounted at their requested size: a trainer whose chunks
 *  are 1 MiB offloads them every step, and the C heap handed each one fresh pages (about 12,000
 *  page faults per step of train_gpt's `mini`, 92% of them in the copy engine's memcpy). Small
 *  blocks go to the aligned global operator new, which pools them better than any cache here would.
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/memory_report.hpp>
#include <chunkstar/memory/detail/block_cache.hpp>
#include <chunkstar/memory/detail/space_accounting.hpp>
#include <chunkstar/memory/memory_space.hpp>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <new>
#include <string>
#include <utility>

namespace chunkstar {

/** @brief Numeric knobs of a `host_space`. */
struct host_space_options {
  /** @brief Hard cap on bytes handed out plus bytes cached; SIZE_MAX = unlimited. */
  std::size_t capacity = std::numeric_limits<std::size_t>::max();
  /** @brief Blocks at least this large are mapped, pre-faulted and cached (rounded up to 2 MiB). */
  std::size_t large_block_threshold = std::size_t{2} << 20;
  /** @brief Most bytes of freed large (and mid-size) blocks kept for reuse; `trim()` releases them. */
  std::size_t cache_limit = std::size_t{1} << 30;
  /** @brief Blocks from this size up to large_block_threshold are mapped (64 KiB granules) and cached
   *  too, but accounted at their requested size; SIZE_MAX: operator new, uncached. */
  std::size_t cached_block_threshold = std::size_t{256} << 10;
  /** @brief Fault large blocks in at allocation, so the first real write runs at warm speed. */
  bool prefault = true;
  /** @brief Ask for transparent huge pages on large blocks (MADV_HUGEPAGE). */
  bool huge_pages = true;
  /** @brief Name in reports and errors. */
  std::string name = "host";
};

/** @brief Pageable host memory. Thread-safe. Models `MemorySpace`.
 *
 *  Accounting: `used()` counts what each block occupies — the requested size for small and
 *  mid-size blocks, the size rounded up to 2 MiB for large ones. Freed large and mid-size blocks
 *  sit in the cache; the capacity bounds `used() + cached_bytes()` (the resident footprint, up to
 *  the 64 KiB rounding of mid-size blocks), evicting cached blocks before refusing a request.
 */
class host_space {
 public:
  static constexpr memory_kind kind = memory_kind::host;
  /** @brief Granule of large blocks: the x86-64/aarch64 transparent huge page size. */
  static constexpr std::size_t huge_page_bytes = detail::huge_page_bytes;

  host_space() : host_space(host_space_options{}) {}
  explicit host_space(host_space_options options) : options_(std::move(options)), accounting_(options_.capacity) {
    if (options_.large_block_threshold == 0) {
      throw config_error(options_.name + ": large_block_threshold must be > 0 (default 2 MiB)");
    }
  }
  host_space(const host_space&) = delete;
  host_space& operator=(const host_space&) = delete;
  ~host_space() { trim(); }

  /** @brief `n` bytes aligned to `a`; throws out_of_memory_error with this space's usage. */
  [[nodiscard]] void* allocate(std::size_t n, std::size_t a = alignof(std::max_align_t)) {
    if (void* p = try_allocate(n, a)) return p;
    throw detail::make_oom(options_.name, n, a, usage(),
                           options_.capacity == std::numeric_limits<std::size_t>::max()
                               ? "the operating system refused the memory; free host memory or lower the host budget"
                               : "raise host_space_options::capacity or free blocks first");
  }

  /** @brief As allocate(), but nullptr when the capacity or the system says no. */
  [[nodiscard]] void* try_allocate(std::size_t n, std::size_t a = alignof(std::max_align_t)) {
    detail::check_alignment(a, options_.name);
    if (is_large(n)) return allocate_large(n, a);
    if (!accounting_.try_reserve(n)) return nullptr;
    void* p = is_mid(n) ? allocate_mid(n, a) : ::operator new (n, std::align_val_t{a}, std::nothrow);
    if (p == nullptr) accounting_.release(n);
    return p;
  }

  /** @brief Return a block; `n` and `a` as passed to allocate. */
  void deallocate(void* p, std::size_t n, std::size_t a = alignof(std::max_align_t)) noexcept {
    if (p == nullptr) return;
    if (is_large(n)) {
      deallocate_large(p, n);
      return;
    }
    if (is_mid(n)) deallocate_mid(p, n);
    else ::operator delete (p, std::align_val_t{a});
    accounting_.release(n);
  }

  /** @brief Unmap every cached block. */
  void trim() noexcept { cache_.trim(); }

  [[nodiscard]] std::size_t capacity() const noexcept { return accounting_.capacity(); }
  [[nodiscard]] std::size_t used() const noexcept { return accounting_.used(); }
  /** @brief Highest `used()` since construction or the last reset_peak(). */
  [[nodiscard]] std::size_t peak() const noexcept { return accounting_.peak(); }
  void reset_peak() noexcept { accounting_.reset_peak(); }
  /** @brief Bytes of freed large and mid-size blocks held for reuse. */
  [[nodiscard]] std::size_t cached_bytes() const noexcept { return cache_.bytes(); }
  /** @brief Largest free block is `capacity - used` (unlimited: SIZE_MAX): host memory is virtual,
   *  so fragmentation of the address space never limits a request before the capacity does. */
  [[nodiscard]] space_usage usage() const { return accounting_.snapshot(options_.name); }
  [[nodiscard]] const std::string& name() const noexcept { return options_.name; }
  [[nodiscard]] const host_space_options& options() const noexcept { return options_; }

 private:
  [[nodiscard]] bool is_large(std::size_t n) const noexcept {
    return CHUNKSTAR_DETAIL_HOST_MMAP && n >= options_.large_block_threshold;
  }
  [[nodiscard]] bool is_mid(std::size_t n) const noexcept {
    return CHUNKSTAR_DETAIL_HOST_MMAP && n >= options_.cached_block_threshold && n < options_.large_block_threshold;
  }
  static constexpr std::size_t mid_granule = std::size_t{64} << 10;

#if CHUNKSTAR_DETAIL_HOST_MMAP
  void* allocate_large(std::size_t n, std::size_t a) {
    const std::size_t size = detail::round_up_pow2(n, huge_page_bytes);
    const std::size_t align = a > huge_page_bytes ? a : huge_page_bytes;
    if (size == std::numeric_limits<std::size_t>::max() || size > std::numeric_limits<std::size_t>::max() - align) {
      return nullptr;
    }
    if (!accounting_.try_reserve(size)) return nullptr;
    if (void* p = cache_.take(size, align)) return p;
    // Keep the resident footprint (handed out + cached) within the capacity.
    cache_.shrink_to(options_.capacity - accounting_.used());
    void* p = detail::map_aligned(size, align, options_.huge_pages, options_.prefault);
    if (p == nullptr) accounting_.release(size);
    return p;
  }

  void deallocate_large(void* p, std::size_t n) noexcept {
    const std::size_t size = detail::round_up_pow2(n, huge_page_bytes);
    cache_.put(p, size, options_.cache_limit);
    accounting_.release(size);
  }

  /** A mid-size block; its requested size @p n is already reserved in the accounting. */
  void* allocate_mid(std::size_t n, std::size_t a) noexcept {
    const std::size_t size = detail::round_up_pow2(n, mid_granule), align = a > mid_granule ? a : mid_granule;
    if (void* p = cache_.take(size, align)) return p;
    cache_.shrink_to(options_.capacity - accounting_.used());
    return detail::map_aligned(size, align, false, options_.prefault);
  }
  void deallocate_mid(void* p, std::size_t n) noexcept {
    cache_.put(p, detail::round_up_pow2(n, mid_granule), options_.cache_limit);
  }
#else
  void* allocate_large(std::size_t, std::size_t) { return nullptr; }
  void deallocate_large(void*, std::size_t) noexcept {}
  void* allocate_mid(std::size_t, std::size_t) noexcept { return nullptr; }
  void deallocate_mid(void*, std::size_t) noexcept {}
#endif

  host_space_options options_;
  detail::space_accounting accounting_;
  detail::block_cache cache_;  // rounded size -> mapped, pre-faulted block
};

/** @brief Host code reaches host memory. */
template <>
inline constexpr bool can_access_v<host_exec, host_space> = true;

/** @brief Host to host: a memcpy, asynchronous on a copy engine's worker thread. */
template <>
struct copy_traits<host_space, host_space> {
  static constexpr bool possible = true;
  static constexpr bool async = true;
};

static_assert(MemorySpace<host_space>);

}  // namespace chunkstar
