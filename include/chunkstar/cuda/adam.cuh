// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Tier 2 (nvcc): the fused Adam/AdamW step on device memory, and device-wide gradient
 *         checks (inf/NaN, sum of squares) with CUB.
 *
 *  Same contract, same per-call constants (make_adam_constants) and the same sequence of correctly
 *  rounded operations as the host kernel in chunkstar/optim/adam.hpp, written with the explicit
 *  _rn intrinsics so nvcc cannot contract or approximate them: results match the host path.
 *  adam_update_device has the host adam_update's signature plus a stream; adam_step_device takes
 *  the same adam_chunk as adam_step_host, so a runtime dispatches on where the state lives.
 */
#pragma once

#include <chunkstar/core/dtype.hpp>
#include <chunkstar/core/error.hpp>
#include <chunkstar/optim/adam.hpp>

#include <cub/device/device_reduce.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

namespace chunkstar::cuda {

namespace adam_detail {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw error(std::string("chunkstar::cuda: ") + what + " failed: " + cudaGetErrorString(e) +
                " (check that the pointers are device memory and the stream is valid)");
}

__device__ __forceinline__ float load_elem(const float* p) { return *p; }
__device__ __forceinline__ float load_elem(const float16* p) { return __half2float(__ushort_as_half(p->bits)); }
__device__ __forceinline__ float load_elem(const bfloat16* p) {
  return __uint_as_float(static_cast<unsigned>(p->bits) << 16);
}
__device__ __forceinline__ void store_elem(float* p, float x) { *p = x; }
__device__ __forceinline__ void store_elem(float16* p, float x) { p->bits = __half_as_ushort(__float2half_rn(x)); }
__device__ __forceinline__ void store_elem(bfloat16* p, float x) {
  p->bits = __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

/** The element update, in the host kernel's order (see adam.hpp). */
__device__ __forceinline__ void adam_elem(float& p, float& m, float& v, float graw, const adam_constants& c) {
  const float g = __fmaf_rn(c.l2, p, __fmul_rn(graw, c.grad_scale));
  m = __fmaf_rn(c.beta1, m, __fmul_rn(c.one_minus_beta1, g));
  v = __fmaf_rn(c.beta2, v, __fmul_rn(__fmul_rn(c.one_minus_beta2, g), g));
  const float d = __fmaf_rn(__fsqrt_rn(v), c.inv_sqrt_bc2, c.eps);
  p = __fmaf_rn(c.neg_step_size, __fdiv_rn(m, d), __fmul_rn(p, c.decay));
}

/** Four gradients in one load: 16 bytes for fp32, 8 bytes for fp16/bf16. */
template <class G>
struct vec4_of;
template <>
struct vec4_of<float> {
  using type = float4;
};
template <>
struct vec4_of<float16> {
  using type = uint2;
};
template <>
struct vec4_of<bfloat16> {
  using type = uint2;
};

template <class G, class P, bool WriteParam>
__global__ void adam_kernel(float* __restrict__ master, float* __restrict__ m, float* __restrict__ v,
                            const G* __restrict__ grad, P* __restrict__ param, std::size_t n, adam_constants c,
                            bool vectorised) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  std::size_t tid = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  std::size_t done = 0;
  if (vectorised) {
    const std::size_t n4 = n / 4;
    for (std::size_t q = tid; q < n4; q += stride) {
      float4 p4 = reinterpret_cast<const float4*>(master)[q];
      float4 m4 = reinterpret_cast<const float4*>(m)[q];
      float4 v4 = reinterpret_cast<const float4*>(v)[q];
      const auto graw = reinterpret_cast<const typename vec4_of<G>::type*>(grad)[q];
      const G* gs = reinterpret_cast<const G*>(&graw);
      adam_elem(p4.x, m4.x, v4.x, load_elem(gs + 0), c);
      adam_elem(p4.y, m4.y, v4.y, load_elem(gs + 1), c);
      adam_elem(p4.z, m4.z, v4.z, load_elem(gs + 2), c);
      adam_elem(p4.w, m4.w, v4.w, load_elem(gs + 3), c);
      reinterpret_cast<float4*>(master)[q] = p4;
      reinterpret_cast<float4*>(m)[q] = m4;
      reinterpret_cast<float4*>(v)[q] = v4;
      if constexpr (WriteParam) {
        if constexpr (std::is_same_v<P, float>) {
          reinterpret_cast<float4*>(param)[q] = p4;
        } else {
          P out[4];
          store_elem(out + 0, p4.x);
          store_elem(out + 1, p4.y);
          store_elem(out + 2, p4.z);
          store_elem(out + 3, p4.w);
          reinterpret_cast<uint2*>(param)[q] = *reinterpret_cast<const uint2*>(out);
        }
      }
    }
    done = n4 * 4;
  }
  for (std::size_t i = done + tid; i < n; i += stride) {  // tail, or everything when unaligned
    float p = master[i], mm = m[i], vv = v[i];
    adam_elem(p, mm, vv, load_elem(grad + i), c);
    master[i] = p;
    m[i] = mm;
    v[i] = vv;
    if constexpr (WriteParam) store_elem(param + i, p);
  }
}

inline bool aligned(const void* p, std::size_t a) { return reinterpret_cast<std::uintptr_t>(p) % a == 0; }

template <class G>
struct sq_op {
  float scale;
  __device__ double operator()(const G& x) const {
    const double y = static_cast<double>(load_elem(&x)) * static_cast<double>(scale);
    return y * y;
  }
};
template <class G>
struct abs_bits_op {
  __device__ unsigned operator()(const G& x) const {
    if constexpr (std::is_same_v<G, float>) return __float_as_uint(x) & 0x7fffffffu;
    else return static_cast<unsigned>(x.bits & 0x7fffu);
  }
};
struct max_op {
  __device__ unsigned operator()(unsigned a, unsigned b) const { return a > b ? a : b; }
};
struct sum_op {
  __device__ double operator()(double a, double b) const { return a + b; }
};

template <class Out, class G, class Reduce, class Transform>
void transform_reduce(const G* d_in, std::size_t n, Out* d_out, Reduce r, Transform t, Out init, cudaStream_t s) {
  std::size_t temp_bytes = 0;
  check(cub::DeviceReduce::TransformReduce(nullptr, temp_bytes, d_in, d_out, n, r, t, init, s), "CUB size query");
  void* temp = nullptr;
  check(cudaMallocAsync(&temp, temp_bytes, s), "cudaMallocAsync (reduction scratch)");
  const cudaError_t e = cub::DeviceReduce::TransformReduce(temp, temp_bytes, d_in, d_out, n, r, t, init, s);
  check(cudaFreeAsync(temp, s), "cudaFreeAsync");
  check(e, "cub::DeviceReduce::TransformReduce");
}

}  // namespace adam_detail

/** @brief One fused Adam(W) step over device arrays, enqueued on @p stream. The spans hold device
 *         pointers; the contract (lengths, empty param_out when master is the parameter, throws
 *         config_error on bad arguments) is that of chunkstar::adam_update. args.threads is ignored. */
template <class G, class P>
requires is_element_type_v<G> && is_element_type_v<P>
void adam_update_device(std::span<float> master, std::span<float> m, std::span<float> v, std::span<const G> grad,
                        std::span<P> param_out, const adam_hyper& hyper, const adam_step_args& args,
                        cudaStream_t stream) {
  const std::size_t n = master.size();
  if (m.size() != n || v.size() != n || grad.size() != n || (!param_out.empty() && param_out.size() != n))
    throw config_error(
        "adam_update_device: master, m, v, grad (and param_out unless empty) must have the same "
        "length; pass the same chunk range of each list");
  const adam_constants c = make_adam_constants(hyper, args);
  if (n == 0) return;
  const bool vec = adam_detail::aligned(master.data(), 16) && adam_detail::aligned(m.data(), 16) &&
                   adam_detail::aligned(v.data(), 16) && adam_detail::aligned(grad.data(), 4 * sizeof(G)) &&
                   (param_out.empty() || adam_detail::aligned(param_out.data(), 4 * sizeof(P)));
  constexpr int block = 256;
  const std::size_t work = vec ? (n + 3) / 4 : n;
  const unsigned grid = static_cast<unsigned>(std::min<std::size_t>((work + block - 1) / block, 65535u * 8u));
  if (param_out.empty())
    adam_detail::adam_kernel<G, P, false>
        <<<grid, block, 0, stream>>>(master.data(), m.data(), v.data(), grad.data(), nullptr, n, c, vec);
  else
    adam_detail::adam_kernel<G, P, true>
        <<<grid, block, 0, stream>>>(master.data(), m.data(), v.data(), grad.data(), param_out.data(), n, c, vec);
  adam_detail::check(cudaGetLastError(), "adam kernel launch");
}

/** @brief Adam(W) step of one chunk whose state lives in device memory (dispatches on the dtypes);
 *         the device twin of chunkstar::adam_step_host. */
inline void adam_step_device(const adam_chunk& ch, const adam_hyper& hyper, const adam_step_args& args,
                             cudaStream_t stream) {
  optim_detail::with_element_type(ch.grad_type, [&](auto g) {
    using G = decltype(g);
    const std::span<const G> grad(static_cast<const G*>(ch.grad), ch.count);
    optim_detail::with_element_type(ch.param_type, [&](auto p) {
      using P = decltype(p);
      const std::span<P> out = ch.param ? std::span<P>(static_cast<P*>(ch.param), ch.count) : std::span<P>{};
      adam_update_device<G, P>({ch.master, ch.count}, {ch.m, ch.count}, {ch.v, ch.count}, grad, out, hyper, args,
                               stream);
    });
  });
}

/** @brief Enqueues the sum over @p grad (device memory) of (g * scale)^2, in double, into
 *         `*d_result` (device memory). CUB's reduction is deterministic run to run on one device;
 *         its association differs from the host's, so host and device sums agree to rounding. */
template <class G>
requires is_element_type_v<G>
void sum_of_squares_device(std::span<const G> grad, float scale, double* d_result, cudaStream_t stream) {
  adam_detail::transform_reduce(grad.data(), grad.size(), d_result, adam_detail::sum_op{}, adam_detail::sq_op<G>{scale},
                                0.0, stream);
}

/** @brief Enqueues the largest |bits| of @p grad into `*d_max_abs_bits`; all elements are finite iff
 *         it is below finite_limit_bits<G>() (read it back, or test it on device). */
template <class G>
requires is_element_type_v<G>
void max_abs_bits_device(std::span<const G> grad, unsigned* d_max_abs_bits, cudaStream_t stream) {
  adam_detail::transform_reduce(grad.data(), grad.size(), d_max_abs_bits, adam_detail::max_op{},
                                adam_detail::abs_bits_op<G>{}, 0u, stream);
}

/** @brief The bit pattern of +infinity of @p G: max_abs_bits below it means all finite. */
template <class G>
requires is_element_type_v<G>
constexpr unsigned finite_limit_bits() noexcept {
  if constexpr (std::is_same_v<G, float>) return 0x7f800000u;
  else if constexpr (std::is_same_v<G, float16>) return 0x7c00u;
  else return 0x7f80u;
}

/** @brief True iff no element of @p grad (device memory) is inf or NaN. Synchronises @p stream. */
template <class G>
requires is_element_type_v<G>
bool all_finite_device(std::span<const G> grad, cudaStream_t stream) {
  unsigned* d = nullptr;
  adam_detail::check(cudaMallocAsync(reinterpret_cast<void**>(&d), sizeof(unsigned), stream), "cudaMallocAsync");
  max_abs_bits_device(grad, d, stream);
  unsigned h = 0;
  adam_detail::check(cudaMemcpyAsync(&h, d, sizeof h, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
  adam_detail::check(cudaFreeAsync(d, stream), "cudaFreeAsync");
  adam_detail::check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  return h < finite_limit_bits<G>();
}

}  // namespace chunkstar::cuda
