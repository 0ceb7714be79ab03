/** @file
 *  @brief `rtp::transit_buffers`: the buffers a rotation uses only while a pass runs — two weight
 *         shards (one resident, one arriving), two gradient shards (one sent on, one arriving) and
 *         a scratch shard — sized for the largest shard of the rotations that share them.
 *
 *  A model's rotations run their passes one after another, so they can share one set: a rank then
 *  holds five shards of its largest layer in transit instead of five of every layer. A
 *  `rtp::rotation` built without one owns its own.
 */
#pragma once

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <span>
#include <vector>

namespace chunkstar::rtp {

/** @brief Transit buffers for rotations of shards of `T` (see the file comment). Not thread-safe:
 *  the rotations sharing one set must not run passes at the same time (one model on one thread
 *  does not). */
template <std::floating_point T = float>
class transit_buffers {
 public:
  /** @brief Grows every buffer to at least @p elems elements; the weight and gradient buffers only
   *  when @p ring (more than one rank: with one, a pass needs the scratch alone). Called by each
   *  rotation that uses the set, at construction, so no pass ever finds them short. */
  void reserve(std::size_t elems, bool ring) {
    grow(scratch_, elems);
    if (!ring) return;
    for (auto& b : w_) grow(b, elems);
    for (auto& b : g_) grow(b, elems);
  }
  /** @brief Weight buffer @p k (0 or 1). */
  [[nodiscard]] T* weights(std::size_t k) noexcept { return w_[k].data(); }
  /** @brief Gradient buffer @p k (0 or 1). */
  [[nodiscard]] T* grads(std::size_t k) noexcept { return g_[k].data(); }
  /** @brief The scratch buffer. */
  [[nodiscard]] T* scratch() noexcept { return scratch_.data(); }
  /** @brief Bytes of all five buffers. */
  [[nodiscard]] std::size_t bytes() const noexcept {
    return (w_[0].size() + w_[1].size() + g_[0].size() + g_[1].size() + scratch_.size()) * sizeof(T);
  }

 private:
  static void grow(std::vector<T>& b, std::size_t n) {
    if (b.size() < n) b.assign(n, T{});
  }
  std::array<std::vector<T>, 2> w_, g_;
  std::vector<T> scratch_;
};

}  // namespace chunkstar::rtp
