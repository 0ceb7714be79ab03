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
 *  (optimizer-state bytes per chunk)` chunk indices step on the compute tier. */
struct auto_placement {
  double margin_use = 0.8;  ///< share of the margin given to optimizer state (headroom for fragmentation)

  [[nodiscard]] std::size_t chunk_budget(const placement_inputs& in) const noexcept {
    const std::size_t non_model = in.trace_ready
                                      ? std::max({in.non_model_peak_here, in.non_model_peak_next, in.non_model_now})
                                      : in.non_model_now;
    return room_after(in.device_capacity, non_model);
  }
  [[nodiscard]] tier optimizer_tier(const placement_inputs& in, std::size_t c) const noexcept {
    if (!in.trace_ready || in.step_chunk_bytes == 0) return tier::host;
    const std::size_t margin =
        room_after(room_after(in.device_capacity, in.non_model_peak_max), in.compute_chunk_bytes);
    // The margin already excludes every param and grad chunk, so a chunk stepped on the device
    // costs only its optimizer state (master, momentum, variance) on top.
    const std::size_t compute_per_chunk = in.num_chunks ? in.compute_chunk_bytes / in.num_chunks : 0;
    const std::size_t state = in.step_chunk_bytes > compute_per_chunk ? in.step_chunk_bytes - compute_per_chunk : 0;
    if (state == 0) return margin > 0 ? tier::device : tier::host;
    const auto chunks = static_cast<std::size_t>(static_cast<double>(margin) * std::clamp(margin_use, 0.0, 1.0) /
                                                 static_cast<double>(state));
    return c < chunks ? tier::device : tier::host;
  }
  [[nodiscard]] static constexpr std::string_view name() noexcept { return "auto"; }
};

static_assert(PlacementPolicy<auto_placement>);

}  // namespace chunkstar
