// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief The `MemorySpace` concept, the trait table of which space can reach and copy to which,
 *         and `memory_space_ref`, a non-owning type-erased reference for API boundaries.
 *
 *  Models: `host_space` (host_space.hpp), `simulated_device_space` (simulated_device_space.hpp),
 *  `cuda::device_space` and `cuda::pinned_host_space` (chunkstar/cuda/, Tier 1).
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/memory_report.hpp>

#include <concepts>
#include <cstddef>
#include <string_view>

namespace chunkstar {

/** @brief Where bytes physically live; decides reachability and which copies can be asynchronous. */
enum class memory_kind : unsigned char { host, pinned_host, device, file };

/** @brief The `MemorySpace` concept.
 *
 *  Required expressions, for `s` an `S&`, `cs` a `const S&`, `n`, `a` `std::size_t` (a a power of
 *  two), `p` a `void*` obtained from `s`:
 *  1. `S::kind` — a `static constexpr memory_kind`.
 *  2. `s.allocate(n, a)` → `void*`: `n` bytes aligned to `a`; never null; on failure throws
 *     `out_of_memory_error` carrying this space's usage. `used()` grows by at least `n`.
 *  3. `s.try_allocate(n, a)` → `void*`: as above but returns `nullptr` instead of throwing, so a
 *     caller can evict and retry. A space with a capacity never exceeds it.
 *  4. `s.deallocate(p, n, a)` — `noexcept`; `n`, `a` as passed to allocate.
 *  5. `cs.capacity()`, `cs.used()` → `std::size_t` bytes (capacity may be SIZE_MAX: unlimited).
 *  6. `cs.usage()` → `space_usage`: name, capacity, used, peak and largest free block.
 *  7. `cs.name()` → convertible to `std::string_view`.
 *  Spaces are not copyable (they own their blocks) and are safe to call from several threads.
 */
template <class S>
concept MemorySpace = requires(S& s, const S& cs, std::size_t n, std::size_t a, void* p) {
  { S::kind } -> std::convertible_to<memory_kind>;
  { s.allocate(n, a) } -> std::same_as<void*>;
  { s.try_allocate(n, a) } -> std::same_as<void*>;
  { s.deallocate(p, n, a) }
  noexcept;
  { cs.capacity() } -> std::same_as<std::size_t>;
  { cs.used() } -> std::same_as<std::size_t>;
  { cs.usage() } -> std::same_as<space_usage>;
  { cs.name() } -> std::convertible_to<std::string_view>;
}
&&!std::copyable<S>;

/** @brief Execution contexts that may dereference memory: the host CPU, or CUDA kernels. */
struct host_exec {};
struct cuda_exec {};

/** @brief Trait table: can code running in `Exec` dereference memory of `Space`?
 *  Specialised next to each space (Kokkos' MemorySpaceAccess, as a table). */
template <class Exec, class Space>
inline constexpr bool can_access_v = false;

/** @brief Trait table: can bytes be copied from `Src` to `Dst`, and can the copy run
 *  asynchronously to the caller (a worker thread or a CUDA stream)? Specialised next to each space. */
template <class Src, class Dst>
struct copy_traits {
  static constexpr bool possible = false;
  static constexpr bool async = false;
};

/** @brief A non-owning, type-erased reference to any `MemorySpace`: for API boundaries where a
 *  template parameter would spread (stats, reports, the runtime's per-tier bookkeeping). */
class memory_space_ref {
 public:
  template <MemorySpace S>
  memory_space_ref(S& s) noexcept  // NOLINT(google-explicit-constructor): a reference converts implicitly
      : obj_(&s), vt_(&vtable_for<S>), kind_(S::kind) {}

  void* allocate(std::size_t n, std::size_t a) { return vt_->allocate(obj_, n, a); }
  void* try_allocate(std::size_t n, std::size_t a) { return vt_->try_allocate(obj_, n, a); }
  void deallocate(void* p, std::size_t n, std::size_t a) noexcept { vt_->deallocate(obj_, p, n, a); }
  [[nodiscard]] std::size_t capacity() const { return vt_->capacity(obj_); }
  [[nodiscard]] std::size_t used() const { return vt_->used(obj_); }
  [[nodiscard]] space_usage usage() const { return vt_->usage(obj_); }
  [[nodiscard]] std::string_view name() const { return vt_->name(obj_); }
  [[nodiscard]] memory_kind kind() const noexcept { return kind_; }
  /** @brief True when both refer to the same space object. */
  friend bool operator==(const memory_space_ref& x, const memory_space_ref& y) noexcept { return x.obj_ == y.obj_; }

 private:
  struct vtable {
    void* (*allocate)(void*, std::size_t, std::size_t);
    void* (*try_allocate)(void*, std::size_t, std::size_t);
    void (*deallocate)(void*, void*, std::size_t, std::size_t) noexcept;
    std::size_t (*capacity)(const void*);
    std::size_t (*used)(const void*);
    space_usage (*usage)(const void*);
    std::string_view (*name)(const void*);
  };
  template <class S>
  static constexpr vtable vtable_for{
      [](void* o, std::size_t n, std::size_t a) { return static_cast<S*>(o)->allocate(n, a); },
      [](void* o, std::size_t n, std::size_t a) { return static_cast<S*>(o)->try_allocate(n, a); },
      [](void* o, void* p, std::size_t n, std::size_t a) noexcept { static_cast<S*>(o)->deallocate(p, n, a); },
      [](const void* o) { return static_cast<const S*>(o)->capacity(); },
      [](const void* o) { return static_cast<const S*>(o)->used(); },
      [](const void* o) { return static_cast<const S*>(o)->usage(); },
      [](const void* o) { return std::string_view(static_cast<const S*>(o)->name()); },
  };
  void* obj_;
  const vtable* vt_;
  memory_kind kind_;
};

}  // namespace chunkstar
