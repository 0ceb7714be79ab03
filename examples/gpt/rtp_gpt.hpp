// SPDX-License-Identifier: Apache-2.0
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
 *  - embedding backward: each token's gradient row goes to the shard that holds its id.
 *  Each backward pass adds its sum over the ranks into the owner's accumulated gradient, so the
 *  tied weight's gradient is the head's plus the embedding's, as in the serial model.
 *  docs/rtp.md ("The whole model") has the stages, the memory and bytes per rank and why
 *  vocabulary rows.
 *
 *  The kernels run on an `RtpBackend` (gpt_backend.hpp): the CPU's by default, or a GPU's
 *  (`cuda_backend`), where activations, transit buffers and the replicas' working copies are device
 *  memory from the store's compute tier. The replicas' master copies, their gradients and Adam
 *  moments stay in host memory (they are small: 6C per block and (T + 2)C); the working copies
 *  are refreshed after every write and step.
 */
#pragma once

#include "gpt_backend.hpp"
#include "gpt_model.hpp"
#include "kernels_cpu.hpp"
#include "model_config.hpp"
#include "rtp_block.hpp"

#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/comm/rank_agreement.hpp>
#include <chunkstar/comm/single_process.hpp>
#include <chunkstar/core/error.hpp>
#include <chunkstar/optim/adam.hpp>
#include <chunkstar/optim/clip.hpp>
#include <chunkstar/optim/param_groups.hpp>
#include <chunkstar/rtp/checkpoint_view.hpp>
#include <chunkstar/rtp/replicated.hpp>
#include <chunkstar/rtp/rotation.hpp>
#include <chunkstar/rtp/shard_store.hpp>
#include <chunkstar/rtp/transit_buffers.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace gpt {

/** @brief Rows of the tied embedding after padding the vocabulary @p V to a multiple of @p world
 *  (the padding rows are never looked up and their logits are masked). */
constexpr std::size_t rtp_padded_vocab(std::size_t V, int world) noexcept {
  const auto n = static_cast<std::size_t>(world);
  return (V + n - 1) / n * n;
}

/** @brief One buffer of this rank's model data: a shard of a rotation (in the shard store) or a
 *  replica (in host memory, the same on every rank), and where its elements come from. */
using rtp_part = chunkstar::rtp::model_part;

/** @brief The whole GPT of config @p c under RTP on the ranks of @p Comm, its shards in a shard
 *  store @p Store (rtp/shard_store.hpp: host memory by default, or a chunk runtime with
 *  `chunkstar::rtp::chunk_shard_store`). See the file comment.
 *
 *  Every rank of the communicator builds one with the same config and micro-batch shape, calls
 *  `init` (or `load`), then the same sequence of `forward`, `backward`, `step`, `loss` and
 *  `next_token_probs` calls (all collectives), each with its own micro-batch.
 *
 *  **Gradients** are of the *sum* of the ranks' losses scaled by `loss_scale` (each rank's loss
 *  being its micro-batch's mean). They accumulate over `backward` calls until `step` (or
 *  `zero_grad`), which divides by the number of micro-batches it is told.
 *
 *  **Stages.** Each pass runs in stages the store sees (a chunk runtime opens a scope per stage):
 *  "embedding", "h0".."h<L-1>", "head" forward; "head", the blocks in reverse, "embedding"
 *  backward. The stage holds its shards on the compute tier while their rotations run.
 *
 *  **Exception safety.** If a kernel, the store or the communicator throws in a pass, no weight
 *  and no optimizer state has changed, no shift is in flight, and the peers get
 *  `communication_error` (the rotations' guarantee); gradients and activations are unspecified
 *  (zero them before the next step). `step` communicates only for the clipping norm, before it
 *  writes anything.
 */
template <chunkstar::Communicator Comm, chunkstar::rtp::ShardStore Store = chunkstar::rtp::host_shard_store, RtpBackend Backend = cpu_backend>
class rtp_gpt {
 public:
  using backend_type = Backend;
  using block_type = rtp_block<Comm, Backend>;
  using rotation_type = chunkstar::rtp::rotation<Comm, float, backend_buffer_ops<Backend>>;

  /** @brief Partitions @p c over `comm.size()` ranks for micro-batches of @p B sequences of @p Tn
   *  tokens (`config_error` on every rank, naming the field, if the ranks were given different
   *  shapes; naming the dimension and the valid world sizes if the ranks do not divide the heads),
   *  registers this rank's shards in its own @p Store (default-constructed),
   *  and allocates the transit buffers, activations and replicas. */
  rtp_gpt(Comm& comm, const gpt_config& c, std::size_t B, std::size_t Tn)
    requires std::default_initializable<Store>
      : rtp_gpt(comm, std::make_unique<Store>(), nullptr, c, B, Tn, nullptr) {}

  /** @brief The same with the shards in @p store (held by reference, not finalized yet: this
   *  registers the shards and finalizes it; it must outlive the model), the kernels on @p backend
   *  (held by reference; the store's compute tier must be its memory), by default the model's own
   *  CPU backend. */
  rtp_gpt(Comm& comm, Store& store, const gpt_config& c, std::size_t B, std::size_t Tn, Backend* backend = nullptr)
      : rtp_gpt(comm, nullptr, &store, c, B, Tn, backend) {}

  rtp_gpt(const rtp_gpt&) = delete;
  rtp_gpt& operator=(const rtp_gpt&) = delete;
  ~rtp_gpt() = default;

  [[nodiscard]] const gpt_config& config() const noexcept { return c_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int world() const noexcept { return world_; }
  [[nodiscard]] std::size_t batch() const noexcept { return B_; }
  [[nodiscard]] std::size_t seq() const noexcept { return Tn_; }
  [[nodiscard]] std::size_t tokens_per_batch() const noexcept { return B_ * Tn_; }
  /** @brief Rows of the tied embedding including the padding (a multiple of the world size). */
  [[nodiscard]] std::size_t padded_vocab() const noexcept { return vpad_; }
  [[nodiscard]] std::span<const chunkstar::tensor_spec> specs() const noexcept { return specs_; }
  [[nodiscard]] block_type& block(int l) noexcept { return *blocks_[static_cast<std::size_t>(l)]; }
  /** @brief The backend the kernels run on. */
  [[nodiscard]] Backend& backend() const noexcept { return *be_; }
  [[nodiscard]] Store& store() noexcept { return *store_; }
  /** @brief This rank's buffers of model data (see `rtp_part`): the shards first, in store order,
   *  then the replicas. */
  [[nodiscard]] std::span<const rtp_part> parts() const noexcept { return parts_; }

  /** @brief The shard segments rank @p rank registers for part @p p (one tensor of the store
   *  each: "<tensor>@<rank>", its run of the shard, the tensor's role). */
  static std::vector<chunkstar::rtp::shard_segment> segments_of(const rtp_part& p, std::span<const chunkstar::tensor_spec> specs,
                                                                int rank) {
    std::vector<chunkstar::rtp::shard_segment> segs;
    for (const auto& s : p.segments)
      segs.push_back({specs[s.tensor].name + "@" + std::to_string(rank), s.begin, s.end - s.begin, specs[s.tensor].role});
    return segs;
  }
  /** @brief The tensors rank @p rank of @p world registers in its store, in order (what a chunk
   *  layout plans: a trainer sizes the device from them before it builds anything). */
  static std::vector<chunkstar::tensor_spec> shard_tensors(const gpt_config& c, int world, int rank) {
    const auto specs = param_specs(c);
    std::vector<chunkstar::tensor_spec> out;
    for (const auto& p : describe(c, world, rank))
      if (!p.replicated)
        for (const auto& s : segments_of(p, specs, rank))
          out.push_back({s.name, {static_cast<std::int64_t>(s.elems)}, chunkstar::dtype::f32, s.role});
    return out;
  }
  /** @brief Elements of activations a model of @p c on @p world ranks keeps for [B, Tn] batches:
   *  the serial model's, without the [rows, V] logits and probabilities (the head keeps the final
   *  LayerNorm, the log-sum-exp, the losses and the target's logit per token; one [rows, V/N]
   *  slice of logits is the scratch of a step). */
  static std::size_t activation_elems(const gpt_config& c, int world, std::size_t B, std::size_t Tn) {
    const auto sizes = compute_activation_sizes(c, B, Tn);
    const std::size_t N = B * Tn, C = static_cast<std::size_t>(c.width);
    const std::size_t vs = rtp_padded_vocab(static_cast<std::size_t>(c.vocab), world) / static_cast<std::size_t>(world);
    return N * C + sizes.layers * sizes.block + (N * C + 2 * N) + 3 * N + N * C + N * vs;
  }
  /** @brief Elements of the backward workspace: the serial one's, ending in a [rows, V/N] slice. */
  static std::size_t workspace_elems(const gpt_config& c, int world, std::size_t B, std::size_t Tn) {
    const std::size_t N = B * Tn;
    const std::size_t vs = rtp_padded_vocab(static_cast<std::size_t>(c.vocab), world) / static_cast<std::size_t>(world);
    return compute_activation_sizes(c, B, Tn).workspace - N * static_cast<std::size_t>(c.vocab) + N * vs;
  }
  /** @brief Bytes the model takes from its store's compute tier for [B, Tn] batches: activations,
   *  workspace, the rotations' transit buffers, attention's scratch, the working copy and one
   *  pass's gradients of wpe | lnf, and (off host memory) the micro-batch's tokens. */
  static std::size_t compute_tier_bytes(const gpt_config& c, int world, std::size_t B, std::size_t Tn) {
    const std::size_t floats = activation_elems(c, world, B, Tn) + workspace_elems(c, world, B, Tn) +
                               scratch_elems(c, world, B, Tn) + 2 * top_elems(c) + (Backend::host_memory ? 0 : 2 * B * Tn);
    return floats * sizeof(float) + transit_bytes(c, world);
  }
  /** @brief Bytes of the transit buffers: five shards of the largest rotation. */
  static std::size_t transit_bytes(const gpt_config& c, int world) {
    const auto bp = partition_block(c, world);
    const std::size_t vs = rtp_padded_vocab(static_cast<std::size_t>(c.vocab), world) / static_cast<std::size_t>(world);
    return 5 * std::max({vs * static_cast<std::size_t>(c.width), bp.attn_elems(), bp.mlp_elems()}) * sizeof(float);
  }

  /** @brief List @p kind (param, grad, momentum, variance) of part @p k, whole, into @p out
   *  (outside a pass). */
  void read(std::size_t k, chunkstar::chunk_kind kind, std::span<float> out) const {
    if (!parts_.at(k).replicated) return store_->read(k, kind, out);
    const auto l = list_of(replica_at(k), kind);
    std::copy(l.begin(), l.end(), out.begin());
  }
  /** @brief Sets list @p kind of part @p k from @p in (outside a pass). Replicas must be written
   *  alike on every rank. */
  void write(std::size_t k, chunkstar::chunk_kind kind, std::span<const float> in) {
    if (!parts_.at(k).replicated) return store_->write(k, kind, in);
    const auto l = list_of(replica_at(k), kind);
    std::copy(in.begin(), in.end(), l.begin());
    if (kind == chunkstar::chunk_kind::param) publish(k - first_replica());
  }
  /** @brief Clears the accumulated gradients (`step` does it too). */
  void zero_grad() {
    store_->zero_grad();
    for (auto& r : replicas_) std::fill(r.g.begin(), r.g.end(), 0.0f);
  }

  /** @brief Bytes of model data this rank holds: weights, gradients and both Adam moments of its
   *  shards (in the store: a chunk runtime counts its chunks) and of the replicas. */
  [[nodiscard]] std::size_t model_bytes() const noexcept {
    std::size_t n = 0;
    for (const auto& r : replicas_) n += 4 * r.elems;
    return store_->bytes() + n * sizeof(float);
  }
  /** @brief Bytes of the rotations' transit buffers on this rank: one set, shared by every
   *  rotation (they run one at a time), of five shards of the largest. */
  [[nodiscard]] std::size_t transient_bytes() const noexcept { return transit_->bytes(); }
  /** @brief Bytes of activations and the backward workspace on this rank. */
  [[nodiscard]] std::size_t activation_bytes() const noexcept { return (act_elems_ + work_elems_) * sizeof(float); }
  /** @brief Bytes of the largest shard of one rotation (what one shift sends). */
  [[nodiscard]] std::size_t largest_shard_bytes() const noexcept {
    std::size_t n = wte_->shard_bytes();
    for (const auto& b : blocks_) n = std::max({n, b->attention().shard_bytes(), b->mlp().shard_bytes()});
    return n;
  }
  /** @brief Bytes one rank sends in one training iteration (forward, backward): three passes of
   *  every block's rotations, two forward and two backward passes of the embedding's (two of
   *  them backward: weights and gradients), and the all-reduces of the replicated gradients
   *  (the in-process model's (N - 1) x bytes). */
  [[nodiscard]] std::size_t iteration_bytes_theory() const noexcept {
    const std::size_t n1 = static_cast<std::size_t>(world_ - 1);
    std::size_t b = 6 * n1 * wte_->shard_bytes();
    for (const auto& blk : blocks_) b += 3 * n1 * (blk->attention().shard_bytes() + blk->mlp().shard_bytes()) +
                                         n1 * blk->replicated().size() * sizeof(float);
    return b + n1 * top_elems() * sizeof(float);
  }

  /** @brief Flyweight initialisation: this rank's elements only, `init_value` of each. */
  void init(std::uint64_t seed) {
    for_each_part_list(chunkstar::chunk_kind::param,
                       [&](std::size_t t, std::size_t i, float& v) { v = init_value<float>(c_, specs_[t], t, i, seed); });
  }
  /** @brief Takes this rank's elements from the full tensors @p full (e.g. a serial model's). */
  void load(const gpt_params<float>& full) {
    const auto ptrs = param_list(full);
    for_each_part_list(chunkstar::chunk_kind::param, [&](std::size_t t, std::size_t i, float& v) { v = ptrs[t][i]; });
  }
  /** @brief Writes this rank's elements into their places in @p full: every rank storing into one
   *  set of tensors assembles the whole model (replicas are written by every rank, identically). */
  void store(const gpt_params<float>& full) const { store_list(full, chunkstar::chunk_kind::param); }
  /** @brief The same for the accumulated gradients. */
  void store_grads(const gpt_params<float>& full) const { store_list(full, chunkstar::chunk_kind::grad); }

  /** @brief Forward of this rank's micro-batch: returns its mean cross-entropy, keeps the
   *  activations (and a copy of @p tokens and @p targets) for `backward`. Collective. */
  double forward(const int* tokens, const int* targets) {
    pending_ = false;
    const double l = run_forward(B_, Tn_, tokens, targets, nullptr);  // keeps the compute tier's copies of tokens and targets
    const std::size_t N = B_ * Tn_;
    tokens_.assign(tokens, tokens + N);
    targets_.assign(targets, targets + N);
    pending_ = true;
    return l;
  }

  /** @brief Forward only, for evaluation (not part of the training iteration: untraced): the mean
   *  loss; every rank keeps holding its own shards. It reuses the activations, so between a
   *  `forward` and its `backward` it is a `state_error` (evaluate after the step). Collective. */
  double loss(const int* tokens, const int* targets) {
    require_no_pending("loss");
    auto guard = store_->untraced();
    return run_forward(B_, Tn_, tokens, targets, nullptr);
  }

  /** @brief Next-token probabilities after @p context (the last `seq()` tokens of it are used),
   *  rank 0's on every rank (the ranks add the shards' partial outputs in different orders, so
   *  their own roundings differ; sampling must pick the same token everywhere). Untraced.
   *  Collective: every rank passes the same context. */
  std::vector<float> next_token_probs(std::span<const int> context) {
    const std::size_t n = std::min(context.size(), Tn_);
    if (n == 0) throw chunkstar::config_error("rtp_gpt::next_token_probs: the context is empty; pass at least one token");
    require_no_pending("next_token_probs");
    std::vector<int> tokens(context.end() - static_cast<std::ptrdiff_t>(n), context.end()), targets(n, 0);
    std::vector<float> logits(static_cast<std::size_t>(c_.vocab));
    {
      auto guard = store_->untraced();
      run_forward(1, n, tokens.data(), targets.data(), logits.data());
    }
    const float mx = *std::max_element(logits.begin(), logits.end());
    float sum = 0;
    for (auto& z : logits) sum += (z = std::exp(z - mx));
    for (auto& z : logits) z /= sum;
    comm_.broadcast(logits.data(), logits.size() * sizeof(float), 0);
    return logits;
  }

  /** @brief Backward of the last `forward`, which must have been given the same @p tokens and
   *  @p targets (`state_error` without a forward to go back through, `config_error` for other
   *  tokens): adds the gradient of the sum over ranks of `loss_scale` x their mean losses to the
   *  accumulated gradients. Collective. */
  void backward(const int* tokens, const int* targets, float loss_scale = 1.0f) {
    const std::size_t B = B_, Tn = Tn_, N = B * Tn, C = static_cast<std::size_t>(c_.width);
    if (!std::exchange(pending_, false))
      throw chunkstar::state_error("rtp_gpt::backward: no forward to go back through (call forward first; an evaluation or a "
                                   "failed pass in between leaves none)");
    if (!std::equal(tokens, tokens + N, tokens_.begin()) || !std::equal(targets, targets + N, targets_.begin()))
      throw chunkstar::config_error("rtp_gpt::backward: the tokens or targets differ from the forward's; pass the same micro-batch");
    const auto a = bind(B, Tn);
    const auto w = bind_backward_workspace<float>(c_, B, Tn, work_.data());
    Backend& be = *be_;
    const int* tok = compute_tokens(tokens, false);
    const int* tgt = compute_tokens(targets, true);
    float* const top_pass = top_pass_.data();
    be.zero(top_pass, top_elems());
    float* g_lnf_w = top_pass + lnf_offset();
    float* g_lnf_b = g_lnf_w + C;
    // Head: logits per shard recomputed, softmax minus one-hot, into the shard's gradient and dln.
    const float dloss = loss_scale / static_cast<float>(N);
    const std::size_t wte_part = 0;
    stage("head", true, {wte_part}, [&] {
      be.zero(w.dln, N * C);
      wte_->backward(loader(wte_part), [&](int j, std::span<const float> s, std::span<float> g) {
        const std::size_t v0 = static_cast<std::size_t>(j) * vs_, valid = valid_rows(j);
        if (valid == 0) return;
        float* z = a.logits;  // [N, vs]
        be.matmul_forward(z, a.lnf, s.data(), nullptr, N, C, vs_);
        be.head_shard_backward(z, a.lse, tgt, dloss, v0, valid, N, vs_);
        be.matmul_backward(w.dln, g.data(), nullptr, z, a.lnf, s.data(), N, C, vs_);
      }, storer(wte_part));
      be.zero(w.dres, N * C);
      be.layernorm_backward(w.dres, g_lnf_w, g_lnf_b, w.dln, a.block_out(c_.layers), rep(lnf_offset()), a.lnf_mean, a.lnf_rstd, N, C);
    });
    std::vector<float> pass;  // one backward's replica gradients, copied down
    for (int l = c_.layers - 1; l >= 0; --l) {
      const std::size_t ia = 1 + 2 * static_cast<std::size_t>(l);
      block_stage(l, ia, true, [&](rtp_block_io& io) {
        block(l).backward(B, Tn, a.block_out(l), a.blocks[static_cast<std::size_t>(l)], w, &io, scratch_.data());
      });
      pass.resize(block(l).replicated().size());
      block(l).read_replicated(pass, true);
      add_replica_grads(1 + static_cast<std::size_t>(l), pass);
    }
    // Embedding: each token's row gradient goes to the shard holding its id (the head's share of
    // the tied weight was added by the head's stage); the positions' rows are replicas.
    be.position_backward(top_pass, w.dres, N, Tn, C);
    stage("embedding", true, {wte_part}, [&] {
      wte_->backward(loader(wte_part), [&](int j, std::span<const float>, std::span<float> g) {
        be.embedding_shard_backward(g.data(), tok, w.dres, static_cast<std::size_t>(j) * vs_, vs_, N, C);
      }, storer(wte_part));
    });
    be.quiesce();  // the all-reduce reads what the kernels wrote
    chunkstar::rtp::reduce_replicated_grads(comm_, std::span<float>(top_pass, top_elems()));
    pass.resize(top_elems());
    be.from_compute(pass.data(), top_pass, pass.size() * sizeof(float));
    add_replica_grads(0, pass);
  }

  /** @brief What `step` did. */
  struct step_result {
    double grad_norm = 0;  ///< global norm of the averaged gradient over every rank's shards and the replicas once (NaN without clipping)
    float clip_scale = 1;  ///< the factor clipping applied
  };

  /** @brief One local AdamW step of every shard (by the store, where it placed each) and replica:
   *  gradients averaged over @p micro_batches and clipped to @p max_norm (0: off; the norm is
   *  summed over the ranks by one all-reduce, each replica counted once), decay per tensor role
   *  by @p groups; then the gradients are cleared. `optimizer_steps()` counts the steps. */
  step_result step(const chunkstar::adam_hyper& base, const chunkstar::param_groups& groups, int micro_batches, float max_norm = 0.0f) {
    if (micro_batches < 1) throw chunkstar::config_error("rtp_gpt::step: micro_batches must be >= 1");
    const float unscale = 1.0f / static_cast<float>(micro_batches);  // as chunk_adam
    const auto global = [&](double shards) {
      double sq = shards;
      if (rank_ == 0)  // each replica once
        for (const auto& r : replicas_)
          for (const float x : r.g) {
            const double y = static_cast<double>(x * unscale);
            sq += y * y;
          }
      comm_.allreduce(std::span<double>(&sq, 1), chunkstar::reduce_op::sum);
      return sq;
    };
    const auto r = store_->step(base, groups, micro_batches, max_norm, global);
    const chunkstar::adam_step_args args{.step = store_->step_count(), .grad_scale = r.grad_scale};
    for (auto& rp : replicas_) {
      const auto& part = parts_[rp.part];
      for (const auto& s : part.segments) {
        const auto h = groups.hyper_for(specs_[s.tensor], base);
        const std::size_t n = s.end - s.begin;
        chunkstar::adam_update(std::span<float>(rp.w).subspan(s.begin, n), std::span<float>(rp.m).subspan(s.begin, n),
                               std::span<float>(rp.v).subspan(s.begin, n), std::span<const float>(rp.g).subspan(s.begin, n),
                               std::span<float>(), h, args);
      }
      std::fill(rp.g.begin(), rp.g.end(), 0.0f);
    }
    for (std::size_t i = 0; i < replicas_.size(); ++i) publish(i);
    return {r.grad_norm, r.clip_coefficient};
  }
  /** @brief Adam steps taken (restored from a checkpoint with `restore_step_count`). */
  [[nodiscard]] std::int64_t optimizer_steps() const noexcept { return store_->step_count(); }
  void restore_step_count(std::int64_t n) { store_->restore_step_count(n); }

  /** @brief Wall seconds this rank waited for ring shifts (`rtp::rotation_stats::wait_s`), summed
   *  over the embedding's and every block's rotations since construction or `reset_ring_stats()`. */
  [[nodiscard]] double ring_wait_s() const noexcept {
    double s = wte_->stats().wait_s;
    for (const auto& b : blocks_) s += b->attention().stats().wait_s + b->mlp().stats().wait_s;
    return s;
  }
  /** @brief Zeroes every rotation's stats. */
  void reset_ring_stats() noexcept {
    wte_->reset_stats();
    for (auto& b : blocks_) {
      b->attention().reset_stats();
      b->mlp().reset_stats();
    }
  }

 private:
  /** A replica in host memory: the weights (the master copy; `publish` refreshes the working copy
   *  the kernels read: the model's top_c_ or the block's replicated()), the gradient accumulated
   *  over backward passes, the Adam moments. */
  struct replica {
    std::size_t part = 0, elems = 0;
    std::vector<float> w, g, m, v;
  };

  /** @p n floats of the store's compute tier, freed with it. */
  class store_buffer {
   public:
    store_buffer() = default;
    store_buffer(Store& s, std::size_t n) : s_(&s), n_(n), p_(s.allocate(n)) {}
    store_buffer(store_buffer&& o) noexcept
        : s_(std::exchange(o.s_, nullptr)), n_(std::exchange(o.n_, 0)), p_(std::exchange(o.p_, nullptr)) {}
    store_buffer& operator=(store_buffer&& o) noexcept {
      std::swap(s_, o.s_), std::swap(n_, o.n_), std::swap(p_, o.p_);
      return *this;
    }
    ~store_buffer() {
      if (p_) s_->deallocate(p_, n_);
    }
    [[nodiscard]] float* data() const noexcept { return p_; }

   private:
    Store* s_ = nullptr;
    std::size_t n_ = 0;
    float* p_ = nullptr;
  };

  rtp_gpt(Comm& comm, std::unique_ptr<Store> own, Store* shared, const gpt_config& c, std::size_t B, std::size_t Tn,
          Backend* backend)
      : comm_(comm),
        c_(c),
        B_(B),
        Tn_(Tn),
        world_(comm.size()),
        rank_(comm.rank()),
        vpad_(rtp_padded_vocab(static_cast<std::size_t>(c.vocab), comm.size())),
        vs_(vpad_ / static_cast<std::size_t>(comm.size())),
        own_store_(std::move(own)),
        store_(shared ? shared : own_store_.get()),
        specs_(param_specs(c)),
        be_(backend ? backend : &local_backend_) {
    // Before anything that could fail on some ranks only: every rank must build the same model.
    const std::vector<chunkstar::config_field> shape{
        {"vocab", std::to_string(c.vocab)}, {"context", std::to_string(c.context)}, {"layers", std::to_string(c.layers)},
        {"heads", std::to_string(c.heads)}, {"width", std::to_string(c.width)},  {"batch", std::to_string(B)},
        {"seq", std::to_string(Tn)}};
    chunkstar::require_agreement(comm, shape, "rtp_gpt");
    parts_ = describe(c, world_, rank_);
    for (std::size_t k = 0; k < parts_.size(); ++k)
      if (!parts_[k].replicated) store_->add_shard(parts_[k].elems, segments_of(parts_[k], specs_, rank_));
    store_->finalize();
    // The rotations (their transit buffers from the store: non-model memory on the compute tier),
    // after the store is final.
    transit_.emplace([this](std::size_t n) { return store_->allocate(n); }, [this](float* p, std::size_t n) { store_->deallocate(p, n); });
    const std::size_t C = static_cast<std::size_t>(c.width);
    wte_.emplace(comm, vs_ * C, *transit_, chunkstar::rtp::external_shard, backend_buffer_ops<Backend>{be_});
    for (int l = 0; l < c.layers; ++l)
      blocks_.push_back(std::make_unique<block_type>(comm, c, *transit_, chunkstar::rtp::external_shard, be_));
    bind_replicas();
    // Activations: the serial model's, without the [rows, V] logits and probabilities (the head
    // keeps the final LayerNorm, the log-sum-exp, the losses and the target's logit per token; one
    // [rows, V/N] slice of logits is the scratch of a step). The workspace likewise ends in a
    // [rows, V/N] slice. Attention's scratch is shared by the blocks (they run one at a time).
    act_elems_ = activation_elems(c, world_, B, Tn);
    work_elems_ = workspace_elems(c, world_, B, Tn);
    acts_ = store_buffer(*store_, act_elems_);
    work_ = store_buffer(*store_, work_elems_);
    scratch_ = store_buffer(*store_, scratch_elems(c, world_, B, Tn));
    top_c_ = store_buffer(*store_, top_elems());
    top_pass_ = store_buffer(*store_, top_elems());
    if constexpr (!Backend::host_memory) {  // the kernels' copies of the micro-batch (ints in float-sized slots)
      tokens_c_ = store_buffer(*store_, B * Tn);
      targets_c_ = store_buffer(*store_, B * Tn);
    }
  }

  /** The activations of one forward, bound for a [B, Tn] batch. */
  struct acts_view {
    float* encoded;
    std::vector<block_activations<float>> blocks;
    float *lnf, *lnf_mean, *lnf_rstd, *lse, *losses, *zt, *proj, *logits;
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
    a.zt = detail::take(p, N);
    a.proj = detail::take(p, N * C);
    a.logits = detail::take(p, N * vs_);
    return a;
  }

  void require_no_pending(const char* what) const {
    if (pending_)
      throw chunkstar::state_error(std::string("rtp_gpt::") + what +
                                   ": a forward is waiting for its backward, and this pass would overwrite its activations; "
                                   "run backward (and the step) first");
  }

  [[nodiscard]] std::size_t lnf_offset() const noexcept { return static_cast<std::size_t>(c_.context) * static_cast<std::size_t>(c_.width); }
  /** The working copy of wpe | lnf.w | lnf.b the kernels read. */
  [[nodiscard]] const float* rep(std::size_t off) const noexcept { return top_c_.data() + off; }
  /** Elements of wpe | lnf.w | lnf.b. */
  static std::size_t top_elems(const gpt_config& c) noexcept {
    return static_cast<std::size_t>(c.context + 2) * static_cast<std::size_t>(c.width);
  }
  [[nodiscard]] std::size_t top_elems() const noexcept { return top_elems(c_); }
  /** Attention's scratch for a shard's heads, shared by the blocks (at least one float). */
  static std::size_t scratch_elems(const gpt_config& c, int world, std::size_t B, std::size_t Tn) {
    const auto bp = partition_block(c, world);
    return std::max<std::size_t>(1, Backend::attention_scratch_elems(B, Tn, bp.shard_channels, bp.shard_heads));
  }
  [[nodiscard]] std::size_t first_replica() const noexcept { return 1 + 2 * static_cast<std::size_t>(c_.layers); }
  /** Refreshes replica @p i's working copy from its master. */
  void publish(std::size_t i) {
    const auto& w = replicas_[i].w;
    if (i == 0) be_->to_compute(top_c_.data(), w.data(), w.size() * sizeof(float));
    else block(static_cast<int>(i - 1)).write_replicated(w);
  }
  /** @p host (the caller's tokens or targets) where the kernels read them: in place on host
   *  memory; otherwise copied up when @p upload (a forward), or the forward's copy. */
  const int* compute_tokens(const int* host, bool targets, std::size_t N = 0, bool upload = false) {
    if constexpr (Backend::host_memory) {
      return host;
    } else {
      float* dst = (targets ? targets_c_ : tokens_c_).data();
      if (upload) be_->to_compute(dst, host, N * sizeof(int));
      return reinterpret_cast<const int*>(dst);
    }
  }
  /** Rows of shard @p j that are real words (not padding). */
  [[nodiscard]] std::size_t valid_rows(int j) const noexcept {
    const std::size_t v0 = static_cast<std::size_t>(j) * vs_, V = static_cast<std::size_t>(c_.vocab);
    return v0 >= V ? 0 : std::min(vs_, V - v0);
  }

  /** Runs @p f as store stage @p name on the shards @p parts. */
  template <class F>
  void stage(std::string_view name, bool backward, std::initializer_list<std::size_t> parts, F&& f) {
    store_->stage(name, backward, std::span<const std::size_t>(parts.begin(), parts.size()), f);
  }
  /** Block @p l's stage (its attention shard is part @p ia, its MLP shard ia + 1): @p f gets the io
   *  that loads them and takes their gradients. */
  template <class F>
  void block_stage(int l, std::size_t ia, bool backward, F&& f) {
    struct io final : rtp_block_io {
      Store* s;
      std::size_t first;
      io(Store* st, std::size_t k) : s(st), first(k) {}
      void load(int which, std::span<float> dst) override { s->load(first + static_cast<std::size_t>(which), dst); }
      void store_grad(int which, std::span<const float> sum) override { s->add_grad(first + static_cast<std::size_t>(which), sum); }
    } shards(store_, ia);
    const std::string name = "h" + std::to_string(l);
    stage(name, backward, {ia, ia + 1}, [&] { f(shards); });
  }
  auto loader(std::size_t k) {
    return [this, k](std::span<float> d) { store_->load(k, d); };
  }
  auto storer(std::size_t k) {
    return [this, k](std::span<const float> g) { store_->add_grad(k, g); };
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
    Backend& be = *be_;
    const int* tok = compute_tokens(tokens, false, N, true);
    const int* tgt = compute_tokens(targets, true, N, true);
    const std::size_t wte_part = 0;
    // Embedding: a token's row from the shard that holds its id, plus its position's row.
    stage("embedding", false, {wte_part}, [&] {
      wte_->forward(loader(wte_part), [&](int j, std::span<const float> s) {
        be.embedding_shard_forward(a.encoded, tok, s.data(), static_cast<std::size_t>(j) * vs_, vs_, rep(0), N, Tn, C);
      });
    });
    for (int l = 0; l < c_.layers; ++l)
      block_stage(l, 1 + 2 * static_cast<std::size_t>(l), false, [&](rtp_block_io& io) {
        block(l).forward(B, Tn, a.block_out(l), a.blocks[static_cast<std::size_t>(l)], a.proj, &io, scratch_.data());
      });
    // Head: each shard's logits, folded into a running max (in lse) and sum (in losses) per token,
    // the online softmax; the target's logit into zt.
    stage("head", false, {wte_part}, [&] {
      be.fill(a.lse, N, -std::numeric_limits<float>::infinity());
      be.fill(a.losses, N, 0.0f);
      be.fill(a.zt, N, 0.0f);
      be.layernorm_forward(a.lnf, a.lnf_mean, a.lnf_rstd, a.block_out(c_.layers), rep(lnf_offset()), rep(lnf_offset() + C), N, C);
      wte_->forward(loader(wte_part), [&](int j, std::span<const float> s) {
        const std::size_t v0 = static_cast<std::size_t>(j) * vs_, valid = valid_rows(j);
        if (valid == 0) return;
        be.matmul_forward(a.logits, a.lnf, s.data(), nullptr, N, C, vs_);
        be.head_shard_forward(a.lse, a.losses, a.zt, a.logits, tgt, v0, valid, N, vs_);
        if (last_logits) be.from_compute(last_logits + v0, a.logits + (Tn - 1) * vs_, valid * sizeof(float));
      });
    });
    be.head_losses(a.lse, a.losses, a.zt, N);
    losses_.resize(N);
    be.from_compute(losses_.data(), a.losses, N * sizeof(float));
    double total = 0;
    for (const float l : losses_) total += l;
    return total / static_cast<double>(N);
  }

  /** The parts of rank @p me of @p world, in store order: wte's shard, then per block its
   *  attention and MLP shards; then the replicas: the model's (wpe | lnf.w | lnf.b), then each
   *  block's. A pure function of the shapes (the element visitors hold copies of them). */
  static std::vector<rtp_part> describe(const gpt_config& c, int world, int me) {
    const auto specs = param_specs(c);
    const auto bp = partition_block(c, world);  // config_error for a world size the heads do not split over
    const std::size_t C = static_cast<std::size_t>(c.width), V = static_cast<std::size_t>(c.vocab);
    const std::size_t vs = rtp_padded_vocab(V, world) / static_cast<std::size_t>(world);
    std::vector<rtp_part> parts;
    using visit = std::function<void(std::size_t, std::size_t, std::size_t)>;
    const auto add = [&](std::size_t elems, bool replicated, std::function<void(const visit&)> each) {
      rtp_part p;
      p.elems = elems;
      p.replicated = replicated;
      p.for_each = std::move(each);
      // Every tensor occupies one contiguous run of the buffer (the layouts are built so).
      std::vector<std::size_t> lo(specs.size(), SIZE_MAX), hi(specs.size(), 0), count(specs.size(), 0);
      p.for_each([&](std::size_t t, std::size_t, std::size_t off) {
        lo[t] = std::min(lo[t], off);
        hi[t] = std::max(hi[t], off + 1);
        ++count[t];
      });
      for (std::size_t t = 0; t < specs.size(); ++t)
        if (count[t] > 0) {
          if (count[t] != hi[t] - lo[t]) throw chunkstar::state_error("rtp_gpt: tensor " + specs[t].name + " is not contiguous in its shard");
          p.segments.push_back({lo[t], hi[t], t});
        }
      std::sort(p.segments.begin(), p.segments.end(), [](const auto& x, const auto& y) { return x.begin < y.begin; });
      // A shard's padding (wte's rows past the vocabulary, zero and never looked up) belongs to
      // the last segment, so the store's segments tile the shard.
      if (p.segments.empty()) p.segments.push_back({0, elems, 0});
      p.segments.back().end = std::max(p.segments.back().end, elems);
      parts.push_back(std::move(p));
    };
    // The tied embedding: vocabulary rows [me vs, (me + 1) vs), the padding rows never looked up.
    add(vs * C, false, [vs, me, C, V](const visit& f) {
      const std::size_t v0 = static_cast<std::size_t>(me) * vs;
      for (std::size_t r = 0; r < vs && v0 + r < V; ++r)
        for (std::size_t k = 0; k < C; ++k) f(0, (v0 + r) * C + k, r * C + k);
    });
    for (int l = 0; l < c.layers; ++l) {
      const std::size_t base = 2 + tensors_per_block * static_cast<std::size_t>(l);
      add(bp.attn_elems(), false, [bp, base, me](const visit& f) {
        bp.for_each_attention(me, [&](block_tensor t, std::size_t i, std::size_t off) { f(base + static_cast<std::size_t>(t), i, off); });
      });
      add(bp.mlp_elems(), false, [bp, base, me](const visit& f) {
        bp.for_each_mlp(me, [&](block_tensor t, std::size_t i, std::size_t off) { f(base + static_cast<std::size_t>(t), i, off); });
      });
    }
    // wpe | lnf.w | lnf.b, replicated.
    const std::size_t T = static_cast<std::size_t>(c.context), last = specs.size();
    add((T + 2) * C, true, [C, T, last](const visit& f) {
      for (std::size_t i = 0; i < T * C; ++i) f(1, i, i);
      for (std::size_t i = 0; i < C; ++i) f(last - 2, i, T * C + i);
      for (std::size_t i = 0; i < C; ++i) f(last - 1, i, T * C + C + i);
    });
    for (int l = 0; l < c.layers; ++l) {
      const std::size_t base = 2 + tensors_per_block * static_cast<std::size_t>(l);
      add(bp.replicated_elems(), true, [bp, base](const visit& f) {
        bp.for_each_replicated([&](block_tensor t, std::size_t i, std::size_t off) { f(base + static_cast<std::size_t>(t), i, off); });
      });
    }
    return parts;
  }

  /** The replicas: the model's (wpe | lnf.w | lnf.b), then each block's. */
  void bind_replicas() {
    for (std::size_t k = first_replica(); k < parts_.size(); ++k) {
      replica r;
      r.part = k;
      r.elems = parts_[k].elems;
      r.w.assign(r.elems, 0.0f);
      r.g.assign(r.elems, 0.0f);
      r.m.assign(r.elems, 0.0f);
      r.v.assign(r.elems, 0.0f);
      replicas_.push_back(std::move(r));
    }
  }
  /** Adds one backward's (all-reduced) replica gradients to replica @p i's accumulated ones. */
  void add_replica_grads(std::size_t i, std::span<const float> pass) {
    auto& g = replicas_[i].g;
    for (std::size_t e = 0; e < g.size(); ++e) g[e] += pass[e];
  }
  /** The replica that is part @p k (the parts after the shards). */
  replica& replica_at(std::size_t k) { return replicas_.at(k - first_replica()); }
  const replica& replica_at(std::size_t k) const { return replicas_.at(k - first_replica()); }
  /** List @p kind of replica @p r (const or not). */
  template <class R>
  static auto list_of(R& r, chunkstar::chunk_kind kind) {
    using span = std::conditional_t<std::is_const_v<R>, std::span<const float>, std::span<float>>;
    switch (kind) {
      case chunkstar::chunk_kind::param: return span(r.w);
      case chunkstar::chunk_kind::grad: return span(r.g);
      case chunkstar::chunk_kind::momentum: return span(r.m);
      case chunkstar::chunk_kind::variance: return span(r.v);
      default: throw chunkstar::config_error("rtp_gpt: no fp32 master list (the weights are fp32)");
    }
  }

  /** Calls f(tensor, global, value&) for every element of list @p kind of every part, then writes
   *  the parts back. */
  template <class F>
  void for_each_part_list(chunkstar::chunk_kind kind, F&& f) {
    std::vector<float> v;
    for (std::size_t k = 0; k < parts_.size(); ++k) {
      v.resize(parts_[k].elems);
      read(k, kind, v);
      parts_[k].for_each([&](std::size_t t, std::size_t i, std::size_t off) { f(t, i, v[off]); });
      write(k, kind, v);
    }
  }
  void store_list(const gpt_params<float>& full, chunkstar::chunk_kind kind) const {
    const auto ptrs = param_list(full);
    std::vector<float> v;
    for (std::size_t k = 0; k < parts_.size(); ++k) {
      v.resize(parts_[k].elems);
      read(k, kind, v);
      parts_[k].for_each([&](std::size_t t, std::size_t i, std::size_t off) { ptrs[t][i] = v[off]; });
    }
  }

  Comm& comm_;
  gpt_config c_;
  std::size_t B_, Tn_;
  int world_, rank_;
  std::size_t vpad_, vs_;
  std::unique_ptr<Store> own_store_;
  Store* store_;
  std::vector<chunkstar::tensor_spec> specs_;
  std::vector<rtp_part> parts_;
  Backend local_backend_{};  // the kernels, when the caller gives no backend
  Backend* be_;
  std::optional<chunkstar::rtp::transit_buffers<float>> transit_;
  std::optional<rotation_type> wte_;
  std::vector<std::unique_ptr<block_type>> blocks_;
  std::vector<replica> replicas_;
  std::size_t act_elems_ = 0, work_elems_ = 0;
  store_buffer acts_, work_, scratch_;
  store_buffer top_c_, top_pass_;  // wpe [T_max, C] | lnf.w | lnf.b for the kernels, and one backward's gradients of them
  store_buffer tokens_c_, targets_c_;  // the micro-batch on a compute tier that is not host memory
  std::vector<float> losses_;  // the head's per-token losses, summed on the host
  bool pending_ = false;                 // a forward's activations wait for its backward
  std::vector<int> tokens_, targets_;    // that forward's micro-batch
};

static_assert(chunkstar::rtp::ShardedModel<rtp_gpt<chunkstar::single_process_communicator>>);

}  // namespace gpt
