// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Byte quantities: parsing "256MiB"-style strings and printing sizes for people.
 */
#pragma once

#include <cctype>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

namespace chunkstar {

/** @brief Parse a byte count such as "4096", "64KiB", "1.5GiB", "256MB" (SI: MB = 10^6; IEC: MiB = 2^20).
 *  @return nullopt when the text is not a size (the caller raises a config_error naming the option). */
inline std::optional<std::size_t> parse_bytes(std::string_view text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) text.remove_prefix(1);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.remove_suffix(1);
  std::size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  if (i == 0) return std::nullopt;
  const std::string number(text.substr(0, i));
  char* end = nullptr;
  const double value = std::strtod(number.c_str(), &end);
  if (end != number.c_str() + number.size() || value < 0) return std::nullopt;
  std::string_view unit = text.substr(i);
  while (!unit.empty() && unit.front() == ' ') unit.remove_prefix(1);
  struct entry {
    std::string_view name;
    double factor;
  };
  static constexpr entry units[] = {
      {"", 1},
      {"B", 1},
      {"KiB", 1024.0},
      {"MiB", 1048576.0},
      {"GiB", 1073741824.0},
      {"TiB", 1099511627776.0},
      {"K", 1024.0},
      {"M", 1048576.0},
      {"G", 1073741824.0},
      {"T", 1099511627776.0},
      {"KB", 1e3},
      {"MB", 1e6},
      {"GB", 1e9},
      {"TB", 1e12},
      {"kB", 1e3},
  };
  for (const auto& u : units) {
    if (unit == u.name) {
      const double bytes = value * u.factor;
      if (bytes > 1.8e19) return std::nullopt;
      return static_cast<std::size_t>(bytes + 0.5);
    }
  }
  return std::nullopt;
}

/** @brief "1.50 GiB", "12.0 MiB", "512 B": three significant figures, IEC units. */
inline std::string format_bytes(std::size_t bytes) {
  static constexpr const char* names[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  if (u == 0) std::snprintf(buf, sizeof buf, "%zu B", bytes);
  else std::snprintf(buf, sizeof buf, v < 10 ? "%.2f %s" : v < 100 ? "%.1f %s" : "%.0f %s", v, names[u]);
  return buf;
}

}  // namespace chunkstar
