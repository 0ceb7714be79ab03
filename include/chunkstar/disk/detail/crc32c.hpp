// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief CRC32C (Castagnoli), table-driven, for the disk engines' optional checksums. Portable
 *         and slow-ish (about 0.5-1 GB/s): checksums are a debug-build safety net, off with NDEBUG.
 */
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace chunkstar::detail {

inline constexpr std::array<std::uint32_t, 256> crc32c_table = [] {
  std::array<std::uint32_t, 256> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}();

/** @brief CRC32C of `n` bytes at `p`, continuing from `crc` (0 to start). */
[[nodiscard]] inline std::uint32_t crc32c(const void* p, std::size_t n, std::uint32_t crc = 0) noexcept {
  const auto* b = static_cast<const unsigned char*>(p);
  crc = ~crc;
  for (std::size_t i = 0; i < n; ++i) crc = crc32c_table[(crc ^ b[i]) & 0xFFu] ^ (crc >> 8);
  return ~crc;
}

}  // namespace chunkstar::detail
