// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `rtp::VocabKernels`: the kernels of a vocabulary-parallel embedding and cross-entropy
 *         (rtp/vocab_parallel.hpp), and `rtp::cpu_vocab_kernels`, the host's.
 *
 *  A shard holds `vs` consecutive rows of the [V, C] embedding, words [v0, v0 + vs), of which the
 *  first `valid` are real words (the rest pad V to a multiple of the world size). Rows of the batch
 *  are tokens, `N` of them, with a width of `C`. Pointers are compute-tier memory (the kernels'
 *  own), `tokens` and `targets` ints there. Semantics:
 *  - `gather_rows(out, tokens, shard, v0, vs, positions, N, T, C)`: out[i] = shard[tokens[i] - v0]
 *    for every i whose token is in the shard (other rows untouched), plus positions[i mod T] when
 *    @p positions is not null (learned absolute positions, one rounding: the serial sum's bits).
 *  - `scatter_add_rows(gshard, tokens, dout, v0, vs, N, C)`: gshard[tokens[i] - v0] += dout[i] for
 *    those i, in increasing i (the order fixes the bits).
 *  - `logits(z, x, shard, N, C, vs)`: z [N, vs] = x [N, C] shard^T.
 *  - `logits_backward(dx, dshard, dz, x, shard, N, C, vs)`: dx += dz shard; dshard += dz^T x.
 *  - `softmax_fold(mx, sum, zt, z, targets, v0, valid, N, vs)`: the online softmax's step over one
 *    shard's logits: per row, the running maximum `mx` and the sum `sum` of exp(z - mx) take in
 *    columns [0, valid); `zt` takes the target's logit if the target is in the shard.
 *  - `finish_losses(mx, sum, zt, N)`: with l = log(sum), mx becomes the log-sum-exp mx + l and
 *    sum the loss l + (mx - zt).
 *  - `softmax_grad(z, lse, targets, scale, v0, valid, N, vs)`: z becomes scale exp(z - lse) in
 *    columns [0, valid), less scale at the target's, and 0 in the padding.
 *  - `fill(p, n, value)`; `from_compute(dst, src, bytes)` (to host memory, after the work that
 *    wrote it).
 *  Kernels may return before they finish if their memory's `BufferOps::settle` waits for them.
 */
#pragma once

#include <chunkstar/core/error.hpp>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace chunkstar::rtp {

/** @brief The kernels the vocabulary-parallel embedding and loss run on (see the file comment). */
template <class K>
concept VocabKernels = std::copy_constructible<K> &&
    requires(K& k, float* p, const float* c, const int* t, std::size_t n, float s) {
  k.gather_rows(p, t, c, n, n, c, n, n, n);
  k.scatter_add_rows(p, t, c, n, n, n, n);
  k.logits(p, c, c, n, n, n);
  k.logits_backward(p, p, c, c, c, n, n, n);
  k.softmax_fold(p, p, p, c, t, n, n, n, n);
  k.finish_losses(p, p, c, n);
  k.softmax_grad(p, c, t, s, n, n, n, n);
  k.fill(p, n, s);
  k.from_compute(static_cast<void*>(p), static_cast<const void*>(c), n);
};

/** @brief The host's kernels: loops over rows, OpenMP-parallel over independent rows or columns,
 *  each sum in a fixed order (the same bits with any number of threads). */
struct cpu_vocab_kernels {
  void gather_rows(float* out, const int* tokens, const float* shard, std::size_t v0, std::size_t vs,
                   const float* positions, std::size_t N, std::size_t T, std::size_t C) const {
    for (std::size_t i = 0; i < N; ++i) {
      const std::size_t r = row_of(tokens[i], v0, vs);
      if (r >= vs) continue;
      if (!positions) {
        std::memcpy(out + i * C, shard + r * C, C * sizeof(float));
        continue;
      }
      const float *row = shard + r * C, *pos = positions + (i % T) * C;
      for (std::size_t k = 0; k < C; ++k) out[i * C + k] = row[k] + pos[k];
    }
  }
  void scatter_add_rows(float* gshard, const int* tokens, const float* dout, std::size_t v0, std::size_t vs,
                        std::size_t N, std::size_t C) const {
    for (std::size_t i = 0; i < N; ++i) {
      const std::size_t r = row_of(tokens[i], v0, vs);
      if (r >= vs) continue;
      float* g = gshard + r * C;
      const float* d = dout + i * C;
      for (std::size_t k = 0; k < C; ++k) g[k] += d[k];
    }
  }
  void logits(float* z, const float* x, const float* shard, std::size_t N, std::size_t C, std::size_t vs) const {
    rows(N, [&](std::size_t i) {
      const float* xi = x + i * C;
      for (std::size_t v = 0; v < vs; ++v) z[i * vs + v] = dot(xi, shard + v * C, C);
    });
  }
  void logits_backward(float* dx, float* dshard, const float* dz, const float* x, const float* shard, std::size_t N,
                       std::size_t C, std::size_t vs) const {
    rows(N, [&](std::size_t i) {
      float* d = dx + i * C;
      for (std::size_t v = 0; v < vs; ++v) {
        const float g = dz[i * vs + v];
        const float* w = shard + v * C;
        for (std::size_t k = 0; k < C; ++k) d[k] += g * w[k];
      }
    });
    rows(vs, [&](std::size_t v) {
      float* d = dshard + v * C;
      for (std::size_t i = 0; i < N; ++i) {
        const float g = dz[i * vs + v];
        const float* xi = x + i * C;
        for (std::size_t k = 0; k < C; ++k) d[k] += g * xi[k];
      }
    });
  }
  void softmax_fold(float* mx, float* sum, float* zt, const float* z, const int* targets, std::size_t v0,
                    std::size_t valid, std::size_t N, std::size_t vs) const {
    if (valid == 0) return;  // a shard of padding only
    rows(N, [&](std::size_t i) {
      const float* zi = z + i * vs;
      const float m = std::max(mx[i], *std::max_element(zi, zi + valid));
      float s = sum[i] * std::exp(mx[i] - m);  // 0 while mx is -inf (no shard seen yet)
      for (std::size_t v = 0; v < valid; ++v) s += std::exp(zi[v] - m);
      mx[i] = m;
      sum[i] = s;
      const std::size_t r = row_of(targets[i], v0, valid);
      if (r < valid) zt[i] = zi[r];
    });
  }
  void finish_losses(float* mx, float* sum, const float* zt, std::size_t N) const {
    for (std::size_t i = 0; i < N; ++i) {
      const float m = mx[i], l = std::log(sum[i]);
      mx[i] = m + l;
      sum[i] = l + (m - zt[i]);
    }
  }
  void softmax_grad(float* z, const float* lse, const int* targets, float scale, std::size_t v0, std::size_t valid,
                    std::size_t N, std::size_t vs) const {
    rows(N, [&](std::size_t i) {
      float* zi = z + i * vs;
      const std::size_t r = row_of(targets[i], v0, valid);
      for (std::size_t v = 0; v < valid; ++v) zi[v] = scale * std::exp(zi[v] - lse[i]);
      std::fill(zi + valid, zi + vs, 0.0f);
      if (r < valid) zi[r] -= scale;
    });
  }
  void fill(float* p, std::size_t n, float value) const { std::fill(p, p + n, value); }
  void from_compute(void* dst, const void* src, std::size_t bytes) const { std::memcpy(dst, src, bytes); }

 private:
  /** The shard row of @p token, or @p vs if the shard does not hold it (negative ids included). */
  static std::size_t row_of(int token, std::size_t v0, std::size_t vs) noexcept {
    const auto t = static_cast<std::size_t>(static_cast<std::uint32_t>(token));
    return token >= 0 && t >= v0 && t - v0 < vs ? t - v0 : vs;
  }
  static float dot(const float* a, const float* b, std::size_t n) noexcept {
    float s = 0;
    for (std::size_t k = 0; k < n; ++k) s += a[k] * b[k];
    return s;
  }
  template <class F>
  static void rows(std::size_t n, F&& f) {
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (n >= 64)
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(n); ++i) f(static_cast<std::size_t>(i));
#else
    for (std::size_t i = 0; i < n; ++i) f(i);
#endif
  }
};

static_assert(VocabKernels<cpu_vocab_kernels>);

}  // namespace chunkstar::rtp
