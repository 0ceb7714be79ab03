// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Static placement: a fixed share of the chunks on the compute tier (all, none, or a fraction).
 */
#pragma once

#include <chunkstar/placement/placement_policy.hpp>

#include <algorithm>
#include <cmath>

namespace chunkstar {

/** @brief Keeps `device_fraction` of all chunk bytes on the compute tier and steps the optimizer of
 *  the first `device_fraction` of chunk indices there; the rest lives on the host and visits the
 *  compute tier only while a scope uses it. Ignores the trace (ZeRO-Offload-like static split). */
struct static_placement {
  double device_fraction = 1.0;

  static constexpr static_placement all_device() noexcept { return {1.0}; }
  static constexpr static_placement all_host() noexcept { return {0.0}; }
  static constexpr static_placement fraction(double f) noexcept { return {f}; }

  [[nodiscard]] std::size_t chunk_budget(const placement_inputs& in) const noexcept {
    const auto share =
        static_cast<std::size_t>(std::clamp(device_fraction, 0.0, 1.0) * static_cast<double>(in.total_chunk_bytes));
    return std::min(share, room_after(in.device_capacity, in.non_model_now));
  }
  [[nodiscard]] tier optimizer_tier(const placement_inputs& in, std::size_t c) const noexcept {
    const auto on_device = static_cast<std::size_t>(
        std::floor(std::clamp(device_fraction, 0.0, 1.0) * static_cast<double>(in.num_chunks)));
    return c < on_device ? tier::device : tier::host;
  }
  [[nodiscard]] static constexpr std::string_view name() noexcept { return "static"; }
};

static_assert(PlacementPolicy<static_placement>);

}  // namespace chunkstar
