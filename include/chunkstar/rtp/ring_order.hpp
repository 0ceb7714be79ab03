// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief The ring order of Rotated Tensor Parallelism as pure functions: which shard a rank
 *         holds at each step of a forward and a backward pass, in which order the ranks add to a
 *         shard's gradient, and what a pass sends.
 *
 *  The decision half of `rtp::rotation` (rtp/rotation.hpp), which only carries it out, so the
 *  order can be checked exhaustively on its own (tests/rtp/rtp_schedule.test.cpp).
 *
 *  The `Communicator`'s ring shift goes one way: every rank sends to rank + 1 and receives from
 *  rank - 1. Shards therefore always travel "up" the ring, and a rank sees them in descending
 *  order (mod N):
 *  - forward step s (0..N-1): rank r holds shard (r - s) mod N. Step 0 is its own shard, so the
 *    pass needs N - 1 shifts and ends without one: the owned shard never left.
 *  - backward step t (0..N-1): rank r holds shard (r - 1 - t) mod N. It starts one place on, so
 *    that the last shard it visits is its own: the gradient buffer that travelled with each shard
 *    arrives at its owner at the last step, with no shift back. A one-way ring cannot retrace the
 *    forward order; nothing needs it to, since the schedule hands each step's kernel the shard's
 *    index and data explicitly (no aliasing that requires replaying forward in reverse).
 *  - the gradient of shard j is summed in the rank order j+1, j+2, ..., j+N-1, j (mod N): the
 *    owner's contribution comes last. The order is fixed, so results are bit-identical run to run.
 */
#pragma once

#include <cstddef>
#include <cstdint>

namespace chunkstar::rtp {

namespace detail {
constexpr int ring_mod(int a, int n) noexcept { return ((a % n) + n) % n; }
}  // namespace detail

/** @brief The shard rank @p rank of @p world holds at forward step @p step (0..world-1). */
constexpr int forward_shard(int rank, int world, int step) noexcept { return detail::ring_mod(rank - step, world); }

/** @brief The shard rank @p rank of @p world holds at backward step @p step (0..world-1); the
 *  last step is the rank's own shard. */
constexpr int backward_shard(int rank, int world, int step) noexcept {
  return detail::ring_mod(rank - 1 - step, world);
}

/** @brief The rank whose contribution is the @p k-th (0-based) term of shard @p shard's gradient
 *  sum: the rank that holds @p shard at backward step @p k. The last (k = world - 1) is the owner. */
constexpr int gradient_contributor(int shard, int world, int k) noexcept {
  return detail::ring_mod(shard + 1 + k, world);
}

/** @brief What one pass over one layer sends per rank (and receives: the ring is symmetric). */
struct pass_traffic {
  int shifts = 0;                ///< ring shifts issued (collectives)
  std::uint64_t bytes_sent = 0;  ///< bytes sent by each rank
  friend constexpr bool operator==(const pass_traffic&, const pass_traffic&) = default;
};

/** @brief A forward pass: N - 1 shifts of one shard. One rank sends nothing. */
constexpr pass_traffic forward_traffic(int world, std::size_t shard_bytes) noexcept {
  const int hops = world > 1 ? world - 1 : 0;
  return {hops, static_cast<std::uint64_t>(hops) * shard_bytes};
}

/** @brief A backward pass: N - 1 weight shifts (the first fetches shard r - 1 before step 0; the
 *  last step uses the owned shard, so none arrives for it) and N - 1 gradient shifts (one after
 *  every step but the last), each of one shard's bytes (the gradient has the shard's shape). */
constexpr pass_traffic backward_traffic(int world, std::size_t shard_bytes) noexcept {
  const int hops = world > 1 ? world - 1 : 0;
  return {2 * hops, 2 * static_cast<std::uint64_t>(hops) * shard_bytes};
}

}  // namespace chunkstar::rtp
