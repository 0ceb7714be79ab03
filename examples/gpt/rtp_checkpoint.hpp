// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Checkpoints of `gpt::rtp_gpt` in chunkstar's per-tensor safetensors format, the same
 *         files whatever the mode: a checkpoint saved under RTP loads in one process and under
 *         ZeRO, and one saved by either loads under RTP at any world size the model divides.
 *
 *  Two views of an RTP model model `chunkstar::CheckpointableRuntime`:
 *  - `rtp_save_view` (collective construction): every tensor is given to one rank to write, by
 *    bytes, greedily; each of its lists (weights, Adam moments) is summed into that rank by a
 *    rooted reduce in which every rank contributes its own elements and -0.0 everywhere else
 *    (x + -0.0 = x for every float, signed zeros included, so the sum is the tensor's bits). A
 *    rank then holds whole tensors, only its share of them and only while saving. Passed to
 *    `save_checkpoint`, it writes `model-<r>-of-<N>.safetensors` per rank and the index, as ZeRO
 *    does.
 *  - `rtp_load_view`: `load_checkpoint` reads every tensor on every rank (one at a time), and the
 *    view keeps this rank's elements.
 *  The optimizer step count travels in the trainer's `checkpoint_extra`, as for the other modes.
 */
#pragma once

#include "rtp_gpt.hpp"

#include <chunkstar/checkpoint/runtime_checkpoint.hpp>
#include <chunkstar/core/dtype.hpp>
#include <chunkstar/core/error.hpp>
#include <chunkstar/core/tensor_spec.hpp>
#include <chunkstar/runtime/shard_map.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

namespace gpt {

namespace rtp_detail {

/** What the checkpoint views answer for `options()`. */
struct view_options {
  chunkstar::dtype param_type = chunkstar::dtype::f32;
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

}  // namespace rtp_detail

/** @brief The save view of an `rtp_gpt` (see the file comment). Construct it on every rank at the
 *  same point (it communicates), pass it to `chunkstar::save_checkpoint` on every rank, then drop it. */
template <chunkstar::Communicator Comm, class Store = chunkstar::rtp::host_shard_store, RtpBackend Backend = cpu_backend>
class rtp_save_view {
 public:
  explicit rtp_save_view(rtp_gpt<Comm, Store, Backend>& model, Comm& comm) : model_(model), comm_(comm) {
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
        rtp_detail::for_each_of(model, t, [&](std::size_t k, std::size_t i, std::size_t off) {
          if (!parts[k].replicated || me == 0) part[i] = lists[k][off];  // a replica once
        });
        auto& out = data_[t][slot(kind)];
        if (owner_[t] == me) out.assign(part.size(), 0.0f);
        comm.reduce(part.data(), out.empty() ? nullptr : out.data(), part.size(), chunkstar::dtype::f32,
                    chunkstar::reduce_op::sum, owner_[t]);
      }
    }
  }

  [[nodiscard]] std::span<const chunkstar::tensor_spec> params() const noexcept { return model_.specs(); }
  [[nodiscard]] rtp_detail::view_options options() const noexcept { return {}; }
  [[nodiscard]] bool has_list(chunkstar::chunk_kind k) const noexcept { return k != chunkstar::chunk_kind::master; }
  [[nodiscard]] chunkstar::shard_map shards() const noexcept { return {comm_.size(), comm_.rank()}; }
  [[nodiscard]] Comm& communicator() const noexcept { return comm_; }
  /** @brief The rank that writes tensor @p t. */
  [[nodiscard]] int tensor_owner(std::size_t t) const noexcept { return owner_[t]; }

  void read_tensor(chunkstar::param_id p, chunkstar::chunk_kind kind, std::span<float> out) const {
    const auto& v = data_.at(p.value)[slot(kind)];
    if (v.size() != out.size())
      throw chunkstar::state_error("rtp_save_view: tensor " + model_.specs()[p.value].name + " is written by rank " +
                                   std::to_string(owner_[p.value]) + ", not this one");
    std::copy(v.begin(), v.end(), out.begin());
  }
  void write_tensor(chunkstar::param_id, chunkstar::chunk_kind, std::span<const float>) {
    throw chunkstar::state_error("rtp_save_view is for saving; load into an rtp_gpt with rtp_load_view");
  }

 private:
  static constexpr chunkstar::chunk_kind lists_saved[] = {chunkstar::chunk_kind::param, chunkstar::chunk_kind::momentum,
                                                    chunkstar::chunk_kind::variance};
  static std::size_t slot(chunkstar::chunk_kind k) noexcept {
    return k == chunkstar::chunk_kind::momentum ? 1 : k == chunkstar::chunk_kind::variance ? 2 : 0;
  }

  rtp_gpt<Comm, Store, Backend>& model_;
  Comm& comm_;
  std::vector<int> owner_;
  std::vector<std::array<std::vector<float>, 3>> data_;  // per tensor: weights, exp_avg, exp_avg_sq (owner only)
};

/** @brief The load view of an `rtp_gpt`: `chunkstar::load_checkpoint(view, dir)` on every rank
 *  restores that rank's elements of every tensor (weights and, unless told otherwise, the Adam
 *  moments) from any chunkstar checkpoint of this model — one process's, ZeRO's or RTP's. */
template <chunkstar::Communicator Comm, class Store = chunkstar::rtp::host_shard_store, RtpBackend Backend = cpu_backend>
class rtp_load_view {
 public:
  explicit rtp_load_view(rtp_gpt<Comm, Store, Backend>& model) : model_(model) {}

  [[nodiscard]] std::span<const chunkstar::tensor_spec> params() const noexcept { return model_.specs(); }
  [[nodiscard]] rtp_detail::view_options options() const noexcept { return {}; }
  [[nodiscard]] bool has_list(chunkstar::chunk_kind k) const noexcept { return k != chunkstar::chunk_kind::master; }

  void read_tensor(chunkstar::param_id, chunkstar::chunk_kind, std::span<float>) const {
    throw chunkstar::state_error("rtp_load_view is for loading; save an rtp_gpt with rtp_save_view");
  }
  void write_tensor(chunkstar::param_id p, chunkstar::chunk_kind kind, std::span<const float> in) {
    // Read-modify-write of the parts that hold some of the tensor (a part may hold several).
    const auto parts = model_.parts();
    std::vector<float> v;
    for (std::size_t k = 0; k < parts.size(); ++k) {
      const auto& part = parts[k];
      if (std::none_of(part.segments.begin(), part.segments.end(), [&](const auto& s) { return s.tensor == p.value; })) continue;
      v.resize(part.elems);
      model_.read(k, kind, v);
      part.for_each([&](std::size_t t, std::size_t i, std::size_t off) {
        if (t == p.value) v[off] = in[i];
      });
      model_.write(k, kind, v);
    }
  }

 private:
  rtp_gpt<Comm, Store, Backend>& model_;
};

}  // namespace gpt
