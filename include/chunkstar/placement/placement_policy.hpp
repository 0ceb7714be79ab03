// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief The `PlacementPolicy` concept: how many bytes of chunks the compute tier may hold at each
 *         moment, and on which tier each chunk's optimizer step runs.
 *
 *  Models: `static_placement` (static_placement.hpp), `auto_placement` (auto_placement.hpp).
 */
#pragma once

#include <chunkstar/core/moment_kind.hpp>
#include <chunkstar/core/tier.hpp>

#include <concepts>
#include <cstddef>
#include <limits>
#include <string_view>

namespace chunkstar {

/** @brief What the runtime tells a placement policy. Bytes throughout. Chunk payloads with a
 *  transfer in flight count as resident: they already occupy their destination. */
struct placement_inputs {
  std::size_t moment = 0;  ///< the moment asked about: its index in the iteration (the trace's, when ready)
  moment_kind kind = moment_kind::forward;  ///< what that moment is: forward, backward or the optimizer step
  std::size_t device_capacity = 0;          ///< the compute tier's budget (chunks + non-model data)
  std::size_t non_model_now = 0;            ///< non-model bytes live now
  bool trace_ready = false;                 ///< the fields below are from a trace only when true
  std::size_t non_model_peak_here = 0;      ///< recorded peak during this moment
  std::size_t non_model_peak_next = 0;      ///< recorded peak during the next moment
  std::size_t non_model_peak_max = 0;       ///< recorded peak over the iteration
  std::size_t non_model_peak_step = 0;      ///< recorded peak during the optimizer step (activations are gone)
  std::size_t total_chunk_bytes = 0;        ///< every chunk of every list
  std::size_t compute_chunk_bytes = 0;      ///< the param and grad lists (what forward/backward touch)
  std::size_t step_chunk_bytes = 0;         ///< one chunk index across all lists (what one step needs)
  std::size_t num_chunks = 0;               ///< chunks per list
};

/** @brief The `PlacementPolicy` concept.
 *
 *  Required expressions, for `p` a `const P&`, `in` a `const placement_inputs&`, `c` a `std::size_t`:
 *  1. `p.chunk_budget(in)` → `std::size_t`: bytes of chunks the compute tier may hold at moment
 *     `in.moment` (the current one, or a coming one when the prefetcher plans ahead; `in.kind`
 *     says whether it is forward, backward or the optimizer step, so a policy may budget each
 *     phase differently). The runtime never exceeds `device_capacity - non_model_now` whatever this
 *     says, and always admits the open scope's working set (or fails with a typed error).
 *  2. `p.optimizer_tier(in, c)` → `tier`: `tier::device` or `tier::host`, where chunk index `c`'s
 *     optimizer step runs. Must depend only on `in` and `c` (deterministic).
 *  3. `p.name()` → convertible to `std::string_view`.
 */
template <class P>
concept PlacementPolicy = requires(const P& p, const placement_inputs& in, std::size_t c) {
  { p.chunk_budget(in) } -> std::same_as<std::size_t>;
  { p.optimizer_tier(in, c) } -> std::same_as<tier>;
  { p.name() } -> std::convertible_to<std::string_view>;
};

/** @brief `device_capacity - non_model`, saturating at zero. */
constexpr std::size_t room_after(std::size_t capacity, std::size_t non_model) noexcept {
  return capacity > non_model ? capacity - non_model : 0;
}

/** @brief How many chunks' optimizer state fits @p share of the room the compute tier has beside
 *  @p non_model bytes and every param and grad chunk: a chunk stepped there adds only its state
 *  (master, momentum, variance: a step's chunk bytes less its param and grad share). Without
 *  state, any room holds every chunk (the largest size_t); without room, none. */
constexpr std::size_t chunks_of_state_fitting(const placement_inputs& in, std::size_t non_model,
                                              double share) noexcept {
  const std::size_t room = room_after(room_after(in.device_capacity, non_model), in.compute_chunk_bytes);
  const std::size_t compute_per_chunk = in.num_chunks ? in.compute_chunk_bytes / in.num_chunks : 0;
  const std::size_t state = in.step_chunk_bytes > compute_per_chunk ? in.step_chunk_bytes - compute_per_chunk : 0;
  constexpr std::size_t all = std::numeric_limits<std::size_t>::max();
  if (room == 0 || state == 0) return room == 0 ? 0 : all;
  const double fits = static_cast<double>(room) * (share < 0 ? 0 : share > 1 ? 1 : share) / static_cast<double>(state);
  return fits >= static_cast<double>(all) ? all : static_cast<std::size_t>(fits);  // 2^64 would not convert
}

}  // namespace chunkstar
