// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Checkpoints of a model under RTP in chunkstar's per-tensor safetensors format, the same
 *         files whatever the mode: a checkpoint saved under RTP loads in one process and under
 *         ZeRO, and one saved by either loads under RTP at any world size the model divides.
 *
 *  A model under RTP (`ShardedModel`) tells which of its tensors' elements each of its buffers
 *  holds (`model_part`: a shard of a rotation in its shard store, or a replica) and reads and
 *  writes those buffers. Two views of it model `chunkstar::CheckpointableRuntime`:
 *  - `checkpoint_save_view` (collective construction): every tensor is given to one rank to write,
 *    by bytes, greedily; each of its lists (weights, Adam moments) is summed into that rank by a
 *    rooted reduce in which every rank contributes its own elements and -0.0 everywhere else
 *    (x + -0.0 = x for every float, signed zeros included, so the sum is the tensor's bits). A
 *    rank then holds whole tensors, only its share of them and only while saving. Passed to
 *    `save_checkpoint`, it writes `model-<r>-of-<N>.safetensors` per rank and the index, as ZeRO
 *    does.
 *  - `checkpoint_load_view`: `load_checkpoint` reads every tensor on every rank (one at a time),
 *    and the view keeps this rank's elements.
 *  The optimizer step count travels in the trainer's `checkpoint_extra`, as for the other modes.
 */
#pragma once

#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/core/dtype.hpp>
#include <chunkstar/core/error.hpp>
#include <chunkstar/core/tensor_spec.hpp>
#include <chunkstar/layout/chunk_layout.hpp>
#include <chunkstar/rtp/model_part.hpp>
#include <chunkstar/runtime/param_registry.hpp>
#include <chunkstar/zero/shard_map.hpp>

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace chunkstar::rtp {

/** @brief A model under RTP as its checkpoints see it: its tensors (`specs()`, registration
 *  order), its buffers (`parts()`), and each buffer's lists read and written whole
 *  (`read(k, kind, out)`, `write(k, kind, in)`: weights, momentum, variance). */
template <class M>
concept ShardedModel = requires(M& m, const M& cm, std::size_t k, chunk_kind kind, std::span<float> out,
                                std::span<const float> in) {
  { cm.specs() } -> std::convertible_to<std::span<const tensor_spec>>;
  { cm.parts() } -> std::convertible_to<std::span<const model_part>>;
  cm.read(k, kind, out);
  m.write(k, kind, in);
};

namespace checkpoint_detail {

/** What the checkpoint views answer for `options()`. */
struct view_options {
  dtype param_type = dtype::f32;
};

/** Calls `f(part, global_index, offset)` for every element of tensor @p t this rank holds. */
template <class Model, class F>
void for_each_of(const Model& model, std::size_t t, F&& f) {
  const auto parts = model.parts();
  for (std::size_t k = 0; k < parts.size(); ++k) {
    const auto& p = parts[k];
    if (std::none_of(p.segments.begin(), p.segments.end(), [&](const auto& s) { return s.tensor == t; })) continue;
    p.for_each([&](std::size_t tt, std::size_t i, std::size_t off) {
      if (tt == t) f(k, i, off);
    });
  }
}

}  // namespace checkpoint_detail

/** @brief The save view of a model under RTP (see the file comment). Construct it on every rank at
 *  the same point (it communicates), pass it to `chunkstar::save_checkpoint` on every rank, then drop it. */
template <ShardedModel Model, Communicator Comm>
class checkpoint_save_view {
 public:
  explicit checkpoint_save_view(Model& model, Comm& comm) : model_(model), comm_(comm) {
    const auto specs = model.specs();
    const int n = comm.size(), me = comm.rank();
    // Each tensor to the rank with the fewest bytes so far (ties: the lowest rank): a pure function
    // of the shapes, so every rank computes the same owners.
    std::vector<std::size_t> load(static_cast<std::size_t>(n), 0);
    owner_.resize(specs.size());
    for (std::size_t t = 0; t < specs.size(); ++t) {
      const auto r = static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
      owner_[t] = static_cast<int>(r);
      load[r] += specs[t].numel();
    }
    data_.resize(specs.size());
    // One list of every part at a time, each tensor's elements summed into the rank that writes it.
    const auto parts = model.parts();
    std::vector<std::vector<float>> lists(parts.size());
    std::vector<float> part;
    for (const auto kind : lists_saved) {
      for (std::size_t k = 0; k < parts.size(); ++k) {
        lists[k].resize(parts[k].elems);
        model.read(k, kind, lists[k]);
      }
      for (std::size_t t = 0; t < specs.size(); ++t) {
        part.assign(specs[t].numel(), -0.0f);
        checkpoint_detail::for_each_of(model, t, [&](std::size_t k, std::size_t i, std::size_t off) {
          if (!parts[k].replicated || me == 0) part[i] = lists[k][off];  // a replica once
        });
        auto& out = data_[t][slot(kind)];
        if (owner_[t] == me) out.assign(part.size(), 0.0f);
        comm.reduce(part.data(), out.empty() ? nullptr : out.data(), part.size(), dtype::f32, reduce_op::sum,
                    owner_[t]);
      }
    }
  }

  [[nodiscard]] std::span<const tensor_spec> params() const noexcept { return model_.specs(); }
  [[nodiscard]] checkpoint_detail::view_options options() const noexcept { return {}; }
  [[nodiscard]] bool has_list(chunk_kind k) const noexcept { return k != chunk_kind::master; }
  [[nodiscard]] shard_map shards() const noexcept { return {comm_.size(), comm_.rank()}; }
  [[nodiscard]] Comm& communicator() const noexcept { return comm_; }
  /** @brief The rank that writes tensor @p t. */
  [[nodiscard]] int tensor_owner(std::size_t t) const noexcept { return owner_[t]; }

  void read_tensor(param_id p, chunk_kind kind, std::span<float> out) const {
    const auto& v = data_.at(p.value)[slot(kind)];
    if (v.size() != out.size())
      throw state_error("rtp::checkpoint_save_view: tensor " + model_.specs()[p.value].name + " is written by rank " +
                        std::to_string(owner_[p.value]) + ", not this one");
    std::copy(v.begin(), v.end(), out.begin());
  }
  void write_tensor(param_id, chunk_kind, std::span<const float>) {
    throw state_error("rtp::checkpoint_save_view is for saving; load into the model with rtp::checkpoint_load_view");
  }

 private:
  static constexpr chunk_kind lists_saved[] = {chunk_kind::param, chunk_kind::momentum, chunk_kind::variance};
  static std::size_t slot(chunk_kind k) noexcept {
    return k == chunk_kind::momentum ? 1 : k == chunk_kind::variance ? 2 : 0;
  }

  Model& model_;
  Comm& comm_;
  std::vector<int> owner_;
  std::vector<std::array<std::vector<float>, 3>> data_;  // per tensor: weights, exp_avg, exp_avg_sq (owner only)
};

/** @brief The load view of a model under RTP: `chunkstar::load_checkpoint(view, dir)` on every
 *  rank restores that rank's elements of every tensor (weights and, unless told otherwise, the
 *  Adam moments) from any chunkstar checkpoint of this model — one process's, ZeRO's or RTP's. */
template <ShardedModel Model>
class checkpoint_load_view {
 public:
  explicit checkpoint_load_view(Model& model) : model_(model) {}

  [[nodiscard]] std::span<const tensor_spec> params() const noexcept { return model_.specs(); }
  [[nodiscard]] checkpoint_detail::view_options options() const noexcept { return {}; }
  [[nodiscard]] bool has_list(chunk_kind k) const noexcept { return k != chunk_kind::master; }

  void read_tensor(param_id, chunk_kind, std::span<float>) const {
    throw state_error("rtp::checkpoint_load_view is for loading; save the model with rtp::checkpoint_save_view");
  }
  void write_tensor(param_id p, chunk_kind kind, std::span<const float> in) {
    // Read-modify-write of the parts that hold some of the tensor (a part may hold several).
    const auto parts = model_.parts();
    std::vector<float> v;
    for (std::size_t k = 0; k < parts.size(); ++k) {
      const auto& part = parts[k];
      if (std::none_of(part.segments.begin(), part.segments.end(), [&](const auto& s) { return s.tensor == p.value; }))
        continue;
      v.resize(part.elems);
      model_.read(k, kind, v);
      part.for_each([&](std::size_t t, std::size_t i, std::size_t off) {
        if (t == p.value) v[off] = in[i];
      });
      model_.write(k, kind, v);
    }
  }

 private:
  Model& model_;
};

}  // namespace chunkstar::rtp
