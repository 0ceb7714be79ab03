// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `tier`: where a chunk's payload lives (none, another rank, device, host, disk).
 */
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace chunkstar {

/** @brief Where a chunk's payload lives.
 *  - `free`: no payload yet, or dropped (a gradient before its first backward use, or after the
 *    step); reading it is reading zeros.
 *  - `remote`: this rank holds no payload, another rank does (ZeRO: a parameter chunk of another
 *    owner between uses); reading it needs a gather, it is never zeros.
 *  - `device`, `host`, `disk`: the payload is in that tier's memory space. */
enum class tier : std::uint8_t { free, remote, device, host, disk };

/** @brief Number of `tier` values, for per-tier arrays. */
inline constexpr std::size_t num_tiers = 5;

constexpr std::string_view tier_name(tier t) noexcept {
  switch (t) {
    case tier::free: return "free";
    case tier::remote: return "remote";
    case tier::device: return "device";
    case tier::host: return "host";
    case tier::disk: return "disk";
  }
  return "?";
}

/** @brief True for the tiers that hold a payload in a memory space of this rank. */
constexpr bool holds_payload(tier t) noexcept { return t == tier::device || t == tier::host || t == tier::disk; }

}  // namespace chunkstar
