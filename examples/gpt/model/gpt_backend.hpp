// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Where chunked_gpt's layers run: a kernel backend. `cpu_backend` (here) runs the CPU
 *         kernels of gpt_model.hpp on host memory; `cuda_backend` (gpt_backend_cuda.hpp) runs the
 *         CUDA kernels and cuBLAS on one stream of a GPU.
 *
 *  A backend is the mechanism only: chunked_gpt decides which stage runs in which scope and when a
 *  buffer may be freed, and tells the backend. The contract, for a backend `b` (see GptBackend):
 *  - `b.stream()` is where the kernels run; chunked_gpt closes every scope with it, so the runtime
 *    orders later moves of the scope's chunks after those kernels (the runtime's stream contract).
 *  - Kernels may still be running when a call returns. `b.quiesce()` returns once they all have
 *    finished: chunked_gpt calls it before it frees compute-tier memory the kernels used (the
 *    runtime may hand that memory to an arriving chunk at once) and before reading a result.
 *  - `host_memory`: whether the compute tier is host memory (then tokens are read in place).
 *  - `to_compute`, `from_compute` copy between host memory and compute-tier memory, ordered with
 *    the kernels on the stream; `from_compute` returns once the bytes have arrived.
 *  - `scratch_elems(c, B, T)` floats of compute-tier scratch the backend needs beside gpt_model's
 *    activation_sizes (attention's per-head copies on CUDA; none on the CPU), passed to the block
 *    kernels; chunked_gpt allocates it for a forward and keeps it through the backward.
 *
 *  RTP composes sub-blocks on shards, so it needs the layers one at a time: `LayerBackend` adds
 *  them (and compute-tier allocation, copies and sums) for rtp_block, `RtpBackend` the tied
 *  embedding and head on vocabulary shards for rtp_gpt. `backend_tier` makes a backend's memory a
 *  host shard store's compute tier.
 */
#pragma once

#include "gpt_model.hpp"

#include <chunkstar/core/dtype.hpp>
#include <chunkstar/memory/copy_engine.hpp>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstring>
#include <span>

namespace gpt {

/** @brief What chunked_gpt needs of a kernel backend. */
template <class B>
concept GptBackend = std::movable<B> &&
    requires(B& b, const gpt_config& c, std::size_t n, float* f, const float* cf, const int* tok, std::byte* bytes,
             const std::byte* cbytes, chunkstar::dtype t, const block_params<float>& p,
             const block_activations<float>& a, const head_activations<float>& h, const backward_workspace<float>& w) {
  typename B::stream_type;
  { B::host_memory } -> std::convertible_to<bool>;
  { b.stream() } -> std::convertible_to<typename B::stream_type>;
  { B::scratch_elems(c, n, n) } -> std::same_as<std::size_t>;
  b.quiesce();
  b.to_compute(f, cf, n);
  b.from_compute(f, cf, n);
  b.zero(f, n);
  b.widen(cbytes, t, f, n);
  b.add_into(bytes, t, cf, n);
  b.embedding_forward(c, n, n, tok, cf, cf, f);
  b.block_forward(c, n, n, p, cf, a, f, f);
  { b.head_forward(c, n, n, cf, cf, cf, cf, h, tok) } -> std::same_as<double>;
  b.head_backward(c, n, n, cf, cf, cf, h, tok, f, f, f, w, 1.0f);
  b.block_backward(c, n, n, p, p, cf, a, w, f);
  b.embedding_backward(c, n, n, tok, f, f, w);
};

/** @brief The CPU kernels of gpt_model.hpp, on host memory (the simulated device is host memory):
 *  every call has finished when it returns, and copies are memcpy. */
struct cpu_backend {
  using stream_type = chunkstar::host_stream;
  /** The compute tier is host memory: the kernels read the caller's tokens where they are. */
  static constexpr bool host_memory = true;
  [[nodiscard]] stream_type stream() const noexcept { return {}; }
  static std::size_t scratch_elems(const gpt_config&, std::size_t, std::size_t) noexcept { return 0; }
  void quiesce() const noexcept {}

  void to_compute(void* dst, const void* src, std::size_t bytes) const noexcept { std::memcpy(dst, src, bytes); }
  void from_compute(void* dst, const void* src, std::size_t bytes) const noexcept { std::memcpy(dst, src, bytes); }
  void zero(float* p, std::size_t n) const noexcept { std::memset(p, 0, n * sizeof(float)); }
  /** dst = float(src) for @p n elements of 16-bit type @p t. */
  void widen(const std::byte* src, chunkstar::dtype t, float* dst, std::size_t n) const noexcept {
    chunkstar::widen_to_float(src, t, {dst, n});
  }
  /** dst16 = round(float(dst16) + add) for @p n elements, in blocks through the vectorised conversions. */
  void add_into(std::byte* dst16, chunkstar::dtype t, const float* add, std::size_t n) const noexcept {
    constexpr std::size_t block = 2048;
    float sum[block];
    const std::size_t width = chunkstar::dtype_size(t);
    for (std::size_t off = 0; off < n; off += block) {
      const std::size_t len = std::min(block, n - off);
      chunkstar::widen_to_float(dst16 + off * width, t, {sum, len});
      for (std::size_t k = 0; k < len; ++k) sum[k] += add[off + k];
      chunkstar::narrow_from_float({sum, len}, t, dst16 + off * width);
    }
  }

  void embedding_forward(const gpt_config& c, std::size_t B, std::size_t T, const int* tokens, const float* wte,
                         const float* wpe, float* out) const {
    gpt::embedding_forward<float>(c, B, T, tokens, wte, wpe, out);
  }
  void block_forward(const gpt_config& c, std::size_t B, std::size_t T, const block_params<float>& p, const float* x,
                     const block_activations<float>& a, float* proj, float* /*scratch*/) const {
    gpt::block_forward<float>(c, B, T, p, x, a, proj);
  }
  double head_forward(const gpt_config& c, std::size_t B, std::size_t T, const float* wte, const float* lnf_w,
                      const float* lnf_b, const float* x, const head_activations<float>& h, const int* targets) const {
    return gpt::head_forward<float>(c, B, T, wte, lnf_w, lnf_b, x, h, targets);
  }
  void head_backward(const gpt_config& c, std::size_t B, std::size_t T, const float* wte, const float* lnf_w,
                     const float* x, const head_activations<float>& h, const int* targets, float* g_wte, float* g_lnf_w,
                     float* g_lnf_b, const backward_workspace<float>& w, float loss_scale) const {
    gpt::head_backward<float>(c, B, T, wte, lnf_w, x, h, targets, g_wte, g_lnf_w, g_lnf_b, w, loss_scale);
  }
  void block_backward(const gpt_config& c, std::size_t B, std::size_t T, const block_params<float>& p,
                      const block_params<float>& g, const float* x, const block_activations<float>& a,
                      const backward_workspace<float>& w, float* /*scratch*/) const {
    gpt::block_backward<float>(c, B, T, p, g, x, a, w);
  }
  void embedding_backward(const gpt_config& c, std::size_t B, std::size_t T, const int* tokens, float* g_wte,
                          float* g_wpe, const backward_workspace<float>& w) const {
    gpt::embedding_backward<float>(c, B, T, tokens, g_wte, g_wpe, w);
  }

  // The layers one by one (LayerBackend): what rtp_block composes a sharded block from.
  [[nodiscard]] float* allocate(std::size_t n) const { return new float[n](); }
  void deallocate(float* p, std::size_t) const noexcept { delete[] p; }
  void copy(float* dst, const float* src, std::size_t n) const noexcept { std::memcpy(dst, src, n * sizeof(float)); }
  void add(float* acc, const float* x, std::size_t n) const noexcept {
    for (std::size_t i = 0; i < n; ++i) acc[i] += x[i];
  }
  void bias_residual(float* out, const float* residual, const float* bias, std::size_t rows,
                     std::size_t C) const noexcept {
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t c = 0; c < C; ++c) out[r * C + c] = residual[r * C + c] + (out[r * C + c] + bias[c]);
  }
  void add_column_sums(float* out, const float* in, std::size_t rows, std::size_t cols) const noexcept {
    cpu::detail::add_column_sums(out, in, rows, cols);
  }
  void layernorm_forward(float* out, float* mean, float* rstd, const float* x, const float* w, const float* b,
                         std::size_t N, std::size_t C) const {
    cpu::layernorm_forward(out, mean, rstd, x, w, b, N, C);
  }
  void layernorm_backward(float* dx, float* dw, float* db, const float* dout, const float* x, const float* w,
                          const float* mean, const float* rstd, std::size_t N, std::size_t C) const {
    cpu::layernorm_backward(dx, dw, db, dout, x, w, mean, rstd, N, C);
  }
  void matmul_forward(float* out, const float* x, const float* w, const float* bias, std::size_t N, std::size_t C,
                      std::size_t OC) const {
    cpu::matmul_forward(out, x, w, bias, N, C, OC);
  }
  void matmul_backward(float* dx, float* dw, float* dbias, const float* dout, const float* x, const float* w,
                       std::size_t N, std::size_t C, std::size_t OC) const {
    cpu::matmul_backward(dx, dw, dbias, dout, x, w, N, C, OC);
  }
  /** Floats of scratch attention_forward / attention_backward take for these shapes: d(att) rows. */
  static std::size_t attention_scratch_elems(std::size_t B, std::size_t T, std::size_t /*C*/, std::size_t NH) noexcept {
    return B * NH * T;
  }
  void attention_forward(float* out, float* att, const float* qkv, std::size_t B, std::size_t T, std::size_t C,
                         std::size_t NH, float* /*scratch*/) const {
    cpu::attention_forward(out, att, qkv, B, T, C, NH);
  }
  void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att, std::size_t B,
                          std::size_t T, std::size_t C, std::size_t NH, float* scratch) const {
    cpu::attention_backward(dqkv, scratch, dout, qkv, att, B, T, C, NH);
  }
  void gelu_forward(float* out, const float* x, std::size_t n) const { cpu::gelu_forward(out, x, n); }
  void gelu_backward(float* dx, const float* x, const float* dout, std::size_t n) const {
    cpu::gelu_backward(dx, x, dout, n);
  }

  // The tied embedding and head on vocabulary shards (RtpBackend): rows [v0, v0 + vs) of wte.
  void fill(float* p, std::size_t n, float value) const noexcept { std::fill(p, p + n, value); }
  /** out[n] = shard[tokens[n] - v0] + wpe[n % Tn] for the tokens the shard holds. */
  void embedding_shard_forward(float* out, const int* tokens, const float* shard, std::size_t v0, std::size_t vs,
                               const float* wpe, std::size_t N, std::size_t Tn, std::size_t C) const noexcept {
    for (std::size_t n = 0; n < N; ++n) {
      const auto t = static_cast<std::size_t>(tokens[n]);
      if (t < v0 || t >= v0 + vs) continue;
      const float* row = shard + (t - v0) * C;
      const float* pos = wpe + (n % Tn) * C;
      float* out_row = out + n * C;
      for (std::size_t k = 0; k < C; ++k) out_row[k] = row[k] + pos[k];
    }
  }
  /** g[tokens[n] - v0] += dres[n] for the tokens the shard holds, in token order. */
  void embedding_shard_backward(float* g, const int* tokens, const float* dres, std::size_t v0, std::size_t vs,
                                std::size_t N, std::size_t C) const noexcept {
    for (std::size_t n = 0; n < N; ++n) {
      const auto t = static_cast<std::size_t>(tokens[n]);
      if (t < v0 || t >= v0 + vs) continue;
      const float* d = dres + n * C;
      float* gr = g + (t - v0) * C;
      for (std::size_t k = 0; k < C; ++k) gr[k] += d[k];
    }
  }
  /** g_wpe[n % Tn] += dres[n], in token order. */
  void position_backward(float* g_wpe, const float* dres, std::size_t N, std::size_t Tn, std::size_t C) const noexcept {
    for (std::size_t n = 0; n < N; ++n) {
      const float* d = dres + n * C;
      float* gp = g_wpe + (n % Tn) * C;
      for (std::size_t k = 0; k < C; ++k) gp[k] += d[k];
    }
  }
  /** Folds one shard's logits z [N, vs] (the first @p valid columns are words) into a running
   *  maximum @p mx and sum of exponentials @p sum per token (the online softmax), and takes the
   *  target's logit into @p zt where the shard holds it. */
  void head_shard_forward(float* mx, float* sum, float* zt, const float* z, const int* targets, std::size_t v0,
                          std::size_t valid, std::size_t N, std::size_t vs) const noexcept {
    for (std::size_t n = 0; n < N; ++n) {
      const float* row = z + n * vs;
      const float m = std::max(mx[n], *std::max_element(row, row + valid));
      float acc = sum[n] * std::exp(mx[n] - m);  // 0 on the first shard (exp(-inf) = 0)
      for (std::size_t v = 0; v < valid; ++v) acc += std::exp(row[v] - m);
      mx[n] = m;
      sum[n] = acc;
      const auto t = static_cast<std::size_t>(targets[n]);
      if (t >= v0 && t < v0 + valid) zt[n] = row[t - v0];
    }
  }
  /** In place: lse = mx + log(sum) (over @p mx), losses = log(sum) + (mx - zt) (over @p sum). */
  void head_losses(float* mx_lse, float* sum_losses, const float* zt, std::size_t N) const noexcept {
    for (std::size_t n = 0; n < N; ++n) {
      const float m = mx_lse[n], l = std::log(sum_losses[n]);
      mx_lse[n] = m + l;
      sum_losses[n] = l + (m - zt[n]);
    }
  }
  /** z [N, vs] (one shard's logits) becomes their gradient: dloss softmax, minus dloss at the
   *  target, 0 on padding columns. */
  void head_shard_backward(float* z, const float* lse, const int* targets, float dloss, std::size_t v0,
                           std::size_t valid, std::size_t N, std::size_t vs) const noexcept {
    for (std::size_t n = 0; n < N; ++n) {
      float* row = z + n * vs;
      for (std::size_t v = 0; v < vs; ++v) row[v] = v < valid ? dloss * std::exp(row[v] - lse[n]) : 0.0f;
      const auto t = static_cast<std::size_t>(targets[n]);
      if (t >= v0 && t < v0 + valid) row[t - v0] -= dloss;
    }
  }
};

static_assert(GptBackend<cpu_backend>);

/** @brief A backend that also runs the layers one at a time, on compute-tier buffers it allocates
 *  (what rtp_block needs: it composes a block from sub-layers on shards). Same conventions as
 *  kernels_cpu.hpp: forward kernels overwrite, backward kernels add into every gradient; `add` sums
 *  in index order; `bias_residual(out, r, b, rows, C)` sets out = r + (out + b) per row. */
template <class B>
concept LayerBackend = GptBackend<B> && requires(B& b, std::size_t n, float* f, const float* cf) {
  { b.allocate(n) } -> std::same_as<float*>;
  b.deallocate(f, n);
  b.copy(f, cf, n);
  b.add(f, cf, n);
  b.bias_residual(f, cf, cf, n, n);
  b.add_column_sums(f, cf, n, n);
  b.layernorm_forward(f, f, f, cf, cf, cf, n, n);
  b.layernorm_backward(f, f, f, cf, cf, cf, cf, cf, n, n);
  b.matmul_forward(f, cf, cf, cf, n, n, n);
  b.matmul_backward(f, f, f, cf, cf, cf, n, n, n);
  { B::attention_scratch_elems(n, n, n, n) } -> std::same_as<std::size_t>;
  b.attention_forward(f, f, cf, n, n, n, n, f);
  b.attention_backward(f, cf, cf, cf, n, n, n, n, f);
  b.gelu_forward(f, cf, n);
  b.gelu_backward(f, cf, cf, n);
};

static_assert(LayerBackend<cpu_backend>);

/** @brief A layer backend that also runs the tied embedding and head on vocabulary shards (what
 *  rtp_gpt needs); cpu_backend's comments say what each call does. Token arrays are compute-tier
 *  memory too. */
template <class B>
concept RtpBackend = LayerBackend<B> && requires(B& b, std::size_t n, float* f, const float* cf, const int* tok) {
  b.fill(f, n, 0.0f);
  b.embedding_shard_forward(f, tok, cf, n, n, cf, n, n, n);
  b.embedding_shard_backward(f, tok, cf, n, n, n, n);
  b.position_backward(f, cf, n, n, n);
  b.head_shard_forward(f, f, f, cf, tok, n, n, n, n);
  b.head_losses(f, f, cf, n);
  b.head_shard_backward(f, cf, tok, 0.0f, n, n, n, n);
};

static_assert(RtpBackend<cpu_backend>);

/** @brief A backend's memory as a shard store's compute tier (rtp/shard_store.hpp `ComputeTier`):
 *  `basic_host_shard_store<backend_tier<B>>` keeps the shards in host memory and its transit
 *  buffers and activations where backend @p B computes. Holds the backend by pointer. */
template <LayerBackend Backend>
struct backend_tier {
  static constexpr bool host_memory = Backend::host_memory;
  Backend* backend = nullptr;
  [[nodiscard]] float* allocate(std::size_t n) const {
    float* p = backend->allocate(n);
    try {
      backend->zero(p, n);
    } catch (...) {
      backend->deallocate(p, n);
      throw;
    }
    return p;
  }
  void deallocate(float* p, std::size_t n) const noexcept { backend->deallocate(p, n); }
  void to_compute(void* dst, const void* src, std::size_t bytes) const { backend->to_compute(dst, src, bytes); }
  void from_compute(void* dst, const void* src, std::size_t bytes) const { backend->from_compute(dst, src, bytes); }
};

}  // namespace gpt
