// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `disk_tier`: what a runtime needs of a third tier on local disk — a file-backed memory
 *         space and the copy engine that moves chunks between host memory and it — as one
 *         non-owning, type-erased reference (`chunk_runtime::attach_disk`).
 *
 *  Erased because a disk copy moves a whole chunk (MiBs) and costs a system call: one indirect call
 *  per copy is nothing beside it, and every platform (simulated, CUDA) can then take a disk at run
 *  time without another instantiation of the runtime. Which engine (thread pool or io_uring) is a
 *  run-time choice too (uring_copy_engine.hpp: `uring_or_pool_copy_engine`).
 */
#pragma once

#include <chunkstar/memory/copy_engine.hpp>
#include <chunkstar/memory/host_copy_engine.hpp>
#include <chunkstar/memory/memory_space.hpp>

#include <concepts>
#include <cstddef>
#include <functional>
#include <utility>

namespace chunkstar {

/** @brief The completion of a disk copy (the disk engines' handle). */
using disk_copy_handle = host_copy_handle;

/** @brief A `CopyEngine` a disk tier can use: its handles are `disk_copy_handle`s and it can order
 *  a lane after a handle of another engine (`disk_copy_engine`, `uring_copy_engine` do). */
template <class E>
concept DiskCopyEngine = CopyEngine<E> && requires(E& e, void* dst, const void* src, std::size_t n, copy_direction d) {
  { e.copy_async(dst, src, n, d) } -> std::same_as<disk_copy_handle>;
};

/** @brief A non-owning reference to a file-backed space and its disk copy engine. Both must
 *  outlive every runtime given it. Directions as the disk engines define them: `to_device` is a
 *  read (disk -> host), `to_host` a write (host -> disk). */
class disk_tier {
 public:
  template <MemorySpace S, DiskCopyEngine E>
  disk_tier(S& space, E& engine) noexcept : space_(space), engine_(&engine), vt_(&vtable_for<E>) {}

  [[nodiscard]] memory_space_ref space() const noexcept { return space_; }
  disk_copy_handle copy_async(void* dst, const void* src, std::size_t n, copy_direction d) const {
    return vt_->copy_async(engine_, dst, src, n, d);
  }
  void copy(void* dst, const void* src, std::size_t n, copy_direction d) const { copy_async(dst, src, n, d).wait(); }
  disk_copy_handle zero_async(void* dst, std::size_t n) const { return vt_->zero_async(engine_, dst, n); }
  /** @brief Later jobs of lane @p d start after @p h, a handle of any engine; the caller does not wait. */
  template <CopyHandle H>
  void order_after(const H& h, copy_direction d) const {
    if (h.ready()) return;
    vt_->order_after(
        engine_, [h] { h.wait(); }, d);
  }
  void synchronize() const { vt_->synchronize(engine_); }
  [[nodiscard]] copy_stats stats() const { return vt_->stats(engine_); }

 private:
  /** A foreign handle as the engine's order_after sees it. */
  struct waitable {
    std::function<void()> wait_fn;
    [[nodiscard]] bool ready() const { return false; }
    void wait() const { wait_fn(); }
  };
  struct vtable {
    disk_copy_handle (*copy_async)(void*, void*, const void*, std::size_t, copy_direction);
    disk_copy_handle (*zero_async)(void*, void*, std::size_t);
    void (*order_after)(void*, std::function<void()>, copy_direction);
    void (*synchronize)(void*);
    copy_stats (*stats)(const void*);
  };
  template <class E>
  static constexpr vtable vtable_for{
      [](void* e, void* dst, const void* src, std::size_t n, copy_direction d) {
        return static_cast<E*>(e)->copy_async(dst, src, n, d);
      },
      [](void* e, void* dst, std::size_t n) { return static_cast<E*>(e)->zero_async(dst, n); },
      [](void* e, std::function<void()> w, copy_direction d) {
        if constexpr (requires(E & x, const waitable& h) { x.order_after(h, d); })
          static_cast<E*>(e)->order_after(waitable{std::move(w)}, d);
        else w();  // an engine that orders only after its own handles: wait here
      },
      [](void* e) { static_cast<E*>(e)->synchronize(); },
      [](const void* e) { return static_cast<const E*>(e)->stats(); },
  };

  memory_space_ref space_;
  void* engine_;
  const vtable* vt_;
};

}  // namespace chunkstar
