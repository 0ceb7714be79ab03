// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `simulated_device_space`: host memory posing as a device with a hard capacity and an
 *         optional modelled link, so CPU-only runs exercise memory pressure, eviction and overlap.
 *
 *  Like a device's caching allocator, it keeps freed large blocks mapped and hands them to the
 *  next request of the same size: a trainer frees and re-allocates its activations, workspace and
 *  chunk payloads every step, and fresh pages cost about 12 us each to fault in (a gpt2-shape step
 *  took ~22,000 page faults, ~88 MB of fresh memory, before this cache). Large blocks are mapped
 *  pre-faulted, on transparent huge pages from 2 MiB. The cache holds at most `cache_limit` bytes
 *  (default: the capacity), so the host memory the space maps stays below twice its capacity;
 *  `used()` still counts requested bytes exactly and is what the capacity bounds. (Bounding blocks
 *  in use plus cached by the capacity, as a real device must, made a nearly full device unmap and
 *  re-map blocks of other sizes every step: more page faults than the C heap, not fewer.)
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/memory_report.hpp>
#include <chunkstar/memory/copy_engine.hpp>
#include <chunkstar/memory/detail/block_cache.hpp>
#include <chunkstar/memory/detail/space_accounting.hpp>
#include <chunkstar/memory/host_space.hpp>
#include <chunkstar/memory/memory_space.hpp>

#include <cstddef>
#include <limits>
#include <new>
#include <string>
#include <utility>

namespace chunkstar {

/** @brief Numeric knobs of a `simulated_device_space`. */
struct simulated_device_options {
  /** @brief Hard cap in bytes; required (a device always has one). */
  std::size_t capacity = 0;
  /** @brief The modelled host<->device link; give the same model to the `host_copy_engine`. */
  copy_model link{};
  /** @brief Name in reports and errors. */
  std::string name = "simulated_device";
  /** @brief Blocks at least this large are mapped pre-faulted and, once freed, cached for the next
   *  request of the same rounded size (64 KiB granules below 2 MiB, 2 MiB above); smaller ones
   *  come from operator new. SIZE_MAX turns the cache off. */
  std::size_t large_block_threshold = std::size_t{256} << 10;
  /** @brief Most bytes of freed large blocks kept for reuse; 0: the capacity. `trim()` releases them. */
  std::size_t cache_limit = 0;
};

/** @brief A device simulated in host memory. Thread-safe. Models `MemorySpace`.
 *
 *  Guarantee: `used()` and `peak()` never exceed `capacity()`; a request that would exceed it makes
 *  `try_allocate` return nullptr and `allocate` throw out_of_memory_error. `used()` counts requested
 *  bytes exactly, so tests can compute the expected use independently.
 *
 *  `kind` is `memory_kind::device` because the runtime treats this space as its device tier; the
 *  trait table still says host code may touch it (it is host memory), which is what lets the
 *  simulation run "device" compute on the CPU.
 */
class simulated_device_space {
 public:
  static constexpr memory_kind kind = memory_kind::device;

  explicit simulated_device_space(simulated_device_options options)
      : options_(std::move(options)), accounting_(options_.capacity) {
    if (options_.capacity == 0) {
      throw config_error(options_.name +
                         ": capacity is 0; set simulated_device_options::capacity to the "
                         "simulated device's memory in bytes (for example 1 GiB)");
    }
    if (options_.link.bandwidth_bytes_per_s < 0 || options_.link.latency_s < 0) {
      throw config_error(options_.name + ": copy_model bandwidth and latency must be >= 0 (0 bandwidth = unmodelled)");
    }
  }
  simulated_device_space(const simulated_device_space&) = delete;
  simulated_device_space& operator=(const simulated_device_space&) = delete;

  /** @brief `n` bytes aligned to `a`; throws out_of_memory_error with this space's usage. */
  [[nodiscard]] void* allocate(std::size_t n, std::size_t a = alignof(std::max_align_t)) {
    if (void* p = try_allocate(n, a)) return p;
    throw detail::make_oom(options_.name, n, a, usage(),
                           "evict or free chunks first, or raise simulated_device_options::capacity");
  }

  /** @brief As allocate(), but nullptr when the request would exceed the capacity. */
  [[nodiscard]] void* try_allocate(std::size_t n, std::size_t a = alignof(std::max_align_t)) {
    detail::check_alignment(a, options_.name);
    if (!accounting_.try_reserve(n)) return nullptr;
    void* p = is_large(n) ? allocate_large(n, a) : ::operator new (n, std::align_val_t{a}, std::nothrow);
    if (p == nullptr) accounting_.release(n);
    return p;
  }

  /** @brief Return a block; `n` and `a` as passed to allocate. */
  void deallocate(void* p, std::size_t n, std::size_t a = alignof(std::max_align_t)) noexcept {
    if (p == nullptr) return;
    if (is_large(n)) deallocate_large(p, n);
    else ::operator delete (p, std::align_val_t{a});
    accounting_.release(n);
  }

  /** @brief Bytes of freed large blocks kept mapped for reuse. */
  [[nodiscard]] std::size_t cached_bytes() const noexcept { return cache_.bytes(); }
  /** @brief Unmaps every cached block (blocks in use are untouched). */
  void trim() noexcept { cache_.trim(); }

  [[nodiscard]] std::size_t capacity() const noexcept { return accounting_.capacity(); }
  [[nodiscard]] std::size_t used() const noexcept { return accounting_.used(); }
  /** @brief Highest `used()` since construction or reset_peak(); never above capacity(), which
   *  tests assert to prove a run stayed within its simulated device. */
  [[nodiscard]] std::size_t peak() const noexcept { return accounting_.peak(); }
  void reset_peak() noexcept { accounting_.reset_peak(); }
  /** @brief Usage with `largest_free_block = capacity - used`: the blocks come from host malloc,
   *  whose virtual address space does not fragment at these sizes, so every request up to the
   *  remaining capacity succeeds. (A real device can fragment; its space reports less.) */
  [[nodiscard]] space_usage usage() const { return accounting_.snapshot(options_.name); }
  [[nodiscard]] const std::string& name() const noexcept { return options_.name; }
  /** @brief The modelled link to this device (unmodelled when its bandwidth is 0). */
  [[nodiscard]] const copy_model& link() const noexcept { return options_.link; }

 private:
  [[nodiscard]] bool is_large(std::size_t n) const noexcept {
    return CHUNKSTAR_DETAIL_HOST_MMAP && n >= options_.large_block_threshold;
  }
  [[nodiscard]] static std::size_t granule(std::size_t n) noexcept {
    return n >= detail::huge_page_bytes ? detail::huge_page_bytes : std::size_t{64} << 10;
  }

  void* allocate_large(std::size_t n, std::size_t a) noexcept {
#if CHUNKSTAR_DETAIL_HOST_MMAP
    const std::size_t g = granule(n), size = detail::round_up_pow2(n, g), align = a > g ? a : g;
    if (size == std::numeric_limits<std::size_t>::max() || size > std::numeric_limits<std::size_t>::max() - align)
      return nullptr;
    if (void* p = cache_.take(size, align)) return p;
    return detail::map_aligned(size, align, n >= detail::huge_page_bytes, true);
#else
    (void)n;
    (void)a;
    return nullptr;
#endif
  }

  void deallocate_large(void* p, std::size_t n) noexcept {
    cache_.put(p, detail::round_up_pow2(n, granule(n)),
               options_.cache_limit ? options_.cache_limit : accounting_.capacity());
  }

  simulated_device_options options_;
  detail::space_accounting accounting_;
  detail::block_cache cache_;
};

/** @brief Host code may touch the simulated device: it is host memory, and the simulation runs its
 *  "device" compute there. */
template <>
inline constexpr bool can_access_v<host_exec, simulated_device_space> = true;

/** @brief Host <-> simulated device and simulated device <-> itself: memcpy, asynchronous on the
 *  host copy engine's worker threads. */
template <>
struct copy_traits<host_space, simulated_device_space> {
  static constexpr bool possible = true;
  static constexpr bool async = true;
};
template <>
struct copy_traits<simulated_device_space, host_space> {
  static constexpr bool possible = true;
  static constexpr bool async = true;
};
template <>
struct copy_traits<simulated_device_space, simulated_device_space> {
  static constexpr bool possible = true;
  static constexpr bool async = true;
};

static_assert(MemorySpace<simulated_device_space>);

}  // namespace chunkstar
