// SPDX-License-Identifier: Apache-2.0
// Command-line helpers shared by the benchmarks.
#pragma once

#include <chunkstar/core/error.hpp>

#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

namespace chunkstar::bench {

/** "1,0.5,0.25" -> {1, 0.5, 0.25}; a malformed item is a config_error naming @p option. */
inline std::vector<double> parse_number_list(const std::string& option, const std::string& list) {
  std::vector<double> out;
  for (std::size_t at = 0; at <= list.size();) {
    const std::size_t comma = std::min(list.find(',', at), list.size());
    const std::string item = list.substr(at, comma - at);
    try {
      std::size_t used = 0;
      out.push_back(std::stod(item, &used));
      if (used != item.size()) throw std::invalid_argument(item);
    } catch (const std::logic_error&) {
      throw config_error(option + ": '" + item + "' is not a number; pass a comma-separated list such as 1,0.5,0.25");
    }
    at = comma + 1;
  }
  return out;
}

}  // namespace chunkstar::bench
