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
 */
#pragma once

#include "gpt_model.hpp"

#include <chunkstar/core/dtype.hpp>
#include <chunkstar/memory/copy_engine.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstring>
#include <span>

namespace gpt {

/** @brief What chunked_gpt needs of a kernel backend. */
template <class B>
concept GptBackend = std::movable<B> && requires(B& b, const gpt_config& c, std::size_t n, float* f, const float* cf,
                                                 const int* tok, std::byte* bytes, const std::byte* cbytes,
                                                 chunkstar::dtype t, const block_params<float>& p,
                                                 const block_activations<float>& a,
                                                 const head_activations<float>& h,
                                                 const backward_workspace<float>& w) {
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
                     const float* x, const head_activations<float>& h, const int* targets, float* g_wte,
                     float* g_lnf_w, float* g_lnf_b, const backward_workspace<float>& w, float loss_scale) const {
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
};

static_assert(GptBackend<cpu_backend>);

}  // namespace gpt
