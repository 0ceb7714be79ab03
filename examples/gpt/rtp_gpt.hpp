/** @file
 *  @brief `gpt::rtp_gpt`: the whole GPT example under Rotated Tensor Parallelism on the ranks of a
 *         `Communicator` — the tied token embedding and LM head by vocabulary rows, the blocks
 *         (`rtp_block`), the position embedding and the final LayerNorm replicated — with its
 *         optimizer state and a local AdamW step.
 *
 *  Every rank trains on its own micro-batch and owns 1/N of each sharded layer: its weights,
 *  gradient and Adam moments. Nothing but weight shards and gradients travels (the rotations);
 *  the replicated tensors' gradients are all-reduced. The model is the serial one's
 *  (gpt_model.hpp), the same for every N: initial values come from `init_value`, a pure function
 *  of (seed, tensor, element), so a rank materialises only its own elements and N = 1 and N = 4
 *  start from the serial trainer's weights, bit for bit.
 *
 *  The tied embedding wte [V, C] is one rotation of vocabulary rows (V padded to a multiple of N
 *  with rows no token uses and whose logits are masked). It runs four passes per training step:
 *  - embedding forward: each token's row comes from the shard that holds its id (a copy, plus the
 *    position row: the serial sum's bits);
 *  - head forward: each shard gives the logits of its V/N words, [rows, V/N], and a running
 *    maximum and sum per token (the online softmax) turn them into the log-sum-exp and the loss,
 *    so the [rows, V] logits and probabilities never exist;
 *  - head backward: each shard's logits are recomputed from the final LayerNorm's output and the
 *    shard, their gradient (softmax minus one-hot) gives this rank's share of the shard's gradient
 *    and adds into the LayerNorm's input gradient;
 *  - embedding backward: the gradient travels again and the owner adds the head's sum (which
 *    `owned_grad()` holds until the pass ends) to the embedding's.
 *  docs/rtp.md has the memory and bytes per rank and why vocabulary rows.
 */
#pragma once

#include "gpt_model.hpp"
#include "kernels_cpu.hpp"
#include "model_config.hpp"
#include "rtp_block.hpp"

#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/core/error.hpp>
#include <chunkstar/optim/adam.hpp>
#include <chunkstar/optim/clip.hpp>
#include <chunkstar/optim/param_groups.hpp>
#include <chunkstar/rtp/replicated.hpp>
#include <chunkstar/rtp/rotation.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace gpt {

/** @brief Rows of the tied embedding after padding the vocabulary @p V to a multiple of @p world
 *  (the padding rows are never looked up and their logits are masked). */
constexpr std::size_t rtp_padded_vocab(std::size_t V, int world) noexcept {
  const auto n = static_cast<std::size_t>(world);
  return (V + n - 1) / n * n;
}

/** @brief One buffer of this rank's model data and where its elements come from: the weights,
 *  their gradient and Adam moments, and for each element the tensor (index into param_specs) and
 *  global index it holds. */
struct rtp_part {
  std::span<float> w, g;             ///< weights and gradient (a rotation's owned buffers, or a replica)
  std::vector<float> m, v;           ///< Adam moments, this rank's only
  bool replicated = false;           ///< every rank holds the same values (all-reduced gradients)
  /** @brief Calls `f(tensor, global_index, offset)` for every element of the buffer. */
  std::function<void(const std::function<void(std::size_t, std::size_t, std::size_t)>&)> for_each;
  /** @brief Contiguous runs of one tensor in the buffer: [begin, end) and the tensor. */
  struct segment {
    std::size_t begin, end, tensor;
  };
  std::vector<segment> segments;
};

/** @brief The whole GPT of config @p c under RTP on the ranks of @p Comm (see the file comment).
 *
 *  Every rank of the communicator builds one with the same config and micro-batch shape, calls
 *  `init` (or `load`), then the same sequence of `forward`, `backward`, `step`, `loss` and
 *  `next_token_probs` calls (all collectives), each with its own micro-batch.
 *
 *  **Gradients** are of the *sum* of the ranks' losses scaled by `loss_scale` (each rank's loss
 *  being its micro-batch's mean); `step` divides by the number of micro-batches it is told.
 *  `backward` replaces the gradients (no accumulation over micro-batches).
 *
 *  **Exception safety.** If a kernel or the communicator throws in a pass, no weight and no
 *  optimizer state has changed, no shift is in flight, and the peers get `communication_error`
 *  (the rotations' guarantee); gradients and activations are unspecified. `step` communicates
 *  only for the clipping norm, before it writes anything.
 */
template <chunkstar::Communicator Comm>
class rtp_gpt {
 public:
  using rotation_type = chunkstar::rtp::rotation<Comm>;

  /** @brief Partitions @p c over `comm.size()` ranks for micro-batches of @p B sequences of @p Tn
   *  tokens (`config_error` naming the dimension and the valid world sizes if the ranks do not
   *  divide the heads) and allocates this rank's shards, optimizer state and activations. */
  rtp_gpt(Comm& comm, const gpt_config& c, std::size_t B, std::size_t Tn)
      : comm_(comm),
        c_(c),
        B_(B),
        Tn_(Tn),
        world_(comm.size()),
        rank_(comm.rank()),
        vpad_(rtp_padded_vocab(static_cast<std::size_t>(c.vocab), comm.size())),
        vs_(vpad_ / static_cast<std::size_t>(comm.size())),
        wte_(comm, vs_ * static_cast<std::size_t>(c.width)),
        top_(static_cast<std::size_t>(c.context + 2) * static_cast<std::size_t>(c.width), 0.0f),
        top_grad_(top_.size(), 0.0f) {
    const auto sizes = compute_activation_sizes(c, B, Tn);
    for (int l = 0; l < c.layers; ++l) blocks_.push_back(std::make_unique<rtp_block<Comm>>(comm, c));
    specs_ = param_specs(c);
    const std::size_t N = B * Tn, C = static_cast<std::size_t>(c.width);
    // Activations: the serial model's, without the [rows, V] logits and probabilities (the head
    // keeps the final LayerNorm, the log-sum-exp and the losses per token; one [rows, V/N] slice
    // of logits is the scratch of a step). The workspace likewise ends in a [rows, V/N] slice.
    acts_.assign(N * C + sizes.layers * sizes.block + (N * C + 2 * N) + 2 * N + N * C + N * vs_, 0.0f);
    work_.assign(sizes.workspace - N * static_cast<std::size_t>(c.vocab) + N * vs_, 0.0f);
    build_parts();
  }

  rtp_gpt(const rtp_gpt&) = delete;
  rtp_gpt& operator=(const rtp_gpt&) = delete;

  [[nodiscard]] const gpt_config& config() const noexcept { return c_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int world() const noexcept { return world_; }
  [[nodiscard]] std::size_t batch() const noexcept { return B_; }
  [[nodiscard]] std::size_t seq() const noexcept { return Tn_; }
  [[nodiscard]] std::size_t tokens_per_batch() const noexcept { return B_ * Tn_; }
  /** @brief Rows of the tied embedding including the padding (a multiple of the world size). */
  [[nodiscard]] std::size_t padded_vocab() const noexcept { return vpad_; }
  [[nodiscard]] std::span<const chunkstar::tensor_spec> specs() const noexcept { return specs_; }
  [[nodiscard]] rtp_block<Comm>& block(int l) noexcept { return *blocks_[static_cast<std::size_t>(l)]; }
  [[nodiscard]] rotation_type& embedding() noexcept { return wte_; }
  /** @brief This rank's buffers of model data (see `rtp_part`). */
  [[nodiscard]] std::span<rtp_part> parts() noexcept { return parts_; }
  [[nodiscard]] std::span<const rtp_part> parts() const noexcept { return parts_; }

  /** @brief Bytes of model data this rank holds: weights, gradients and both Adam moments of its
   *  shards and of the replicas. */
  [[nodiscard]] std::size_t model_bytes() const noexcept {
    std::size_t n = 0;
    for (const auto& p : parts_) n += p.w.size();
    return 4 * n * sizeof(float);
  }
  /** @brief Bytes of the rotations' transit buffers on this rank. */
  [[nodiscard]] std::size_t transient_bytes() const noexcept {
    std::size_t n = wte_.transient_bytes();
    for (const auto& b : blocks_) n += b->transient_bytes();
    return n;
  }
  /** @brief Bytes of activations and the backward workspace on this rank. */
  [[nodiscard]] std::size_t activation_bytes() const noexcept { return (acts_.size() + work_.size()) * sizeof(float); }
  /** @brief Bytes of the largest shard of one rotation (what one shift sends). */
  [[nodiscard]] std::size_t largest_shard_bytes() const noexcept {
    std::size_t n = wte_.shard_bytes();
    for (const auto& b : blocks_) n = std::max({n, b->attention().shard_bytes(), b->mlp().shard_bytes()});
    return n;
  }
  /** @brief Bytes one rank sends in one training iteration (forward, backward): three passes of
   *  every block's rotations, two forward and two backward passes of the embedding's (two of
   *  them backward: weights and gradients), and the all-reduces of the replicated gradients
   *  (the in-process model's (N - 1) x bytes). */
  [[nodiscard]] std::size_t iteration_bytes_theory() const noexcept {
    const std::size_t n1 = static_cast<std::size_t>(world_ - 1);
    std::size_t b = 6 * n1 * wte_.shard_bytes();
    for (const auto& blk : blocks_) b += 3 * n1 * (blk->attention().shard_bytes() + blk->mlp().shard_bytes()) +
                                         n1 * blk->replicated().size() * sizeof(float);
    return b + n1 * top_.size() * sizeof(float);
  }

  /** @brief Flyweight initialisation: this rank's elements only, `init_value` of each. */
  void init(std::uint64_t seed) {
    for (auto& p : parts_)
      p.for_each([&](std::size_t t, std::size_t i, std::size_t off) { p.w[off] = init_value<float>(c_, specs_[t], t, i, seed); });
  }
  /** @brief Takes this rank's elements from the full tensors @p full (e.g. a serial model's). */
  void load(const gpt_params<float>& full) {
    const auto ptrs = param_list(full);
    for (auto& p : parts_) p.for_each([&](std::size_t t, std::size_t i, std::size_t off) { p.w[off] = ptrs[t][i]; });
  }
  /** @brief Writes this rank's elements into their places in @p full: every rank storing into one
   *  set of tensors assembles the whole model (replicas are written by every rank, identically). */
  void store(const gpt_params<float>& full) const { store_list(full, &rtp_part::w); }
  /** @brief The same for the gradients of the last backward. */
  void store_grads(const gpt_params<float>& full) const { store_list(full, &rtp_part::g); }

  /** @brief Forward of this rank's micro-batch: returns its mean cross-entropy, keeps the
   *  activations for `backward`. Collective. */
  double forward(const int* tokens, const int* targets) { return run_forward(B_, Tn_, tokens, targets, nullptr); }

  /** @brief Forward only, for evaluation: the mean loss; no shard moves home-wards or away
   *  (forward passes leave every rank holding its own shards). Collective. */
  double loss(const int* tokens, const int* targets) { return run_forward(B_, Tn_, tokens, targets, nullptr); }

  /** @brief Next-token probabilities after @p context (the last `seq()` tokens of it are used),
   *  rank 0's on every rank (the ranks add the shards' partial outputs in different orders, so
   *  their own roundings differ; sampling must pick the same token everywhere). Collective: every
   *  rank passes the same context. */
  std::vector<float> next_token_probs(std::span<const int> context) {
    const std::size_t n = std::min(context.size(), Tn_);
    if (n == 0) throw chunkstar::config_error("rtp_gpt::next_token_probs: the context is empty; pass at least one token");
    std::vector<int> tokens(context.end() - static_cast<std::ptrdiff_t>(n), context.end()), targets(n, 0);
    std::vector<float> logits(static_cast<std::size_t>(c_.vocab));
    run_forward(1, n, tokens.data(), targets.data(), logits.data());
    const float mx = *std::max_element(logits.begin(), logits.end());
    float sum = 0;
    for (auto& z : logits) sum += (z = std::exp(z - mx));
    for (auto& z : logits) z /= sum;
    comm_.broadcast(logits.data(), logits.size() * sizeof(float), 0);
    return logits;
  }

  /** @brief Backward of the last `forward`: replaces every gradient with that of the sum over
   *  ranks of `loss_scale` x their mean losses. Collective. */
  void backward(const int* tokens, const int* targets, float loss_scale = 1.0f) {
    const std::size_t B = B_, Tn = Tn_, N = B * Tn, C = static_cast<std::size_t>(c_.width);
    const auto a = bind(B, Tn);
    const auto w = bind_backward_workspace<float>(c_, B, Tn, work_.data());
    std::fill(top_grad_.begin(), top_grad_.end(), 0.0f);
    float* g_lnf_w = top_grad_.data() + lnf_offset();
    float* g_lnf_b = g_lnf_w + C;
    // Head: logits per shard recomputed, softmax minus one-hot, into the shard's gradient and dln.
    const float dloss = loss_scale / static_cast<float>(N);
    cpu::zero(w.dln, N * C);
    wte_.backward([&](int j, std::span<const float> s, std::span<float> g) {
      const std::size_t v0 = static_cast<std::size_t>(j) * vs_, valid = valid_rows(j);
      if (valid == 0) return;
      float* z = a.logits;  // [N, vs]
      cpu::matmul_forward(z, a.lnf, s.data(), static_cast<const float*>(nullptr), N, C, vs_);
      for (std::size_t n = 0; n < N; ++n) {
        float* row = z + n * vs_;
        const float lse = a.lse[n];
        for (std::size_t v = 0; v < vs_; ++v) row[v] = v < valid ? dloss * std::exp(row[v] - lse) : 0.0f;
        const auto t = static_cast<std::size_t>(targets[n]);
        if (t >= v0 && t < v0 + valid) row[t - v0] -= dloss;
      }
      cpu::matmul_backward(w.dln, g.data(), static_cast<float*>(nullptr), z, a.lnf, s.data(), N, C, vs_);
    });
    cpu::zero(w.dres, N * C);
    cpu::layernorm_backward(w.dres, g_lnf_w, g_lnf_b, w.dln, a.block_out(c_.layers), rep(lnf_offset()),
                            a.lnf_mean, a.lnf_rstd, N, C);
    for (int l = c_.layers - 1; l >= 0; --l) block(l).backward(B, Tn, a.block_out(l), a.blocks[static_cast<std::size_t>(l)], w);
    // Embedding: each token's row gradient goes to the shard holding its id; the owner adds the
    // head's sum, which owned_grad() holds until this pass ends.
    float* g_wpe = top_grad_.data();
    for (std::size_t n = 0; n < N; ++n) {
      const float* d = w.dres + n * C;
      float* gp = g_wpe + (n % Tn) * C;
      for (std::size_t k = 0; k < C; ++k) gp[k] += d[k];
    }
    wte_.backward([&](int j, std::span<const float>, std::span<float> g) {
      const std::size_t v0 = static_cast<std::size_t>(j) * vs_;
      for (std::size_t n = 0; n < N; ++n) {
        const auto t = static_cast<std::size_t>(tokens[n]);
        if (t < v0 || t >= v0 + vs_) continue;
        const float* d = w.dres + n * C;
        float* gr = g.data() + (t - v0) * C;
        for (std::size_t k = 0; k < C; ++k) gr[k] += d[k];
      }
      if (j == rank_) {
        const auto head = wte_.owned_grad();
        for (std::size_t i = 0; i < g.size(); ++i) g[i] += head[i];
      }
    });
    chunkstar::rtp::reduce_replicated_grads(comm_, std::span<float>(top_grad_));
  }

  /** @brief What `step` did. */
  struct step_result {
    double grad_norm = 0;  ///< global norm of the (unscaled) gradient, over every rank's shards and the replicas once
    float clip_scale = 1;  ///< the factor clipping applied
  };

  /** @brief One local AdamW step of every shard and replica: gradients multiplied by
   *  1/(@p micro_batches x @p loss_scale) and clipped to @p max_norm (0: off; the norm is summed
   *  over the ranks by one all-reduce, each replica counted once), decay per tensor role by
   *  @p groups. `optimizer_steps()` counts the steps (the bias correction's t). */
  step_result step(const chunkstar::adam_hyper& base, const chunkstar::param_groups& groups, int micro_batches,
                   float max_norm = 0.0f, float loss_scale = 1.0f) {
    if (micro_batches < 1) throw chunkstar::config_error("rtp_gpt::step: micro_batches must be >= 1");
    const float unscale = 1.0f / (loss_scale * static_cast<float>(micro_batches));  // as chunk_adam
    step_result r;
    float scale = unscale;
    if (max_norm > 0.0f) {
      double sq = 0;
      for (const auto& p : parts_) {
        if (p.replicated && rank_ != 0) continue;  // each replica once
        for (const float x : p.g) {
          const double y = static_cast<double>(x * unscale);
          sq += y * y;
        }
      }
      comm_.allreduce(std::span<double>(&sq, 1), chunkstar::reduce_op::sum);
      const auto clip = chunkstar::clip_coefficient(sq, max_norm);
      r.grad_norm = clip.norm;
      r.clip_scale = clip.coefficient;
      scale = unscale * clip.coefficient;
    }
    ++steps_;
    const chunkstar::adam_step_args args{.step = steps_, .grad_scale = scale};
    for (auto& p : parts_)
      for (const auto& s : p.segments) {
        const auto h = groups.hyper_for(specs_[s.tensor], base);
        const std::size_t n = s.end - s.begin;
        chunkstar::adam_update(p.w.subspan(s.begin, n), std::span<float>(p.m).subspan(s.begin, n),
                               std::span<float>(p.v).subspan(s.begin, n), std::span<const float>(p.g.subspan(s.begin, n)),
                               std::span<float>(), h, args);
      }
    return r;
  }
  /** @brief Adam steps taken (restored from a checkpoint with `restore_step_count`). */
  [[nodiscard]] std::int64_t optimizer_steps() const noexcept { return steps_; }
  void restore_step_count(std::int64_t n) noexcept { steps_ = n; }

  /** @brief Wall seconds this rank waited for ring shifts (`rtp::rotation_stats::wait_s`), summed
   *  over the embedding's and every block's rotations since construction or `reset_ring_stats()`. */
  [[nodiscard]] double ring_wait_s() const noexcept {
    double s = wte_.stats().wait_s;
    for (const auto& b : blocks_) s += b->attention().stats().wait_s + b->mlp().stats().wait_s;
    return s;
  }
  /** @brief Zeroes every rotation's stats. */
  void reset_ring_stats() noexcept {
    wte_.reset_stats();
    for (auto& b : blocks_) {
      b->attention().reset_stats();
      b->mlp().reset_stats();
    }
  }

 private:
  /** The activations of one forward, bound for a [B, Tn] batch. */
  struct acts_view {
    float* encoded;
    std::vector<block_activations<float>> blocks;
    float *lnf, *lnf_mean, *lnf_rstd, *lse, *losses, *proj, *logits;
    [[nodiscard]] const float* block_out(int l) const { return l == 0 ? encoded : blocks[static_cast<std::size_t>(l) - 1].res3; }
  };

  acts_view bind(std::size_t B, std::size_t Tn) {
    const std::size_t N = B * Tn, C = static_cast<std::size_t>(c_.width);
    const std::size_t block = compute_activation_sizes(c_, B, Tn).block;
    float* p = acts_.data();
    acts_view a;
    a.encoded = detail::take(p, N * C);
    for (int l = 0; l < c_.layers; ++l) a.blocks.push_back(bind_block_activations(c_, B, Tn, detail::take(p, block)));
    a.lnf = detail::take(p, N * C);
    a.lnf_mean = detail::take(p, N);
    a.lnf_rstd = detail::take(p, N);
    a.lse = detail::take(p, N);
    a.losses = detail::take(p, N);
    a.proj = detail::take(p, N * C);
    a.logits = detail::take(p, N * vs_);
    return a;
  }

  [[nodiscard]] std::size_t lnf_offset() const noexcept { return static_cast<std::size_t>(c_.context) * static_cast<std::size_t>(c_.width); }
  [[nodiscard]] const float* rep(std::size_t off) const noexcept { return top_.data() + off; }
  /** Rows of shard @p j that are real words (not padding). */
  [[nodiscard]] std::size_t valid_rows(int j) const noexcept {
    const std::size_t v0 = static_cast<std::size_t>(j) * vs_, V = static_cast<std::size_t>(c_.vocab);
    return v0 >= V ? 0 : std::min(vs_, V - v0);
  }

  /** The forward of a [B, Tn] batch; with @p last_logits, also the full logits of the last token
   *  of sequence 0 (for sampling). Returns the mean loss. */
  double run_forward(std::size_t B, std::size_t Tn, const int* tokens, const int* targets, float* last_logits) {
    const std::size_t N = B * Tn, C = static_cast<std::size_t>(c_.width);
    if (B > B_ || Tn > Tn_ || B * Tn > B_ * Tn_)
      throw chunkstar::config_error("rtp_gpt: a batch of [" + std::to_string(B) + ", " + std::to_string(Tn) +
                                    "] is larger than the model was built for");
    detail::check_tokens(c_, tokens, N, "tokens");
    detail::check_tokens(c_, targets, N, "targets");
    const auto a = bind(B, Tn);
    // Embedding: a token's row from the shard that holds its id, plus its position's row.
    const float* wpe = top_.data();
    wte_.forward([&](int j, std::span<const float> s) {
      const std::size_t v0 = static_cast<std::size_t>(j) * vs_;
      for (std::size_t n = 0; n < N; ++n) {
        const auto t = static_cast<std::size_t>(tokens[n]);
        if (t < v0 || t >= v0 + vs_) continue;
        const float* row = s.data() + (t - v0) * C;
        const float* pos = wpe + (n % Tn) * C;
        float* out = a.encoded + n * C;
        for (std::size_t k = 0; k < C; ++k) out[k] = row[k] + pos[k];
      }
    });
    for (int l = 0; l < c_.layers; ++l) block(l).forward(B, Tn, a.block_out(l), a.blocks[static_cast<std::size_t>(l)], a.proj);
    cpu::layernorm_forward(a.lnf, a.lnf_mean, a.lnf_rstd, a.block_out(c_.layers), rep(lnf_offset()), rep(lnf_offset() + C), N, C);
    // Head: each shard's logits, folded into a running max and sum per token (online softmax).
    std::vector<float> mx(N, -std::numeric_limits<float>::infinity()), sum(N, 0.0f), zt(N, 0.0f);
    wte_.forward([&](int j, std::span<const float> s) {
      const std::size_t v0 = static_cast<std::size_t>(j) * vs_, valid = valid_rows(j);
      if (valid == 0) return;
      cpu::matmul_forward(a.logits, a.lnf, s.data(), static_cast<const float*>(nullptr), N, C, vs_);
      for (std::size_t n = 0; n < N; ++n) {
        const float* z = a.logits + n * vs_;
        const float m = std::max(mx[n], *std::max_element(z, z + valid));
        float acc = sum[n] * std::exp(mx[n] - m);  // 0 on the first shard (exp(-inf) = 0)
        for (std::size_t v = 0; v < valid; ++v) acc += std::exp(z[v] - m);
        mx[n] = m;
        sum[n] = acc;
        const auto t = static_cast<std::size_t>(targets[n]);
        if (t >= v0 && t < v0 + valid) zt[n] = z[t - v0];
      }
      if (last_logits) std::copy(a.logits + (Tn - 1) * vs_, a.logits + (Tn - 1) * vs_ + valid, last_logits + v0);
    });
    double total = 0;
    for (std::size_t n = 0; n < N; ++n) {
      a.lse[n] = mx[n] + std::log(sum[n]);
      a.losses[n] = std::log(sum[n]) + (mx[n] - zt[n]);
      total += a.losses[n];
    }
    return total / static_cast<double>(N);
  }

  void build_parts() {
    const std::size_t C = static_cast<std::size_t>(c_.width), V = static_cast<std::size_t>(c_.vocab);
    const auto add = [&](std::span<float> w, std::span<float> g, bool replicated, auto each) {
      rtp_part p;
      p.w = w;
      p.g = g;
      p.m.assign(w.size(), 0.0f);
      p.v.assign(w.size(), 0.0f);
      p.replicated = replicated;
      p.for_each = each;
      // Every tensor occupies one contiguous run of the buffer (the layouts are built so).
      std::vector<std::size_t> lo(specs_.size(), SIZE_MAX), hi(specs_.size(), 0), count(specs_.size(), 0);
      p.for_each([&](std::size_t t, std::size_t, std::size_t off) {
        lo[t] = std::min(lo[t], off);
        hi[t] = std::max(hi[t], off + 1);
        ++count[t];
      });
      for (std::size_t t = 0; t < specs_.size(); ++t)
        if (count[t] > 0) {
          if (count[t] != hi[t] - lo[t]) throw chunkstar::state_error("rtp_gpt: tensor " + specs_[t].name + " is not contiguous in its shard");
          p.segments.push_back({lo[t], hi[t], t});
        }
      std::sort(p.segments.begin(), p.segments.end(), [](const auto& x, const auto& y) { return x.begin < y.begin; });
      parts_.push_back(std::move(p));
    };
    using visit = std::function<void(std::size_t, std::size_t, std::size_t)>;
    const int me = rank_;
    // The tied embedding: vocabulary rows [me vs, (me + 1) vs), the padding rows excluded.
    add(wte_.owned(), wte_.owned_grad(), false, [this, me, C, V](const visit& f) {
      const std::size_t v0 = static_cast<std::size_t>(me) * vs_;
      for (std::size_t r = 0; r < vs_ && v0 + r < V; ++r)
        for (std::size_t k = 0; k < C; ++k) f(0, (v0 + r) * C + k, r * C + k);
    });
    for (int l = 0; l < c_.layers; ++l) {
      auto& b = block(l);
      const std::size_t base = 2 + tensors_per_block * static_cast<std::size_t>(l);
      const auto& part = b.partition();
      add(b.attention().owned(), b.attention().owned_grad(), false, [&part, base, me](const visit& f) {
        part.for_each_attention(me, [&](block_tensor t, std::size_t i, std::size_t off) { f(base + static_cast<std::size_t>(t), i, off); });
      });
      add(b.mlp().owned(), b.mlp().owned_grad(), false, [&part, base, me](const visit& f) {
        part.for_each_mlp(me, [&](block_tensor t, std::size_t i, std::size_t off) { f(base + static_cast<std::size_t>(t), i, off); });
      });
      add(b.replicated(), b.replicated_grad(), true, [&part, base](const visit& f) {
        part.for_each_replicated([&](block_tensor t, std::size_t i, std::size_t off) { f(base + static_cast<std::size_t>(t), i, off); });
      });
    }
    // wpe | lnf.w | lnf.b, replicated.
    const std::size_t T = static_cast<std::size_t>(c_.context), last = specs_.size();
    add(top_, top_grad_, true, [C, T, last](const visit& f) {
      for (std::size_t i = 0; i < T * C; ++i) f(1, i, i);
      for (std::size_t i = 0; i < C; ++i) f(last - 2, i, T * C + i);
      for (std::size_t i = 0; i < C; ++i) f(last - 1, i, T * C + C + i);
    });
  }

  void store_list(const gpt_params<float>& full, std::span<float> rtp_part::*which) const {
    const auto ptrs = param_list(full);
    for (const auto& p : parts_) {
      const auto src = p.*which;
      p.for_each([&](std::size_t t, std::size_t i, std::size_t off) { ptrs[t][i] = src[off]; });
    }
  }

  Comm& comm_;
  gpt_config c_;
  std::size_t B_, Tn_;
  int world_, rank_;
  std::size_t vpad_, vs_;
  rotation_type wte_;
  std::vector<std::unique_ptr<rtp_block<Comm>>> blocks_;
  std::vector<float> top_, top_grad_;  // wpe [T_max, C] | lnf.w | lnf.b, and their gradients
  std::vector<chunkstar::tensor_spec> specs_;
  std::vector<float> acts_, work_;
  std::vector<rtp_part> parts_;
  std::int64_t steps_ = 0;
};

}  // namespace gpt
