// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Private: thin per-ISA float vector wrappers for the CPU kernels (Adam, gradient scans,
 *         dtype conversions), each ISA's inside its target region (core/simd_target.hpp).
 *
 *  Each kernel is written once against these wrappers (and included once per ISA by
 *  core/simd_foreach_isa.hpp), so every ISA runs the same sequence of correctly rounded IEEE
 *  operations (mul, div, sqrt, fused multiply-add) per element. That is what makes the SIMD paths
 *  bit-identical to the portable path. The wrappers never expose a separate multiply followed by
 *  an add, so floating-point contraction cannot fuse differently per path.
 */
#pragma once

#include <chunkstar/config.hpp>
#include <chunkstar/core/cpu_isa.hpp>
#include <chunkstar/core/detail/float_formats.hpp>
#include <chunkstar/core/simd_target.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace chunkstar::simd_detail {

template <cpu_isa Isa>
struct simd;

/** @brief One element at a time; the reference every vector path must match bit for bit. */
template <>
struct simd<cpu_isa::portable> {
  using vf = float;
  static constexpr std::size_t width = 1;
  static CHUNKSTAR_FORCEINLINE vf set1(float x) noexcept { return x; }
  static CHUNKSTAR_FORCEINLINE vf load(const float* p) noexcept { return *p; }
  static CHUNKSTAR_FORCEINLINE vf load(const float16* p) noexcept { return f16_bits_to_float(p->bits); }
  static CHUNKSTAR_FORCEINLINE vf load(const bfloat16* p) noexcept { return bf16_bits_to_float(p->bits); }
  static CHUNKSTAR_FORCEINLINE void store(float* p, vf x) noexcept { *p = x; }
  static CHUNKSTAR_FORCEINLINE void store(float16* p, vf x) noexcept { p->bits = float_to_f16_bits(x); }
  static CHUNKSTAR_FORCEINLINE void store(bfloat16* p, vf x) noexcept { p->bits = float_to_bf16_bits(x); }
  static CHUNKSTAR_FORCEINLINE vf mul(vf a, vf b) noexcept { return a * b; }
  static CHUNKSTAR_FORCEINLINE vf div(vf a, vf b) noexcept { return a / b; }
  static CHUNKSTAR_FORCEINLINE vf sqrt(vf a) noexcept { return std::sqrt(a); }
  /** a*b + c, rounded once. */
  static CHUNKSTAR_FORCEINLINE vf fma(vf a, vf b, vf c) noexcept { return std::fma(a, b, c); }
};

}  // namespace chunkstar::simd_detail

#if CHUNKSTAR_ISA_DISPATCH
CHUNKSTAR_SIMD_BEGIN_AVX2
namespace chunkstar::simd_detail {
template <>
struct simd<cpu_isa::avx2> {
  using vf = __m256;
  static constexpr std::size_t width = 8;
  static CHUNKSTAR_FORCEINLINE vf set1(float x) noexcept { return _mm256_set1_ps(x); }
  static CHUNKSTAR_FORCEINLINE vf load(const float* p) noexcept { return _mm256_loadu_ps(p); }
  static CHUNKSTAR_FORCEINLINE vf load(const float16* p) noexcept {
    // F16C quietens signalling NaNs; f16_bits_to_float widens every pattern unchanged (the quiet
    // bit moves from bit 9 to bit 22 as it is), so NaN lanes take their quiet bit from the input.
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i f = _mm256_castps_si256(_mm256_cvtph_ps(h));
    const __m256i w = _mm256_cvtepu16_epi32(h);
    const __m256i is_nan =
        _mm256_cmpgt_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x7fff)), _mm256_set1_epi32(0x7c00));
    const __m256i exact = _mm256_or_si256(_mm256_andnot_si256(_mm256_set1_epi32(0x400000), f),
                                          _mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x200)), 13));
    return _mm256_castsi256_ps(_mm256_blendv_epi8(f, exact, is_nan));
  }
  static CHUNKSTAR_FORCEINLINE vf load(const bfloat16* p) noexcept {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static CHUNKSTAR_FORCEINLINE void store(float* p, vf x) noexcept { _mm256_storeu_ps(p, x); }
  static CHUNKSTAR_FORCEINLINE void store(float16* p, vf x) noexcept {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  static CHUNKSTAR_FORCEINLINE void store(bfloat16* p, vf x) noexcept {
    // Integer round-to-nearest-even, exactly float_to_bf16_bits: (x + 0x7fff + lsb) >> 16; NaN quietened.
    const __m256i xi = _mm256_castps_si256(x);
    const __m256i hi = _mm256_srli_epi32(xi, 16);
    const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(xi, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet, is_nan);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static CHUNKSTAR_FORCEINLINE vf mul(vf a, vf b) noexcept { return _mm256_mul_ps(a, b); }
  static CHUNKSTAR_FORCEINLINE vf div(vf a, vf b) noexcept { return _mm256_div_ps(a, b); }
  static CHUNKSTAR_FORCEINLINE vf sqrt(vf a) noexcept { return _mm256_sqrt_ps(a); }
  static CHUNKSTAR_FORCEINLINE vf fma(vf a, vf b, vf c) noexcept { return _mm256_fmadd_ps(a, b, c); }
};

}  // namespace chunkstar::simd_detail
CHUNKSTAR_SIMD_END

CHUNKSTAR_SIMD_BEGIN_AVX512
namespace chunkstar::simd_detail {
template <>
struct simd<cpu_isa::avx512> {
  using vf = __m512;
  static constexpr std::size_t width = 16;
  static CHUNKSTAR_FORCEINLINE vf set1(float x) noexcept { return _mm512_set1_ps(x); }
  static CHUNKSTAR_FORCEINLINE vf load(const float* p) noexcept { return _mm512_loadu_ps(p); }
  static CHUNKSTAR_FORCEINLINE vf load(const float16* p) noexcept {
    // As the AVX2 load: NaN lanes keep the input's quiet bit (F16C would set it).
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m512i f = _mm512_castps_si512(_mm512_cvtph_ps(h));
    const __m512i w = _mm512_cvtepu16_epi32(h);
    const __mmask16 is_nan =
        _mm512_cmpgt_epi32_mask(_mm512_and_si512(w, _mm512_set1_epi32(0x7fff)), _mm512_set1_epi32(0x7c00));
    const __m512i exact = _mm512_or_si512(_mm512_andnot_si512(_mm512_set1_epi32(0x400000), f),
                                          _mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x200)), 13));
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(is_nan, f, exact));
  }
  static CHUNKSTAR_FORCEINLINE vf load(const bfloat16* p) noexcept {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static CHUNKSTAR_FORCEINLINE void store(float* p, vf x) noexcept { _mm512_storeu_ps(p, x); }
  static CHUNKSTAR_FORCEINLINE void store(float16* p, vf x) noexcept {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  static CHUNKSTAR_FORCEINLINE void store(bfloat16* p, vf x) noexcept {
    const __m512i xi = _mm512_castps_si512(x);
    const __m512i hi = _mm512_srli_epi32(xi, 16);
    const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(xi, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __m512i quiet = _mm512_or_si512(hi, _mm512_set1_epi32(0x40));
    const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i r = _mm512_mask_blend_epi32(is_nan, rounded, quiet);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static CHUNKSTAR_FORCEINLINE vf mul(vf a, vf b) noexcept { return _mm512_mul_ps(a, b); }
  static CHUNKSTAR_FORCEINLINE vf div(vf a, vf b) noexcept { return _mm512_div_ps(a, b); }
  static CHUNKSTAR_FORCEINLINE vf sqrt(vf a) noexcept { return _mm512_sqrt_ps(a); }
  static CHUNKSTAR_FORCEINLINE vf fma(vf a, vf b, vf c) noexcept { return _mm512_fmadd_ps(a, b, c); }
};
}  // namespace chunkstar::simd_detail
CHUNKSTAR_SIMD_END
#endif
