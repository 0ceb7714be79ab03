// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `chunk_id`: one chunk of one parallel list, the name every policy and the store use for it.
 */
#pragma once

#include <chunkstar/core/chunk_kind.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace chunkstar {

/** @brief One chunk of one parallel list. */
struct chunk_id {
  chunk_kind kind = chunk_kind::param;
  std::uint32_t index = 0;
  // Written out rather than defaulted: nvcc 13 leaves defaulted friend comparisons undefined at link time.
  friend constexpr bool operator==(const chunk_id& a, const chunk_id& b) noexcept {
    return a.kind == b.kind && a.index == b.index;
  }
  friend constexpr bool operator<(const chunk_id& a, const chunk_id& b) noexcept {
    return a.kind != b.kind ? a.kind < b.kind : a.index < b.index;
  }
};

/** @brief "param#3". */
inline std::string to_string(chunk_id c) {
  return std::string(chunk_kind_name(c.kind)) + "#" + std::to_string(c.index);
}

}  // namespace chunkstar

template <>
struct std::hash<chunkstar::chunk_id> {
  std::size_t operator()(const chunkstar::chunk_id& c) const noexcept {
    return (static_cast<std::size_t>(c.index) << 3) ^ static_cast<std::size_t>(c.kind);
  }
};
