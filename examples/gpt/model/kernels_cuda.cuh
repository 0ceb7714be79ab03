// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief CUDA forward and backward of every layer of the GPT model (float), the same layers and
 *         conventions as kernels_cpu.hpp: row-major tensors, linear weights [out, in], forward
 *         kernels overwrite, backward kernels ADD into every gradient, scratch passed in.
 *
 *  Matrix products go through cuBLAS (FP32, no TF32, so results track the CPU path); the rest are
 *  small kernels. Like the CPU path, nothing uses atomics: each output element has one writer and
 *  every reduction has a fixed order (warp butterflies, or one thread looping over rows), so a
 *  run repeats bit for bit on the same GPU.
 *
 *  Host functions take a stream; those that call cuBLAS also take a handle and put it on that
 *  stream. Errors in cuBLAS calls throw chunkstar::error; kernel launch errors are left to the
 *  caller's cudaGetLastError / stream synchronisation, as usual for asynchronous work.
 */
#pragma once

#include <chunkstar/core/error.hpp>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <string>

namespace gpt::cuda {

/** @brief The cuBLAS entry points the GPT's CUDA code uses. By default the linked library's; a
 *  translation unit that defines GPT_CUBLAS_LAZY before including this header defines `blas()`
 *  itself (gpt_backend_cuda.cu loads libcublas with dlopen when a GPU run starts, so a CPU run of
 *  the trainer does not map cuBLAS's 600 MB: under `ulimit -v` that decides whether it starts). */
struct cublas_api {
  decltype(&cublasCreate) create;
  decltype(&cublasDestroy) destroy;
  decltype(&cublasSetStream) set_stream;
  decltype(&cublasSetMathMode) set_math_mode;
  decltype(&cublasSetAtomicsMode) set_atomics_mode;
  decltype(&cublasSetWorkspace) set_workspace;
  decltype(&cublasSgemm) sgemm;
  decltype(&cublasSgemmStridedBatched) sgemm_strided_batched;
};
#if defined(GPT_CUBLAS_LAZY)
const cublas_api& blas();
#else
inline const cublas_api& blas() {
  static const cublas_api api{&cublasCreate,         &cublasDestroy,      &cublasSetStream, &cublasSetMathMode,
                              &cublasSetAtomicsMode, &cublasSetWorkspace, &cublasSgemm,     &cublasSgemmStridedBatched};
  return api;
}
#endif

namespace detail {

inline void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw chunkstar::error(std::string("cuBLAS ") + what + " failed with status " +
                           std::to_string(static_cast<int>(s)) +
                           "; check the handle was created on this device and the shapes fit the buffers");
}

inline constexpr int block_size = 256;
inline constexpr int warps_per_block = block_size / 32;

inline unsigned grid_for(std::size_t threads) { return static_cast<unsigned>((threads + block_size - 1) / block_size); }
inline unsigned grid_for_warps(std::size_t warps) {
  return static_cast<unsigned>((warps + warps_per_block - 1) / warps_per_block);
}

/** Butterfly reductions: every lane ends with the same value, summed in the same order every run. */
__device__ inline float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ inline float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/** Row-major GEMM on column-major cuBLAS: C = op(A) op(B) row-major is C^T = op(B)^T op(A)^T
 *  column-major, and a row-major buffer read column-major is its transpose, so swap the operands. */
inline void gemm(cublasHandle_t h, bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda,
                 const float* b, int ldb, float beta, float* c, int ldc) {
  check(blas().sgemm(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k, &alpha, b, ldb, a, lda,
                     &beta, c, ldc),
        "sgemm");
}
/** The same over @p batch matrices spaced by the given strides. */
inline void gemm_batched(cublasHandle_t h, bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda,
                         long long sa, const float* b, int ldb, long long sb, float beta, float* c, int ldc,
                         long long sc, int batch) {
  check(blas().sgemm_strided_batched(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k, &alpha,
                                     b, ldb, sb, a, lda, sa, &beta, c, ldc, sc, batch),
        "sgemm strided batched");
}

// ---- kernels (static: a header-only library gives each translation unit its own copy) ---------

static __global__ void encoder_forward_kernel(float* out, const int* tokens, const float* wte, const float* wpe,
                                              std::size_t BT, int T, int C) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= BT * C) return;
  const std::size_t bt = i / C, c = i % C;
  out[i] = wte[static_cast<std::size_t>(tokens[bt]) * C + c] + wpe[(bt % T) * C + c];
}

/** One thread per channel walks every position in order: positions sharing a token never race. */
static __global__ void encoder_backward_kernel(float* dwte, float* dwpe, const float* dout, const int* tokens,
                                               std::size_t BT, int T, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  for (std::size_t bt = 0; bt < BT; ++bt) {
    const float d = dout[bt * C + c];
    dwte[static_cast<std::size_t>(tokens[bt]) * C + c] += d;
    dwpe[(bt % T) * C + c] += d;
  }
}

/** One warp per row. */
static __global__ void layernorm_forward_kernel(float* out, float* mean, float* rstd, const float* inp, const float* w,
                                                const float* b, int N, int C, float eps) {
  const int row = blockIdx.x * warps_per_block + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= N) return;
  const float* x = inp + static_cast<std::size_t>(row) * C;
  float s = 0;
  for (int c = lane; c < C; c += 32) s += x[c];
  const float m = warp_sum(s) / C;
  float v = 0;
  for (int c = lane; c < C; c += 32) v += (x[c] - m) * (x[c] - m);
  const float r = 1.0f / sqrtf(warp_sum(v) / C + eps);
  float* y = out + static_cast<std::size_t>(row) * C;
  for (int c = lane; c < C; c += 32) y[c] = (x[c] - m) * r * w[c] + b[c];
  if (lane == 0) mean[row] = m, rstd[row] = r;
}

/** Input gradient, one warp per row. */
static __global__ void layernorm_backward_input_kernel(float* dinp, const float* dout, const float* inp, const float* w,
                                                       const float* mean, const float* rstd, int N, int C) {
  const int row = blockIdx.x * warps_per_block + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= N) return;
  const std::size_t o = static_cast<std::size_t>(row) * C;
  const float m = mean[row], r = rstd[row];
  float sd = 0, sdx = 0;
  for (int c = lane; c < C; c += 32) {
    const float dxhat = dout[o + c] * w[c];
    sd += dxhat;
    sdx += dxhat * (inp[o + c] - m) * r;
  }
  sd = warp_sum(sd) / C;
  sdx = warp_sum(sdx) / C;
  for (int c = lane; c < C; c += 32) {
    const float xhat = (inp[o + c] - m) * r;
    dinp[o + c] += r * (dout[o + c] * w[c] - sd - xhat * sdx);
  }
}

/** Gain and bias gradients, one thread per column summing rows in order. */
static __global__ void layernorm_backward_params_kernel(float* dw, float* db, const float* dout, const float* inp,
                                                        const float* mean, const float* rstd, int N, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float sw = 0, sb = 0;
  for (int n = 0; n < N; ++n) {
    const float d = dout[static_cast<std::size_t>(n) * C + c];
    sw += d * (inp[static_cast<std::size_t>(n) * C + c] - mean[n]) * rstd[n];
    sb += d;
  }
  dw[c] += sw;
  db[c] += sb;
}

static __global__ void broadcast_rows_kernel(float* out, const float* row, std::size_t N, int C) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < N * C) out[i] = row[i % C];
}

static __global__ void add_column_sums_kernel(float* out, const float* in, int rows, int cols) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float s = 0;
  for (int r = 0; r < rows; ++r) s += in[static_cast<std::size_t>(r) * cols + c];
  out[c] += s;
}

/** dst[b, h, t, :] = src[(b*T + t) * stride + h*hs + :], so each head is a contiguous [T, hs]. */
static __global__ void split_heads_kernel(float* dst, const float* src, int B, int T, int NH, int hs, int stride) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<std::size_t>(B) * NH * T * hs) return;
  const int e = i % hs, t = (i / hs) % T, h = (i / hs / T) % NH, b = i / hs / T / NH;
  dst[i] = src[(static_cast<std::size_t>(b) * T + t) * stride + h * hs + e];
}

/** The inverse of split_heads, overwriting (accumulate = false) or adding into dst. */
static __global__ void merge_heads_kernel(float* dst, const float* src, int B, int T, int NH, int hs, int stride,
                                          bool accumulate) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= static_cast<std::size_t>(B) * NH * T * hs) return;
  const int e = i % hs, t = (i / hs) % T, h = (i / hs / T) % NH, b = i / hs / T / NH;
  float& d = dst[(static_cast<std::size_t>(b) * T + t) * stride + h * hs + e];
  d = accumulate ? d + src[i] : src[i];
}

/** In place: scores -> causal softmax(scale * scores), zero above the diagonal. Warp per row. */
static __global__ void causal_softmax_kernel(float* att, std::size_t rows, int T, float scale) {
  const std::size_t row = blockIdx.x * static_cast<std::size_t>(warps_per_block) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int t = row % T;
  float* a = att + row * T;
  float mx = -INFINITY;
  for (int u = lane; u <= t; u += 32) mx = fmaxf(mx, a[u] * scale);
  mx = warp_max(mx);
  float s = 0;
  for (int u = lane; u <= t; u += 32) {
    const float e = expf(a[u] * scale - mx);
    a[u] = e;
    s += e;
  }
  const float inv = 1.0f / warp_sum(s);
  for (int u = lane; u < T; u += 32) a[u] = u <= t ? a[u] * inv : 0.0f;
}

/** In place: datt -> d(scores) = scale * att * (datt - sum(att * datt)), zero above the diagonal. */
static __global__ void causal_softmax_backward_kernel(float* datt, const float* att, std::size_t rows, int T,
                                                      float scale) {
  const std::size_t row = blockIdx.x * static_cast<std::size_t>(warps_per_block) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int t = row % T;
  float* d = datt + row * T;
  const float* a = att + row * T;
  float dot = 0;
  for (int u = lane; u <= t; u += 32) dot += a[u] * d[u];
  dot = warp_sum(dot);
  for (int u = lane; u < T; u += 32) d[u] = u <= t ? scale * a[u] * (d[u] - dot) : 0.0f;
}

static __global__ void gelu_forward_kernel(float* out, const float* inp, std::size_t n) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float x = inp[i], k = 0.7978845608f;
  out[i] = 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}

static __global__ void gelu_backward_kernel(float* dinp, const float* inp, const float* dout, std::size_t n) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const float x = inp[i], k = 0.7978845608f;
  const float th = tanhf(k * (x + 0.044715f * x * x * x));
  const float dth = (1.0f - th * th) * k * (1.0f + 3.0f * 0.044715f * x * x);
  dinp[i] += (0.5f * (1.0f + th) + 0.5f * x * dth) * dout[i];
}

static __global__ void residual_forward_kernel(float* out, const float* a, const float* b, std::size_t n) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = a[i] + b[i];
}

static __global__ void residual_backward_kernel(float* da, float* db, const float* dout, std::size_t n) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  da[i] += dout[i];
  db[i] += dout[i];
}

/** Warp per row: probabilities and -log p[target] as log-sum-exp minus the target logit. */
static __global__ void softmax_crossentropy_forward_kernel(float* probs, float* losses, const float* logits,
                                                           const int* targets, int N, int V) {
  const int row = blockIdx.x * warps_per_block + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= N) return;
  const float* z = logits + static_cast<std::size_t>(row) * V;
  float* p = probs + static_cast<std::size_t>(row) * V;
  float mx = -INFINITY;
  for (int v = lane; v < V; v += 32) mx = fmaxf(mx, z[v]);
  mx = warp_max(mx);
  float s = 0;
  for (int v = lane; v < V; v += 32) {
    const float e = expf(z[v] - mx);
    p[v] = e;
    s += e;
  }
  s = warp_sum(s);
  const float inv = 1.0f / s;
  for (int v = lane; v < V; v += 32) p[v] *= inv;
  if (lane == 0) losses[row] = logf(s) + (mx - z[targets[row]]);
}

static __global__ void softmax_crossentropy_backward_kernel(float* dlogits, const float* probs, const int* targets,
                                                            float dloss, std::size_t N, int V) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= N * V) return;
  const std::size_t n = i / V;
  const int v = i % V;
  dlogits[i] += dloss * (probs[i] - (v == targets[n] ? 1.0f : 0.0f));
}

}  // namespace detail

// ---- host API: same shapes and semantics as gpt::cpu ---------------------------------------

/** @brief LayerNorm's epsilon (GPT-2's value, as on the CPU). */
inline constexpr float layernorm_eps = 1e-5f;

/** @brief out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]. */
inline void encoder_forward(float* out, const int* tokens, const float* wte, const float* wpe, std::size_t B,
                            std::size_t T, std::size_t C, cudaStream_t s = nullptr) {
  detail::encoder_forward_kernel<<<detail::grid_for(B * T * C), detail::block_size, 0, s>>>(
      out, tokens, wte, wpe, B * T, static_cast<int>(T), static_cast<int>(C));
}

/** @brief dwte[tokens[b,t]] += dout[b,t]; dwpe[t] += sum_b dout[b,t]. */
inline void encoder_backward(float* dwte, float* dwpe, const float* dout, const int* tokens, std::size_t B,
                             std::size_t T, std::size_t C, cudaStream_t s = nullptr) {
  detail::encoder_backward_kernel<<<detail::grid_for(C), detail::block_size, 0, s>>>(
      dwte, dwpe, dout, tokens, B * T, static_cast<int>(T), static_cast<int>(C));
}

/** @brief out = (inp - mean) * rstd * w + b per row; keeps mean and rstd [N]. */
inline void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* w, const float* b,
                              std::size_t N, std::size_t C, cudaStream_t s = nullptr) {
  detail::layernorm_forward_kernel<<<detail::grid_for_warps(N), detail::block_size, 0, s>>>(
      out, mean, rstd, inp, w, b, static_cast<int>(N), static_cast<int>(C), layernorm_eps);
}

/** @brief dinp += ...; dw += sum_n dout * xhat; db += sum_n dout. */
inline void layernorm_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp, const float* w,
                               const float* mean, const float* rstd, std::size_t N, std::size_t C,
                               cudaStream_t s = nullptr) {
  detail::layernorm_backward_input_kernel<<<detail::grid_for_warps(N), detail::block_size, 0, s>>>(
      dinp, dout, inp, w, mean, rstd, static_cast<int>(N), static_cast<int>(C));
  detail::layernorm_backward_params_kernel<<<detail::grid_for(C), detail::block_size, 0, s>>>(
      dw, db, dout, inp, mean, rstd, static_cast<int>(N), static_cast<int>(C));
}

/** @brief out[N, OC] = inp[N, C] W[OC, C]^T + bias (bias may be null). */
inline void matmul_forward(cublasHandle_t h, float* out, const float* inp, const float* weight, const float* bias,
                           std::size_t N, std::size_t C, std::size_t OC, cudaStream_t s = nullptr) {
  detail::check(blas().set_stream(h, s), "set stream");
  if (bias)
    detail::broadcast_rows_kernel<<<detail::grid_for(N * OC), detail::block_size, 0, s>>>(out, bias, N,
                                                                                          static_cast<int>(OC));
  detail::gemm(h, false, true, static_cast<int>(N), static_cast<int>(OC), static_cast<int>(C), 1.0f, inp,
               static_cast<int>(C), weight, static_cast<int>(C), bias ? 1.0f : 0.0f, out, static_cast<int>(OC));
}

/** @brief dinp += dout W (dinp may be null); dweight += dout^T inp; dbias += column sums (may be null). */
inline void matmul_backward(cublasHandle_t h, float* dinp, float* dweight, float* dbias, const float* dout,
                            const float* inp, const float* weight, std::size_t N, std::size_t C, std::size_t OC,
                            cudaStream_t s = nullptr) {
  detail::check(blas().set_stream(h, s), "set stream");
  const int n = static_cast<int>(N), c = static_cast<int>(C), oc = static_cast<int>(OC);
  if (dinp) detail::gemm(h, false, false, n, c, oc, 1.0f, dout, oc, weight, c, 1.0f, dinp, c);
  detail::gemm(h, true, false, oc, c, n, 1.0f, dout, oc, inp, c, 1.0f, dweight, c);
  if (dbias) detail::add_column_sums_kernel<<<detail::grid_for(OC), detail::block_size, 0, s>>>(dbias, dout, n, oc);
}

/** @brief Scratch for attention: per-head copies of q, k, v and the output (forward), their
 *         gradients and d(att) (backward). */
struct attention_scratch {
  float* q;     ///< [B, NH, T, hs]
  float* k;     ///< [B, NH, T, hs]
  float* v;     ///< [B, NH, T, hs]
  float* y;     ///< [B, NH, T, hs] the output, or in the backward its gradient
  float* dq;    ///< [B, NH, T, hs]
  float* dk;    ///< [B, NH, T, hs]
  float* dv;    ///< [B, NH, T, hs]
  float* datt;  ///< [B, NH, T, T]
};

/** @brief Elements of attention scratch for these shapes. */
inline std::size_t attention_scratch_elements(std::size_t B, std::size_t T, std::size_t C, std::size_t NH) {
  return 7 * B * T * C + B * NH * T * T;
}

/** @brief Carves attention_scratch_elements() floats at @p base. */
inline attention_scratch bind_attention_scratch(float* base, std::size_t B, std::size_t T, std::size_t C) {
  const std::size_t n = B * T * C;
  return {base, base + n, base + 2 * n, base + 3 * n, base + 4 * n, base + 5 * n, base + 6 * n, base + 7 * n};
}

/** @brief Causal multi-head attention: qkv [B, T, 3C] -> out [B, T, C]; att [B, NH, T, T] keeps
 *         the probabilities for the backward. */
inline void attention_forward(cublasHandle_t h, float* out, float* att, const float* qkv, const attention_scratch& w,
                              std::size_t B, std::size_t T, std::size_t C, std::size_t NH, cudaStream_t s = nullptr) {
  detail::check(blas().set_stream(h, s), "set stream");
  const int b = static_cast<int>(B), t = static_cast<int>(T), nh = static_cast<int>(NH), hs = static_cast<int>(C / NH);
  const std::size_t n = B * T * C;
  const unsigned g = detail::grid_for(n);
  detail::split_heads_kernel<<<g, detail::block_size, 0, s>>>(w.q, qkv, b, t, nh, hs, 3 * static_cast<int>(C));
  detail::split_heads_kernel<<<g, detail::block_size, 0, s>>>(w.k, qkv + C, b, t, nh, hs, 3 * static_cast<int>(C));
  detail::split_heads_kernel<<<g, detail::block_size, 0, s>>>(w.v, qkv + 2 * C, b, t, nh, hs, 3 * static_cast<int>(C));
  const long long sh = static_cast<long long>(T) * hs, st = static_cast<long long>(T) * T;
  // scores = q k^T per head (the whole square; the softmax masks the future)
  detail::gemm_batched(h, false, true, t, t, hs, 1.0f, w.q, hs, sh, w.k, hs, sh, 0.0f, att, t, st, b * nh);
  detail::causal_softmax_kernel<<<detail::grid_for_warps(B * NH * T), detail::block_size, 0, s>>>(
      att, B * NH * T, t, 1.0f / sqrtf(static_cast<float>(hs)));
  detail::gemm_batched(h, false, false, t, hs, t, 1.0f, att, t, st, w.v, hs, sh, 0.0f, w.y, hs, sh, b * nh);
  detail::merge_heads_kernel<<<g, detail::block_size, 0, s>>>(out, w.y, b, t, nh, hs, static_cast<int>(C), false);
}

/** @brief dqkv += the gradient of attention_forward given dout [B, T, C]. */
inline void attention_backward(cublasHandle_t h, float* dqkv, const float* dout, const float* qkv, const float* att,
                               const attention_scratch& w, std::size_t B, std::size_t T, std::size_t C, std::size_t NH,
                               cudaStream_t s = nullptr) {
  detail::check(blas().set_stream(h, s), "set stream");
  const int b = static_cast<int>(B), t = static_cast<int>(T), nh = static_cast<int>(NH), hs = static_cast<int>(C / NH);
  const int c3 = 3 * static_cast<int>(C);
  const std::size_t n = B * T * C;
  const unsigned g = detail::grid_for(n);
  detail::split_heads_kernel<<<g, detail::block_size, 0, s>>>(w.q, qkv, b, t, nh, hs, c3);
  detail::split_heads_kernel<<<g, detail::block_size, 0, s>>>(w.k, qkv + C, b, t, nh, hs, c3);
  detail::split_heads_kernel<<<g, detail::block_size, 0, s>>>(w.v, qkv + 2 * C, b, t, nh, hs, c3);
  detail::split_heads_kernel<<<g, detail::block_size, 0, s>>>(w.y, dout, b, t, nh, hs, static_cast<int>(C));
  const long long sh = static_cast<long long>(T) * hs, st = static_cast<long long>(T) * T;
  // y = att v:  datt = dy v^T,  dv = att^T dy
  detail::gemm_batched(h, false, true, t, t, hs, 1.0f, w.y, hs, sh, w.v, hs, sh, 0.0f, w.datt, t, st, b * nh);
  detail::gemm_batched(h, true, false, t, hs, t, 1.0f, att, t, st, w.y, hs, sh, 0.0f, w.dv, hs, sh, b * nh);
  detail::causal_softmax_backward_kernel<<<detail::grid_for_warps(B * NH * T), detail::block_size, 0, s>>>(
      w.datt, att, B * NH * T, t, 1.0f / sqrtf(static_cast<float>(hs)));
  // scores = q k^T:  dq = dscores k,  dk = dscores^T q
  detail::gemm_batched(h, false, false, t, hs, t, 1.0f, w.datt, t, st, w.k, hs, sh, 0.0f, w.dq, hs, sh, b * nh);
  detail::gemm_batched(h, true, false, t, hs, t, 1.0f, w.datt, t, st, w.q, hs, sh, 0.0f, w.dk, hs, sh, b * nh);
  detail::merge_heads_kernel<<<g, detail::block_size, 0, s>>>(dqkv, w.dq, b, t, nh, hs, c3, true);
  detail::merge_heads_kernel<<<g, detail::block_size, 0, s>>>(dqkv + C, w.dk, b, t, nh, hs, c3, true);
  detail::merge_heads_kernel<<<g, detail::block_size, 0, s>>>(dqkv + 2 * C, w.dv, b, t, nh, hs, c3, true);
}

/** @brief out = gelu(inp) (tanh approximation). */
inline void gelu_forward(float* out, const float* inp, std::size_t n, cudaStream_t s = nullptr) {
  detail::gelu_forward_kernel<<<detail::grid_for(n), detail::block_size, 0, s>>>(out, inp, n);
}

/** @brief dinp += gelu'(inp) * dout. */
inline void gelu_backward(float* dinp, const float* inp, const float* dout, std::size_t n, cudaStream_t s = nullptr) {
  detail::gelu_backward_kernel<<<detail::grid_for(n), detail::block_size, 0, s>>>(dinp, inp, dout, n);
}

/** @brief out = a + b. */
inline void residual_forward(float* out, const float* a, const float* b, std::size_t n, cudaStream_t s = nullptr) {
  detail::residual_forward_kernel<<<detail::grid_for(n), detail::block_size, 0, s>>>(out, a, b, n);
}

/** @brief da += dout; db += dout. */
inline void residual_backward(float* da, float* db, const float* dout, std::size_t n, cudaStream_t s = nullptr) {
  detail::residual_backward_kernel<<<detail::grid_for(n), detail::block_size, 0, s>>>(da, db, dout, n);
}

/** @brief probs = softmax(logits) per row; losses[n] = -log probs[n, targets[n]]. */
inline void softmax_crossentropy_forward(float* probs, float* losses, const float* logits, const int* targets,
                                         std::size_t N, std::size_t V, cudaStream_t s = nullptr) {
  detail::softmax_crossentropy_forward_kernel<<<detail::grid_for_warps(N), detail::block_size, 0, s>>>(
      probs, losses, logits, targets, static_cast<int>(N), static_cast<int>(V));
}

/** @brief dlogits += dloss * (probs - onehot(targets)). */
inline void softmax_crossentropy_backward(float* dlogits, const float* probs, const int* targets, float dloss,
                                          std::size_t N, std::size_t V, cudaStream_t s = nullptr) {
  detail::softmax_crossentropy_backward_kernel<<<detail::grid_for(N * V), detail::block_size, 0, s>>>(
      dlogits, probs, targets, dloss, N, static_cast<int>(V));
}

}  // namespace gpt::cuda
