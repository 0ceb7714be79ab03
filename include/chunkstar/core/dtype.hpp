// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Element types of model data: fp32, fp16 and bf16, with round-to-nearest-even
 *         conversions that behave identically on every host (no FPU mode dependence).
 */
#pragma once

#include <chunkstar/config.hpp>
#include <chunkstar/core/cpu_isa.hpp>
#include <chunkstar/core/detail/float_formats.hpp>  // float16, bfloat16 and their bit conversions
#include <chunkstar/core/detail/simd.hpp>

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

/** @brief The storage type of each dtype, and back. */
template <dtype T>
struct dtype_storage;
template <>
struct dtype_storage<dtype::f32> {
  using type = float;
};
template <>
struct dtype_storage<dtype::f16> {
  using type = float16;
};
template <>
struct dtype_storage<dtype::bf16> {
  using type = bfloat16;
};
template <dtype T>
using dtype_storage_t = typename dtype_storage<T>::type;

template <class T>
inline constexpr bool is_element_type_v = false;
template <>
inline constexpr bool is_element_type_v<float> = true;
template <>
inline constexpr bool is_element_type_v<float16> = true;
template <>
inline constexpr bool is_element_type_v<bfloat16> = true;

/** @brief The dtype tag of a storage type. */
template <class T>
requires is_element_type_v<T>
inline constexpr dtype dtype_of_v = std::is_same_v<T, float>     ? dtype::f32
                                    : std::is_same_v<T, float16> ? dtype::f16
                                                                 : dtype::bf16;

/** @brief Widen any storage element to float. */
CHUNKSTAR_HOST_DEVICE constexpr float to_float(float x) noexcept { return x; }
CHUNKSTAR_HOST_DEVICE constexpr float to_float(float16 x) noexcept { return f16_bits_to_float(x.bits); }
CHUNKSTAR_HOST_DEVICE constexpr float to_float(bfloat16 x) noexcept { return bf16_bits_to_float(x.bits); }

/** @brief Narrow a float to storage type @p T with round-to-nearest-even. */
template <class T>
requires is_element_type_v<T> CHUNKSTAR_HOST_DEVICE constexpr T from_float(float x) noexcept {
  if constexpr (std::is_same_v<T, float>) return x;
  else return T(x);
}

namespace simd_detail {
/** The bulk conversions of one ISA (`widen<T>`, `narrow<T>`), specialised once per ISA inside its
 *  target region by core/detail/convert_kernels.inc. */
template <cpu_isa Isa>
struct convert_kernels;
}  // namespace simd_detail

}  // namespace chunkstar

#define CHUNKSTAR_SIMD_KERNELS <chunkstar/core/detail/convert_kernels.inc>
#include <chunkstar/core/simd_foreach_isa.hpp>

namespace chunkstar {

/** @brief Widens `out.size()` elements of type @p t at @p src (any alignment) to float: exact.
 *  Vectorised on the ISA active_cpu_isa() names (F16C for fp16); every ISA gives the same bits. */
inline void widen_to_float(const std::byte* src, dtype t, std::span<float> out) noexcept {
  switch (t) {
    case dtype::f32: std::memcpy(out.data(), src, out.size_bytes()); break;
    case dtype::f16:
      with_cpu_isa(active_cpu_isa(), [&](auto isa) {
        simd_detail::convert_kernels<isa()>::template widen<float16>(src, out.data(), out.size());
      });
      break;
    case dtype::bf16:
      with_cpu_isa(active_cpu_isa(), [&](auto isa) {
        simd_detail::convert_kernels<isa()>::template widen<bfloat16>(src, out.data(), out.size());
      });
      break;
  }
}

/** @brief Narrows @p in to type @p t at @p dst (`in.size() * dtype_size(t)` bytes) with
 *  round-to-nearest-even; exact for values the type represents. Vectorised like widen_to_float. */
inline void narrow_from_float(std::span<const float> in, dtype t, std::byte* dst) noexcept {
  switch (t) {
    case dtype::f32: std::memcpy(dst, in.data(), in.size_bytes()); break;
    case dtype::f16:
      with_cpu_isa(active_cpu_isa(), [&](auto isa) {
        simd_detail::convert_kernels<isa()>::template narrow<float16>(in.data(), dst, in.size());
      });
      break;
    case dtype::bf16:
      with_cpu_isa(active_cpu_isa(), [&](auto isa) {
        simd_detail::convert_kernels<isa()>::template narrow<bfloat16>(in.data(), dst, in.size());
      });
      break;
  }
}

}  // namespace chunkstar
