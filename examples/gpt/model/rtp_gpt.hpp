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
 *  The model is built on the library's pieces for any model under RTP: its state is an
 *  `rtp::sharded_model` (the shards and the replicas — (T + 2)C and 6C per block — in one shard
 *  store, so under the same budget and in the same checkpoints; one step, one global norm counting
 *  each replica once), the tied embedding and head an `rtp::vocab_parallel` on the backend's
 *  kernels (`backend_vocab_kernels`), the blocks `rtp_block`s on the model's rotations.
 *
 *  The kernels run on an `RtpBackend` (gpt_backend.hpp): the CPU's by default, or a GPU's
 *  (`cuda_backend`), where activations, transit buffers and the replicas' working copies and
 *  gradient buffers are device memory from the store's compute tier.
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
#include <chunkstar/optim/param_groups.hpp>
#include <chunkstar/rtp/checkpoint_view.hpp>
#include <chunkstar/rtp/model_part.hpp>
#include <chunkstar/rtp/rotation.hpp>
#include <chunkstar/rtp/shard_store.hpp>
#include <chunkstar/rtp/sharded_model.hpp>
#include <chunkstar/rtp/vocab_parallel.hpp>
#include <chunkstar/runtime/memory_plan.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace gpt {

/** @brief Rows of the tied embedding after padding the vocabulary @p V to a multiple of @p world
 *  (the padding rows are never looked up and their logits are masked). */
constexpr std::size_t rtp_padded_vocab(std::size_t V, int world) noexcept {
  return chunkstar::rtp::padded_vocab(V, world);
}

/** @brief An `RtpBackend`'s embedding and head kernels as the library's `rtp::VocabKernels`. */
template <class Backend>
struct backend_vocab_kernels {
  Backend* b;
  void gather_rows(float* out, const int* tok, const float* shard, std::size_t v0, std::size_t vs, const float* pos,
                   std::size_t N, std::size_t T, std::size_t C) const {
    b->embedding_shard_forward(out, tok, shard, v0, vs, pos, N, T, C);
  }
  void scatter_add_rows(float* g, const int* tok, const float* d, std::size_t v0, std::size_t vs, std::size_t N,
                        std::size_t C) const {
    b->embedding_shard_backward(g, tok, d, v0, vs, N, C);
  }
  void logits(float* z, const float* x, const float* shard, std::size_t N, std::size_t C, std::size_t vs) const {
    b->matmul_forward(z, x, shard, nullptr, N, C, vs);
  }
  void logits_backward(float* dx, float* dshard, const float* dz, const float* x, const float* shard, std::size_t N,
                       std::size_t C, std::size_t vs) const {
    b->matmul_backward(dx, dshard, nullptr, dz, x, shard, N, C, vs);
  }
  void softmax_fold(float* mx, float* sum, float* zt, const float* z, const int* t, std::size_t v0, std::size_t valid,
                    std::size_t N, std::size_t vs) const {
    b->head_shard_forward(mx, sum, zt, z, t, v0, valid, N, vs);
  }
  void finish_losses(float* mx, float* sum, const float* zt, std::size_t N) const { b->head_losses(mx, sum, zt, N); }
  void softmax_grad(float* z, const float* lse, const int* t, float scale, std::size_t v0, std::size_t valid,
                    std::size_t N, std::size_t vs) const {
    b->head_shard_backward(z, lse, t, scale, v0, valid, N, vs);
  }
  void fill(float* p, std::size_t n, float v) const { b->fill(p, n, v); }
  void from_compute(void* dst, const void* src, std::size_t bytes) const { b->from_compute(dst, src, bytes); }
};

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
template <chunkstar::Communicator Comm, chunkstar::rtp::ShardStore Store = chunkstar::rtp::host_shard_store,
          RtpBackend Backend = cpu_backend>
class rtp_gpt {
 public:
  using backend_type = Backend;
  using block_type = rtp_block<Comm, Backend>;
  using rotation_type = chunkstar::rtp::rotation<Comm, float, backend_buffer_ops<Backend>>;
  /** @brief The model's state: its shards and replicas in the store, its rotations. */
  using state_type = chunkstar::rtp::sharded_model<Comm, Store, backend_buffer_ops<Backend>>;
  /** @brief What the rotations carry: the store's weights, fp32 or 16-bit (mixed precision). */
  using element_type = typename state_type::element_type;
  static constexpr bool mixed = state_type::mixed;
  using vocab_type = chunkstar::rtp::vocab_parallel<state_type, backend_vocab_kernels<Backend>>;

  /** @brief Partitions @p c over `comm.size()` ranks for micro-batches of @p B sequences of @p Tn
   *  tokens (`config_error` on every rank, naming the field, if the ranks were given different
   *  shapes; naming the dimension and the valid world sizes if the ranks do not divide the heads),
   *  registers this rank's shards in its own @p Store (default-constructed),
   *  and allocates the transit buffers, activations and replicas. */
  rtp_gpt(Comm& comm, const gpt_config& c, std::size_t B, std::size_t Tn) requires std::default_initializable<Store>
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
  [[nodiscard]] std::span<const rtp_part> parts() const noexcept { return m_->parts(); }
  /** @brief The model's state (parts, rotations, replicas, the step). */
  [[nodiscard]] state_type& state() noexcept { return *m_; }

  /** @brief Between steps (not between a forward and its backward: `state_error`), frees the
   *  compute tier: the activations, the workspace and scratch, the vocabulary pass's buffers, then
   *  the state's (`sharded_model::sleep`: transit buffers, replicas, the store's chunks off the
   *  device). `wake()` allocates them again; the next step's bits are those of a run that never
   *  slept. */
  void sleep() {
    require_no_pending("sleep");
    if (m_->asleep()) throw chunkstar::state_error("rtp_gpt::sleep while asleep: call wake() first");
    acts_ = {}, work_ = {}, scratch_ = {}, tokens_c_ = {}, targets_c_ = {};
    vocab_->sleep();
    m_->sleep();
  }
  void wake() {
    if (!m_->asleep()) throw chunkstar::state_error("rtp_gpt::wake while awake: call sleep() first");
    m_->wake();
    vocab_->wake();
    for (int l = 0; l < c_.layers; ++l) {
      const std::size_t rep = first_replica() + 1 + static_cast<std::size_t>(l);
      blocks_[static_cast<std::size_t>(l)]->rebind_replicas(m_->replica(rep), m_->replica_grad(rep));
    }
    allocate_buffers();
  }

  /** @brief The tensors rank @p rank of @p world registers in its store, in order: one per segment
   *  of each part, the shards' named "<tensor>@<rank>", the replicas' by their tensor (what a chunk
   *  layout plans: a trainer sizes the device from them before it builds anything). */
  static std::vector<chunkstar::tensor_spec> shard_tensors(const gpt_config& c, int world, int rank) {
    const auto specs = param_specs(c);
    std::vector<chunkstar::tensor_spec> out;
    for (const auto& p : describe(c, world, rank))
      for (const auto& s : p.segments)
        out.push_back({p.replicated ? specs[s.tensor].name : specs[s.tensor].name + "@" + std::to_string(rank),
                       {static_cast<std::int64_t>(s.end - s.begin)},
                       chunkstar::dtype_of_v<element_type>,
                       specs[s.tensor].role});
    return out;
  }
  /** @brief The stages rank @p rank of @p world opens, as scopes over `shard_tensors`' indices
   *  (chunkstar::forward_scopes, what `plan_memory` takes): the embedding, each block, the head,
   *  then each replica alone (its gradients' stage, and its working copy's). */
  static chunkstar::forward_scopes stage_scopes(const gpt_config& c, int world, int rank) {
    std::vector<std::vector<std::size_t>> of_part;
    std::size_t t = 0;
    for (const auto& p : describe(c, world, rank)) {
      of_part.emplace_back();
      for (std::size_t s = 0; s < p.segments.size(); ++s) of_part.back().push_back(t++);
    }
    chunkstar::forward_scopes f{of_part[0]};
    for (int l = 0; l < c.layers; ++l) {
      auto blk = of_part[1 + 2 * static_cast<std::size_t>(l)];
      const auto& mlp = of_part[2 + 2 * static_cast<std::size_t>(l)];
      blk.insert(blk.end(), mlp.begin(), mlp.end());
      f.push_back(std::move(blk));
    }
    f.push_back(of_part[0]);
    for (std::size_t k = 1 + 2 * static_cast<std::size_t>(c.layers); k < of_part.size(); ++k) f.push_back(of_part[k]);
    return f;
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
   *  workspace, the rotations' transit buffers, attention's scratch, the replicas' working copies
   *  and one pass's gradients of them, and (off host memory) the micro-batch's tokens. */
  static std::size_t compute_tier_bytes(const gpt_config& c, int world, std::size_t B, std::size_t Tn) {
    const std::size_t replicas =
        top_elems(c) + static_cast<std::size_t>(c.layers) * partition_block(c, world).replicated_elems();
    const std::size_t floats = activation_elems(c, world, B, Tn) + workspace_elems(c, world, B, Tn) +
                               scratch_elems(c, world, B, Tn) + 2 * replicas + (Backend::host_memory ? 0 : 2 * B * Tn) +
                               (mixed ? 2 * largest_shard(c, world) : 0);  // 16-bit: the widened shard and gradient
    return floats * sizeof(float) + transit_bytes(c, world);
  }
  /** @brief Bytes of the transit buffers: five shards of the largest rotation, of the rotations'
   *  element type (half of fp32's in 16-bit; each buffer a whole number of floats). */
  static std::size_t transit_bytes(const gpt_config& c, int world) {
    return 5 * ((largest_shard(c, world) * sizeof(element_type) + 3) / 4 * 4);
  }
  /** @brief Elements of the largest rotated shard (the embedding's, attention's or the MLP's). */
  static std::size_t largest_shard(const gpt_config& c, int world) {
    const auto bp = partition_block(c, world);
    const std::size_t vs = rtp_padded_vocab(static_cast<std::size_t>(c.vocab), world) / static_cast<std::size_t>(world);
    return std::max({vs * static_cast<std::size_t>(c.width), bp.attn_elems(), bp.mlp_elems()});
  }

  /** @brief List @p kind (param, grad, momentum, variance) of part @p k, whole, into @p out
   *  (outside a pass). */
  void read(std::size_t k, chunkstar::chunk_kind kind, std::span<float> out) const { m_->read(k, kind, out); }
  /** @brief Sets list @p kind of part @p k from @p in (outside a pass). Replicas must be written
   *  alike on every rank. */
  void write(std::size_t k, chunkstar::chunk_kind kind, std::span<const float> in) { m_->write(k, kind, in); }
  /** @brief Clears the accumulated gradients (`step` does it too). */
  void zero_grad() { m_->zero_grad(); }

  /** @brief Bytes of model data this rank holds: weights, gradients and both Adam moments of its
   *  shards and replicas (in the store: a chunk runtime counts its chunks). */
  [[nodiscard]] std::size_t model_bytes() const noexcept { return store_->bytes(); }
  /** @brief Bytes of the rotations' transit buffers on this rank: one set, shared by every
   *  rotation (they run one at a time), of five shards of the largest. */
  [[nodiscard]] std::size_t transient_bytes() const noexcept { return m_->transit_bytes(); }
  /** @brief Bytes of activations and the backward workspace on this rank. */
  [[nodiscard]] std::size_t activation_bytes() const noexcept { return (act_elems_ + work_elems_) * sizeof(float); }
  /** @brief Bytes of the largest shard of one rotation (what one shift sends). */
  [[nodiscard]] std::size_t largest_shard_bytes() const noexcept {
    std::size_t n = 0;
    for (std::size_t k = 0; k < first_replica(); ++k) n = std::max(n, m_->rotation_of(k).shard_bytes());
    return n;
  }
  /** @brief Bytes one rank sends in one training iteration (forward, backward): three passes of
   *  every block's rotations, two forward and two backward passes of the embedding's (two of
   *  them backward: weights and gradients), and the all-reduces of the replicated gradients
   *  (the in-process model's (N - 1) x bytes). */
  [[nodiscard]] std::size_t iteration_bytes_theory() const noexcept {
    const std::size_t n1 = static_cast<std::size_t>(world_ - 1);
    std::size_t b = 6 * n1 * m_->rotation_of(0).shard_bytes();
    for (std::size_t l = 0; l < blocks_.size(); ++l) {
      const std::size_t ia = 1 + 2 * l;  // the block's attention and MLP rotations, of the model's element type
      b += 3 * n1 * (m_->rotation_of(ia).shard_bytes() + m_->rotation_of(ia + 1).shard_bytes()) +
           n1 * blocks_[l]->replicated().size() * sizeof(float);
    }
    return b + n1 * top_elems() * sizeof(float);
  }

  /** @brief Flyweight initialisation: this rank's elements only, `init_value` of each. */
  void init(std::uint64_t seed) {
    for_each_part_list(chunkstar::chunk_kind::param, [&](std::size_t t, std::size_t i, float& v) {
      v = init_value<float>(c_, specs_[t], t, i, seed);
    });
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
    require_awake("forward");
    pending_ = false;
    const double l =
        run_forward(B_, Tn_, tokens, targets, nullptr);  // keeps the compute tier's copies of tokens and targets
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
    require_awake("loss");
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
    if (n == 0)
      throw chunkstar::config_error("rtp_gpt::next_token_probs: the context is empty; pass at least one token");
    require_awake("next_token_probs");
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
      throw chunkstar::state_error(
          "rtp_gpt::backward: no forward to go back through (call forward first; an evaluation or a "
          "failed pass in between leaves none)");
    if (!std::equal(tokens, tokens + N, tokens_.begin()) || !std::equal(targets, targets + N, targets_.begin()))
      throw chunkstar::config_error(
          "rtp_gpt::backward: the tokens or targets differ from the forward's; pass the same micro-batch");
    const auto a = bind(B, Tn);
    const auto w = bind_backward_workspace<float>(c_, B, Tn, work_.data());
    Backend& be = *be_;
    const int* tok = compute_tokens(tokens, false);
    const int* tgt = compute_tokens(targets, true);
    const std::size_t top = first_replica();
    float* const top_pass = m_->replica_grad(top);  // this backward's gradients of wpe | lnf.w | lnf.b
    be.zero(top_pass, top_elems());
    float* g_lnf_w = top_pass + lnf_offset();
    float* g_lnf_b = g_lnf_w + C;
    // Head: logits per shard recomputed, softmax minus one-hot, into the shard's gradient and dln.
    be.zero(w.dln, N * C);
    vocab_->loss_backward(a.lnf, tgt, N, loss_scale, w.dln);
    be.zero(w.dres, N * C);
    be.layernorm_backward(w.dres, g_lnf_w, g_lnf_b, w.dln, a.block_out(c_.layers), rep(lnf_offset()), a.lnf_mean,
                          a.lnf_rstd, N, C);
    for (int l = c_.layers - 1; l >= 0; --l)
      block_stage(l, true, [&](auto pass) {
        block(l).backward(B, Tn, a.block_out(l), a.blocks[static_cast<std::size_t>(l)], w, pass, scratch_.data());
      });
    // Embedding: each token's row gradient goes to the shard holding its id (the head's share of
    // the tied weight was added by the head's pass); the positions' rows are replicas.
    be.position_backward(top_pass, w.dres, N, Tn, C);
    vocab_->embed_backward(tok, N, w.dres);
    m_->reduce_replica_grads();  // every replica's gradient summed over the ranks into the store
  }

  /** @brief What `step` did. */
  struct step_result {
    /// global norm of the averaged gradient over every rank's shards and the replicas once (NaN without clipping)
    double grad_norm = 0;
    float clip_scale = 1;  ///< the factor clipping applied
    bool stepped = true;   ///< false: an fp16 overflow skipped it (on every rank)
  };

  /** @brief One local AdamW step of every shard (by the store, where it placed each) and replica:
   *  gradients averaged over @p micro_batches and clipped to @p max_norm (0: off; the norm is
   *  summed over the ranks by one all-reduce, each replica counted once), decay per tensor role
   *  by @p groups; then the gradients are cleared. `optimizer_steps()` counts the steps. */
  /** @brief Before a step's micro-batches: a chunk store's host-stepped updates may start inside the
   *  last backward (rtp::sharded_model::prepare_step); `step` with the same arguments follows. */
  bool prepare_step(const chunkstar::adam_hyper& base, const chunkstar::param_groups& groups, int micro_batches,
                    float max_norm = 0.0f) {
    if (micro_batches < 1) throw chunkstar::config_error("rtp_gpt::prepare_step: micro_batches must be >= 1");
    return m_->prepare_step(base, groups, micro_batches, max_norm);
  }
  step_result step(const chunkstar::adam_hyper& base, const chunkstar::param_groups& groups, int micro_batches,
                   float max_norm = 0.0f) {
    // No local check first: the step compares its arguments across the ranks before anything
    // (step_agreement), so a bad one on one rank stops every rank; the store then refuses it.
    const auto r = m_->step(base, groups, micro_batches, max_norm);
    return {r.grad_norm, r.clip_coefficient, r.stepped};
  }
  /** @brief What `backward`'s loss is to be multiplied by: the store's fp16 loss scale, else 1. */
  [[nodiscard]] float loss_scale() const { return m_->loss_scale(); }
  /** @brief Adam steps taken (restored from a checkpoint with `restore_step_count`). */
  [[nodiscard]] std::int64_t optimizer_steps() const noexcept { return store_->step_count(); }
  void restore_step_count(std::int64_t n) { store_->restore_step_count(n); }

  /** @brief Wall seconds this rank waited for ring shifts (`rtp::rotation_stats::wait_s`), summed
   *  over the embedding's and every block's rotations since construction or `reset_ring_stats()`. */
  [[nodiscard]] double ring_wait_s() const noexcept { return m_->ring_stats().wait_s; }
  /** @brief Zeroes every rotation's stats. */
  void reset_ring_stats() noexcept { m_->reset_ring_stats(); }

 private:
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
        {"vocab", std::to_string(c.vocab)},   {"context", std::to_string(c.context)},
        {"layers", std::to_string(c.layers)}, {"heads", std::to_string(c.heads)},
        {"width", std::to_string(c.width)},   {"batch", std::to_string(B)},
        {"seq", std::to_string(Tn)}};
    chunkstar::require_agreement(comm, shape, "rtp_gpt");
    // The state: every part in the store (shards, then replicas), the rotations on the store's
    // compute tier; the embedding and head on the vocabulary rotation; the blocks on theirs.
    m_.emplace(comm, *store_, specs_, backend_buffer_ops<Backend>{be_});
    for (auto& p : describe(c, world_, rank_)) {
      if (p.replicated) m_->add_replicated(std::move(p));
      else m_->add_rotated(std::move(p));
    }
    m_->finalize();
    vocab_.emplace(*m_, 0, B * Tn, backend_vocab_kernels<Backend>{be_});
    for (int l = 0; l < c.layers; ++l) {
      const std::size_t ia = 1 + 2 * static_cast<std::size_t>(l),
                        rep = first_replica() + 1 + static_cast<std::size_t>(l);
      blocks_.push_back(std::make_unique<block_type>(comm, c, m_->rotation_of(ia), m_->rotation_of(ia + 1),
                                                     m_->replica(rep), m_->replica_grad(rep), be_));
    }
    // Activations: the serial model's, without the [rows, V] logits and probabilities (the head
    // keeps the final LayerNorm here, and in the vocabulary pass's buffers the log-sum-exp, the
    // losses and the target's logit per token and one [rows, V/N] slice of logits). The workspace
    // likewise ends in a [rows, V/N] slice. Attention's scratch is shared by the blocks (they run
    // one at a time).
    act_elems_ = activation_elems(c, world_, B, Tn);
    work_elems_ = workspace_elems(c, world_, B, Tn);
    allocate_buffers();
  }

  void allocate_buffers() {
    acts_ = store_buffer(*store_, act_elems_ - vocab_elems(B_ * Tn_));
    work_ = store_buffer(*store_, work_elems_);
    scratch_ = store_buffer(*store_, scratch_elems(c_, world_, B_, Tn_));
    if constexpr (!Backend::host_memory) {  // the kernels' copies of the micro-batch (ints in float-sized slots)
      tokens_c_ = store_buffer(*store_, B_ * Tn_);
      targets_c_ = store_buffer(*store_, B_ * Tn_);
    }
  }

  /** The activations of one forward, bound for a [B, Tn] batch. */
  struct acts_view {
    float* encoded;
    std::vector<block_activations<float>> blocks;
    float *lnf, *lnf_mean, *lnf_rstd, *proj;
    [[nodiscard]] const float* block_out(int l) const {
      return l == 0 ? encoded : blocks[static_cast<std::size_t>(l) - 1].res3;
    }
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
    a.proj = detail::take(p, N * C);
    return a;
  }

  void require_awake(const char* what) const {
    if (m_->asleep())
      throw chunkstar::state_error(std::string("rtp_gpt::") + what + " while asleep: call wake() first");
  }
  void require_no_pending(const char* what) const {
    if (pending_)
      throw chunkstar::state_error(
          std::string("rtp_gpt::") + what +
          ": a forward is waiting for its backward, and this pass would overwrite its activations; "
          "run backward (and the step) first");
  }

  /** Floats of the vocabulary pass's buffers for @p rows tokens: a [rows, V/N] slice of logits and
   *  three per token (max or log-sum-exp, sum or loss, the target's logit). */
  [[nodiscard]] std::size_t vocab_elems(std::size_t rows) const noexcept { return rows * vs_ + 3 * rows; }
  [[nodiscard]] std::size_t lnf_offset() const noexcept {
    return static_cast<std::size_t>(c_.context) * static_cast<std::size_t>(c_.width);
  }
  /** The working copy of wpe | lnf.w | lnf.b the kernels read. */
  [[nodiscard]] const float* rep(std::size_t off) const noexcept { return m_->replica(first_replica()) + off; }
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
  /** Block @p l's stage (its attention shard is part 1 + 2l, its MLP shard the next): @p f gets
   *  the pass that runs the block's rotations through the model, which loads their shards from the
   *  store and adds their gradients there. */
  template <class F>
  void block_stage(int l, bool backward, F&& f) {
    const std::size_t ia = 1 + 2 * static_cast<std::size_t>(l);
    m_->stage("h" + std::to_string(l), backward, {ia, ia + 1}, [&] {
      f([&](int which, auto&& g) {  // a forward's g(j, shard) or a backward's g(j, shard, grad)
        const std::size_t k = ia + static_cast<std::size_t>(which);
        if constexpr (std::is_invocable_v<decltype(g), int, std::span<const float>>) m_->forward(k, g);
        else m_->backward(k, g);
      });
    });
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
    const int* tok = compute_tokens(tokens, false, N, true);
    const int* tgt = compute_tokens(targets, true, N, true);
    // Embedding: a token's row from the shard that holds its id, plus its position's row.
    vocab_->embed(tok, N, a.encoded, rep(0), Tn);
    for (int l = 0; l < c_.layers; ++l)
      block_stage(l, false, [&](auto pass) {
        block(l).forward(B, Tn, a.block_out(l), a.blocks[static_cast<std::size_t>(l)], a.proj, pass, scratch_.data());
      });
    // Head: the final LayerNorm, then each shard's logits folded into the online softmax.
    be_->layernorm_forward(a.lnf, a.lnf_mean, a.lnf_rstd, a.block_out(c_.layers), rep(lnf_offset()),
                           rep(lnf_offset() + C), N, C);
    return vocab_->loss(a.lnf, tgt, N, Tn - 1, last_logits);
  }

  /** The parts of rank @p me of @p world, in store order: wte's shard, then per block its
   *  attention and MLP shards; then the replicas: the model's (wpe | lnf.w | lnf.b), then each
   *  block's. A pure function of the shapes (the element visitors hold copies of them). */
  static std::vector<rtp_part> describe(const gpt_config& c, int world, int me) {
    using chunkstar::rtp::make_part;
    const auto specs = param_specs(c);
    const auto bp = partition_block(c, world);  // config_error for a world size the heads do not split over
    using visit = rtp_part::element_fn;
    std::vector<rtp_part> parts;
    // The tied embedding: vocabulary rows [me vs, (me + 1) vs), the padding rows never looked up.
    parts.push_back(vocab_type::part(0, world, me, specs));
    for (int l = 0; l < c.layers; ++l) {
      const std::size_t base = 2 + tensors_per_block * static_cast<std::size_t>(l);
      parts.push_back(make_part(
          bp.attn_elems(), false,
          [bp, base, me](const visit& f) {
            bp.for_each_attention(me, [&](block_tensor t, std::size_t i, std::size_t off) {
              f(base + static_cast<std::size_t>(t), i, off);
            });
          },
          specs));
      parts.push_back(make_part(
          bp.mlp_elems(), false,
          [bp, base, me](const visit& f) {
            bp.for_each_mlp(me, [&](block_tensor t, std::size_t i, std::size_t off) {
              f(base + static_cast<std::size_t>(t), i, off);
            });
          },
          specs));
    }
    // wpe | lnf.w | lnf.b, replicated; then each block's replicas.
    const std::size_t last = specs.size();
    const std::vector<std::size_t> top{1, last - 2, last - 1};
    parts.push_back(chunkstar::rtp::replicated_part(top, specs));
    for (int l = 0; l < c.layers; ++l) {
      const std::size_t base = 2 + tensors_per_block * static_cast<std::size_t>(l);
      parts.push_back(make_part(
          bp.replicated_elems(), true,
          [bp, base](const visit& f) {
            bp.for_each_replicated(
                [&](block_tensor t, std::size_t i, std::size_t off) { f(base + static_cast<std::size_t>(t), i, off); });
          },
          specs));
    }
    return parts;
  }

  /** Calls f(tensor, global, value&) for every element of list @p kind of every part, then writes
   *  the parts back. */
  template <class F>
  void for_each_part_list(chunkstar::chunk_kind kind, F&& f) {
    std::vector<float> v;
    const auto parts = m_->parts();
    for (std::size_t k = 0; k < parts.size(); ++k) {
      v.resize(parts[k].elems);
      read(k, kind, v);
      parts[k].for_each([&](std::size_t t, std::size_t i, std::size_t off) { f(t, i, v[off]); });
      write(k, kind, v);
    }
  }
  void store_list(const gpt_params<float>& full, chunkstar::chunk_kind kind) const {
    const auto ptrs = param_list(full);
    std::vector<float> v;
    const auto parts = m_->parts();
    for (std::size_t k = 0; k < parts.size(); ++k) {
      v.resize(parts[k].elems);
      read(k, kind, v);
      parts[k].for_each([&](std::size_t t, std::size_t i, std::size_t off) { ptrs[t][i] = v[off]; });
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
  Backend local_backend_{};  // the kernels, when the caller gives no backend
  Backend* be_;
  std::optional<state_type> m_;                      // parts, rotations, replicas, the step
  std::optional<vocab_type> vocab_;                  // the tied embedding and head on part 0
  std::vector<std::unique_ptr<block_type>> blocks_;  // on m_'s rotations and replicas
  std::size_t act_elems_ = 0, work_elems_ = 0;
  store_buffer acts_, work_, scratch_;
  store_buffer tokens_c_, targets_c_;  // the micro-batch on a compute tier that is not host memory
  bool pending_ = false;               // a forward's activations wait for its backward
  std::vector<int> tokens_, targets_;  // that forward's micro-batch
};

static_assert(chunkstar::rtp::ShardedModel<rtp_gpt<chunkstar::single_process_communicator>>);

}  // namespace gpt
