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
#include <chunkstar/core/units.hpp>
#include <chunkstar/layout/chunk_layout.hpp>
#include <chunkstar/zero/gather_plan.hpp>
#include <chunkstar/runtime/runtime_options.hpp>
#include <chunkstar/zero/shard_map.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <utility>
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
        throw config_error("scope_trace: tensor index " + std::to_string(t) + " is outside the plan's " +
                           std::to_string(plan.slots.size()) +
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

/** @brief A warm-up's non-model bytes per moment (@p tracer: a `Tracer` with a trace, e.g. the
 *  runtime's `warmup_tracer`), one entry per moment of `scope_trace`: each forward and backward
 *  scope's peak, then the optimizer step's (the runtime records a moment per chunk it steps: their
 *  peak). Empty before a trace exists. */
template <class T>
[[nodiscard]] std::vector<std::size_t> traced_non_model(const T& tracer) {
  std::vector<std::size_t> out;
  bool step = false;
  for (std::size_t m = 0; m < tracer.num_moments(); ++m) {
    const std::size_t b = tracer.non_model_peak(m);
    if (tracer.kind_of(m) != moment_kind::optimizer) {
      out.push_back(b);
    } else if (!step) {
      out.push_back(b);
      step = true;
    } else {
      out.back() = std::max(out.back(), b);
    }
  }
  return out;
}

/** @brief A non-model profile for `plan_memory` without a trace: @p peak during every forward and
 *  backward scope of @p scopes, nothing during the optimizer step (activations live in the passes). */
[[nodiscard]] inline std::vector<std::size_t> passes_non_model(const forward_scopes& scopes, std::size_t peak) {
  std::vector<std::size_t> p(2 * scopes.size() + 1, peak);
  p.back() = 0;
  return p;
}

/** @brief What one rank of a run needs (see plan_memory). */
struct memory_plan {
  chunk_plan chunks;  ///< the layout's plan, padded to whole groups of N chunks under ZeRO (as the runtime pads)
  std::size_t param_chunk_bytes = 0;     ///< one parameter (and gradient) chunk
  std::size_t model_bytes = 0;           ///< every chunk of every list, all ranks together
  std::size_t model_bytes_per_rank = 0;  ///< this rank's: model_bytes / N under ZeRO, all of it otherwise
  /// ZeRO: gather and reduction buffers at their peak on the compute tier, the first iteration included (0 otherwise)
  std::size_t collective_bytes = 0;
  /// as given: the compute tier's non-model peak (activations, workspace; a profile's highest)
  std::size_t non_model_bytes = 0;
  /** The most parameter and gradient chunks of its own one scope opens, which must be on the
   *  compute tier at once (the optimizer state may stay below; under ZeRO the rank's own chunks of
   *  the scope's groups, the rest being collective buffers; in the memory-saving mode its own
   *  parameter chunks only, its gradients being accumulated in buffers — and none when it keeps
   *  gathered chunks, whose buffers count them). */
  std::size_t largest_scope_bytes = 0;
  /** The compute tier's peak beside the rank's own chunks: the collective buffers and the
   *  non-model bytes at their highest together — moment by moment when a non-model profile was
   *  given (a warm-up's trace, `passes_non_model`), else the sum of the two peaks (an upper bound). */
  std::size_t transient_peak_bytes = 0;
  /** A resident run's compute tier at its peak, moment by moment: the rank's own chunks (a
   *  gradient chunk under ZeRO only from its first reduction to the step; one process keeps them all),
   *  the collective buffers and the non-model bytes of that moment. */
  std::size_t resident_peak_bytes = 0;
  int world = 1;
  bool sharded = false;
  bool memory_saving = false;  ///< ZeRO's memory-saving mode

  /** @brief The compute tier that holds everything at once (a resident run): `resident_peak_bytes`,
   *  this rank's model data, the collective buffers and the non-model bytes at their peak moment.
   *  Resident means a placement that keeps every chunk and its step there
   *  (`static_placement::all_device()`); `auto_placement` on the same device keeps a margin and steps
   *  some chunks on the host, so chunks still move. `finalize()` puts every chunk on the host, so
   *  even a resident run loads them in its first iteration. */
  [[nodiscard]] std::size_t device_for_resident() const noexcept { return resident_peak_bytes; }
  /** @brief The least compute tier a run that moves chunks can use: the non-model peak, the
   *  collective buffers and the largest scope's chunks (below it some scope cannot open). */
  [[nodiscard]] std::size_t device_floor() const noexcept { return transient_peak_bytes + largest_scope_bytes; }
  /** @brief The host a disk tier needs: a host-side optimizer step holds up to five chunks of a
   *  list and chunks pass through the host on their way to and from the disk — eight fp32 chunks.
   *  What admit() asks for and the tests train with, not a measured least host like device_floor()
   *  (the chunks are counted unrounded, and a somewhat smaller host may still train). */
  [[nodiscard]] std::size_t host_floor_with_disk() const noexcept { return 8 * chunks.chunk_elems * sizeof(float); }
  /** @brief Device + host (+ disk) a rank needs in all for its model data and buffers. */
  [[nodiscard]] std::size_t total_per_rank() const noexcept { return model_bytes_per_rank + collective_bytes; }
};

/** @brief What one rank of a run of @p specs needs, laid out by @p layout with runtime options @p o
 *  on @p world ranks (ZeRO when `o.sharding.enabled`, in the group or the memory-saving mode),
 *  the model opening @p scopes, and @p non_model_bytes of non-model memory at its peak on the
 *  compute tier. Pure: no memory space, no communication; callable before anything is built.
 *
 *  The largest scope's own parameter and gradient chunks beside that peak give the least device a
 *  run that moves chunks needs (`device_floor`: tested to be exact unsharded). The collective buffers are the runtime's
 *  rules replayed over the scopes (`plan_gathers`, every
 *  gather ahead accepted, which is their most), and with `keep_gathered` over the first iteration
 *  too, which keeps every gathered group until the step; in the memory-saving mode, the most
 *  chunks one scope holds at once (its parameters, its gradients, and the previous scope's
 *  gradients still reducing) plus, with `keep_gathered`, forward's kept chunks. Tested against the
 *  runtime's measured peak (tests/zero/memory_plan.test.cpp): equal in the group mode, with and
 *  without keep_gathered, and in the memory-saving mode; with both memory_saving and
 *  keep_gathered an upper bound (it counts a rank's own chunks as buffers too: 1.2-1.5x there). */
template <ChunkLayout Layout>
[[nodiscard]] memory_plan plan_memory(std::span<const tensor_spec> specs, const Layout& layout,
                                      const runtime_options& o, int world, const forward_scopes& scopes,
                                      std::size_t non_model_bytes = 0) {
  return plan_memory(specs, layout, o, world, scopes, std::span<const std::size_t>(&non_model_bytes, 1));
}

/** @brief The same with the non-model bytes per moment of the iteration (@p non_model_profile:
 *  one entry per moment of `scope_trace(plan, scopes)` — its forward scopes, backward scopes and
 *  the step — e.g. a warm-up's `warmup_tracer::non_model_peak(m)`; one entry: a peak at every
 *  moment), so the compute tier's peak is the largest sum moment by moment, not the sum of the
 *  peaks. */
template <ChunkLayout Layout>
[[nodiscard]] memory_plan plan_memory(std::span<const tensor_spec> specs, const Layout& layout,
                                      const runtime_options& o, int world, const forward_scopes& scopes,
                                      std::span<const std::size_t> non_model_profile) {
  if (world < 1) throw config_error("plan_memory: world " + std::to_string(world) + " is not a rank count; pass >= 1");
  memory_plan p;
  p.world = world;
  p.sharded = o.sharding.enabled && world > 1;
  p.memory_saving = p.sharded && o.sharding.memory_saving;
  for (const std::size_t b : non_model_profile) p.non_model_bytes = std::max(p.non_model_bytes, b);
  p.chunks = layout.plan(specs);
  p.chunks.num_chunks =
      shard_map{o.sharding.enabled ? world : 1, 0}.padded(p.chunks.num_chunks);  // whole groups, as the runtime pads
  p.chunks.chunk_tensors.resize(p.chunks.num_chunks);
  for (const auto& l : make_chunk_lists(p.chunks, {.param_type = o.param_type, .optimizer_state = o.optimizer_state}))
    if (!l.aliases_param) p.model_bytes += l.chunk_bytes * l.num_chunks;
  p.model_bytes_per_rank = o.sharding.enabled ? p.model_bytes / static_cast<std::size_t>(world) : p.model_bytes;
  p.param_chunk_bytes = p.chunks.chunk_elems * dtype_size(o.param_type);
  const sharding_trace trace = scope_trace(p.chunks, scopes);
  if (non_model_profile.size() > 1 && non_model_profile.size() != trace.size())
    throw config_error("plan_memory: a non-model profile of " + std::to_string(non_model_profile.size()) +
                       " moments for an iteration of " + std::to_string(trace.size()) +
                       " (forward scopes, backward scopes, the step): give one entry per moment, or one peak");
  const auto non_model_at = [&](std::size_t m) {
    return non_model_profile.size() > 1 ? non_model_profile[m] : p.non_model_bytes;
  };
  std::vector<std::size_t> buffers(trace.size(), 0);  // collective buffers per moment
  const shard_map map{o.sharding.enabled ? world : 1, 0};
  const auto finish = [&] {
    // The compute tier's transient bytes. In backward a scope frees activations as it goes and
    // starts its reductions when its gradients are final, so its peaks fall at its two ends: at its
    // opening its own non-model peak beside the previous moment's buffers, at its close its buffers
    // (and its new gradient chunks) beside what the next backward moment opens with. A run that
    // moves chunks may open a scope's buffers before the previous scope's are gone, so its floor
    // takes the larger of the two at the opening (the floor test trains there; the resident rule
    // alone ran out of memory in the memory-saving mode).
    const std::size_t M = trace.size();
    const bool profiled = non_model_profile.size() > 1;
    const auto backward = [&](std::size_t m) { return m < M && trace.kinds[m] == moment_kind::backward; };
    const auto opening = [&](std::size_t m) { return (m > 0 ? buffers[m - 1] : 0) + non_model_at(m); };
    const auto opening_moving = [&](std::size_t m) {
      return std::max(m > 0 ? buffers[m - 1] : 0, buffers[m]) + non_model_at(m);
    };
    const auto closing = [&](std::size_t m) { return buffers[m] + (backward(m + 1) ? non_model_at(m + 1) : 0); };
    p.transient_peak_bytes = p.collective_bytes + (profiled ? 0 : p.non_model_bytes);
    for (std::size_t m = 0; m < M; ++m)
      p.transient_peak_bytes =
          std::max(p.transient_peak_bytes,
                   profiled && backward(m) ? std::max(opening_moving(m), closing(m)) : buffers[m] + non_model_at(m));
    // Rank 0's own chunks (every rank owns as many: the plan is padded to whole groups); under ZeRO
    // their gradient chunks hold a payload from their first reduction to the step.
    const std::size_t gb = p.param_chunk_bytes;
    std::size_t own = 0, live = 0;
    for (std::uint32_t c = 0; c < p.chunks.num_chunks; ++c) own += map.owner(c) == 0;
    const std::size_t base = p.model_bytes_per_rank - own * gb;
    std::vector<char> seen(p.chunks.num_chunks, 0);
    if (!p.sharded) {  // one process keeps its gradient chunks from one iteration to the next (zeroed ahead)
      live = own;
      std::fill(seen.begin(), seen.end(), char{1});
    }
    for (std::size_t m = 0; m < M; ++m) {
      const std::size_t before = base + live * gb;
      if (trace.kinds[m] == moment_kind::optimizer) live = own;
      for (const std::uint32_t c : trace.grads[m])
        if (map.owner(c) == 0 && !std::exchange(seen[c], 1)) ++live;
      const std::size_t after = base + live * gb;
      p.resident_peak_bytes =
          std::max(p.resident_peak_bytes, profiled && backward(m) ? std::max(before + opening(m), after + closing(m))
                                                                  : after + buffers[m] + non_model_at(m));
    }
    return p;
  };
  // The memory-saving mode accumulates every gradient in a buffer and, keeping gathered chunks,
  // counts a scope's own parameter chunks as buffers too; otherwise they are on the device beside them.
  const std::size_t own_kinds = !p.memory_saving ? 2 : o.sharding.keep_gathered ? 0 : 1;
  for (const auto& cs : trace.params) {
    std::size_t own = 0;
    for (const std::uint32_t c : cs) own += map.owner(c) == 0;
    p.largest_scope_bytes = std::max(p.largest_scope_bytes, own * own_kinds * p.param_chunk_bytes);
  }
  if (!p.sharded) return finish();
  const std::size_t b = p.param_chunk_bytes;
  if (o.sharding.memory_saving) {
    // Every chunk a scope opens counted as a buffer (its own too: an upper bound per rank).
    std::size_t most = 0, kept = 0;
    for (std::size_t m = 0; m < trace.size(); ++m) {
      const std::size_t before = m > 0 ? trace.grads[m - 1].size() : 0;
      const std::size_t now = (o.sharding.keep_gathered ? 0 : trace.params[m].size()) + trace.grads[m].size() + before;
      most = std::max(most, now);
      kept += o.sharding.keep_gathered && trace.kinds[m] == moment_kind::forward ? trace.params[m].size() : 0;
      // This moment's buffers beside rank 0's own chunks: its own parameter chunks are their own
      // send buffers (already in the model data), every gradient chunk is accumulated in one.
      std::size_t own_params = 0;
      for (const std::uint32_t c : trace.params[m]) own_params += map.owner(c) == 0;
      buffers[m] = (now - (o.sharding.keep_gathered ? 0 : own_params)) * b;
    }
    p.collective_bytes = (most + kept) * b;
    if (kept > 0) std::fill(buffers.begin(), buffers.end(), p.collective_bytes);  // kept chunks: no profile
  } else {
    const auto peak = [&](const sharding_trace& t) {
      const gather_plan g =
          plan_gathers(t, {.map = map,
                           .param_chunk_bytes = b,
                           .grad_chunk_bytes = b,
                           .keep_gathered = o.sharding.keep_gathered,
                           .budget = std::vector<std::size_t>(t.size(), std::numeric_limits<std::size_t>::max())});
      for (std::size_t m = 0; m < std::min(buffers.size(), g.buffers.size()); ++m)
        buffers[m] = std::max(buffers[m], g.buffers[m]);
      return g.peak_buffer_bytes;
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
  return finish();
}

/** @brief The memory one rank of a run is given, per tier (`unbounded` for no limit). */
struct tier_budgets {
  static constexpr std::size_t unbounded = std::numeric_limits<std::size_t>::max();
  std::size_t device = 0;        ///< the compute tier
  std::size_t host = unbounded;  ///< host memory for chunks
  std::size_t disk = 0;          ///< a disk tier's file (0: none)
};

/** @brief Whether a plan fits its budgets (see `admit`). */
struct admission {
  std::size_t device_short = 0;  ///< bytes the compute tier lacks below `device_floor()`
  std::size_t host_short = 0;    ///< with a disk tier: bytes the host lacks below `host_floor_with_disk()`
  std::size_t total_short = 0;  ///< bytes all tiers together lack for the rank's model data, buffers and non-model peak
  [[nodiscard]] bool fits() const noexcept { return device_short == 0 && host_short == 0 && total_short == 0; }
  /** @brief Each shortfall in bytes and what would fix it; empty when it fits. */
  std::string message;
};

/** @brief Decides, before anything is built, whether a run of plan @p p fits @p b: the compute tier
 *  must hold `p.device_floor()` (the non-model peak, the collective buffers and the largest
 *  scope's chunks), the host with a disk tier `p.host_floor_with_disk()`, and the tiers together
 *  what the rank holds at its peak moment (`resident_peak_bytes`: a chunk lives in one tier at a
 *  time). Pure. */
[[nodiscard]] inline admission admit(const memory_plan& p, const tier_budgets& b) {
  admission a;
  const auto add = [](std::size_t x, std::size_t y) {
    return x > tier_budgets::unbounded - y ? tier_budgets::unbounded : x + y;
  };
  const std::size_t floor = p.device_floor(), need = p.resident_peak_bytes;
  const auto exact = [](std::size_t x) {  // a figure a budget can be set from
    return x < 1024 ? format_bytes(x) : format_bytes(x) + " (" + std::to_string(x) + " B)";
  };
  const std::size_t have = add(add(b.device, b.host), b.disk);
  a.device_short = b.device < floor ? floor - b.device : 0;
  a.host_short = b.disk > 0 && b.host < p.host_floor_with_disk() ? p.host_floor_with_disk() - b.host : 0;
  a.total_short = have < need ? need - have : 0;
  if (a.device_short > 0)
    a.message += "the device is " + format_bytes(a.device_short) + " short of the least this run can use, " +
                 exact(floor) + " (non-model memory and collective buffers at their peak " +
                 format_bytes(p.transient_peak_bytes) +
                 (p.largest_scope_bytes
                      ? ", the largest scope's parameter and gradient chunks " + format_bytes(p.largest_scope_bytes)
                      : "") +
                 "): give the device more memory, lower the non-model peak (a smaller batch) or use smaller chunks" +
                 (p.sharded && !p.memory_saving ? " (or ZeRO's memory-saving mode, if its plan fits)" : "") + ".";
  if (a.host_short > 0)
    a.message += std::string(a.message.empty() ? "" : " ") + "with a disk tier the host is " +
                 format_bytes(a.host_short) + " short of the " + exact(p.host_floor_with_disk()) +
                 " a host-side step and the chunks passing to and from the disk " + "need (eight chunks of " +
                 format_bytes(p.host_floor_with_disk() / 8) + "): give the host more room or use smaller chunks.";
  if (a.total_short > 0)
    a.message += std::string(a.message.empty() ? "" : " ") + "device, host and disk together are " +
                 format_bytes(a.total_short) + " short of the " + exact(need) +
                 " this rank holds at its peak (model data " + format_bytes(p.model_bytes_per_rank) +
                 ", buffers and non-model memory): " +
                 "give the host or a disk tier more room, or shard the model over more ranks.";
  return a;
}

/** @brief The largest size in [@p lo, @p hi] whose plan fits: `plan_for(size)` returns the
 *  `memory_plan` of a model of that size (a width, a depth), tried from @p hi down with `admit`
 *  (not by bisection: chunk packing makes fitting non-monotone — a wider model can pack into
 *  fewer chunks). Returns @p lo - 1 when none fits. Pure when `plan_for` is. */
template <class PlanFor>
[[nodiscard]] std::int64_t largest_admitted(std::int64_t lo, std::int64_t hi, PlanFor&& plan_for,
                                            const tier_budgets& b) {
  for (std::int64_t k = hi; k >= lo; --k)
    if (admit(plan_for(k), b).fits()) return k;
  return lo - 1;
}

/** @brief ZeRO's mode chosen for budgets (see `choose_sharding`). */
struct sharding_choice {
  runtime_options options;  ///< the options given, memory_saving set when it was chosen
  memory_plan plan;         ///< the chosen mode's plan
  bool switched = false;    ///< the memory-saving mode was chosen because the group mode does not fit
  std::string why;          ///< when switched: what the group mode lacked
};

/** @brief ZeRO's mode for budgets @p b: the group mode (fewer, larger collectives) when `admit`
 *  takes its plan; otherwise the memory-saving mode (chunk by chunk: smaller buffers, more
 *  collectives) when it takes that one, saying why; otherwise the options as given, whose plan
 *  `admit` refuses with its shortfalls. Options without ZeRO, or already in the memory-saving mode,
 *  come back as given. Pure. */
template <ChunkLayout Layout>
[[nodiscard]] sharding_choice choose_sharding(std::span<const tensor_spec> specs, const Layout& layout,
                                              runtime_options o, int world, const forward_scopes& scopes,
                                              std::span<const std::size_t> non_model, const tier_budgets& b) {
  sharding_choice c{o, plan_memory(specs, layout, o, world, scopes, non_model), false, {}};
  if (!o.sharding.enabled || world < 2 || o.sharding.memory_saving) return c;
  const admission group = admit(c.plan, b);
  if (group.fits()) return c;
  runtime_options saving = o;
  saving.sharding.memory_saving = true;
  memory_plan p = plan_memory(specs, layout, saving, world, scopes, non_model);
  if (!admit(p, b).fits()) return c;
  c.why = "the group mode needs at least " + format_bytes(c.plan.device_floor()) +
          " of device memory (gather and reduction buffers " + format_bytes(c.plan.collective_bytes) +
          ") and the device has " + format_bytes(b.device) + "; the memory-saving mode needs " +
          format_bytes(p.device_floor()) + " (buffers " + format_bytes(p.collective_bytes) + ")";
  c.options = saving;
  c.plan = std::move(p);
  c.switched = true;
  return c;
}

}  // namespace chunkstar
