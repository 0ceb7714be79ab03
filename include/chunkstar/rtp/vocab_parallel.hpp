// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `rtp::vocab_parallel`: a tied token embedding and output head under RTP, sharded by
 *         vocabulary rows, with a cross-entropy that never holds the [rows, V] logits — what every
 *         language model needs at both ends.
 *
 *  The embedding E [V, C] is one rotated part of a `sharded_model` (`vocab_parallel::part`), V
 *  padded to a multiple of the world size with rows no token uses and whose logits are masked.
 *  Four passes, each a stage of the model with one rotation of E:
 *  - `embed` (forward): each token's row from the shard that holds its id (a copy: the bits of E);
 *  - `loss` (forward): each shard's logits [rows, V/N] = x E_shard^T, folded into a running maximum
 *    and sum per row (the online softmax), so the log-sum-exp and the loss come out exact to the
 *    rounding of one softmax, without the [rows, V] logits;
 *  - `loss_backward`: each shard's logits recomputed from x, their gradient (softmax minus
 *    one-hot) gives this rank's share of the shard's gradient and adds into x's gradient;
 *  - `embed_backward`: each row's gradient goes to the shard that holds its token.
 *  Both backward passes add into E's accumulated gradient, so the tied weight's gradient is the
 *  head's plus the embedding's, as in a serial model. Memory per rank: E's shard, one [rows, V/N]
 *  slice of logits and four floats per row, on the store's compute tier.
 *
 *  The kernels are a `VocabKernels` (rtp/vocab_kernels.hpp): the host's by default; a device's
 *  plugs in with its memory (the model's `Ops` and store on the same device). Pointers passed in
 *  (x, tokens, targets, gradients) are compute-tier memory.
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/tensor_spec.hpp>
#include <chunkstar/rtp/model_part.hpp>
#include <chunkstar/rtp/sharded_model.hpp>
#include <chunkstar/rtp/vocab_kernels.hpp>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace chunkstar::rtp {

/** @brief Rows of a vocabulary of @p V words padded to a multiple of @p world. */
constexpr std::size_t padded_vocab(std::size_t V, int world) noexcept {
  const auto n = static_cast<std::size_t>(world);
  return (V + n - 1) / n * n;
}

/** @brief See the file comment. `Model` is a `sharded_model`; `K` the kernels. */
template <class Model, VocabKernels K = cpu_vocab_kernels>
class vocab_parallel {
 public:
  /** @brief Shard @p rank of @p world of embedding tensor @p tensor ([V, C] in @p specs) as a part
   *  of rows [rank vs, (rank + 1) vs), vs = padded_vocab(V, world) / world; the padding rows (past
   *  V) hold no element of the tensor. */
  static model_part part(std::size_t tensor, int world, int rank, std::span<const tensor_spec> specs) {
    const auto& s = specs[tensor];
    if (s.shape.size() != 2)
      throw config_error("rtp::vocab_parallel: tensor " + s.name +
                         " is not [vocab, width]; give the embedding as a 2-D tensor");
    const auto V = static_cast<std::size_t>(s.shape[0]), C = static_cast<std::size_t>(s.shape[1]);
    const std::size_t vs = padded_vocab(V, world) / static_cast<std::size_t>(world),
                      v0 = static_cast<std::size_t>(rank) * vs;
    if (v0 >= V)
      throw config_error("rtp::vocab_parallel: " + std::to_string(world) + " ranks leave rank " + std::to_string(rank) +
                         " no word of " + s.name + "'s " + std::to_string(V) + "; use at most " + std::to_string(V) +
                         " ranks");
    return make_part(
        vs * C, false,
        [=](const model_part::element_fn& f) {
          for (std::size_t r = 0; r < vs && v0 + r < V; ++r)
            for (std::size_t k = 0; k < C; ++k) f(tensor, (v0 + r) * C + k, r * C + k);
        },
        specs);
  }

  /** @brief The embedding and loss over part @p part of @p model (built by `part`; the model
   *  finalized), for at most @p max_rows tokens per call; buffers from the model's store. */
  vocab_parallel(Model& model, std::size_t part, std::size_t max_rows, K kernels = K{})
      : m_(model), part_(part), k_(std::move(kernels)), max_rows_(max_rows) {
    const auto& seg = model.parts()[part].segments.front();
    const auto& s = model.specs()[seg.tensor];
    V_ = static_cast<std::size_t>(s.shape[0]);
    C_ = static_cast<std::size_t>(s.shape[1]);
    vs_ = padded_vocab(V_, model.world()) / static_cast<std::size_t>(model.world());
    if (model.parts()[part].elems != vs_ * C_)
      throw config_error("rtp::vocab_parallel: part " + std::to_string(part) + " is not tensor " + s.name +
                         "'s vocabulary shard; build it with vocab_parallel::part");
    if (max_rows == 0) throw config_error("rtp::vocab_parallel: max_rows must be at least 1");
    z_ = take(max_rows * vs_);
    mx_ = take(max_rows);
    sum_ = take(max_rows);
    zt_ = take(max_rows);
  }
  vocab_parallel(const vocab_parallel&) = delete;
  vocab_parallel& operator=(const vocab_parallel&) = delete;
  ~vocab_parallel() {
    for (auto& b : bufs_)
      if (b.p) m_.store().deallocate(b.p, b.n);
  }

  /** @brief Frees its compute-tier buffers (scratch between calls) before the model sleeps;
   *  `wake()` allocates them again. Calls in between are refused by the model's stages. */
  void sleep() noexcept {
    for (auto& b : bufs_) m_.store().deallocate(std::exchange(b.p, nullptr), b.n);
  }
  void wake() {
    for (auto& b : bufs_)
      if (!b.p) b.p = m_.store().allocate(b.n);
    z_ = bufs_[0].p, mx_ = bufs_[1].p, sum_ = bufs_[2].p, zt_ = bufs_[3].p;  // in the order taken
  }

  [[nodiscard]] std::size_t vocab() const noexcept { return V_; }
  [[nodiscard]] std::size_t width() const noexcept { return C_; }
  /** @brief Rows of E per shard (the padded vocabulary / world). */
  [[nodiscard]] std::size_t shard_rows() const noexcept { return vs_; }

  /** @brief out [rows, C] = E[tokens], plus @p positions [period, C] row i mod period when given
   *  (learned absolute positions): stage @p stage (forward). Collective. */
  void embed(const int* tokens, std::size_t rows, float* out, const float* positions = nullptr, std::size_t period = 1,
             std::string_view stage = "embedding") {
    check(rows);
    m_.stage(stage, false, {part_}, [&] {
      m_.forward(part_, [&](int j, std::span<const float> s) {
        k_.gather_rows(out, tokens, s.data(), v0(j), vs_, positions, rows, period, C_);
      });
    });
  }
  /** @brief Adds the gradient @p dout [rows, C] of `embed`'s output into E's gradient: stage
   *  @p stage (backward). Collective. */
  void embed_backward(const int* tokens, std::size_t rows, const float* dout, std::string_view stage = "embedding") {
    check(rows);
    m_.stage(stage, true, {part_}, [&] {
      m_.backward(part_, [&](int j, std::span<const float>, std::span<float> g) {
        k_.scatter_add_rows(g.data(), tokens, dout, v0(j), vs_, rows, C_);
      });
    });
  }
  /** @brief The mean cross-entropy of logits x [rows, C] E^T against @p targets: stage @p stage
   *  (forward). Keeps the log-sum-exp per row for `loss_backward` and the per-row losses
   *  (`losses()`). Collective. */
  double loss(const float* x, const int* targets, std::size_t rows, std::string_view stage = "head") {
    return loss(x, targets, rows, SIZE_MAX, nullptr, stage);
  }
  /** @brief The same, also writing row @p row's logits over the whole vocabulary into @p logits
   *  (V floats, host memory; e.g. to sample the next token). */
  double loss(const float* x, const int* targets, std::size_t rows, std::size_t row, float* logits,
              std::string_view stage = "head") {
    check(rows);
    if (logits && row >= rows)
      throw config_error("rtp::vocab_parallel::loss: logits asked of row " + std::to_string(row) + " of a batch of " +
                         std::to_string(rows) + " rows; pass a row below it");
    m_.stage(stage, false, {part_}, [&] {
      k_.fill(mx_, rows, -std::numeric_limits<float>::infinity());
      k_.fill(sum_, rows, 0.0f);
      k_.fill(zt_, rows, 0.0f);
      m_.forward(part_, [&](int j, std::span<const float> s) {
        if (valid(j) == 0) return;
        k_.logits(z_, x, s.data(), rows, C_, vs_);
        k_.softmax_fold(mx_, sum_, zt_, z_, targets, v0(j), valid(j), rows, vs_);
        if (logits) k_.from_compute(logits + v0(j), z_ + row * vs_, valid(j) * sizeof(float));
      });
    });
    k_.finish_losses(mx_, sum_, zt_, rows);
    losses_.resize(rows);
    k_.from_compute(losses_.data(), sum_, rows * sizeof(float));
    double total = 0;
    for (const float l : losses_) total += l;
    rows_ = rows;
    return total / static_cast<double>(rows);
  }
  /** @brief The per-row losses of the last `loss` (host memory). */
  [[nodiscard]] std::span<const float> losses() const noexcept { return losses_; }
  /** @brief Backward of the last `loss` (the same @p x and @p targets): adds the gradient of
   *  @p scale x the mean loss into E's gradient and into @p dx [rows, C]: stage @p stage (backward).
   *  Collective. */
  void loss_backward(const float* x, const int* targets, std::size_t rows, float scale, float* dx,
                     std::string_view stage = "head") {
    if (rows != rows_)
      throw state_error("rtp::vocab_parallel::loss_backward: " + std::to_string(rows) +
                        " rows, but the last loss had " + std::to_string(rows_) +
                        "; call loss on the same batch first");
    const float dloss = scale / static_cast<float>(rows);
    m_.stage(stage, true, {part_}, [&] {
      m_.backward(part_, [&](int j, std::span<const float> s, std::span<float> g) {
        if (valid(j) == 0) return;
        k_.logits(z_, x, s.data(), rows, C_, vs_);
        k_.softmax_grad(z_, mx_, targets, dloss, v0(j), valid(j), rows, vs_);
        k_.logits_backward(dx, g.data(), z_, x, s.data(), rows, C_, vs_);
      });
    });
  }

 private:
  struct buffer {
    float* p;
    std::size_t n;
  };
  float* take(std::size_t n) {
    bufs_.reserve(bufs_.size() + 1);
    bufs_.push_back({m_.store().allocate(n), n});
    return bufs_.back().p;
  }
  void check(std::size_t rows) const {
    if (rows == 0 || rows > max_rows_)
      throw config_error("rtp::vocab_parallel: " + std::to_string(rows) + " rows, but it was built for 1 to " +
                         std::to_string(max_rows_));
  }
  [[nodiscard]] std::size_t v0(int j) const noexcept { return static_cast<std::size_t>(j) * vs_; }
  [[nodiscard]] std::size_t valid(int j) const noexcept { return v0(j) >= V_ ? 0 : std::min(vs_, V_ - v0(j)); }

  Model& m_;
  std::size_t part_;
  K k_;
  std::size_t max_rows_, V_ = 0, C_ = 0, vs_ = 0, rows_ = 0;
  std::vector<buffer> bufs_;
  float *z_ = nullptr, *mx_ = nullptr, *sum_ = nullptr, *zt_ = nullptr;
  std::vector<float> losses_;
};

}  // namespace chunkstar::rtp
