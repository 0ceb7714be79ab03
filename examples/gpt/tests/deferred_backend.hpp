// SPDX-License-Identifier: Apache-2.0
// A test double of a device backend, for the CPU: the CPU kernels on a "stream" that runs nothing
// until it is waited for. Every kernel, fill, sum and copy is queued and runs in order at quiesce()
// (or when a result is read back with from_compute), as a CUDA stream's work may run any time
// before the wait, while a communicator reads and writes the buffers at once, from the host. So a
// missing wait (a shift, an all-reduce or a host read before the kernels that write its buffer
// ran) changes the bits: compared with the CPU backend, it shows. `deferred_backend(true)` is the
// faulty double that skips its waits (the comparison's teeth).
#pragma once

#include "gpt_backend.hpp"

#include <cstring>
#include <functional>
#include <memory>
#include <vector>

namespace gpt::testing {

/** The CPU kernels on a stream that runs its queue only when waited for (see the file comment). */
class deferred_backend {
 public:
  using stream_type = chunkstar::host_stream;
  static constexpr bool host_memory = false;  // the host reads results only through from_compute

  explicit deferred_backend(bool skip_waits = false) : s_(std::make_unique<state>()) { s_->skip_waits = skip_waits; }
  deferred_backend(deferred_backend&&) noexcept = default;
  deferred_backend& operator=(deferred_backend&&) noexcept = default;
  ~deferred_backend() {
    if (s_) drain();
  }

  [[nodiscard]] stream_type stream() const noexcept { return {}; }
  static std::size_t scratch_elems(const gpt::gpt_config&, std::size_t, std::size_t) noexcept { return 0; }
  /** Runs what is queued, unless this is the faulty double that skips its waits. */
  void quiesce() noexcept {
    if (!s_->skip_waits) drain();
  }

  /** The source is read now (it may be a temporary), the destination written when the queue runs. */
  void to_compute(void* dst, const void* src, std::size_t bytes) {
    auto copy = std::make_shared<std::vector<std::byte>>(static_cast<const std::byte*>(src),
                                                         static_cast<const std::byte*>(src) + bytes);
    queue([dst, copy] { std::memcpy(dst, copy->data(), copy->size()); });
  }
  /** Returns once the bytes are there: after everything queued before it. */
  void from_compute(void* dst, const void* src, std::size_t bytes) {
    drain();
    std::memcpy(dst, src, bytes);
  }
  void zero(float* p, std::size_t n) {
    queue([=] { gpt::cpu_backend{}.zero(p, n); });
  }
  void widen(const std::byte* src, chunkstar::dtype t, float* dst, std::size_t n) {
    queue([=] { gpt::cpu_backend{}.widen(src, t, dst, n); });
  }
  void add_into(std::byte* dst, chunkstar::dtype t, const float* add, std::size_t n) {
    queue([=] { gpt::cpu_backend{}.add_into(dst, t, add, n); });
  }
  void embedding_forward(const gpt::gpt_config& c, std::size_t B, std::size_t T, const int* tok, const float* wte,
                         const float* wpe, float* out) {
    queue([=] { gpt::cpu_backend{}.embedding_forward(c, B, T, tok, wte, wpe, out); });
  }
  void block_forward(const gpt::gpt_config& c, std::size_t B, std::size_t T, const gpt::block_params<float>& p,
                     const float* x, const gpt::block_activations<float>& a, float* proj, float* scratch) {
    queue([=] { gpt::cpu_backend{}.block_forward(c, B, T, p, x, a, proj, scratch); });
  }
  double head_forward(const gpt::gpt_config& c, std::size_t B, std::size_t T, const float* wte, const float* lw,
                      const float* lb, const float* x, const gpt::head_activations<float>& h, const int* tg) {
    drain();
    return cpu.head_forward(c, B, T, wte, lw, lb, x, h, tg);
  }
  void head_backward(const gpt::gpt_config& c, std::size_t B, std::size_t T, const float* wte, const float* lw,
                     const float* x, const gpt::head_activations<float>& h, const int* tg, float* gw, float* glw,
                     float* glb, const gpt::backward_workspace<float>& w, float scale) {
    queue([=] { gpt::cpu_backend{}.head_backward(c, B, T, wte, lw, x, h, tg, gw, glw, glb, w, scale); });
  }
  void block_backward(const gpt::gpt_config& c, std::size_t B, std::size_t T, const gpt::block_params<float>& p,
                      const gpt::block_params<float>& g, const float* x, const gpt::block_activations<float>& a,
                      const gpt::backward_workspace<float>& w, float* scratch) {
    queue([=] { gpt::cpu_backend{}.block_backward(c, B, T, p, g, x, a, w, scratch); });
  }
  void embedding_backward(const gpt::gpt_config& c, std::size_t B, std::size_t T, const int* tok, float* gw, float* gp,
                          const gpt::backward_workspace<float>& w) {
    queue([=] { gpt::cpu_backend{}.embedding_backward(c, B, T, tok, gw, gp, w); });
  }

  // The layers one by one.
  [[nodiscard]] float* allocate(std::size_t n) { return cpu.allocate(n); }
  /** As cudaFree: waits for the device first (always: memory in use must never be freed). */
  void deallocate(float* p, std::size_t n) noexcept {
    drain();
    cpu.deallocate(p, n);
  }
  void copy(float* d, const float* s, std::size_t n) {
    queue([=] { gpt::cpu_backend{}.copy(d, s, n); });
  }
  void add(float* acc, const float* x, std::size_t n) {
    queue([=] { gpt::cpu_backend{}.add(acc, x, n); });
  }
  void bias_residual(float* out, const float* r, const float* bias, std::size_t rows, std::size_t C) {
    queue([=] { gpt::cpu_backend{}.bias_residual(out, r, bias, rows, C); });
  }
  void add_column_sums(float* out, const float* in, std::size_t rows, std::size_t cols) {
    queue([=] { gpt::cpu_backend{}.add_column_sums(out, in, rows, cols); });
  }
  void layernorm_forward(float* out, float* mean, float* rstd, const float* x, const float* w, const float* b,
                         std::size_t N, std::size_t C) {
    queue([=] { gpt::cpu_backend{}.layernorm_forward(out, mean, rstd, x, w, b, N, C); });
  }
  void layernorm_backward(float* dx, float* dw, float* db, const float* dout, const float* x, const float* w,
                          const float* mean, const float* rstd, std::size_t N, std::size_t C) {
    queue([=] { gpt::cpu_backend{}.layernorm_backward(dx, dw, db, dout, x, w, mean, rstd, N, C); });
  }
  void matmul_forward(float* out, const float* x, const float* w, const float* bias, std::size_t N, std::size_t C,
                      std::size_t OC) {
    queue([=] { gpt::cpu_backend{}.matmul_forward(out, x, w, bias, N, C, OC); });
  }
  void matmul_backward(float* dx, float* dw, float* dbias, const float* dout, const float* x, const float* w,
                       std::size_t N, std::size_t C, std::size_t OC) {
    queue([=] { gpt::cpu_backend{}.matmul_backward(dx, dw, dbias, dout, x, w, N, C, OC); });
  }
  static std::size_t attention_scratch_elems(std::size_t B, std::size_t T, std::size_t C, std::size_t NH) noexcept {
    return gpt::cpu_backend::attention_scratch_elems(B, T, C, NH);
  }
  void attention_forward(float* out, float* att, const float* qkv, std::size_t B, std::size_t T, std::size_t C,
                         std::size_t NH, float* scratch) {
    queue([=] { gpt::cpu_backend{}.attention_forward(out, att, qkv, B, T, C, NH, scratch); });
  }
  void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att, std::size_t B,
                          std::size_t T, std::size_t C, std::size_t NH, float* scratch) {
    queue([=] { gpt::cpu_backend{}.attention_backward(dqkv, dout, qkv, att, B, T, C, NH, scratch); });
  }
  void gelu_forward(float* out, const float* x, std::size_t n) {
    queue([=] { gpt::cpu_backend{}.gelu_forward(out, x, n); });
  }
  void gelu_backward(float* dx, const float* x, const float* dout, std::size_t n) {
    queue([=] { gpt::cpu_backend{}.gelu_backward(dx, x, dout, n); });
  }

  // The tied embedding and head on vocabulary shards.
  void fill(float* p, std::size_t n, float v) {
    queue([=] { gpt::cpu_backend{}.fill(p, n, v); });
  }
  void embedding_shard_forward(float* out, const int* tok, const float* shard, std::size_t v0, std::size_t vs,
                               const float* wpe, std::size_t N, std::size_t Tn, std::size_t C) {
    queue([=] { gpt::cpu_backend{}.embedding_shard_forward(out, tok, shard, v0, vs, wpe, N, Tn, C); });
  }
  void embedding_shard_backward(float* g, const int* tok, const float* dres, std::size_t v0, std::size_t vs,
                                std::size_t N, std::size_t C) {
    queue([=] { gpt::cpu_backend{}.embedding_shard_backward(g, tok, dres, v0, vs, N, C); });
  }
  void position_backward(float* g, const float* dres, std::size_t N, std::size_t Tn, std::size_t C) {
    queue([=] { gpt::cpu_backend{}.position_backward(g, dres, N, Tn, C); });
  }
  void head_shard_forward(float* mx, float* sum, float* zt, const float* z, const int* tg, std::size_t v0,
                          std::size_t valid, std::size_t N, std::size_t vs) {
    queue([=] { gpt::cpu_backend{}.head_shard_forward(mx, sum, zt, z, tg, v0, valid, N, vs); });
  }
  void head_losses(float* lse, float* losses, const float* zt, std::size_t N) {
    queue([=] { gpt::cpu_backend{}.head_losses(lse, losses, zt, N); });
  }
  void head_shard_backward(float* z, const float* lse, const int* tg, float dloss, std::size_t v0, std::size_t valid,
                           std::size_t N, std::size_t vs) {
    queue([=] { gpt::cpu_backend{}.head_shard_backward(z, lse, tg, dloss, v0, valid, N, vs); });
  }

 private:
  struct state {
    std::vector<std::function<void()>> queue;
    bool skip_waits = false;
  };
  void queue(std::function<void()> f) { s_->queue.push_back(std::move(f)); }
  void drain() noexcept {
    // Taken out first: a queued call never queues more, but the queue must be empty once it ran.
    auto work = std::move(s_->queue);
    s_->queue.clear();
    for (auto& f : work) f();
  }

  gpt::cpu_backend cpu;
  std::unique_ptr<state> s_;
};
static_assert(gpt::RtpBackend<deferred_backend>);

}  // namespace gpt::testing
