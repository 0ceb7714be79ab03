// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief How Rotated Tensor Parallelism splits one dimension of a layer over N ranks:
 *         `shard_range`, `valid_world_sizes`, `require_divisible`.
 *
 *  Pure functions. RTP shards are equal by construction (every shard travels the same ring and
 *  lands in the same fixed-size buffers, `rtp/rotation.hpp`), so a dimension the world size does
 *  not divide is a configuration error, reported with the world sizes that would work, rather
 *  than padded silently.
 */
#pragma once

#include <chunkstar/core/error.hpp>

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace chunkstar::rtp {

/** @brief A half-open index range `[begin, end)` along one dimension. */
struct index_range {
  std::size_t begin = 0;
  std::size_t end = 0;
  /** @brief `end - begin`. */
  [[nodiscard]] constexpr std::size_t size() const noexcept { return end - begin; }
  friend constexpr bool operator==(const index_range&, const index_range&) = default;
};

/** @brief Largest world size `require_divisible`'s message lists by default. */
inline constexpr int max_listed_world_size = 64;

/** @brief The world sizes in `[1, up_to]` that divide @p dim evenly, ascending (empty when
 *  @p dim is 0). */
[[nodiscard]] inline std::vector<int> valid_world_sizes(std::size_t dim, int up_to = max_listed_world_size) {
  std::vector<int> out;
  if (dim == 0) return out;
  for (int n = 1; n <= up_to; ++n)
    if (dim % static_cast<std::size_t>(n) == 0) out.push_back(n);
  return out;
}

/** @brief Throws `config_error` unless @p dim (called @p name in the message: "hidden",
 *  "w1.rows") splits into @p world equal, non-empty shards. The message lists the world sizes up to
 *  `max_listed_world_size` that would. */
inline void require_divisible(std::string_view name, std::size_t dim, int world) {
  if (world < 1)
    throw config_error("rtp: world size " + std::to_string(world) + " for dimension '" + std::string(name) +
                       "' is not a rank count; pass >= 1");
  if (dim == 0)
    throw config_error("rtp: dimension '" + std::string(name) +
                       "' has size 0; a sharded dimension needs at least one element per rank");
  if (dim % static_cast<std::size_t>(world) == 0) return;
  std::string valid;
  for (const int n : valid_world_sizes(dim)) valid += (valid.empty() ? "" : ", ") + std::to_string(n);
  throw config_error(
      "rtp: dimension '" + std::string(name) + "' of size " + std::to_string(dim) + " does not split evenly over " +
      std::to_string(world) + " ranks; world sizes that divide it (up to " + std::to_string(max_listed_world_size) +
      "): " + valid + "; change the world size or the dimension (e.g. round the hidden width to a multiple of " +
      std::to_string(world) + ")");
}

/** @brief The indices of @p dim that shard @p rank of @p world owns: the contiguous block
 *  `[rank * dim / world, (rank + 1) * dim / world)`. Throws `config_error` when @p world does not
 *  divide @p dim (see `require_divisible`, which names the dimension @p name) or @p rank is not in
 *  `[0, world)`. */
[[nodiscard]] inline index_range shard_range(std::size_t dim, int world, int rank, std::string_view name) {
  require_divisible(name, dim, world);
  if (rank < 0 || rank >= world)
    throw config_error("rtp: shard " + std::to_string(rank) + " of dimension '" + std::string(name) +
                       "' is not in [0, " + std::to_string(world) + ")");
  const std::size_t per = dim / static_cast<std::size_t>(world);
  const auto r = static_cast<std::size_t>(rank);
  return {r * per, (r + 1) * per};
}

}  // namespace chunkstar::rtp
