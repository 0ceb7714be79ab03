// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Private: mapped, pre-faulted large blocks and a size-bucketed cache of freed ones, shared
 *         by host_space and simulated_device_space (see host_space.hpp for the measurements that
 *         motivate both: a first touch of fresh memory costs 15-20x a warm write), and by the CUDA
 *         spaces through caching_space (cudaFree and cudaFreeHost synchronise the device).
 */
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#if __has_include(<sys/mman.h>) && __has_include(<unistd.h>)
#include <sys/mman.h>
#include <unistd.h>
#define CHUNKSTAR_DETAIL_HOST_MMAP 1
#else
#define CHUNKSTAR_DETAIL_HOST_MMAP 0
#endif

namespace chunkstar::detail {

/** @brief Transparent-huge-page size on x86-64 and aarch64: the granule of large blocks. */
inline constexpr std::size_t huge_page_bytes = std::size_t{2} << 20;

#if CHUNKSTAR_DETAIL_HOST_MMAP
/** @brief `size` bytes of anonymous memory at a multiple of `align` (a power of two), marked
 *  MADV_HUGEPAGE if asked and faulted in if asked (MADV_POPULATE_WRITE, else a touch per page);
 *  nullptr when the system refuses. Release with ::munmap(p, size). */
inline void* map_aligned(std::size_t size, std::size_t align, bool huge_pages, bool prefault) noexcept {
  const std::size_t span = size + align;
  void* raw = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const auto base = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t aligned = (base + align - 1) & ~static_cast<std::uintptr_t>(align - 1);
  const std::size_t head = aligned - base;
  const std::size_t tail = span - head - size;
  if (head != 0) ::munmap(raw, head);
  if (tail != 0) ::munmap(reinterpret_cast<void*>(aligned + size), tail);
  auto* p = reinterpret_cast<char*>(aligned);
#ifdef MADV_HUGEPAGE
  if (huge_pages) ::madvise(p, size, MADV_HUGEPAGE);  // advisory: failure only costs speed
#else
  (void)huge_pages;
#endif
  if (prefault) {
#ifdef MADV_POPULATE_WRITE
    if (::madvise(p, size, MADV_POPULATE_WRITE) == 0) return p;
#endif
    const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
    for (std::size_t i = 0; i < size; i += page) static_cast<volatile char*>(p)[i] = 0;
  }
  return p;
}
#endif

/** @brief Gives a mapped block back to the system (what host blocks are released with). */
struct unmap_block {
  void operator()(void* p, std::size_t size) const noexcept {
#if CHUNKSTAR_DETAIL_HOST_MMAP
    ::munmap(p, size);
#else
    (void)p;
    (void)size;
#endif
  }
};

/** @brief Freed blocks by size, for reuse by the next request of exactly that size; @p Release
 *  (called as `release(p, size)`, noexcept) gives a block back for good: munmap for host blocks,
 *  cudaFree for device ones (caching_space.hpp). Thread-safe. Blocks are released outside the lock. */
template <class Release>
class basic_block_cache {
 public:
  explicit basic_block_cache(Release release = {}) noexcept : release_(std::move(release)) {}
  basic_block_cache(const basic_block_cache&) = delete;
  basic_block_cache& operator=(const basic_block_cache&) = delete;
  ~basic_block_cache() { trim(); }

  /** @brief A cached block of exactly @p size bytes whose address is a multiple of @p align, or nullptr. */
  [[nodiscard]] void* take(std::size_t size, std::size_t align) noexcept {
    const std::lock_guard lock(mutex_);
    auto [first, last] = cache_.equal_range(size);
    for (auto it = first; it != last; ++it) {
      if (reinterpret_cast<std::uintptr_t>(it->second) % align == 0) {
        void* p = it->second;
        cache_.erase(it);
        bytes_ -= size;
        return p;
      }
    }
    return nullptr;
  }

  /** @brief Keeps block @p p of @p size bytes if the cache then holds at most @p limit bytes;
   *  otherwise (or if the node cannot be allocated) releases it. */
  void put(void* p, std::size_t size, std::size_t limit) noexcept {
    bool cached = false;
    {
      const std::lock_guard lock(mutex_);
      if (size <= limit - std::min(limit, bytes_)) {
        try {
          cache_.emplace(size, p);
          bytes_ += size;
          cached = true;
        } catch (...) {  // the cache is an optimisation: without room for its node, just unmap
        }
      }
    }
    if (!cached) release_(p, size);
  }

  /** @brief Releases cached blocks, smallest first, until at most @p limit bytes stay cached. */
  void shrink_to(std::size_t limit) noexcept {
    std::vector<std::pair<std::size_t, void*>> victims;
    {
      const std::lock_guard lock(mutex_);
      while (!cache_.empty() && bytes_ > limit) {
        auto victim = cache_.begin();
        try {
          victims.emplace_back(victim->first, victim->second);
        } catch (...) {
          release_(victim->second, victim->first);  // rare: release under the lock rather than leak
        }
        bytes_ -= victim->first;
        cache_.erase(victim);
      }
    }
    for (const auto& [size, p] : victims) release_(p, size);
  }

  /** @brief Releases every cached block. */
  void trim() noexcept { shrink_to(0); }

  /** @brief Bytes held. */
  [[nodiscard]] std::size_t bytes() const noexcept {
    const std::lock_guard lock(mutex_);
    return bytes_;
  }

 private:
  Release release_;
  mutable std::mutex mutex_;
  std::multimap<std::size_t, void*> cache_;  // size -> block
  std::size_t bytes_ = 0;
};

/** @brief The cache of mapped, pre-faulted host blocks (host_space, simulated_device_space). */
using block_cache = basic_block_cache<unmap_block>;

}  // namespace chunkstar::detail
