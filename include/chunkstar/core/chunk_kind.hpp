// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `chunk_kind`: the parallel chunk lists (parameters, gradients, fp32 masters, Adam's moments).
 */
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace chunkstar {

/** @brief The kinds of parallel chunk lists. */
enum class chunk_kind : std::uint8_t { param, grad, master, momentum, variance };
inline constexpr std::size_t num_chunk_kinds = 5;
/** @brief Every kind, in the enum's order: what one chunk index may have a list of. */
inline constexpr std::array<chunk_kind, num_chunk_kinds> all_chunk_kinds = {
    chunk_kind::param, chunk_kind::grad, chunk_kind::master, chunk_kind::momentum, chunk_kind::variance};

constexpr std::string_view chunk_kind_name(chunk_kind k) noexcept {
  switch (k) {
    case chunk_kind::param: return "param";
    case chunk_kind::grad: return "grad";
    case chunk_kind::master: return "master";
    case chunk_kind::momentum: return "momentum";
    case chunk_kind::variance: return "variance";
  }
  return "?";
}

}  // namespace chunkstar
