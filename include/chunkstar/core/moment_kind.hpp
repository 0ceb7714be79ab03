// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `moment_kind`: what a moment of an iteration is (a forward or backward scope, the optimizer step), and
 *         `never` for next-use distances.
 */
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string_view>

namespace chunkstar {

/** @brief What a moment is: an access scope in forward or backward, or the optimizer step. */
enum class moment_kind : std::uint8_t { forward, backward, optimizer };

constexpr std::string_view moment_kind_name(moment_kind k) noexcept {
  switch (k) {
    case moment_kind::forward: return "forward";
    case moment_kind::backward: return "backward";
    case moment_kind::optimizer: return "optimizer";
  }
  return "?";
}

/** @brief "Never used again" for next-use distances. */
inline constexpr std::size_t never = std::numeric_limits<std::size_t>::max();

}  // namespace chunkstar
