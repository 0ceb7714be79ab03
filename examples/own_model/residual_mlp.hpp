// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief A model that is not the GPT, under RTP from library headers only: a residual MLP
 *         language model with a tied embedding and head (docs/rtp.md, "RTP for your own model").
 *
 *      x0 = E[tokens];  x(l+1) = x(l) + W2(l) gelu(W1(l) x(l) + b1(l)) + b2(l);  loss = CE((x(L) * g) E^T, targets)
 *
 *  E [V, C] is sharded by vocabulary rows (`rtp::vocab_parallel`), each block's W1, b1, W2 by
 *  hidden units (`rtp::weight_pair`: W1's rows, b1, W2's columns), and the b2s and the gain g are
 *  replicated. `rtp::sharded_model` holds all of it in one shard store (host memory, or a chunk
 *  runtime under a device budget) and steps it with one global norm. The glue is the class below
 *  up to "the block's math"; the rest is the arithmetic any implementation of the model has.
 */
#pragma once

#include <chunkstar/optim/adam.hpp>
#include <chunkstar/optim/param_groups.hpp>
#include <chunkstar/rtp/counter_init.hpp>
#include <chunkstar/rtp/sharded_model.hpp>
#include <chunkstar/rtp/vocab_parallel.hpp>
#include <chunkstar/rtp/weight_pair.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace own_model {

struct config {
  std::size_t vocab = 37, width = 16, hidden = 24, layers = 2, rows = 8;  // rows: tokens per micro-batch
  std::uint64_t seed = 7;
};

/** The tensors: E, then per block W1, b1, W2, b2, then g. */
inline std::vector<chunkstar::tensor_spec> specs(const config& c) {
  using chunkstar::tensor_role;
  const auto V = static_cast<std::int64_t>(c.vocab), C = static_cast<std::int64_t>(c.width),
             H = static_cast<std::int64_t>(c.hidden);
  std::vector<chunkstar::tensor_spec> s{{"emb", {V, C}, chunkstar::dtype::f32, tensor_role::embedding}};
  for (std::size_t l = 0; l < c.layers; ++l) {
    const std::string p = "h" + std::to_string(l) + ".";
    s.push_back({p + "w1", {H, C}, chunkstar::dtype::f32, tensor_role::weight});
    s.push_back({p + "b1", {H}, chunkstar::dtype::f32, tensor_role::bias});
    s.push_back({p + "w2", {C, H}, chunkstar::dtype::f32, tensor_role::weight});
    s.push_back({p + "b2", {C}, chunkstar::dtype::f32, tensor_role::bias});
  }
  s.push_back({"gain", {C}, chunkstar::dtype::f32, tensor_role::norm});
  return s;
}
/** Tensor indices. */
inline std::size_t w1(std::size_t l) { return 1 + 4 * l; }
inline std::size_t b2(std::size_t l) { return 4 + 4 * l; }

/** Element @p i of tensor @p t of @p sp (`specs(c)`) at initialisation: a pure function of (seed,
 *  tensor, index). */
inline float init_value(const config& c, std::span<const chunkstar::tensor_spec> sp, std::size_t t, std::size_t i) {
  const chunkstar::rtp::counter_init r{.seed = c.seed, .key = chunkstar::rtp::tensor_key(sp[t].name)};
  if (t + 1 == sp.size()) return r.uniform<float>(i, 0.9f, 1.1f);          // gain
  if (sp[t].shape.size() == 1) return r.uniform<float>(i, -0.05f, 0.05f);  // biases
  return r.normal<float>(i, 0.0f, t == 0 ? 0.5f : 1.0f / std::sqrt(static_cast<float>(sp[t].shape[1])));
}

template <class T>
T gelu(T z) {
  const T k = T(0.7978845608028654), a = T(0.044715);
  return T(0.5) * z * (T(1) + std::tanh(k * (z + a * z * z * z)));
}
template <class T>
T gelu_grad(T z) {
  const T k = T(0.7978845608028654), a = T(0.044715), th = std::tanh(k * (z + a * z * z * z));
  return T(0.5) * (T(1) + th) + T(0.5) * z * (T(1) - th * th) * k * (T(1) + T(3) * a * z * z);
}

/** One rank's model: every rank builds one and makes the same calls (forward, backward, step). */
template <chunkstar::Communicator Comm, chunkstar::rtp::ShardStore Store = chunkstar::rtp::host_shard_store>
class residual_mlp {
 public:
  using state_type = chunkstar::rtp::sharded_model<Comm, Store>;
  using vocab_type = chunkstar::rtp::vocab_parallel<state_type>;

  residual_mlp(Comm& comm, Store& store, const config& c) : c_(c), specs_(specs(c)), m_(comm, store, specs_) {
    const int n = comm.size(), me = comm.rank();
    emb_ = m_.add_rotated(vocab_type::part(0, n, me, specs_));
    pair_ = chunkstar::rtp::make_weight_pair(c.width, c.hidden, c.width, n, "hidden units");
    for (std::size_t l = 0; l < c.layers; ++l)
      blocks_.push_back(
          m_.add_rotated(chunkstar::rtp::weight_pair_part(pair_, me, w1(l), w1(l) + 1, w1(l) + 2, specs_)));
    std::vector<std::size_t> reps;
    for (std::size_t l = 0; l < c.layers; ++l) reps.push_back(b2(l));
    reps.push_back(specs_.size() - 1);
    replicas_ = m_.add_replicated(chunkstar::rtp::replicated_part(reps, specs_));
    m_.finalize();
    vocab_.emplace(m_, emb_, c.rows);
    const std::size_t R = c.rows, C = c.width;
    x_.assign((c.layers + 1) * R * C, 0.0f), a_.assign(c.layers * R * c.hidden, 0.0f), f_.assign(R * C, 0.0f);
  }

  /** Every element from `init_value` (flyweight: this rank's only). */
  void init() {
    m_.init([this](std::size_t t, std::size_t i) { return init_value(c_, specs_, t, i); });
  }

  /** This rank's micro-batch of `rows` tokens: its mean loss; keeps the activations. Collective. */
  double forward(const int* tokens, const int* targets) {
    const std::size_t R = c_.rows, C = c_.width;
    vocab_->embed(tokens, R, x(0));
    for (std::size_t l = 0; l < c_.layers; ++l) {
      std::vector<float> y(R * C, 0.0f);
      m_.stage("h" + std::to_string(l), false, {blocks_[l]}, [&] {
        m_.forward(blocks_[l], [&](int j, std::span<const float> s) {
          block_forward(l, static_cast<std::size_t>(j), s.data(), y.data());
        });
      });
      const float* bias = m_.replica(replicas_) + l * C;
      for (std::size_t i = 0; i < R * C; ++i) x(l + 1)[i] = x(l)[i] + (y[i] + bias[i % C]);
    }
    const float* g = gain();
    for (std::size_t i = 0; i < R * C; ++i) f_[i] = x(c_.layers)[i] * g[i % C];
    return vocab_->loss(f_.data(), targets, R);
  }

  /** Backward of the last forward (the same micro-batch): adds the gradient of the sum over ranks
   *  of their mean losses to the accumulated gradients. Collective. */
  void backward(const int* tokens, const int* targets) {
    const std::size_t R = c_.rows, C = c_.width, L = c_.layers;
    std::vector<float> df(R * C, 0.0f), dx(R * C), dprev(R * C);
    vocab_->loss_backward(f_.data(), targets, R, m_.loss_scale(), df.data());  // fp16: the scaled loss
    float* gg = m_.replica_grad(replicas_) + L * C;
    for (std::size_t i = 0; i < R * C; ++i) gg[i % C] += df[i] * x(L)[i], dx[i] = df[i] * gain()[i % C];
    for (std::size_t l = L; l-- > 0;) {
      float* gb = m_.replica_grad(replicas_) + l * C;
      for (std::size_t i = 0; i < R * C; ++i) gb[i % C] += dx[i];
      dprev = dx;  // the residual's share; each shard adds its own
      m_.stage("h" + std::to_string(l), true, {blocks_[l]}, [&] {
        m_.backward(blocks_[l], [&](int j, std::span<const float> s, std::span<float> g) {
          block_backward(l, static_cast<std::size_t>(j), s.data(), g.data(), dx.data(), dprev.data());
        });
      });
      dx = dprev;
    }
    vocab_->embed_backward(tokens, R, dx.data());
    m_.reduce_replica_grads();
  }

  /** AdamW over every part, gradients averaged over the ranks' micro-batches, clipped at @p max_norm. */
  auto step(const chunkstar::adam_hyper& h, const chunkstar::param_groups& groups, float max_norm = 0.0f) {
    return m_.step(h, groups, m_.world(), max_norm);
  }
  /** The model's state: parts, read/write, checkpoint views (`rtp::checkpoint_save_view(state(), comm)`). */
  [[nodiscard]] state_type& state() noexcept { return m_; }

 private:
  // ---- the block's math: shard j holds hidden units [j k, (j + 1) k) ------------------------
  float* x(std::size_t l) { return x_.data() + l * c_.rows * c_.width; }
  const float* gain() const { return m_.replica(replicas_) + c_.layers * c_.width; }
  void block_forward(std::size_t l, std::size_t j, const float* s, float* y) {
    const std::size_t R = c_.rows, C = c_.width, H = c_.hidden, k = pair_.shard_units();
    const float *W1 = s + pair_.a_weight_offset(), *b1 = s + pair_.a_bias_offset(), *W2 = s + pair_.b_weight_offset();
    for (std::size_t r = 0; r < R; ++r) {
      float* a = a_.data() + (l * R + r) * H + j * k;
      for (std::size_t u = 0; u < k; ++u) {
        float z = b1[u];
        for (std::size_t i = 0; i < C; ++i) z += W1[u * C + i] * x(l)[r * C + i];
        a[u] = z;
      }
      for (std::size_t o = 0; o < C; ++o) {
        float q = 0;
        for (std::size_t u = 0; u < k; ++u) q += W2[o * k + u] * gelu(a[u]);
        y[r * C + o] += q;
      }
    }
  }
  void block_backward(std::size_t l, std::size_t j, const float* s, float* g, const float* dy, float* dx) {
    const std::size_t R = c_.rows, C = c_.width, H = c_.hidden, k = pair_.shard_units();
    const float *W1 = s + pair_.a_weight_offset(), *W2 = s + pair_.b_weight_offset();
    float *gW1 = g + pair_.a_weight_offset(), *gb1 = g + pair_.a_bias_offset(), *gW2 = g + pair_.b_weight_offset();
    for (std::size_t r = 0; r < R; ++r) {
      const float* a = a_.data() + (l * R + r) * H + j * k;
      for (std::size_t u = 0; u < k; ++u) {
        float dh = 0;
        for (std::size_t o = 0; o < C; ++o)
          dh += dy[r * C + o] * W2[o * k + u], gW2[o * k + u] += dy[r * C + o] * gelu(a[u]);
        const float da = dh * gelu_grad(a[u]);
        for (std::size_t i = 0; i < C; ++i) gW1[u * C + i] += da * x(l)[r * C + i], dx[r * C + i] += da * W1[u * C + i];
        gb1[u] += da;
      }
    }
  }

  config c_;
  std::vector<chunkstar::tensor_spec> specs_;
  state_type m_;
  chunkstar::rtp::weight_pair pair_;
  std::size_t emb_ = 0, replicas_ = 0;
  std::vector<std::size_t> blocks_;
  std::optional<vocab_type> vocab_;
  std::vector<float> x_, a_, f_;  // activations: x(0..L), the pre-activations, the head's input
};

}  // namespace own_model
