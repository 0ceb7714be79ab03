// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `rtp::weight_pair`: the shard layout of two linear layers in a row, the first split by
 *         its output rows and the second by its input columns over the same units (Megatron's
 *         column-then-row split; RTP's MLP, and attention's QKV then projection), so a shard is a
 *         self-contained slice of the pair and needs no communication between the two.
 *
 *  Matrices are row-major. A is (groups x units) x in: `groups` stacked blocks of `units` rows
 *  (3 for a fused q|k|v projection, 1 for an MLP's first layer), with an optional bias of the same
 *  rows; B is out x units. Shard s of N holds units [s k, (s + 1) k), k = units / N, of every block:
 *
 *      [ A's rows: block 0's k rows | block 1's k rows | ... (each `in` wide) | A's bias, the same rows | B's columns:
 *      out x k ]
 *
 *  A pure description (no memory, no communication): `for_each` maps every element of a shard to
 *  its tensor and global index, for initialisation by global index (counter_init), for loading
 *  full tensors and for checkpoints.
 */
#pragma once

#include <chunkstar/rtp/partition.hpp>

#include <cstddef>
#include <string>

namespace chunkstar::rtp {

/** @brief See the file comment. Build it with `make_weight_pair`, which checks divisibility. */
struct weight_pair {
  /** @brief Which tensor of the pair an element belongs to. */
  enum class part { a_weight, a_bias, b_weight };

  std::size_t in = 0;      ///< A's columns (the pair's input width)
  std::size_t units = 0;   ///< rows of each of A's blocks = B's columns: the dimension that is split
  std::size_t groups = 1;  ///< A's stacked blocks (3 for q|k|v)
  std::size_t out = 0;     ///< B's rows (the pair's output width)
  bool a_bias = true;      ///< A has a bias
  std::size_t world = 1;   ///< shards (ranks)

  /** @brief k: units per shard. */
  [[nodiscard]] constexpr std::size_t shard_units() const noexcept { return units / world; }
  [[nodiscard]] constexpr std::size_t a_weight_offset() const noexcept { return 0; }
  [[nodiscard]] constexpr std::size_t a_bias_offset() const noexcept { return groups * shard_units() * in; }
  [[nodiscard]] constexpr std::size_t b_weight_offset() const noexcept {
    return a_bias_offset() + (a_bias ? groups * shard_units() : 0);
  }
  /** @brief Elements of one shard: k (groups (in + bias) + out). */
  [[nodiscard]] constexpr std::size_t shard_elems() const noexcept { return b_weight_offset() + out * shard_units(); }
  /** @brief Elements of the whole tensors: A (groups units in), its bias, B (out units). */
  [[nodiscard]] constexpr std::size_t a_weight_elems() const noexcept { return groups * units * in; }
  [[nodiscard]] constexpr std::size_t a_bias_elems() const noexcept { return a_bias ? groups * units : 0; }
  [[nodiscard]] constexpr std::size_t b_weight_elems() const noexcept { return out * units; }

  /** @brief Calls `f(part, global_index, offset)` for every element of shard @p shard: element
   *  `global_index` of the whole tensor `part` lives at `offset` in the shard. Visits A's rows
   *  (each row's weights, then its bias element), then B's columns; the offsets follow the
   *  shard's layout, [A's rows | A's biases | B's columns] (a_weight_offset() ...), so a row's bias
   *  is not next to its weights in memory. */
  template <class F>
  void for_each(std::size_t shard, F&& f) const {
    const std::size_t k = shard_units(), u0 = shard * k;
    for (std::size_t g = 0; g < groups; ++g)
      for (std::size_t r = 0; r < k; ++r) {
        const std::size_t row = g * units + u0 + r, local = g * k + r;
        for (std::size_t c = 0; c < in; ++c) f(part::a_weight, row * in + c, a_weight_offset() + local * in + c);
        if (a_bias) f(part::a_bias, row, a_bias_offset() + local);
      }
    for (std::size_t o = 0; o < out; ++o)
      for (std::size_t r = 0; r < k; ++r) f(part::b_weight, o * units + u0 + r, b_weight_offset() + o * k + r);
  }
};

/** @brief The pair A ((groups x units) x in, with a bias when @p a_bias) then B (out x units),
 *  split over @p world shards. Throws `config_error` naming @p what (e.g. "heads", "hidden units")
 *  and the world sizes that divide it when @p world does not divide @p units. */
inline weight_pair make_weight_pair(std::size_t in, std::size_t units, std::size_t out, int world,
                                    const std::string& what, std::size_t groups = 1, bool a_bias = true) {
  require_divisible(what, units, world);
  return {.in = in,
          .units = units,
          .groups = groups,
          .out = out,
          .a_bias = a_bias,
          .world = static_cast<std::size_t>(world)};
}

}  // namespace chunkstar::rtp
