// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `rtp::model_part`: one buffer of a rank's model data under RTP — a shard of a rotation or
 *         a replica every rank holds alike — and where its elements come from; with builders for
 *         the usual buffers (`make_part`, `weight_pair_part`, `replicated_part`).
 *
 *  A part is a pure description: `for_each(f)` calls `f(tensor, global_index, offset)` for every
 *  element it holds (element `global_index` of the model's tensor `tensor` lives at `offset`), and
 *  `segments` are the contiguous runs of one tensor each, which is how a shard store registers the
 *  buffer (weight decay by the tensor's role) and how checkpoints find a tensor's elements.
 *  Initialisation by global index (`counter_init`), checkpoints and loading full tensors all go
 *  through `for_each`, so every world size sees the same model.
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/tensor_spec.hpp>
#include <chunkstar/rtp/weight_pair.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace chunkstar::rtp {

/** @brief One buffer of a rank's model data under RTP: a shard of a rotation (in its shard store)
 *  or a replica (the same on every rank), and where its elements come from. */
struct model_part {
  /** @brief `f(tensor, global_index, offset)`. */
  using element_fn = std::function<void(std::size_t, std::size_t, std::size_t)>;
  std::size_t elems = 0;
  bool replicated = false;
  /** @brief Calls `f(tensor, global_index, offset)` for every element of the buffer: element
   *  `global_index` of tensor `tensor` (an index into the model's specs) is at `offset`. */
  std::function<void(const element_fn&)> for_each;
  /** @brief Contiguous runs of one tensor in the buffer: [begin, end) and the tensor. */
  struct segment {
    std::size_t begin, end, tensor;
  };
  std::vector<segment> segments;
};

/** @brief A part of @p elems elements whose elements @p each visits; its segments are derived from
 *  the visit (every tensor must occupy one contiguous run: `config_error` naming it otherwise).
 *  Elements no tensor claims (padding) join the segment before them, so the segments tile the
 *  buffer. */
inline model_part make_part(std::size_t elems, bool replicated, std::function<void(const model_part::element_fn&)> each,
                            std::span<const tensor_spec> specs) {
  model_part p{.elems = elems, .replicated = replicated, .for_each = std::move(each), .segments = {}};
  std::vector<std::size_t> lo(specs.size(), SIZE_MAX), hi(specs.size(), 0), count(specs.size(), 0);
  p.for_each([&](std::size_t t, std::size_t i, std::size_t off) {
    if (t >= specs.size() || i >= static_cast<std::size_t>(specs[t].numel()) || off >= elems)
      throw config_error("rtp::make_part: element (tensor " + std::to_string(t) + ", index " + std::to_string(i) +
                         ") at offset " + std::to_string(off) + " is outside the model's tensors or the part's " +
                         std::to_string(elems) + " elements");
    lo[t] = std::min(lo[t], off);
    hi[t] = std::max(hi[t], off + 1);
    ++count[t];
  });
  for (std::size_t t = 0; t < specs.size(); ++t)
    if (count[t] > 0) {
      if (count[t] != hi[t] - lo[t])
        throw config_error("rtp::make_part: tensor " + specs[t].name +
                           " is not one contiguous run of the part; order the part so it is");
      p.segments.push_back({lo[t], hi[t], t});
    }
  if (p.segments.empty()) throw config_error("rtp::make_part: the part holds no element of any tensor");
  std::sort(p.segments.begin(), p.segments.end(), [](const auto& x, const auto& y) { return x.begin < y.begin; });
  p.segments.front().begin = 0;
  for (std::size_t s = 1; s < p.segments.size(); ++s) p.segments[s - 1].end = p.segments[s].begin;
  p.segments.back().end = elems;
  return p;
}

/** @brief Shard @p shard of weight pair @p pair (rtp/weight_pair.hpp) as a part: A's weight is
 *  tensor @p a_weight, its bias @p a_bias (ignored without one), B's weight @p b_weight. */
inline model_part weight_pair_part(const weight_pair& pair, std::size_t shard, std::size_t a_weight, std::size_t a_bias,
                                   std::size_t b_weight, std::span<const tensor_spec> specs) {
  return make_part(
      pair.shard_elems(), false,
      [=](const model_part::element_fn& f) {
        pair.for_each(shard, [&](weight_pair::part p, std::size_t i, std::size_t off) {
          f(p == weight_pair::part::a_weight ? a_weight : p == weight_pair::part::a_bias ? a_bias : b_weight, i, off);
        });
      },
      specs);
}

/** @brief Whole tensors @p tensors, one after another, as a replica every rank holds. */
inline model_part replicated_part(std::span<const std::size_t> tensors, std::span<const tensor_spec> specs) {
  struct run {
    std::size_t tensor, offset, elems;
  };
  std::vector<run> runs;
  std::size_t at = 0;
  for (const std::size_t t : tensors) {
    if (t >= specs.size())
      throw config_error("rtp::replicated_part: tensor " + std::to_string(t) + " is not one of the model's");
    runs.push_back({t, at, specs[t].numel()});
    at += specs[t].numel();
  }
  return make_part(
      at, true,
      [runs](const model_part::element_fn& f) {
        for (const run& r : runs)
          for (std::size_t i = 0; i < r.elems; ++i) f(r.tensor, i, r.offset + i);
      },
      specs);
}

}  // namespace chunkstar::rtp
