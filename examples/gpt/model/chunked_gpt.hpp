// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief The GPT model with all of its model data in a chunkstar runtime: parameters registered
 *         stage by stage, every stage's forward and backward inside an access scope, activations
 *         from the runtime's compute-tier allocator.
 *
 *  The kernels compute in fp32. With 16-bit parameters (bf16, fp16) a scope widens the stage's
 *  parameters into fp32 staging buffers on the compute tier and, in backward, adds the fp32
 *  gradients into the 16-bit gradient chunks; the fp32 master copy lives in the runtime's master
 *  chunks and is what the optimizer updates.
 *
 *  The layers run on a kernel backend (gpt_backend.hpp): the CPU kernels by default, the CUDA
 *  kernels on a CUDA runtime. Every scope is closed with the backend's stream, so the runtime
 *  orders later moves of its chunks after the kernels that used them, and compute-tier buffers are
 *  freed only once the kernels are done with them (`quiesce`).
 */
#pragma once

#include "gpt_backend.hpp"

#include <chunkstar/runtime/chunk_runtime.hpp>
#include <chunkstar/runtime/memory_plan.hpp>

#include <algorithm>
#include <cstddef>
#include <functional>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace gpt {

/** @brief One micro-batch's shape. */
struct batch_shape {
  std::size_t batch = 8;
  std::size_t seq = 128;
};

/** @brief The forward scopes chunked_gpt opens in one training iteration, as tensor indices in
 *  registration order (chunkstar::forward_scopes): the embedding, each block, then the head (the
 *  final norm and the tied wte); backward opens them in reverse. What `chunkstar::plan_memory`
 *  needs to size a run before it starts. */
inline chunkstar::forward_scopes forward_scopes(const gpt_config& c) {
  std::vector<std::vector<std::size_t>> stage;  // the tensors of each stage
  std::size_t index = 0;
  for (const auto& layer : param_layers(c)) {
    stage.emplace_back();
    for (std::size_t k = 0; k < layer.tensors.size(); ++k) stage.back().push_back(index++);
  }
  chunkstar::forward_scopes f;
  for (int l = 0; l <= c.layers; ++l) f.push_back(stage[static_cast<std::size_t>(l)]);
  f.push_back({stage.back()[0], stage.back()[1], stage[0][0]});  // the final norm and the tied wte
  return f;
}

/** @brief Compute-tier bytes one micro-batch needs beside the model data, at most: activations,
 *  the backward's workspace, the backend's scratch, tokens and targets, and for 16-bit models the
 *  fp32 staging of the largest scope (parameters and gradients). */
template <GptBackend Backend = cpu_backend>
inline std::size_t non_model_bytes(const gpt_config& c, batch_shape shape, chunkstar::dtype param_type) {
  const auto s = compute_activation_sizes(c, shape.batch, shape.seq);
  std::size_t largest_stage = 0;
  for (const auto& l : param_layers(c)) {
    std::size_t n = 0;
    for (const auto& t : l.tensors) n += t.numel();
    largest_stage = std::max(largest_stage, n);
  }
  const std::size_t staging =
      param_type == chunkstar::dtype::f32 ? 0 : 2 * (largest_stage + static_cast<std::size_t>(c.vocab) * c.width);
  return (s.forward_total() + s.workspace + staging + Backend::scratch_elems(c, shape.batch, shape.seq)) *
             sizeof(float) +
         (Backend::host_memory ? 0 : 2 * shape.batch * shape.seq * sizeof(int));
}

/** @brief The compute tier's non-model bytes moment by moment (`chunkstar::plan_memory`'s profile:
 *  the `forward_scopes` in order, the same in reverse, then the step), as `chunked_gpt` allocates
 *  them: forward keeps each block's activations and backward frees them block by block, so the
 *  early backward scopes hold the most and the step nothing. Each moment's entry is the most it
 *  holds while it is the current one, including what is allocated before the next scope opens
 *  (a block's activations, the backward's workspace): an upper bound of a warm-up's trace, moment
 *  by moment (tested), known before anything is built. */
template <GptBackend Backend = cpu_backend>
inline std::vector<std::size_t> non_model_profile(const gpt_config& c, batch_shape shape, chunkstar::dtype param_type) {
  const std::size_t B = shape.batch, T = shape.seq, N = B * T, L = static_cast<std::size_t>(c.layers);
  const auto s = compute_activation_sizes(c, B, T);
  const auto scopes = forward_scopes(c);
  const auto specs = param_specs(c);
  const auto staged = [&](std::size_t k) {  // a 16-bit scope's fp32 copies of its parameters
    std::size_t n = 0;
    if (param_type != chunkstar::dtype::f32)
      for (const std::size_t t : scopes[k]) n += specs[t].numel();
    return n;
  };
  const std::size_t base = Backend::scratch_elems(c, B, T) + s.embedding;  // through both passes
  const std::size_t tokens = Backend::host_memory ? 0 : 2 * N * sizeof(int);
  std::vector<std::size_t> f(scopes.size()), b(scopes.size());  // elements per scope, forward and backward
  f[0] = base + s.scratch + (L > 0 ? s.block : s.head) + staged(0);
  for (std::size_t l = 0; l < L; ++l)  // block l; the next block's (or the head's) activations open at its end
    f[l + 1] =
        base + staged(l + 1) + (l + 2 <= L ? (l + 2) * s.block + s.scratch : L * s.block + std::max(s.scratch, s.head));
  f[L + 1] =
      base + L * s.block + s.head + s.workspace + staged(L + 1);  // the head; the backward's workspace opens at its end
  b[L + 1] = base + L * s.block + s.head + s.workspace + 2 * staged(L + 1);
  for (std::size_t l = 0; l < L; ++l) b[l + 1] = base + (l + 1) * s.block + s.workspace + 2 * staged(l + 1);
  b[0] = base + s.workspace + 2 * staged(0);
  std::vector<std::size_t> profile;
  for (const std::size_t e : f) profile.push_back(e * sizeof(float) + tokens);
  for (std::size_t k = scopes.size(); k-- > 0;) profile.push_back(b[k] * sizeof(float) + tokens);
  profile.push_back(0);  // the step
  return profile;
}

template <class Runtime, GptBackend Backend = cpu_backend>
class chunked_gpt {
  static_assert(std::is_same_v<typename Backend::stream_type, typename Runtime::stream_type>,
                "the backend's kernels run on a stream of the runtime's platform (cpu_backend on host platforms, "
                "cuda_backend on cuda_platform)");

 public:
  /** @brief Registers every parameter of @p c (in execution order) with @p rt, initialised from
   *  @p seed; call `rt.finalize()` afterwards (or use finalize()). */
  chunked_gpt(Runtime& rt, const gpt_config& c, batch_shape shape, std::uint64_t seed, Backend backend = {})
      : rt_(rt),
        be_(std::move(backend)),
        c_(c),
        shape_(shape),
        sizes_(compute_activation_sizes(c, shape.batch, shape.seq)) {
    const auto type = rt.options().param_type;
    std::size_t index = 0;
    for (auto& layer : param_layers(c, type)) {
      stage s{layer.name, {}};
      for (auto& spec : layer.tensors) {
        const auto i = index++;
        s.ids.push_back(rt.register_param(
            spec, [c, spec, i, seed](std::span<float> v) { init_tensor<float>(c, spec, i, v.data(), seed); }));
      }
      stages_.push_back(std::move(s));
    }
  }

  void finalize() { rt_.finalize(); }

  [[nodiscard]] const gpt_config& config() const noexcept { return c_; }
  [[nodiscard]] batch_shape shape() const noexcept { return shape_; }
  [[nodiscard]] std::size_t tokens_per_batch() const noexcept { return shape_.batch * shape_.seq; }
  [[nodiscard]] Backend& backend() noexcept { return be_; }

  /** @brief Called after each backward scope closes (data parallelism starts the all-reduces of
   *  the gradients that are final there: replicated_gradients::after_backward). */
  std::function<void()> after_backward_scope;

  /** @brief Forward and backward of one micro-batch; gradients (of loss × @p loss_scale) are added
   *  into the runtime's gradient chunks. Returns the mean loss. */
  double forward_backward(const int* tokens, const int* targets, float loss_scale = 1.0f) {
    const std::size_t B = shape_.batch, T = shape_.seq;
    detail::check_tokens(c_, tokens, B * T, "tokens");
    detail::check_tokens(c_, targets, B * T, "targets");
    forward_pass fp(*this);
    const double loss = fp.run(tokens, targets);
    tokens = fp.tokens;  // from here on the compute tier's copies
    targets = fp.targets;

    buffer<float> ws_mem(*this, sizes_.workspace);
    const auto w = bind_backward_workspace<float>(c_, B, T, ws_mem.data());
    {
      auto s = rt_.backward("final", final_ids());
      layer_views v(*this, s, final_ids(), true);
      be_.head_backward(c_, B, T, v.p[2], v.p[0], fp.block_output(c_.layers), fp.head, targets, v.g[2], v.g[0], v.g[1],
                        w, loss_scale);
      v.flush_grads(s, final_ids());
      s.close(be_.stream());
    }
    if (after_backward_scope) after_backward_scope();
    fp.head_mem.reset();
    for (int l = c_.layers - 1; l >= 0; --l) {
      const auto& ids = stages_[static_cast<std::size_t>(l) + 1].ids;
      auto s = rt_.backward(stages_[static_cast<std::size_t>(l) + 1].name, ids);
      layer_views v(*this, s, ids, true);
      be_.block_backward(c_, B, T, block_of(v.p), block_of(v.g), fp.block_output(l),
                         fp.blocks[static_cast<std::size_t>(l)], w, fp.scratch());
      v.flush_grads(s, ids);
      s.close(be_.stream());
      fp.block_mem[static_cast<std::size_t>(l)].reset();
      if (after_backward_scope) after_backward_scope();
    }
    {
      const auto& ids = stages_[0].ids;
      auto s = rt_.backward("embedding", ids);
      layer_views v(*this, s, ids, true);
      be_.embedding_backward(c_, B, T, tokens, v.g[0], v.g[1], w);
      v.flush_grads(s, ids);
      s.close(be_.stream());
    }
    be_.quiesce();  // the gradients are complete when this returns (the optimizer reads them next)
    return loss;
  }

  /** @brief Forward only (validation): the mean loss. Wrap calls in `rt.untraced()`. */
  double loss(const int* tokens, const int* targets) {
    detail::check_tokens(c_, tokens, tokens_per_batch(), "tokens");
    forward_pass fp(*this);
    return fp.run(tokens, targets);
  }

  /** @brief Next-token probabilities after @p context (1 <= size <= seq), for sampling. Uses row 0
   *  of a batch; wrap calls in `rt.untraced()`. */
  std::vector<float> next_token_probs(std::span<const int> context) {
    const std::size_t T = shape_.seq;
    std::vector<int> tokens(tokens_per_batch(), 0), targets(tokens_per_batch(), 0);
    const std::size_t n = std::min(context.size(), T);
    std::copy(context.end() - static_cast<std::ptrdiff_t>(n), context.end(), tokens.begin());
    forward_pass fp(*this);
    fp.run(tokens.data(), targets.data());
    std::vector<float> row(static_cast<std::size_t>(c_.vocab));
    be_.from_compute(row.data(), fp.head.probs + (n - 1) * row.size(), row.size() * sizeof(float));
    return row;
  }

 private:
  struct stage {
    std::string name;
    std::vector<chunkstar::param_id> ids;
  };

  /** A buffer on the compute tier, freed on destruction or reset() once the backend's kernels are
   *  done with it. */
  template <class T>
  class buffer {
   public:
    buffer() = default;
    buffer(chunked_gpt& m, std::size_t n)
        : m_(&m), bytes_(n * sizeof(T)), p_(static_cast<T*>(m.rt_.allocate_non_model(bytes_))) {}
    buffer(buffer&& o) noexcept : m_(o.m_), bytes_(o.bytes_), p_(std::exchange(o.p_, nullptr)) {}
    buffer& operator=(buffer&& o) noexcept {
      reset();
      m_ = o.m_;
      bytes_ = o.bytes_;
      p_ = std::exchange(o.p_, nullptr);
      return *this;
    }
    ~buffer() { reset(); }
    void reset() noexcept {
      if (!p_) return;
      m_->be_.quiesce();
      m_->rt_.deallocate_non_model(p_, bytes_);
      p_ = nullptr;
    }
    [[nodiscard]] T* data() const noexcept { return p_; }

   private:
    chunked_gpt* m_ = nullptr;
    std::size_t bytes_ = 0;
    T* p_ = nullptr;
  };

  /** fp32 views of a scope's parameters (and gradients in backward): the chunk memory itself for
   *  fp32 models, zero-copy; widened staging copies for 16-bit models. */
  class layer_views {
   public:
    std::vector<float*> p, g;
    layer_views(chunked_gpt& m, typename Runtime::scope& s, const std::vector<chunkstar::param_id>& ids, bool grads)
        : m_(m) {
      for (auto id : ids) {
        p.push_back(view(s, id, false));
        if (grads) g.push_back(view(s, id, true));
      }
    }
    /** Adds staged fp32 gradients into the 16-bit gradient chunks (no-op for fp32 models):
     *  g16 = round(float(g16) + g32). */
    void flush_grads(typename Runtime::scope& s, const std::vector<chunkstar::param_id>& ids) {
      const chunkstar::dtype type = m_.rt_.options().param_type;
      if (type == chunkstar::dtype::f32) return;
      for (std::size_t i = 0; i < ids.size(); ++i)
        with_16bit(s, ids[i], true, [&](auto span) {
          m_.be_.add_into(reinterpret_cast<std::byte*>(span.data()), type, g[i], span.size());
        });
    }

   private:
    template <class F>
    void with_16bit(typename Runtime::scope& s, chunkstar::param_id id, bool grad, F&& f) {
      if (m_.rt_.options().param_type == chunkstar::dtype::bf16)
        f(grad ? s.template grad<chunkstar::bfloat16>(id) : s.template param<chunkstar::bfloat16>(id));
      else f(grad ? s.template grad<chunkstar::float16>(id) : s.template param<chunkstar::float16>(id));
    }
    float* view(typename Runtime::scope& s, chunkstar::param_id id, bool grad) {
      if (m_.rt_.options().param_type == chunkstar::dtype::f32)
        return (grad ? s.template grad<float>(id) : s.template param<float>(id)).data();
      const std::size_t n = m_.rt_.spec(id).numel();
      staging_.emplace_back(m_, n);
      float* out = staging_.back().data();
      if (grad) m_.be_.zero(out, n);
      else
        with_16bit(s, id, false, [&](auto span) {
          m_.be_.widen(reinterpret_cast<const std::byte*>(span.data()), m_.rt_.options().param_type, out, n);
        });
      return out;
    }
    chunked_gpt& m_;
    std::vector<buffer<float>> staging_;
  };

  /** The forward of one batch, keeping what backward needs. */
  struct forward_pass {
    chunked_gpt& m;
    buffer<int> token_mem;      // tokens and targets on the compute tier, when it is not host memory
    buffer<float> backend_mem;  // the backend's scratch, through the backward
    buffer<float> emb_mem, scratch_mem, head_mem;
    std::vector<buffer<float>> block_mem;
    const int* tokens = nullptr;
    const int* targets = nullptr;
    float* encoded = nullptr;
    std::vector<block_activations<float>> blocks;
    head_activations<float> head{};

    explicit forward_pass(chunked_gpt& model) : m(model) {}

    const float* block_output(int l) const { return l == 0 ? encoded : blocks[static_cast<std::size_t>(l) - 1].res3; }
    float* scratch() const noexcept { return backend_mem.data(); }

    double run(const int* host_tokens, const int* host_targets) {
      const gpt_config& c = m.c_;
      const std::size_t B = m.shape_.batch, T = m.shape_.seq, N = B * T;
      tokens = host_tokens;
      targets = host_targets;
      if constexpr (!Backend::host_memory) {
        token_mem = buffer<int>(m, 2 * N);
        m.be_.to_compute(token_mem.data(), host_tokens, N * sizeof(int));
        m.be_.to_compute(token_mem.data() + N, host_targets, N * sizeof(int));
        tokens = token_mem.data();
        targets = token_mem.data() + N;
      }
      if (const std::size_t n = Backend::scratch_elems(c, B, T)) backend_mem = buffer<float>(m, n);
      emb_mem = buffer<float>(m, m.sizes_.embedding);
      scratch_mem = buffer<float>(m, m.sizes_.scratch);
      encoded = emb_mem.data();
      {
        auto s = m.rt_.forward("embedding", m.stages_[0].ids);
        layer_views v(m, s, m.stages_[0].ids, false);
        m.be_.embedding_forward(c, B, T, tokens, v.p[0], v.p[1], encoded);
        s.close(m.be_.stream());
      }
      for (int l = 0; l < c.layers; ++l) {
        const auto& st = m.stages_[static_cast<std::size_t>(l) + 1];
        block_mem.emplace_back(m, m.sizes_.block);
        blocks.push_back(bind_block_activations<float>(c, B, T, block_mem.back().data()));
        auto s = m.rt_.forward(st.name, st.ids);
        layer_views v(m, s, st.ids, false);
        m.be_.block_forward(c, B, T, block_of(v.p), block_output(l), blocks.back(), scratch_mem.data(), scratch());
        s.close(m.be_.stream());
      }
      scratch_mem.reset();
      head_mem = buffer<float>(m, m.sizes_.head);
      float* h = head_mem.data();
      const std::size_t C = c.width, V = c.vocab;
      head = {h, h + N * C, h + N * C + N, h + N * C + 2 * N, h + N * C + 2 * N + N * V, h + N * C + 2 * N + 2 * N * V};
      auto s = m.rt_.forward("final", m.final_ids());
      layer_views v(m, s, m.final_ids(), false);
      const double loss = m.be_.head_forward(c, B, T, v.p[2], v.p[0], v.p[1], block_output(c.layers), head, targets);
      s.close(m.be_.stream());
      return loss;
    }
  };

  static block_params<float> block_of(const std::vector<float*>& t) {
    return {t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9], t[10], t[11]};
  }
  /** The head's scope: the final LayerNorm and the tied embedding (wte), which is the LM head. */
  std::vector<chunkstar::param_id> final_ids() const {
    return {stages_.back().ids[0], stages_.back().ids[1], stages_[0].ids[0]};
  }

  Runtime& rt_;
  Backend be_;
  gpt_config c_;
  batch_shape shape_;
  activation_sizes sizes_;
  std::vector<stage> stages_;
};

}  // namespace gpt
