// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Belady's MIN: evict the chunk whose next use (from the recorded trace) is furthest away.
 */
#pragma once

#include <chunkstar/eviction/eviction_strategy.hpp>

namespace chunkstar {

/** @brief Evicts the candidate used furthest in the future; with equal distances (or no trace yet,
 *  when every distance is `never`) it falls back to LRU, so it is never worse-informed than LRU.
 *  With equal-sized chunks this is the offline optimum for the number of loads. */
struct belady_eviction {
  static constexpr bool uses_trace = true;
  [[nodiscard]] std::size_t pick(std::span<const eviction_candidate> c) const noexcept {
    std::size_t best = 0;
    for (std::size_t i = 1; i < c.size(); ++i) {
      const auto& a = c[i];
      const auto& b = c[best];
      if (a.next_use > b.next_use ||
          (a.next_use == b.next_use && (a.last_use < b.last_use || (a.last_use == b.last_use && a.id < b.id))))
        best = i;
    }
    return best;
  }
  [[nodiscard]] static constexpr std::string_view name() noexcept { return "belady"; }
};

static_assert(EvictionStrategy<belady_eviction>);

}  // namespace chunkstar
