/** @file
 *  @brief Element types of model data: fp32, fp16 and bf16, with round-to-nearest-even
 *         conversions that behave identically on every host (no FPU mode dependence).
 */
#pragma once

#include <chunkstar/config.hpp>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <type_traits>

namespace chunkstar {

/** @brief The element type of a tensor or a chunk list. */
enum class dtype : std::uint8_t { f32, f16, bf16 };

/** @brief Bytes per element of @p t. */
constexpr std::size_t dtype_size(dtype t) noexcept { return t == dtype::f32 ? 4 : 2; }

/** @brief Lower-case name as used in configs and checkpoints ("f32", "f16", "bf16"). */
constexpr std::string_view dtype_name(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return "f32";
    case dtype::f16: return "f16";
    case dtype::bf16: return "bf16";
  }
  return "?";
}

/** @brief IEEE binary32 to binary16 bits, round to nearest even; NaNs stay NaN (quietened, sign
 *         and top payload bits kept), overflow goes to infinity, underflow to subnormals or zero. */
CHUNKSTAR_HOST_DEVICE constexpr std::uint16_t float_to_f16_bits(float f) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
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
  if (e == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (m << 13));
  if (e != 0) return std::bit_cast<float>(sign | ((e + 112u) << 23) | (m << 13));
  if (m == 0) return std::bit_cast<float>(sign);
  // Subnormal: normalise the mantissa.
  std::uint32_t exp = 113;
  while ((m & 0x400u) == 0) {
    m <<= 1;
    --exp;
  }
  return std::bit_cast<float>(sign | (exp << 23) | ((m & 0x3ffu) << 13));
}

/** @brief IEEE binary32 to bfloat16 bits, round to nearest even; NaNs stay NaN (quietened). */
CHUNKSTAR_HOST_DEVICE constexpr std::uint16_t float_to_bf16_bits(float f) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);
  return static_cast<std::uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/** @brief bfloat16 bits to binary32 (exact). */
CHUNKSTAR_HOST_DEVICE constexpr float bf16_bits_to_float(std::uint16_t b) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

/** @brief A binary16 value in storage; converts to and from float explicitly. */
struct float16 {
  std::uint16_t bits = 0;
  constexpr float16() noexcept = default;
  CHUNKSTAR_HOST_DEVICE constexpr explicit float16(float f) noexcept : bits(float_to_f16_bits(f)) {}
  CHUNKSTAR_HOST_DEVICE constexpr explicit operator float() const noexcept { return f16_bits_to_float(bits); }
  static constexpr float16 from_bits(std::uint16_t b) noexcept { float16 h; h.bits = b; return h; }
  friend constexpr bool operator==(float16, float16) noexcept = default;  // bitwise
};

/** @brief A bfloat16 value in storage; converts to and from float explicitly. */
struct bfloat16 {
  std::uint16_t bits = 0;
  constexpr bfloat16() noexcept = default;
  CHUNKSTAR_HOST_DEVICE constexpr explicit bfloat16(float f) noexcept : bits(float_to_bf16_bits(f)) {}
  CHUNKSTAR_HOST_DEVICE constexpr explicit operator float() const noexcept { return bf16_bits_to_float(bits); }
  static constexpr bfloat16 from_bits(std::uint16_t b) noexcept { bfloat16 h; h.bits = b; return h; }
  friend constexpr bool operator==(bfloat16, bfloat16) noexcept = default;  // bitwise
};

static_assert(sizeof(float16) == 2 && sizeof(bfloat16) == 2);

/** @brief The storage type of each dtype, and back. */
template <dtype T> struct dtype_storage;
template <> struct dtype_storage<dtype::f32> { using type = float; };
template <> struct dtype_storage<dtype::f16> { using type = float16; };
template <> struct dtype_storage<dtype::bf16> { using type = bfloat16; };
template <dtype T> using dtype_storage_t = typename dtype_storage<T>::type;

template <class T> inline constexpr bool is_element_type_v = false;
template <> inline constexpr bool is_element_type_v<float> = true;
template <> inline constexpr bool is_element_type_v<float16> = true;
template <> inline constexpr bool is_element_type_v<bfloat16> = true;

/** @brief The dtype tag of a storage type. */
template <class T>
  requires is_element_type_v<T>
inline constexpr dtype dtype_of_v = std::is_same_v<T, float> ? dtype::f32 : std::is_same_v<T, float16> ? dtype::f16 : dtype::bf16;

/** @brief Widen any storage element to float. */
CHUNKSTAR_HOST_DEVICE constexpr float to_float(float x) noexcept { return x; }
CHUNKSTAR_HOST_DEVICE constexpr float to_float(float16 x) noexcept { return f16_bits_to_float(x.bits); }
CHUNKSTAR_HOST_DEVICE constexpr float to_float(bfloat16 x) noexcept { return bf16_bits_to_float(x.bits); }

/** @brief Narrow a float to storage type @p T with round-to-nearest-even. */
template <class T>
  requires is_element_type_v<T>
CHUNKSTAR_HOST_DEVICE constexpr T from_float(float x) noexcept {
  if constexpr (std::is_same_v<T, float>) return x;
  else return T(x);
}

/** @brief Widens `out.size()` elements of type @p t at @p src (any alignment) to float: exact. */
inline void widen_to_float(const std::byte* src, dtype t, std::span<float> out) noexcept {
  switch (t) {
    case dtype::f32: std::memcpy(out.data(), src, out.size_bytes()); break;
    case dtype::f16:
      for (std::size_t i = 0; i < out.size(); ++i) {
        float16 h;
        std::memcpy(&h, src + i * sizeof h, sizeof h);
        out[i] = to_float(h);
      }
      break;
    case dtype::bf16:
      for (std::size_t i = 0; i < out.size(); ++i) {
        bfloat16 h;
        std::memcpy(&h, src + i * sizeof h, sizeof h);
        out[i] = to_float(h);
      }
      break;
  }
}

/** @brief Narrows @p in to type @p t at @p dst (`in.size() * dtype_size(t)` bytes) with
 *  round-to-nearest-even; exact for values the type represents. */
inline void narrow_from_float(std::span<const float> in, dtype t, std::byte* dst) noexcept {
  switch (t) {
    case dtype::f32: std::memcpy(dst, in.data(), in.size_bytes()); break;
    case dtype::f16:
      for (std::size_t i = 0; i < in.size(); ++i) {
        const float16 h(in[i]);
        std::memcpy(dst + i * sizeof h, &h, sizeof h);
      }
      break;
    case dtype::bf16:
      for (std::size_t i = 0; i < in.size(); ++i) {
        const bfloat16 h(in[i]);
        std::memcpy(dst + i * sizeof h, &h, sizeof h);
      }
      break;
  }
}

}  // namespace chunkstar
