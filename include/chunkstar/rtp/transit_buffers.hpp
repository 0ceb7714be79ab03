// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `rtp::transit_buffers`: the buffers a rotation uses only while a pass runs — two weight
 *         shards (one resident, one arriving), two gradient shards (one sent on, one arriving) and
 *         a scratch shard — sized for the largest shard of the rotations that share them.
 *
 *  A model's rotations run their passes one after another, so they can share one set: a rank then
 *  holds five shards of its largest layer in transit instead of five of every layer. A
 *  `rtp::rotation` built without one owns its own. The memory comes from the allocator given at
 *  construction (host memory by default; a chunk runtime's non-model memory on the compute tier,
 *  so that its budget accounts for it).
 */
#pragma once

#include <chunkstar/rtp/buffer_ops.hpp>

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <functional>
#include <utility>

namespace chunkstar::rtp {

/** @brief Transit buffers for rotations of shards of `T` (see the file comment). Not thread-safe:
 *  the rotations sharing one set must not run passes at the same time (one model on one thread
 *  does not). Not copyable or movable (rotations hold it by reference). */
template <shard_element T = float>
class transit_buffers {
 public:
  /** @brief Allocates @p n zeroed elements, or throws. */
  using allocate_fn = std::function<T*(std::size_t n)>;
  /** @brief Frees what allocate_fn returned for @p n elements; never throws. */
  using deallocate_fn = std::function<void(T*, std::size_t n)>;

  /** @brief Buffers in host memory. */
  transit_buffers()
      : transit_buffers([](std::size_t n) { return new T[n](); }, [](T* p, std::size_t) { delete[] p; }) {}
  /** @brief Buffers from @p allocate / @p deallocate. */
  transit_buffers(allocate_fn allocate, deallocate_fn deallocate)
      : alloc_(std::move(allocate)), free_(std::move(deallocate)) {}
  transit_buffers(const transit_buffers&) = delete;
  transit_buffers& operator=(const transit_buffers&) = delete;
  ~transit_buffers() {
    for (auto& b : all()) release(*b);
  }

  /** @brief Grows every buffer to at least @p elems elements; the weight and gradient buffers only
   *  when @p ring (more than one rank, or an external shard: with one rank and a held shard, a pass
   *  needs the scratch alone). Called by each rotation that uses the set, at construction, so no
   *  pass ever finds them short. Growing discards the contents. */
  void reserve(std::size_t elems, bool ring) {
    grow(scratch_, elems);
    if (!ring) return;
    for (auto& b : w_) grow(b, elems);
    for (auto& b : g_) grow(b, elems);
  }
  /** @brief Frees every buffer and keeps its size for `restore()` (a model going to sleep: their
   *  contents are scratch between passes). */
  void release() noexcept {
    const auto bs = all();
    for (std::size_t i = 0; i < bs.size(); ++i) {
      if (bs[i]->n > 0) kept_[i] = bs[i]->n;
      release(*bs[i]);
    }
  }
  /** @brief Allocates again, zeroed, the buffers `release()` freed, at their sizes. A call that
   *  throws may be made again: it allocates what is still missing. */
  void restore() {
    const auto bs = all();
    for (std::size_t i = 0; i < bs.size(); ++i) grow(*bs[i], kept_[i]);
    kept_ = {};
  }
  /** @brief Weight buffer @p k (0 or 1). */
  [[nodiscard]] T* weights(std::size_t k) noexcept { return w_[k].p; }
  /** @brief Gradient buffer @p k (0 or 1). */
  [[nodiscard]] T* grads(std::size_t k) noexcept { return g_[k].p; }
  /** @brief The scratch buffer. */
  [[nodiscard]] T* scratch() noexcept { return scratch_.p; }
  /** @brief Bytes of all five buffers. */
  [[nodiscard]] std::size_t bytes() const noexcept {
    return (w_[0].n + w_[1].n + g_[0].n + g_[1].n + scratch_.n) * sizeof(T);
  }

 private:
  struct buffer {
    T* p = nullptr;
    std::size_t n = 0;
  };
  std::array<buffer*, 5> all() noexcept { return {&w_[0], &w_[1], &g_[0], &g_[1], &scratch_}; }
  void release(buffer& b) noexcept {
    if (b.p) free_(b.p, b.n);
    b = {};
  }
  void grow(buffer& b, std::size_t n) {
    if (b.n >= n || n == 0) return;
    T* p = alloc_(n);  // first, so a failure leaves the old buffer in place
    release(b);
    b = {p, n};
  }
  allocate_fn alloc_;
  deallocate_fn free_;
  std::array<buffer, 2> w_, g_;
  buffer scratch_;
  std::array<std::size_t, 5> kept_{};  // the sizes release() freed, in all()'s order
};

}  // namespace chunkstar::rtp
