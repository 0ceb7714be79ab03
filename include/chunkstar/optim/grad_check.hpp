// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Gradient scans for mixed precision and clipping: an inf/NaN check and a sum of squares,
 *         SIMD, OpenMP-parallel and deterministic whatever the thread count or ISA.
 *
 *  Determinism of the sum: the range is cut into fixed blocks of `grad_sum_block` elements; in a
 *  block, element k (counted from the block start) is accumulated into logical lane k % 16 with a
 *  double fused multiply-add; the 16 lanes are added in lane order, then the block partials in block
 *  order. AVX2 holds the 16 lanes as four __m256d, the portable path as double[16]: same bits.
 *  Every ISA's scan is compiled into every build (optim/detail/grad_kernels.inc); the dispatching
 *  functions run active_cpu_isa()'s.
 */
#pragma once

#include <chunkstar/core/detail/simd.hpp>
#include <chunkstar/core/dtype.hpp>
#include <chunkstar/optim/adam.hpp>
#include <chunkstar/optim/cpu_isa.hpp>

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

template <class G>
struct finite_bits;
template <>
struct finite_bits<float> {
  using uint = std::uint32_t;
  static constexpr uint abs_mask = 0x7fffffffu, inf = 0x7f800000u;
};
template <>
struct finite_bits<float16> {
  using uint = std::uint16_t;
  static constexpr uint abs_mask = 0x7fffu, inf = 0x7c00u;
};
template <>
struct finite_bits<bfloat16> {
  using uint = std::uint16_t;
  static constexpr uint abs_mask = 0x7fffu, inf = 0x7f80u;
};

/** The scans of one ISA (`max_abs_bits<G>`, `block_sum_of_squares<G>`), specialised once per ISA
 *  inside its target region by optim/detail/grad_kernels.inc. */
template <cpu_isa Isa>
struct grad_kernels;

}  // namespace optim_detail
}  // namespace chunkstar

#define CHUNKSTAR_SIMD_KERNELS <chunkstar/optim/detail/grad_kernels.inc>
#include <chunkstar/core/simd_foreach_isa.hpp>

namespace chunkstar {

/** @brief True iff no element of @p grad is inf or NaN (integer test of the exponent bits), with an
 *         explicit ISA. */
template <cpu_isa Isa, class G>
requires is_element_type_v<G>
bool all_finite_isa(std::span<const G> grad, int threads = 0) {
  static_assert(cpu_isa_available_v<Isa>,
                "this ISA's kernels are not compiled into this build (CHUNKSTAR_ISA_DISPATCH)");
  if (!cpu_isa_supported(Isa))
    throw config_error("all_finite_isa: this CPU cannot run the " + std::string(cpu_isa_name(Isa)) + " kernels");
  const std::size_t n = grad.size();
  const std::size_t nblocks = (n + grad_sum_block - 1) / grad_sum_block;
  std::vector<std::uint32_t> block_max(nblocks, 0);
  optim_detail::parallel_blocks(
      n, grad_sum_block, optim_detail::adam_parallel_min, threads, [&](std::size_t b, std::size_t e) {
        for (std::size_t s = b; s < e; s += grad_sum_block)
          block_max[s / grad_sum_block] =
              optim_detail::grad_kernels<Isa>::max_abs_bits(grad.data(), s, std::min(e, s + grad_sum_block));
      });
  std::uint32_t m = 0;
  for (auto x : block_max) m = std::max(m, x);
  return m < optim_detail::finite_bits<G>::inf;
}

/** @brief True iff no element of @p grad is inf or NaN. */
template <class G>
requires is_element_type_v<G>
bool all_finite(std::span<const G> grad, int threads = 0) {
  return with_cpu_isa(active_cpu_isa(), [&](auto isa) { return all_finite_isa<isa(), G>(grad, threads); });
}

/** @brief Sum over @p grad of (g * scale)^2 in double, with an explicit ISA. Deterministic: the same
 *         bits for every thread count and ISA (see the file comment). */
template <cpu_isa Isa, class G>
requires is_element_type_v<G>
double sum_of_squares_isa(std::span<const G> grad, float scale = 1.0f, int threads = 0) {
  static_assert(cpu_isa_available_v<Isa>,
                "this ISA's kernels are not compiled into this build (CHUNKSTAR_ISA_DISPATCH)");
  if (!cpu_isa_supported(Isa))
    throw config_error("sum_of_squares_isa: this CPU cannot run the " + std::string(cpu_isa_name(Isa)) + " kernels");
  const std::size_t n = grad.size();
  const std::size_t nblocks = (n + grad_sum_block - 1) / grad_sum_block;
  std::vector<double> partial(nblocks, 0.0);
  const double s = static_cast<double>(scale);
  optim_detail::parallel_blocks(
      n, grad_sum_block, optim_detail::adam_parallel_min, threads, [&](std::size_t b, std::size_t e) {
        for (std::size_t k = b; k < e; k += grad_sum_block)
          partial[k / grad_sum_block] =
              optim_detail::grad_kernels<Isa>::block_sum_of_squares(grad.data(), k, std::min(e, k + grad_sum_block), s);
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
  return with_cpu_isa(active_cpu_isa(), [&](auto isa) { return sum_of_squares_isa<isa(), G>(grad, scale, threads); });
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
requires is_element_type_v<G> grad_stats scan_gradients(std::span<const G> grad, float scale = 1.0f, int threads = 0) {
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
