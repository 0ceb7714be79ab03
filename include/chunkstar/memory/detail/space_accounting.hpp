// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Private helpers shared by every memory space: used/peak accounting against a hard
 *         capacity, alignment validation and the out-of-memory error they all throw.
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/memory_report.hpp>
#include <chunkstar/core/units.hpp>

#include <algorithm>
#include <cstddef>
#include <limits>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>

namespace chunkstar::detail {

/** @brief Bytes handed out by one space, checked against its capacity under one lock, so that two
 *  threads racing for the last bytes cannot both succeed (a check-then-add would let them). */
class space_accounting {
 public:
  explicit space_accounting(std::size_t capacity) noexcept : capacity_(capacity) {}

  /** @brief Reserve `n` bytes; false (and nothing changes) when that would exceed the capacity. */
  [[nodiscard]] bool try_reserve(std::size_t n) noexcept {
    const std::lock_guard lock(mutex_);
    if (n > capacity_ - used_) return false;
    used_ += n;
    peak_ = std::max(peak_, used_);
    return true;
  }
  /** @brief Give back bytes obtained from try_reserve. */
  void release(std::size_t n) noexcept {
    const std::lock_guard lock(mutex_);
    used_ -= std::min(n, used_);
  }
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }
  [[nodiscard]] std::size_t used() const noexcept {
    const std::lock_guard lock(mutex_);
    return used_;
  }
  [[nodiscard]] std::size_t peak() const noexcept {
    const std::lock_guard lock(mutex_);
    return peak_;
  }
  /** @brief Restart peak tracking from the current use (for per-iteration peaks). */
  void reset_peak() noexcept {
    const std::lock_guard lock(mutex_);
    peak_ = used_;
  }
  /** @brief Consistent snapshot; `largest_free_block` is `capacity - used` (SIZE_MAX if unlimited),
   *  which the caller narrows when it knows better. */
  [[nodiscard]] space_usage snapshot(std::string_view name) const {
    const std::lock_guard lock(mutex_);
    constexpr auto unlimited = std::numeric_limits<std::size_t>::max();
    return space_usage{std::string(name), capacity_, used_, peak_,
                       capacity_ == unlimited ? unlimited : capacity_ - used_};
  }

 private:
  mutable std::mutex mutex_;
  std::size_t capacity_;
  std::size_t used_ = 0;
  std::size_t peak_ = 0;
};

/** @brief Throws config_error unless `a` is a non-zero power of two. */
inline void check_alignment(std::size_t a, std::string_view space) {
  if (a == 0 || (a & (a - 1)) != 0) {
    throw config_error(std::string(space) + ": alignment " + std::to_string(a) +
                       " is not a power of two; pass 1, 2, 4, ... (alignof(T) or a cache/page size)");
  }
}

/** @brief The error every space throws from allocate() when try_allocate() would return null. */
[[nodiscard]] inline out_of_memory_error make_oom(std::string_view space, std::size_t n, std::size_t a,
                                                  space_usage usage, std::string_view hint) {
  std::string what = std::string(space) + ": cannot allocate " + format_bytes(n) + " (alignment " + std::to_string(a) +
                     "); " + std::string(hint);
  return out_of_memory_error(what, n, memory_report{{std::move(usage)}});
}

/** @brief `x` rounded up to a multiple of the power of two `g`; SIZE_MAX when that overflows. */
[[nodiscard]] constexpr std::size_t round_up_pow2(std::size_t x, std::size_t g) noexcept {
  if (x > std::numeric_limits<std::size_t>::max() - (g - 1)) return std::numeric_limits<std::size_t>::max();
  return (x + g - 1) & ~(g - 1);
}

/** @brief Remembers the base of blocks a space over-allocated to honour an alignment its
 *  allocator does not give (cudaMalloc: 256 B, cudaHostAlloc: a page), keyed by the aligned pointer. */
class over_aligned_blocks {
 public:
  void insert(void* aligned, void* base) {
    const std::lock_guard lock(mutex_);
    bases_.emplace(aligned, base);
  }
  /** @brief The base recorded for `aligned` (and forget it); `aligned` itself if none was. */
  [[nodiscard]] void* take(void* aligned) noexcept {
    const std::lock_guard lock(mutex_);
    const auto it = bases_.find(aligned);
    if (it == bases_.end()) return aligned;
    void* base = it->second;
    bases_.erase(it);
    return base;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<void*, void*> bases_;
};

}  // namespace chunkstar::detail
