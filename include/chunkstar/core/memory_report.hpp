// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief A snapshot of every memory space's capacity, use and largest free block.
 */
#pragma once

#include <chunkstar/core/units.hpp>

#include <cstddef>
#include <limits>
#include <string>
#include <vector>

namespace chunkstar {

/** @brief One space's numbers at the moment the report was taken. */
struct space_usage {
  std::string name;                    ///< e.g. "host", "simulated_device", "cuda:0"
  std::size_t capacity = 0;            ///< bytes this space may hand out (unlimited: SIZE_MAX)
  std::size_t used = 0;                ///< bytes handed out now
  std::size_t peak = 0;                ///< highest `used` seen
  std::size_t largest_free_block = 0;  ///< largest single allocation that could succeed now
};

/** @brief What an out-of-memory error carries: every space the runtime knows. */
struct memory_report {
  std::vector<space_usage> spaces;

  /** @brief One line per space, human readable. */
  [[nodiscard]] std::string to_string() const {
    std::string s;
    for (const auto& u : spaces) {
      s += "  ";
      s += u.name;
      s += ": used " + format_bytes(u.used) + " of ";
      s += u.capacity == std::numeric_limits<std::size_t>::max() ? std::string("unlimited") : format_bytes(u.capacity);
      s += ", peak " + format_bytes(u.peak);
      s += ", largest free block ";
      s += u.largest_free_block == std::numeric_limits<std::size_t>::max() ? std::string("unlimited")
                                                                           : format_bytes(u.largest_free_block);
      s += '\n';
    }
    return s;
  }
};

}  // namespace chunkstar
