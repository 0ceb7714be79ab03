// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief The `EvictionStrategy` concept: which chunk leaves a tier when room is needed.
 *
 *  The runtime, not the strategy, decides what may be evicted: candidates never include a chunk
 *  with a tensor in COMPUTE or one needed by the scope being opened; a candidate still being
 *  loaded is waited for before it leaves. Strategies are therefore small and stateless. Models: `lru_eviction`
 *  (lru.hpp),
 *  `belady_eviction` (belady.hpp).
 */
#pragma once

#include <chunkstar/core/chunk_id.hpp>
#include <chunkstar/core/moment_kind.hpp>
#include <chunkstar/core/tier.hpp>

#include <concepts>
#include <cstddef>
#include <span>
#include <string_view>
#include <type_traits>

namespace chunkstar {

/** @brief What the runtime knows about a chunk that could be evicted. Ticks count the runtime's
 *  chunk events (accesses and arrivals) and only grow, so they order events without timing. */
struct eviction_candidate {
  chunk_id id;
  std::size_t bytes = 0;
  std::size_t last_use = 0;      ///< tick of the chunk's most recent access (larger = more recent)
  std::size_t next_use = never;  ///< distance in moments to its next use from the trace; `never` if unknown
  std::size_t loaded_at = 0;     ///< tick at which the chunk arrived on this tier (FIFO evicts the smallest)
};

/** @brief The `EvictionStrategy` concept.
 *
 *  Required expressions, for `e` a `const E&` and `c` a non-empty `std::span<const eviction_candidate>`:
 *  1. `e.pick(c)` → `std::size_t`: index into `c` of the victim. Deterministic (same candidates,
 *     same answer), so training results never depend on timing.
 *  2. `e.name()` → convertible to `std::string_view`.
 *  3. `E::uses_trace` — a `static constexpr bool` (a constant expression, checked): true when
 *     `pick` relies on `next_use` (the runtime then asks the tracer for it; otherwise it passes `never`).
 */
template <class E>
concept EvictionStrategy = requires(const E& e, std::span<const eviction_candidate> c) {
  { e.pick(c) } -> std::same_as<std::size_t>;
  { e.name() } -> std::convertible_to<std::string_view>;
  { E::uses_trace } -> std::convertible_to<bool>;
  typename std::bool_constant<E::uses_trace>;  // a constant expression: the runtime branches on it at compile time
};

}  // namespace chunkstar
