/** @file
 *  @brief Gradient scans for mixed precision and clipping: an inf/NaN check and a sum of squares,
 *         SIMD, OpenMP-parallel and deterministic whatever the thread count or ISA.
 *
 *  Determinism of the sum: the range is cut into fixed blocks of `grad_sum_block` elements; in a
 *  block, element k (counted from the block start) is accumulated into logical lane k % 16 with a
 *  double fused multiply-add; the 16 lanes are added in lane order, then the block partials in block
 *  order. AVX2 holds the 16 lanes as four __m256d, the portable path as double[16]: same bits.
 */
#pragma once

#include <chunkstar/core/dtype.hpp>
#include <chunkstar/optim/adam.hpp>
#include <chunkstar/optim/cpu_isa.hpp>
#include <chunkstar/optim/detail/simd.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <vector>

namespace chunkstar {

/** @brief Elements per block of the deterministic sum (a multiple of 16). */
inline constexpr std::size_t grad_sum_block = std::size_t{1} << 15;

namespace optim_detail {

inline constexpr std::size_t sum_lanes = 16;

template <class G> struct finite_bits;
template <> struct finite_bits<float> { using uint = std::uint32_t; static constexpr uint abs_mask = 0x7fffffffu, inf = 0x7f800000u; };
template <> struct finite_bits<float16> { using uint = std::uint16_t; static constexpr uint abs_mask = 0x7fffu, inf = 0x7c00u; };
template <> struct finite_bits<bfloat16> { using uint = std::uint16_t; static constexpr uint abs_mask = 0x7fffu, inf = 0x7f80u; };

/** Largest |bits| in [b, e): the values are finite iff it is below the infinity pattern. */
template <cpu_isa Isa, class G>
std::uint32_t max_abs_bits(const G* g, std::size_t b, std::size_t e) noexcept {
  using fb = finite_bits<G>;
  std::uint32_t acc = 0;
  std::size_t i = b;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if constexpr (Isa != cpu_isa::portable) {  // the AVX2 scan also serves AVX-512 builds: it is bandwidth-bound
    constexpr std::size_t per = 32 / sizeof(G);
    __m256i vacc = _mm256_setzero_si256();
    if constexpr (sizeof(G) == 4) {
      const __m256i mask = _mm256_set1_epi32(static_cast<int>(fb::abs_mask));
      for (; i + per <= e; i += per)
        vacc = _mm256_max_epu32(vacc, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + i)), mask));
    } else {
      const __m256i mask = _mm256_set1_epi16(static_cast<short>(fb::abs_mask));
      __m256i acc16 = _mm256_setzero_si256();
      for (; i + per <= e; i += per)
        acc16 = _mm256_max_epu16(acc16, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + i)), mask));
      vacc = _mm256_max_epu32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(acc16)),
                              _mm256_cvtepu16_epi32(_mm256_extracti128_si256(acc16, 1)));
    }
    alignas(32) std::uint32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), vacc);
    for (std::uint32_t x : lanes) acc = std::max(acc, x);
  }
#endif
  for (; i < e; ++i) {
    typename fb::uint bits;
    std::memcpy(&bits, g + i, sizeof bits);
    acc = std::max<std::uint32_t>(acc, bits & fb::abs_mask);
  }
  return acc;
}

/** Sum of (g * scale)^2 over one block [b, e) (b is the block start), in the 16-lane order. */
template <cpu_isa Isa, class G>
double block_sum_of_squares(const G* g, std::size_t b, std::size_t e, double scale) noexcept {
  alignas(32) double lanes[sum_lanes] = {};
  std::size_t i = b;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if constexpr (Isa != cpu_isa::portable) {
    using S = simd<cpu_isa::avx2>;
    const __m256d s = _mm256_set1_pd(scale);
    __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + sum_lanes <= e; i += sum_lanes) {
      const __m256 lo = S::load(g + i), hi = S::load(g + i + 8);
      const __m256d x0 = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(lo)), s);
      const __m256d x1 = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(lo, 1)), s);
      const __m256d x2 = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(hi)), s);
      const __m256d x3 = _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(hi, 1)), s);
      a0 = _mm256_fmadd_pd(x0, x0, a0);
      a1 = _mm256_fmadd_pd(x1, x1, a1);
      a2 = _mm256_fmadd_pd(x2, x2, a2);
      a3 = _mm256_fmadd_pd(x3, x3, a3);
    }
    _mm256_store_pd(lanes + 0, a0);
    _mm256_store_pd(lanes + 4, a1);
    _mm256_store_pd(lanes + 8, a2);
    _mm256_store_pd(lanes + 12, a3);
  }
#endif
  for (; i < e; ++i) {
    const double x = static_cast<double>(simd<cpu_isa::portable>::load(g + i)) * scale;
    double& lane = lanes[(i - b) % sum_lanes];
    lane = std::fma(x, x, lane);
  }
  double sum = 0.0;
  for (double lane : lanes) sum += lane;
  return sum;
}

}  // namespace optim_detail

/** @brief True iff no element of @p grad is inf or NaN (integer test of the exponent bits), with an
 *         explicit ISA. */
template <cpu_isa Isa, class G>
  requires is_element_type_v<G>
bool all_finite_isa(std::span<const G> grad, int threads = 0) {
  static_assert(cpu_isa_available_v<Isa>, "compile with this ISA's flags (see cpu_isa.hpp)");
  const std::size_t n = grad.size();
  const std::size_t nblocks = (n + grad_sum_block - 1) / grad_sum_block;
  std::vector<std::uint32_t> block_max(nblocks, 0);
  optim_detail::parallel_blocks(n, grad_sum_block, optim_detail::adam_parallel_min, threads,
                                [&](std::size_t b, std::size_t e) {
                                  for (std::size_t s = b; s < e; s += grad_sum_block)
                                    block_max[s / grad_sum_block] = optim_detail::max_abs_bits<Isa>(
                                        grad.data(), s, std::min(e, s + grad_sum_block));
                                });
  std::uint32_t m = 0;
  for (auto x : block_max) m = std::max(m, x);
  return m < optim_detail::finite_bits<G>::inf;
}

/** @brief True iff no element of @p grad is inf or NaN. */
template <class G>
  requires is_element_type_v<G>
bool all_finite(std::span<const G> grad, int threads = 0) {
  return all_finite_isa<native_cpu_isa, G>(grad, threads);
}

/** @brief Sum over @p grad of (g * scale)^2 in double, with an explicit ISA. Deterministic: the same
 *         bits for every thread count and ISA (see the file comment). */
template <cpu_isa Isa, class G>
  requires is_element_type_v<G>
double sum_of_squares_isa(std::span<const G> grad, float scale = 1.0f, int threads = 0) {
  static_assert(cpu_isa_available_v<Isa>, "compile with this ISA's flags (see cpu_isa.hpp)");
  const std::size_t n = grad.size();
  const std::size_t nblocks = (n + grad_sum_block - 1) / grad_sum_block;
  std::vector<double> partial(nblocks, 0.0);
  const double s = static_cast<double>(scale);
  optim_detail::parallel_blocks(n, grad_sum_block, optim_detail::adam_parallel_min, threads,
                                [&](std::size_t b, std::size_t e) {
                                  for (std::size_t k = b; k < e; k += grad_sum_block)
                                    partial[k / grad_sum_block] = optim_detail::block_sum_of_squares<Isa>(
                                        grad.data(), k, std::min(e, k + grad_sum_block), s);
                                });
  double sum = 0.0;
  for (double p : partial) sum += p;
  return sum;
}

/** @brief Sum over @p grad of (g * scale)^2 in double; deterministic whatever the thread count.
 *         Pass scale = 1/loss_scale to get the unscaled gradients' sum for clipping. */
template <class G>
  requires is_element_type_v<G>
double sum_of_squares(std::span<const G> grad, float scale = 1.0f, int threads = 0) {
  return sum_of_squares_isa<native_cpu_isa, G>(grad, scale, threads);
}

/** @brief What one fused pass over a gradient range found. */
struct grad_stats {
  double sum_sq = 0.0;     ///< sum of (g * scale)^2; feeds global_norm_clip
  bool all_finite = true;  ///< false if any gradient was inf or NaN (then skip the step)
};

/** @brief The fused check: one read of the gradients gives both the overflow flag and the sum of
 *         squares. Sound because (g * scale)^2 for finite floats g and scale is at most 1.2e77^2 =
 *         1.4e154, so the double sum cannot overflow: it is finite exactly when every element is
 *         (and @p scale is finite). */
template <class G>
  requires is_element_type_v<G>
grad_stats scan_gradients(std::span<const G> grad, float scale = 1.0f, int threads = 0) {
  const double s = sum_of_squares<G>(grad, scale, threads);
  return {s, std::isfinite(s)};
}

/** @brief Accumulates the stats of several ranges (chunks), in the order they are added. */
inline grad_stats& operator+=(grad_stats& a, const grad_stats& b) noexcept {
  a.sum_sq += b.sum_sq;
  a.all_finite = a.all_finite && b.all_finite;
  return a;
}

}  // namespace chunkstar
