// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief XXH64 (the 64-bit xxHash of Yann Collet's public specification), streaming, for the
 *         checkpoint checksums: several GB/s on one core, so verifying a checkpoint costs about as
 *         much as reading it.
 */
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace chunkstar::checkpoint_detail {

/** @brief Incremental XXH64: `update` any number of times with pieces of any size, then `digest`
 *  (the same value as hashing the concatenation at once). */
class xxh64 {
 public:
  explicit xxh64(std::uint64_t seed = 0) noexcept : v_{seed + p1 + p2, seed + p2, seed, seed - p1}, seed_(seed) {}

  void update(std::span<const std::byte> data) noexcept {
    const std::byte* p = data.data();
    std::size_t n = data.size();
    total_ += n;
    if (buffered_ + n < 32) {
      if (n) std::memcpy(buf_.data() + buffered_, p, n);
      buffered_ += n;
      return;
    }
    if (buffered_) {
      const std::size_t fill = 32 - buffered_;
      std::memcpy(buf_.data() + buffered_, p, fill);
      stripe(buf_.data());
      p += fill;
      n -= fill;
      buffered_ = 0;
    }
    for (; n >= 32; p += 32, n -= 32) stripe(p);
    if (n) std::memcpy(buf_.data(), p, n);
    buffered_ = n;
  }

  [[nodiscard]] std::uint64_t digest() const noexcept {
    std::uint64_t h;
    if (total_ >= 32) {
      h = std::rotl(v_[0], 1) + std::rotl(v_[1], 7) + std::rotl(v_[2], 12) + std::rotl(v_[3], 18);
      for (auto v : v_) h = merge(h, v);
    } else {
      h = seed_ + p5;
    }
    h += total_;
    const std::byte* p = buf_.data();
    std::size_t n = buffered_;
    for (; n >= 8; p += 8, n -= 8) h = std::rotl(h ^ round(0, load64(p)), 27) * p1 + p4;
    if (n >= 4) {
      h = std::rotl(h ^ (static_cast<std::uint64_t>(load32(p)) * p1), 23) * p2 + p3;
      p += 4;
      n -= 4;
    }
    for (; n; ++p, --n)
      h = std::rotl(h ^ (static_cast<std::uint64_t>(std::to_integer<std::uint8_t>(*p)) * p5), 11) * p1;
    h ^= h >> 33;
    h *= p2;
    h ^= h >> 29;
    h *= p3;
    h ^= h >> 32;
    return h;
  }

  /** @brief XXH64 of @p data in one call. */
  [[nodiscard]] static std::uint64_t hash(std::span<const std::byte> data, std::uint64_t seed = 0) noexcept {
    xxh64 h(seed);
    h.update(data);
    return h.digest();
  }

 private:
  static constexpr std::uint64_t p1 = 0x9E3779B185EBCA87ull;
  static constexpr std::uint64_t p2 = 0xC2B2AE3D27D4EB4Full;
  static constexpr std::uint64_t p3 = 0x165667B19E3779F9ull;
  static constexpr std::uint64_t p4 = 0x85EBCA77C2B2AE63ull;
  static constexpr std::uint64_t p5 = 0x27D4EB2F165667C5ull;

  // The specification reads lanes little-endian; checkpoints are only written on little-endian hosts.
  static std::uint64_t load64(const std::byte* p) noexcept {
    std::uint64_t v;
    std::memcpy(&v, p, 8);
    return v;
  }
  static std::uint32_t load32(const std::byte* p) noexcept {
    std::uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
  }
  static constexpr std::uint64_t round(std::uint64_t acc, std::uint64_t lane) noexcept {
    return std::rotl(acc + lane * p2, 31) * p1;
  }
  static constexpr std::uint64_t merge(std::uint64_t acc, std::uint64_t v) noexcept {
    return (acc ^ round(0, v)) * p1 + p4;
  }
  void stripe(const std::byte* p) noexcept {
    for (int i = 0; i < 4; ++i)
      v_[static_cast<std::size_t>(i)] = round(v_[static_cast<std::size_t>(i)], load64(p + 8 * i));
  }

  std::array<std::uint64_t, 4> v_;
  std::array<std::byte, 32> buf_{};
  std::size_t buffered_ = 0;
  std::uint64_t total_ = 0;
  std::uint64_t seed_;
};

static_assert(std::endian::native == std::endian::little,
              "chunkstar checkpoints (safetensors) are little-endian; big-endian hosts are not supported");

}  // namespace chunkstar::checkpoint_detail
