// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief CPU forward and backward of every layer of the GPT model, for float (training) and
 *         double (the reference path of the tests).
 *
 *  Conventions, the same for every kernel:
 *  - Plain pointers and sizes; tensors are row-major, activations [N, C] with N = B*T rows.
 *    Linear weights are stored [out, in], so a linear layer is y = x W^T + b.
 *  - Forward kernels overwrite their outputs.
 *  - Backward kernels ADD into every gradient they produce, inputs and parameters alike: that is
 *    what gradient accumulation and the tied token embedding need, and it lets the residual
 *    stream's gradient be accumulated in place. Callers zero scratch gradients before use.
 *  - No allocation; scratch is passed in.
 *  - Deterministic whatever the OpenMP thread count: every output element is written by one
 *    thread, and every reduction runs in a fixed order (column sums loop over rows in order, in
 *    the thread that owns the column). No atomics.
 *  - The float path of GELU, softmax + cross-entropy, LayerNorm and attention is vectorised
 *    (kernels_cpu_simd.inc, compiled for every ISA chunkstar knows and chosen at run time by
 *    chunkstar::active_cpu_isa()) and gives the same bits on every ISA; the double path (the tests'
 *    reference) is the plain scalar code below.
 */
#pragma once

#include <chunkstar/config.hpp>
#include <chunkstar/core/cpu_isa.hpp>
#include <chunkstar/core/simd_target.hpp>

#if !defined(GPT_BUILTIN_GEMM)
#include <cblas.h>
#endif

#include <algorithm>
#include <atomic>
#include <cassert>
#include <climits>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace gpt::cpu {

/** @brief The vector kernels of one ISA, specialised once per ISA inside its target region by
 *         kernels_cpu_simd.inc (see there for why every ISA gives the same bits). */
template <chunkstar::cpu_isa Isa>
struct simd_kernels;

}  // namespace gpt::cpu

#define CHUNKSTAR_SIMD_KERNELS "kernels_cpu_simd.inc"
#include <chunkstar/core/simd_foreach_isa.hpp>

namespace gpt::cpu {

/** @brief The scalar types the kernels are written for. */
template <class T>
concept scalar = std::same_as<T, float> || std::same_as<T, double>;

/** @brief Columns per task when a reduction over rows is split by column: wide enough for SIMD
 *         and a cache line, small enough to spread C = 64 over a few threads. */
inline constexpr std::size_t column_block = 16;

/** @brief Loops touching fewer elements than this run on one thread. Forking costs microseconds
 *         (far more on a busy machine); the split never changes results, only speed. */
inline constexpr std::size_t parallel_threshold = 4096;

/** @brief Zeroes @p n elements (scratch gradients before a backward kernel adds into them). */
template <scalar T>
void zero(T* p, std::size_t n) {
  std::fill(p, p + n, T(0));
}

// ---------------------------------------------------------------------------------------------
// BLAS: row-major GEMM, C = alpha op(A) op(B) + beta C, one overload per scalar type.
//
// One thread pool: the GEMMs run on the OpenMP threads that run every other kernel, each thread
// calling a single-threaded BLAS on its own block of rows of C. OpenBLAS's own thread pool
// (pthreads) is told to stay at one thread: two pools on the same cores wait and spin against
// each other (a third of the time on two cores, and 0.7x the speed without OMP_WAIT_POLICY=PASSIVE).
// The rows are split into blocks of a fixed height, whatever the number of threads, and each block
// is one BLAS call: a BLAS may pick its kernel (and so its rounding) by the shape of the call
// (OpenBLAS does on AMD Zen), so a split that followed the thread count changed the bits. With the
// split a function of the shape alone, every thread count gives the same bits (the thread-count
// test proves it).
namespace detail {

/** @brief Rows of C per BLAS call when a GEMM is split (a multiple of the micro-kernels' tile height). */
inline constexpr std::size_t gemm_rows_per_call = 128;
/** @brief GEMMs below this many multiply-adds run on the calling thread. */
inline constexpr std::size_t gemm_parallel_min = std::size_t{1} << 18;

inline int blas_int(std::size_t n) {
  assert(n <= static_cast<std::size_t>(INT_MAX) && "matrix dimension too large for 32-bit BLAS");
  return static_cast<int>(n);
}

/** @brief Makes the BLAS single-threaded, once (only OpenBLAS has a pool of its own to stop). */
inline void blas_single_threaded() noexcept {
#if defined(OPENBLAS_VERSION)
  static const bool done = [] {
    openblas_set_num_threads(1);
    return true;
  }();
  (void)done;
#endif
}

#if defined(GPT_BUILTIN_GEMM)
/** @brief Without a CBLAS (GPT_BUILTIN_GEMM: a machine with no BLAS package, such as a GPU image
 *  that carries none): the plain triple loop, each C element summed over k in order in T. Slow,
 *  correct, the same bits on every machine; enough for the small models of the GPU check's CPU
 *  reference. */
template <scalar T>
void blas_gemm(bool ta, bool tb, std::size_t m, std::size_t n, std::size_t k, T alpha, const T* a, std::size_t lda,
               const T* b, std::size_t ldb, T beta, T* c, std::size_t ldc) {
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j) {
      T sum = 0;
      for (std::size_t p = 0; p < k; ++p)
        sum += (ta ? a[p * lda + i] : a[i * lda + p]) * (tb ? b[j * ldb + p] : b[p * ldb + j]);
      c[i * ldc + j] = alpha * sum + (beta == T(0) ? T(0) : beta * c[i * ldc + j]);
    }
}
#else
inline void blas_gemm(bool ta, bool tb, std::size_t m, std::size_t n, std::size_t k, float alpha, const float* a,
                      std::size_t lda, const float* b, std::size_t ldb, float beta, float* c, std::size_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, blas_int(m), blas_int(n),
              blas_int(k), alpha, a, blas_int(lda), b, blas_int(ldb), beta, c, blas_int(ldc));
}
inline void blas_gemm(bool ta, bool tb, std::size_t m, std::size_t n, std::size_t k, double alpha, const double* a,
                      std::size_t lda, const double* b, std::size_t ldb, double beta, double* c, std::size_t ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, blas_int(m), blas_int(n),
              blas_int(k), alpha, a, blas_int(lda), b, blas_int(ldb), beta, c, blas_int(ldc));
}
#endif

/** @brief C = alpha op(A) op(B) + beta C (row-major), rows of C split across the OpenMP threads. */
template <scalar T>
void gemm(bool ta, bool tb, std::size_t m, std::size_t n, std::size_t k, T alpha, const T* a, std::size_t lda,
          const T* b, std::size_t ldb, T beta, T* c, std::size_t ldc) {
  blas_single_threaded();
  const std::size_t calls = (m + gemm_rows_per_call - 1) / gemm_rows_per_call;
  if (calls <= 1 || m * n * k < gemm_parallel_min) {
    blas_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
#pragma omp parallel for schedule(static) if (!omp_in_parallel())
  for (std::size_t t = 0; t < calls; ++t) {
    const std::size_t r0 = t * gemm_rows_per_call, r1 = std::min(m, r0 + gemm_rows_per_call);
    // Row r of op(A) is row r of A (lda apart), or column r of A when A is transposed.
    const T* a_rows = ta ? a + r0 : a + r0 * lda;
    blas_gemm(ta, tb, r1 - r0, n, k, alpha, a_rows, lda, b, ldb, beta, c + r0 * ldc, ldc);
  }
}

/** @brief out[c] += sum over rows r of in[r, c], rows summed in order; parallel over column blocks. */
template <scalar T>
void add_column_sums(T* out, const T* in, std::size_t rows, std::size_t cols) {
  const std::size_t blocks = (cols + column_block - 1) / column_block;
#pragma omp parallel for schedule(static) if (rows * cols >= parallel_threshold)
  for (std::size_t blk = 0; blk < blocks; ++blk) {
    const std::size_t c0 = blk * column_block, c1 = std::min(cols, c0 + column_block);
    T acc[column_block] = {};
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t c = c0; c < c1; ++c) acc[c - c0] += in[r * cols + c];
    for (std::size_t c = c0; c < c1; ++c) out[c] += acc[c - c0];
  }
}
}  // namespace detail

/** @brief Makes every OpenMP thread call the BLAS at the same time, so that the BLAS maps a work
 *  buffer for each concurrent caller now. Call it before the model data is allocated: OpenBLAS
 *  maps a buffer per concurrent caller on first need and, when that mapping fails (an
 *  address-space limit the model data reached first), retries for ever instead of failing; after
 *  this it only reuses them. Every thread repeats its call until every thread has finished one, so
 *  each thread's first call overlaps another's, however late the threads start. */
inline void blas_warm_up() {
#if !defined(GPT_BUILTIN_GEMM)
  detail::blas_single_threaded();
  constexpr int n = 256;  // above OpenBLAS's small-matrix path, which maps no buffer
  std::atomic<int> done{0};
  int threads = 1;
#if defined(_OPENMP)
#pragma omp parallel
#endif
  {
#if defined(_OPENMP)
#pragma omp single
    threads = omp_get_num_threads();
#endif
    std::vector<float> a(n * n, 1.0f), c(n * n, 0.0f);
    bool counted = false;
    do {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, a.data(), n, 0.0f, c.data(),
                  n);
      if (!counted) done.fetch_add(1);
      counted = true;
    } while (done.load() < threads);
  }
#endif
}

// ---------------------------------------------------------------------------------------------
// Encoder: out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]

/** @brief Token plus position embedding. tokens: [B*T] ids in [0, V); out: [B, T, C]. */
template <scalar T>
void encoder_forward(T* out, const int* tokens, const T* wte, const T* wpe, std::size_t B, std::size_t Tn,
                     std::size_t C) {
#pragma omp parallel for schedule(static) if (B * Tn * C >= parallel_threshold)
  for (std::size_t bt = 0; bt < B * Tn; ++bt) {
    const T* e = wte + static_cast<std::size_t>(tokens[bt]) * C;
    const T* p = wpe + (bt % Tn) * C;
    for (std::size_t c = 0; c < C; ++c) out[bt * C + c] = e[c] + p[c];
  }
}

/** @brief dwte[tokens[b,t]] += dout[b,t]; dwpe[t] += sum_b dout[b,t]. Split by column so that
 *         positions sharing a token never race; each column sums positions in order. */
template <scalar T>
void encoder_backward(T* dwte, T* dwpe, const T* dout, const int* tokens, std::size_t B, std::size_t Tn,
                      std::size_t C) {
  const std::size_t blocks = (C + column_block - 1) / column_block;
#pragma omp parallel for schedule(static) if (B * Tn * C >= parallel_threshold)
  for (std::size_t blk = 0; blk < blocks; ++blk) {
    const std::size_t c0 = blk * column_block, c1 = std::min(C, c0 + column_block);
    for (std::size_t bt = 0; bt < B * Tn; ++bt) {
      T* e = dwte + static_cast<std::size_t>(tokens[bt]) * C;
      T* p = dwpe + (bt % Tn) * C;
      const T* d = dout + bt * C;
      for (std::size_t c = c0; c < c1; ++c) {
        e[c] += d[c];
        p[c] += d[c];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// LayerNorm over the last dimension, eps = 1e-5 as in GPT-2.

/** @brief LayerNorm's epsilon (GPT-2's value). */
inline constexpr double layernorm_eps = 1e-5;

/** @brief out = (inp - mean) * rstd * w + b per row; keeps mean and rstd [N] for the backward. */
template <scalar T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* w, const T* b, std::size_t N, std::size_t C) {
#pragma omp parallel for schedule(static) if (N * C >= parallel_threshold)
  for (std::size_t n = 0; n < N; ++n) {
    const T* x = inp + n * C;
    T m = 0;
    for (std::size_t c = 0; c < C; ++c) m += x[c];
    m /= static_cast<T>(C);
    T v = 0;  // two passes: the one-pass E[x^2]-m^2 cancels badly in float
    for (std::size_t c = 0; c < C; ++c) v += (x[c] - m) * (x[c] - m);
    v /= static_cast<T>(C);
    const T s = T(1) / std::sqrt(v + static_cast<T>(layernorm_eps));
    T* y = out + n * C;
    for (std::size_t c = 0; c < C; ++c) y[c] = (x[c] - m) * s * w[c] + b[c];
    mean[n] = m;
    rstd[n] = s;
  }
}

/** @brief dinp += ..., dw += sum_n dout * xhat, db += sum_n dout. Rows in parallel for dinp, then
 *         columns in parallel for dw/db so each parameter gradient sums rows in order. */
template <scalar T>
void layernorm_backward(T* dinp, T* dw, T* db, const T* dout, const T* inp, const T* w, const T* mean, const T* rstd,
                        std::size_t N, std::size_t C) {
#pragma omp parallel for schedule(static) if (N * C >= parallel_threshold)
  for (std::size_t n = 0; n < N; ++n) {
    const T* x = inp + n * C;
    const T* d = dout + n * C;
    const T m = mean[n], s = rstd[n];
    // d xhat = d * w; dx = s * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
    T sum_dxhat = 0, sum_dxhat_xhat = 0;
    for (std::size_t c = 0; c < C; ++c) {
      const T xhat = (x[c] - m) * s;
      const T dxhat = d[c] * w[c];
      sum_dxhat += dxhat;
      sum_dxhat_xhat += dxhat * xhat;
    }
    sum_dxhat /= static_cast<T>(C);
    sum_dxhat_xhat /= static_cast<T>(C);
    T* dx = dinp + n * C;
    for (std::size_t c = 0; c < C; ++c) {
      const T xhat = (x[c] - m) * s;
      dx[c] += s * (d[c] * w[c] - sum_dxhat - xhat * sum_dxhat_xhat);
    }
  }
  const std::size_t blocks = (C + column_block - 1) / column_block;
#pragma omp parallel for schedule(static) if (N * C >= parallel_threshold)
  for (std::size_t blk = 0; blk < blocks; ++blk) {
    const std::size_t c0 = blk * column_block, c1 = std::min(C, c0 + column_block);
    for (std::size_t n = 0; n < N; ++n) {
      const T* x = inp + n * C;
      const T* d = dout + n * C;
      for (std::size_t c = c0; c < c1; ++c) {
        dw[c] += d[c] * (x[c] - mean[n]) * rstd[n];
        db[c] += d[c];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Linear layer: out[N, OC] = inp[N, C] W[OC, C]^T + bias[OC]. GEMMs through BLAS, on the
// OpenMP threads (detail::gemm; called outside any OpenMP region).

/** @brief out = inp W^T + bias (bias may be null: the tied LM head has none). */
template <scalar T>
void matmul_forward(T* out, const T* inp, const T* weight, const T* bias, std::size_t N, std::size_t C,
                    std::size_t OC) {
  if (bias) {
#pragma omp parallel for schedule(static) if (N * OC >= parallel_threshold)
    for (std::size_t n = 0; n < N; ++n) std::copy(bias, bias + OC, out + n * OC);
  }
  detail::gemm(false, true, N, OC, C, T(1), inp, C, weight, C, bias ? T(1) : T(0), out, OC);
}

/** @brief dinp += dout W; dweight += dout^T inp; dbias += column sums of dout (null: no bias).
 *         dinp may be null when the input needs no gradient. */
template <scalar T>
void matmul_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight, std::size_t N,
                     std::size_t C, std::size_t OC) {
  if (dinp) detail::gemm(false, false, N, C, OC, T(1), dout, OC, weight, C, T(1), dinp, C);
  detail::gemm(true, false, OC, C, N, T(1), dout, OC, inp, C, T(1), dweight, C);
  if (dbias) detail::add_column_sums(dbias, dout, N, OC);
}

// ---------------------------------------------------------------------------------------------
// Causal multi-head self-attention. qkv: [B, T, 3C] holding q | k | v per position, head h using
// channels [h*hs, (h+1)*hs) of each; out: [B, T, C]; att: [B, NH, T, T] softmax probabilities
// (zero above the diagonal), kept for the backward. Scores are scaled by 1/sqrt(hs).

/** @brief Forward; one task per (b, t, h), each writing its own att row and output slice. Tasks
 *         are dealt round-robin because their cost grows with t. */
template <scalar T>
void attention_forward(T* out, T* att, const T* qkv, std::size_t B, std::size_t Tn, std::size_t C, std::size_t NH) {
  const std::size_t hs = C / NH, C3 = 3 * C;
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
#pragma omp parallel for collapse(3) schedule(static, 1) if (B * NH * Tn * Tn * hs >= parallel_threshold)
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t t = 0; t < Tn; ++t)
      for (std::size_t h = 0; h < NH; ++h) {
        const T* q = qkv + (b * Tn + t) * C3 + h * hs;
        T* a = att + ((b * NH + h) * Tn + t) * Tn;
        T mx = -INFINITY;
        for (std::size_t t2 = 0; t2 <= t; ++t2) {
          const T* k = qkv + (b * Tn + t2) * C3 + C + h * hs;
          T s = 0;
          for (std::size_t i = 0; i < hs; ++i) s += q[i] * k[i];
          a[t2] = s * scale;
          mx = std::max(mx, a[t2]);
        }
        T sum = 0;  // subtract the row max so exp never overflows
        for (std::size_t t2 = 0; t2 <= t; ++t2) {
          a[t2] = std::exp(a[t2] - mx);
          sum += a[t2];
        }
        const T inv = T(1) / sum;
        for (std::size_t t2 = 0; t2 <= t; ++t2) a[t2] *= inv;
        for (std::size_t t2 = t + 1; t2 < Tn; ++t2) a[t2] = 0;
        T* o = out + (b * Tn + t) * C + h * hs;
        for (std::size_t i = 0; i < hs; ++i) o[i] = 0;
        for (std::size_t t2 = 0; t2 <= t; ++t2) {
          const T* v = qkv + (b * Tn + t2) * C3 + 2 * C + h * hs;
          for (std::size_t i = 0; i < hs; ++i) o[i] += a[t2] * v[i];
        }
      }
}

/** @brief dqkv += ... from dout. One task per (b, h): a query at t sends gradient to the keys
 *         and values of every t2 <= t, so splitting by t would race; a head owns its slices.
 *         scratch: [B * NH * T], one row of d(att) per task. */
template <scalar T>
void attention_backward(T* dqkv, T* scratch, const T* dout, const T* qkv, const T* att, std::size_t B, std::size_t Tn,
                        std::size_t C, std::size_t NH) {
  const std::size_t hs = C / NH, C3 = 3 * C;
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
#pragma omp parallel for collapse(2) schedule(static) if (B * NH * Tn * Tn * hs >= parallel_threshold)
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t h = 0; h < NH; ++h) {
      T* datt = scratch + (b * NH + h) * Tn;
      for (std::size_t t = 0; t < Tn; ++t) {
        const T* a = att + ((b * NH + h) * Tn + t) * Tn;
        const T* d = dout + (b * Tn + t) * C + h * hs;
        // out[t] = sum_t2 a[t2] v[t2]  =>  datt[t2] = d . v[t2],  dv[t2] += a[t2] d
        for (std::size_t t2 = 0; t2 <= t; ++t2) {
          const T* v = qkv + (b * Tn + t2) * C3 + 2 * C + h * hs;
          T* dv = dqkv + (b * Tn + t2) * C3 + 2 * C + h * hs;
          T s = 0;
          for (std::size_t i = 0; i < hs; ++i) {
            s += d[i] * v[i];
            dv[i] += a[t2] * d[i];
          }
          datt[t2] = s;
        }
        // softmax: dscore[t2] = a[t2] (datt[t2] - sum_t3 a[t3] datt[t3])
        T dot = 0;
        for (std::size_t t2 = 0; t2 <= t; ++t2) dot += a[t2] * datt[t2];
        const T* q = qkv + (b * Tn + t) * C3 + h * hs;
        T* dq = dqkv + (b * Tn + t) * C3 + h * hs;
        for (std::size_t t2 = 0; t2 <= t; ++t2) {
          const T ds = a[t2] * (datt[t2] - dot) * scale;
          const T* k = qkv + (b * Tn + t2) * C3 + C + h * hs;
          T* dk = dqkv + (b * Tn + t2) * C3 + C + h * hs;
          for (std::size_t i = 0; i < hs; ++i) {
            dq[i] += ds * k[i];
            dk[i] += ds * q[i];
          }
        }
      }
    }
}

// ---------------------------------------------------------------------------------------------
// GELU, tanh approximation (GPT-2's): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).

/** @brief out = gelu(inp), @p n elements. */
template <scalar T>
void gelu_forward(T* out, const T* inp, std::size_t n) {
  const T k = static_cast<T>(0.79788456080286535588);  // sqrt(2/pi)
#pragma omp parallel for schedule(static) if (n >= parallel_threshold)
  for (std::size_t i = 0; i < n; ++i) {
    const T x = inp[i];
    out[i] = T(0.5) * x * (T(1) + std::tanh(k * (x + T(0.044715) * x * x * x)));
  }
}

/** @brief dinp += gelu'(inp) * dout. */
template <scalar T>
void gelu_backward(T* dinp, const T* inp, const T* dout, std::size_t n) {
  const T k = static_cast<T>(0.79788456080286535588);
#pragma omp parallel for schedule(static) if (n >= parallel_threshold)
  for (std::size_t i = 0; i < n; ++i) {
    const T x = inp[i];
    const T th = std::tanh(k * (x + T(0.044715) * x * x * x));
    const T dth = (T(1) - th * th) * k * (T(1) + T(3) * T(0.044715) * x * x);
    dinp[i] += (T(0.5) * (T(1) + th) + T(0.5) * x * dth) * dout[i];
  }
}

// ---------------------------------------------------------------------------------------------
// Residual connection: out = a + b.

/** @brief out = a + b, @p n elements. */
template <scalar T>
void residual_forward(T* out, const T* a, const T* b, std::size_t n) {
#pragma omp parallel for schedule(static) if (n >= parallel_threshold)
  for (std::size_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

/** @brief da += dout; db += dout. (The model adds in place into one residual-stream gradient
 *         instead, which is the same thing without the copies.) */
template <scalar T>
void residual_backward(T* da, T* db, const T* dout, std::size_t n) {
#pragma omp parallel for schedule(static) if (n >= parallel_threshold)
  for (std::size_t i = 0; i < n; ++i) {
    da[i] += dout[i];
    db[i] += dout[i];
  }
}

// ---------------------------------------------------------------------------------------------
// Softmax + cross-entropy over the vocabulary, fused: one pass over each row of logits gives the
// probabilities and the loss. The LM head's logits come from matmul_forward with W = wte, no bias.

/** @brief probs[n, :] = softmax(logits[n, :]); losses[n] = -log probs[n, targets[n]], computed as
 *         log-sum-exp minus the target logit so a tiny probability does not lose its digits. */
template <scalar T>
void softmax_crossentropy_forward(T* probs, T* losses, const T* logits, const int* targets, std::size_t N,
                                  std::size_t V) {
#pragma omp parallel for schedule(static) if (N * V >= parallel_threshold)
  for (std::size_t n = 0; n < N; ++n) {
    const T* z = logits + n * V;
    T* p = probs + n * V;
    T mx = z[0];
    for (std::size_t v = 1; v < V; ++v) mx = std::max(mx, z[v]);
    T sum = 0;
    for (std::size_t v = 0; v < V; ++v) {
      p[v] = std::exp(z[v] - mx);
      sum += p[v];
    }
    const T inv = T(1) / sum;
    for (std::size_t v = 0; v < V; ++v) p[v] *= inv;
    // (mx - z_target) first: adding log(sum) to a large mx would round it at mx's ulp
    losses[n] = std::log(sum) + (mx - z[static_cast<std::size_t>(targets[n])]);
  }
}

/** @brief dlogits += dloss * (probs - onehot(targets)): the gradient of dloss * sum_n losses[n].
 *         The model passes dloss = 1/(B*T) because its loss is the mean. */
template <scalar T>
void softmax_crossentropy_backward(T* dlogits, const T* probs, const int* targets, T dloss, std::size_t N,
                                   std::size_t V) {
#pragma omp parallel for schedule(static) if (N * V >= parallel_threshold)
  for (std::size_t n = 0; n < N; ++n) {
    const T* p = probs + n * V;
    T* d = dlogits + n * V;
    const std::size_t y = static_cast<std::size_t>(targets[n]);
    for (std::size_t v = 0; v < V; ++v) d[v] += dloss * (p[v] - (v == y ? T(1) : T(0)));
  }
}

/** @brief Mean of @p n losses, summed in order in double (the same number whatever the threads). */
template <scalar T>
double mean_loss(const T* losses, std::size_t n) {
  double s = 0;
  for (std::size_t i = 0; i < n; ++i) s += static_cast<double>(losses[i]);
  return s / static_cast<double>(n);
}

// ---------------------------------------------------------------------------------------------
// The float kernels that have vector versions: the same contracts as the templates above, on the
// ISA chunkstar::active_cpu_isa() names (overload resolution prefers these for float).

/** @brief Elements per task of the element-wise vector kernels (a multiple of 16). */
inline constexpr std::size_t elementwise_block = 4096;

namespace detail {
/** Runs @p body(kernels) with the kernels of the active ISA. */
template <class Body>
void with_simd_kernels(Body&& body) {
  chunkstar::with_cpu_isa(chunkstar::active_cpu_isa(), [&](auto isa) { body(simd_kernels<isa()>{}); });
}
}  // namespace detail

inline void gelu_forward(float* out, const float* inp, std::size_t n) {
  detail::with_simd_kernels([&](auto k) {
    const std::size_t blocks = (n + elementwise_block - 1) / elementwise_block;
#pragma omp parallel for schedule(static) if (n >= parallel_threshold)
    for (std::size_t blk = 0; blk < blocks; ++blk) {
      const std::size_t b = blk * elementwise_block;
      k.gelu_forward(out + b, inp + b, std::min(n, b + elementwise_block) - b);
    }
  });
}

inline void gelu_backward(float* dinp, const float* inp, const float* dout, std::size_t n) {
  detail::with_simd_kernels([&](auto k) {
    const std::size_t blocks = (n + elementwise_block - 1) / elementwise_block;
#pragma omp parallel for schedule(static) if (n >= parallel_threshold)
    for (std::size_t blk = 0; blk < blocks; ++blk) {
      const std::size_t b = blk * elementwise_block;
      k.gelu_backward(dinp + b, inp + b, dout + b, std::min(n, b + elementwise_block) - b);
    }
  });
}

inline void softmax_crossentropy_forward(float* probs, float* losses, const float* logits, const int* targets,
                                         std::size_t N, std::size_t V) {
  detail::with_simd_kernels([&](auto k) {
#pragma omp parallel for schedule(static) if (N * V >= parallel_threshold)
    for (std::size_t n = 0; n < N; ++n) {
      const float* z = logits + n * V;
      float mx, sum;
      k.softmax(probs + n * V, z, V, mx, sum);
      losses[n] = std::log(sum) + (mx - z[static_cast<std::size_t>(targets[n])]);
    }
  });
}

inline void softmax_crossentropy_backward(float* dlogits, const float* probs, const int* targets, float dloss,
                                          std::size_t N, std::size_t V) {
  detail::with_simd_kernels([&](auto k) {
#pragma omp parallel for schedule(static) if (N * V >= parallel_threshold)
    for (std::size_t n = 0; n < N; ++n)
      k.softmax_xent_backward(dlogits + n * V, probs + n * V, V, static_cast<std::size_t>(targets[n]), dloss);
  });
}

inline void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* w, const float* b,
                              std::size_t N, std::size_t C) {
  detail::with_simd_kernels([&](auto k) {
#pragma omp parallel for schedule(static) if (N * C >= parallel_threshold)
    for (std::size_t n = 0; n < N; ++n)
      k.layernorm_forward_row(out + n * C, mean[n], rstd[n], inp + n * C, w, b, C, static_cast<float>(layernorm_eps));
  });
}

inline void layernorm_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp, const float* w,
                               const float* mean, const float* rstd, std::size_t N, std::size_t C) {
  detail::with_simd_kernels([&](auto k) {
#pragma omp parallel for schedule(static) if (N * C >= parallel_threshold)
    for (std::size_t n = 0; n < N; ++n)
      k.layernorm_backward_row(dinp + n * C, dout + n * C, inp + n * C, w, mean[n], rstd[n], C);
    const std::size_t blocks = (C + column_block - 1) / column_block;
#pragma omp parallel for schedule(static) if (N * C >= parallel_threshold)
    for (std::size_t blk = 0; blk < blocks; ++blk)
      k.layernorm_param_grads(dw, db, dout, inp, mean, rstd, N, C, blk * column_block,
                              std::min(C, (blk + 1) * column_block));
  });
}

inline void attention_forward(float* out, float* att, const float* qkv, std::size_t B, std::size_t Tn, std::size_t C,
                              std::size_t NH) {
  const std::size_t hs = C / NH, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  detail::with_simd_kernels([&](auto k) {
#pragma omp parallel for collapse(3) schedule(static, 1) if (B * NH * Tn * Tn * hs >= parallel_threshold)
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t t = 0; t < Tn; ++t)
        for (std::size_t h = 0; h < NH; ++h) {
          const float* seq = qkv + b * Tn * C3 + h * hs;
          k.attention_forward_row(out + (b * Tn + t) * C + h * hs, att + ((b * NH + h) * Tn + t) * Tn, seq + t * C3,
                                  seq + C, seq + 2 * C, C3, t, Tn, hs, scale);
        }
  });
}

inline void attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv, const float* att,
                               std::size_t B, std::size_t Tn, std::size_t C, std::size_t NH) {
  const std::size_t hs = C / NH, C3 = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  detail::with_simd_kernels([&](auto k) {
#pragma omp parallel for collapse(2) schedule(static) if (B * NH * Tn * Tn * hs >= parallel_threshold)
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t h = 0; h < NH; ++h) {
        const std::size_t off = b * Tn * C3 + h * hs;
        k.attention_backward_head(dqkv + off, dqkv + off + C, dqkv + off + 2 * C, scratch + (b * NH + h) * Tn,
                                  dout + b * Tn * C + h * hs, C, qkv + off, qkv + off + C, qkv + off + 2 * C,
                                  att + (b * NH + h) * Tn * Tn, C3, Tn, hs, scale);
      }
  });
}

}  // namespace gpt::cpu
