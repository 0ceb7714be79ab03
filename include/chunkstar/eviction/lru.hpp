// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Least-recently-used eviction: the chunk whose last access is oldest leaves first.
 */
#pragma once

#include <chunkstar/eviction/eviction_strategy.hpp>

namespace chunkstar {

/** @brief Evicts the least recently used candidate; ties go to the lowest chunk id. Needs no trace,
 *  so it is also the safe fallback while the trace is being recorded. */
struct lru_eviction {
  static constexpr bool uses_trace = false;
  [[nodiscard]] std::size_t pick(std::span<const eviction_candidate> c) const noexcept {
    std::size_t best = 0;
    for (std::size_t i = 1; i < c.size(); ++i)
      if (c[i].last_use < c[best].last_use || (c[i].last_use == c[best].last_use && c[i].id < c[best].id)) best = i;
    return best;
  }
  [[nodiscard]] static constexpr std::string_view name() noexcept { return "lru"; }
};

static_assert(EvictionStrategy<lru_eviction>);

}  // namespace chunkstar
