// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `shard_map`: which rank owns which chunk under ZeRO sharding, and the groups of N
 *         consecutive chunks that are gathered and reduced together.
 */
#pragma once

#include <cstddef>

namespace chunkstar {

/** @brief Who owns which chunk: chunk c belongs to rank c mod N; chunks gN .. gN+N-1 form group g. */
struct shard_map {
  int world = 1;
  int rank = 0;
  [[nodiscard]] constexpr int owner(std::size_t c) const noexcept {
    return static_cast<int>(c % static_cast<std::size_t>(world));
  }
  [[nodiscard]] constexpr bool owns(std::size_t c) const noexcept { return owner(c) == rank; }
  [[nodiscard]] constexpr std::size_t group(std::size_t c) const noexcept {
    return c / static_cast<std::size_t>(world);
  }
  [[nodiscard]] constexpr std::size_t first(std::size_t g) const noexcept {
    return g * static_cast<std::size_t>(world);
  }
  /** @brief @p chunks rounded up to whole groups (every rank then owns as many chunks). */
  [[nodiscard]] constexpr std::size_t padded(std::size_t chunks) const noexcept {
    const auto n = static_cast<std::size_t>(world);
    return (chunks + n - 1) / n * n;
  }
};

}  // namespace chunkstar
