// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief PatrickStar's automatic placement: per-moment chunk budgets from the traced non-model
 *         peaks, and optimizer steps on the compute tier for as many chunks as the margin allows.
 */
#pragma once

#include <chunkstar/placement/placement_policy.hpp>

#include <algorithm>

namespace chunkstar {

/** @brief Budget at moment m = capacity - max(non-model peak of m, of m+1): the next moment's
 *  activations must fit when it opens, so room is made one moment early ("tide-like" partition).
 *  Without a trace (warm-up, or after a divergence) it budgets from the current use, and steps every
 *  optimizer chunk on the host, which is always safe.
 *  Margin = capacity - peak non-model - param/grad chunks; the first `margin * margin_use /
 *  (optimizer-state bytes per chunk)` chunk indices step on the compute tier, their state kept there.
 *  The turn: where that is fewer than `turn_chunks`, the first `turn_chunks` indices step there
 *  anyway if the room at the step (capacity - the step's non-model peak - param/grad chunks, times
 *  margin_use) holds their state. Those are the chunks backward finishes last and the next forward
 *  reads first: stepped on the host, the device would wait for their gradients to go down, their
 *  Adam and their weights to come back (docs/performance.md, "The turn"). Their state comes up for
 *  the step, after the activations have gone, and goes back down when the next forward's
 *  activations need the room (the eviction sees it used last): it costs the link the state's bytes
 *  each way per iteration, and saves the chunks' weights and gradients the trip. */
struct auto_placement {
  double margin_use = 0.8;  ///< share of the margin given to optimizer state (headroom for fragmentation)
  /// Chunk indices stepped on the compute tier where the room at the step allows, margin or not (0:
  /// the margin alone decides). 2 measured: bench_overlap's all-host row, 1.08-1.14 -> 1.01-1.05.
  std::size_t turn_chunks = 2;

  [[nodiscard]] std::size_t chunk_budget(const placement_inputs& in) const noexcept {
    const std::size_t non_model = in.trace_ready
                                      ? std::max({in.non_model_peak_here, in.non_model_peak_next, in.non_model_now})
                                      : in.non_model_now;
    return room_after(in.device_capacity, non_model);
  }
  [[nodiscard]] tier optimizer_tier(const placement_inputs& in, std::size_t c) const noexcept {
    if (!in.trace_ready || in.step_chunk_bytes == 0) return tier::host;
    const std::size_t kept = chunks_of_state_fitting(in, in.non_model_peak_max, margin_use);
    const std::size_t at_step = chunks_of_state_fitting(in, in.non_model_peak_step, margin_use);
    return c < std::max(kept, std::min(at_step, turn_chunks)) ? tier::device : tier::host;
  }
  [[nodiscard]] static constexpr std::string_view name() noexcept { return "auto"; }
};

static_assert(PlacementPolicy<auto_placement>);

}  // namespace chunkstar
