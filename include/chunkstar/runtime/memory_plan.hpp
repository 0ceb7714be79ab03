// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `plan_memory`: what a run needs per rank, before any memory space exists — the model
 *         data as the runtime pads and shards it, ZeRO's gather and reduction buffers at their
 *         peak, and the compute tier that holds it all with the non-model bytes you give — and
 *         `scope_trace`, the sharding trace a model's scopes make, as the warm-up would record it.
 *
 *  A model is described by its forward scopes: each the tensors (indices in registration order)
 *  that one `rt.forward(...)` opens, in execution order; backward opens the same scopes in reverse
 *  order, as autograd does. That is all the planner needs from the model; the rest comes from the
 *  specs, the layout and the runtime options, exactly as the runtime will use them.
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/tensor_spec.hpp>
#include <chunkstar/layout/chunk_layout.hpp>
#include <chunkstar/runtime/gather_plan.hpp>
#include <chunkstar/runtime/runtime_options.hpp>
#include <chunkstar/runtime/shard_map.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace chunkstar {

/** @brief A model's forward scopes: per scope, the indices of the tensors it opens (see the file comment). */
using forward_scopes = std::vector<std::vector<std::size_t>>;

/** @brief The sharding trace of one iteration of a model with @p scopes laid out by @p plan: its
 *  forward scopes in order, the same in reverse as backward (using the gradients too), then the
 *  optimizer step. Throws `config_error` for a tensor index outside the plan. */
[[nodiscard]] inline sharding_trace scope_trace(const chunk_plan& plan, const forward_scopes& scopes) {
  std::vector<std::vector<std::uint32_t>> chunks;
  for (const auto& s : scopes) {
    std::vector<std::uint32_t> c;
    for (const std::size_t t : s) {
      if (t >= plan.slots.size())
        throw config_error("scope_trace: tensor index " + std::to_string(t) + " is outside the plan's " + std::to_string(plan.slots.size()) +
                           " tensors: a scope lists the indices of registered tensors (registration order)");
      c.push_back(static_cast<std::uint32_t>(plan.slots[t].chunk));
    }
    std::sort(c.begin(), c.end());
    c.erase(std::unique(c.begin(), c.end()), c.end());
    chunks.push_back(std::move(c));
  }
  sharding_trace t;
  for (const auto& c : chunks) {
    t.kinds.push_back(moment_kind::forward);
    t.params.push_back(c);
    t.grads.emplace_back();
  }
  for (auto it = chunks.rbegin(); it != chunks.rend(); ++it) {
    t.kinds.push_back(moment_kind::backward);
    t.params.push_back(*it);
    t.grads.push_back(*it);
  }
  t.kinds.push_back(moment_kind::optimizer);
  t.params.emplace_back();
  t.grads.emplace_back();
  return t;
}

/** @brief What one rank of a run needs (see plan_memory). */
struct memory_plan {
  chunk_plan chunks;                     ///< the layout's plan, padded to whole groups of N chunks under ZeRO (as the runtime pads)
  std::size_t param_chunk_bytes = 0;     ///< one parameter (and gradient) chunk
  std::size_t model_bytes = 0;           ///< every chunk of every list, all ranks together
  std::size_t model_bytes_per_rank = 0;  ///< this rank's: model_bytes / N under ZeRO, all of it otherwise
  std::size_t collective_bytes = 0;      ///< ZeRO: gather and reduction buffers at their peak on the compute tier, the first iteration included (0 otherwise)
  std::size_t non_model_bytes = 0;       ///< as given: the compute tier's non-model peak (activations, workspace)
  int world = 1;
  bool sharded = false;

  /** @brief The compute tier that holds everything at once (a resident run): this rank's model
   *  data, the collective buffers and the non-model peak. */
  [[nodiscard]] std::size_t device_for_resident() const noexcept { return model_bytes_per_rank + collective_bytes + non_model_bytes; }
  /** @brief Device + host (+ disk) a rank needs in all for its model data and buffers. */
  [[nodiscard]] std::size_t total_per_rank() const noexcept { return model_bytes_per_rank + collective_bytes; }
};

/** @brief What one rank of a run of @p specs needs, laid out by @p layout with runtime options @p o
 *  on @p world ranks (ZeRO when `o.sharding.enabled`, in the group or the memory-saving mode),
 *  the model opening @p scopes, and @p non_model_bytes of non-model memory at its peak on the
 *  compute tier. Pure: no memory space, no communication; callable before anything is built.
 *
 *  The collective buffers are the runtime's rules replayed over the scopes (`plan_gathers`, every
 *  gather ahead accepted, which is their most), and with `keep_gathered` over the first iteration
 *  too, which keeps every gathered group until the step; in the memory-saving mode, the most
 *  chunks one scope holds at once (its parameters, its gradients, and the previous scope's
 *  gradients still reducing) plus, with `keep_gathered`, forward's kept chunks. Tested against the
 *  runtime's measured peak (tests/zero/memory_plan.test.cpp): equal in the group mode, with and
 *  without keep_gathered, and in the memory-saving mode; with both memory_saving and
 *  keep_gathered an upper bound (it counts a rank's own chunks as buffers too: 1.2-1.5x there). */
template <ChunkLayout Layout>
[[nodiscard]] memory_plan plan_memory(std::span<const tensor_spec> specs, const Layout& layout, const runtime_options& o, int world,
                                      const forward_scopes& scopes, std::size_t non_model_bytes = 0) {
  if (world < 1) throw config_error("plan_memory: world " + std::to_string(world) + " is not a rank count; pass >= 1");
  memory_plan p;
  p.world = world;
  p.sharded = o.sharding.enabled && world > 1;
  p.non_model_bytes = non_model_bytes;
  p.chunks = layout.plan(specs);
  const shard_map map{o.sharding.enabled ? world : 1, 0};
  p.chunks.num_chunks = map.padded(p.chunks.num_chunks);  // whole groups, as the runtime pads
  p.chunks.chunk_tensors.resize(p.chunks.num_chunks);
  for (const auto& l : make_chunk_lists(p.chunks, {.param_type = o.param_type, .optimizer_state = o.optimizer_state}))
    if (!l.aliases_param) p.model_bytes += l.chunk_bytes * l.num_chunks;
  p.model_bytes_per_rank = o.sharding.enabled ? p.model_bytes / static_cast<std::size_t>(world) : p.model_bytes;
  p.param_chunk_bytes = p.chunks.chunk_elems * dtype_size(o.param_type);
  if (!p.sharded) return p;
  const sharding_trace trace = scope_trace(p.chunks, scopes);
  const std::size_t b = p.param_chunk_bytes;
  if (o.sharding.memory_saving) {
    // Every chunk a scope opens counted as a buffer (its own too: an upper bound per rank).
    std::size_t most = 0, kept = 0;
    for (std::size_t m = 0; m < trace.size(); ++m) {
      const std::size_t before = m > 0 ? trace.grads[m - 1].size() : 0;
      most = std::max(most, (o.sharding.keep_gathered ? 0 : trace.params[m].size()) + trace.grads[m].size() + before);
      kept += o.sharding.keep_gathered && trace.kinds[m] == moment_kind::forward ? trace.params[m].size() : 0;
    }
    p.collective_bytes = (most + kept) * b;
  } else {
    const auto peak = [&](const sharding_trace& t) {
      return plan_gathers(t, {.map = map,
                              .param_chunk_bytes = b,
                              .grad_chunk_bytes = b,
                              .keep_gathered = o.sharding.keep_gathered,
                              .budget = std::vector<std::size_t>(t.size(), std::numeric_limits<std::size_t>::max())})
          .peak_buffer_bytes;
    };
    p.collective_bytes = peak(trace);
    if (o.sharding.keep_gathered && trace.size() >= 2) {
      // The first iteration has no trace to say when a kept group is used for the last time, so it
      // keeps every gathered group until the step: as if the last backward scope used them all.
      sharding_trace first = trace;
      auto& last = first.params[first.size() - 2];
      for (const auto& c : trace.params) last.insert(last.end(), c.begin(), c.end());
      std::sort(last.begin(), last.end());
      last.erase(std::unique(last.begin(), last.end()), last.end());
      p.collective_bytes = std::max(p.collective_bytes, peak(first));
    }
  }
  return p;
}

}  // namespace chunkstar
