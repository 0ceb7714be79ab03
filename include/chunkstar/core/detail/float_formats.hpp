// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Private: the 16-bit float formats (binary16, bfloat16) and their exact, round-to-nearest-even
 *         conversions to and from binary32. Part of core/dtype.hpp's API (include that); here so that
 *         the SIMD wrappers (core/detail/simd.hpp), which dtype.hpp's bulk conversions use, can use
 *         them without including dtype.hpp.
 */
#pragma once

#include <chunkstar/config.hpp>

#include <cstdint>

namespace chunkstar {

namespace float_detail {
/** std::bit_cast for host and device code: std::bit_cast is a host function to nvcc (warning
 *  #20013 from a __host__ __device__ caller); the builtin it is made of is not. */
template <class To, class From>
CHUNKSTAR_HOST_DEVICE constexpr To bit_cast(const From& from) noexcept {
  static_assert(sizeof(To) == sizeof(From));
  return __builtin_bit_cast(To, from);
}
}  // namespace float_detail

/** @brief IEEE binary32 to binary16 bits, round to nearest even; NaNs stay NaN (quietened, sign
 *         and top payload bits kept), overflow goes to infinity, underflow to subnormals or zero. */
CHUNKSTAR_HOST_DEVICE constexpr std::uint16_t float_to_f16_bits(float f) noexcept {
  const std::uint32_t x = float_detail::bit_cast<std::uint32_t>(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t a = x & 0x7fffffffu;
  if (a >= 0x7f800000u)  // inf or NaN
    return static_cast<std::uint16_t>(sign | (a > 0x7f800000u ? 0x7e00u | ((a >> 13) & 0x3ffu) : 0x7c00u));
  if (a >= 0x477ff000u)  // >= 65520 rounds to infinity
    return static_cast<std::uint16_t>(sign | 0x7c00u);
  if (a < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    const std::uint32_t e = a >> 23;
    if (e < 102) return static_cast<std::uint16_t>(sign);  // below 2^-25: rounds to zero
    const std::uint32_t m = (a & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126 - e;  // value / 2^-24 = m >> shift
    std::uint32_t q = m >> shift;
    const std::uint32_t rem = m & ((1u << shift) - 1u);
    const std::uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;  // q == 0x400 is the smallest normal
    return static_cast<std::uint16_t>(sign | q);
  }
  std::uint32_t h = ((a >> 23) - 112u) << 10 | ((a & 0x7fffffu) >> 13);
  const std::uint32_t rem = a & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry may reach the exponent: fine
  return static_cast<std::uint16_t>(sign | h);
}

/** @brief IEEE binary16 bits to binary32 (exact). */
CHUNKSTAR_HOST_DEVICE constexpr float f16_bits_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1fu;
  std::uint32_t m = h & 0x3ffu;
  if (e == 0x1f) return float_detail::bit_cast<float>(sign | 0x7f800000u | (m << 13));
  if (e != 0) return float_detail::bit_cast<float>(sign | ((e + 112u) << 23) | (m << 13));
  if (m == 0) return float_detail::bit_cast<float>(sign);
  // Subnormal: normalise the mantissa.
  std::uint32_t exp = 113;
  while ((m & 0x400u) == 0) {
    m <<= 1;
    --exp;
  }
  return float_detail::bit_cast<float>(sign | (exp << 23) | ((m & 0x3ffu) << 13));
}

/** @brief IEEE binary32 to bfloat16 bits, round to nearest even; NaNs stay NaN (quietened). */
CHUNKSTAR_HOST_DEVICE constexpr std::uint16_t float_to_bf16_bits(float f) noexcept {
  const std::uint32_t x = float_detail::bit_cast<std::uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);
  return static_cast<std::uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/** @brief bfloat16 bits to binary32 (exact). */
CHUNKSTAR_HOST_DEVICE constexpr float bf16_bits_to_float(std::uint16_t b) noexcept {
  return float_detail::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

/** @brief A binary16 value in storage; converts to and from float explicitly. */
struct float16 {
  std::uint16_t bits = 0;
  constexpr float16() noexcept = default;
  CHUNKSTAR_HOST_DEVICE constexpr explicit float16(float f) noexcept : bits(float_to_f16_bits(f)) {}
  CHUNKSTAR_HOST_DEVICE constexpr explicit operator float() const noexcept { return f16_bits_to_float(bits); }
  static constexpr float16 from_bits(std::uint16_t b) noexcept {
    float16 h;
    h.bits = b;
    return h;
  }
  friend constexpr bool operator==(float16, float16) noexcept = default;  // bitwise
};

/** @brief A bfloat16 value in storage; converts to and from float explicitly. */
struct bfloat16 {
  std::uint16_t bits = 0;
  constexpr bfloat16() noexcept = default;
  CHUNKSTAR_HOST_DEVICE constexpr explicit bfloat16(float f) noexcept : bits(float_to_bf16_bits(f)) {}
  CHUNKSTAR_HOST_DEVICE constexpr explicit operator float() const noexcept { return bf16_bits_to_float(bits); }
  static constexpr bfloat16 from_bits(std::uint16_t b) noexcept {
    bfloat16 h;
    h.bits = b;
    return h;
  }
  friend constexpr bool operator==(bfloat16, bfloat16) noexcept = default;  // bitwise
};

static_assert(sizeof(float16) == 2 && sizeof(bfloat16) == 2);

}  // namespace chunkstar
