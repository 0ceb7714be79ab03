// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `plan_gathers`: which ZeRO allgathers start one moment ahead of their use, decided from
 *         the trace. A pure function: it replays shard_manager's rules (gather before use,
 *         release when the next use is not the next moment, reduce-scatter once final, each
 *         reduction in flight until the next scope has closed) over one traced iteration, and
 *         accepts the gathers for moment m + 1 while m computes only where the compute tier's
 *         budget at m holds them beside everything m itself needs. It also predicts the group
 *         buffers live at each moment (what a budget must leave for them).
 *
 *  Every rank plans from the same trace; budgets may differ per rank (each has its own non-model
 *  peaks), so the runtime agrees on the accepted moments once per trace (the AND over ranks). An
 *  accepted moment changes nothing at other moments (the group is gathered one moment earlier and
 *  kept as it would have been), so the agreed plan is each rank's plan restricted to the agreed
 *  moments and stays within every rank's budget.
 */
#pragma once

#include <chunkstar/core/chunk_kind.hpp>
#include <chunkstar/core/moment_kind.hpp>
#include <chunkstar/core/tier.hpp>
#include <chunkstar/zero/shard_map.hpp>
#include <chunkstar/tracer/tracer.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace chunkstar {

/** @brief One traced iteration as the sharding sees it: per moment, its kind and the parameter and
 *  gradient chunk indices its scope uses (sorted, unique). */
struct sharding_trace {
  std::vector<moment_kind> kinds;
  std::vector<std::vector<std::uint32_t>> params, grads;
  [[nodiscard]] std::size_t size() const noexcept { return kinds.size(); }
};

/** @brief The trace of @p tracer (ready) as a sharding_trace. */
template <Tracer T>
[[nodiscard]] sharding_trace sharding_trace_of(const T& tracer) {
  sharding_trace t;
  const std::size_t n = tracer.num_moments();
  t.kinds.resize(n);
  t.params.resize(n);
  t.grads.resize(n);
  for (std::size_t m = 0; m < n; ++m) t.kinds[m] = tracer.kind_of(m);
  for (const auto& a : tracer.accesses()) {
    if (a.moment >= n) continue;
    if (a.id.kind == chunk_kind::param) t.params[a.moment].push_back(a.id.index);
    if (a.id.kind == chunk_kind::grad) t.grads[a.moment].push_back(a.id.index);
  }
  for (auto* lists : {&t.params, &t.grads})
    for (auto& v : *lists) {
      std::sort(v.begin(), v.end());
      v.erase(std::unique(v.begin(), v.end()), v.end());
    }
  return t;
}

/** @brief What plan_gathers needs besides the trace. */
struct gather_plan_inputs {
  shard_map map;                      ///< ownership (world > 1)
  std::size_t param_chunk_bytes = 0;  ///< one parameter chunk
  std::size_t grad_chunk_bytes = 0;   ///< one gradient chunk
  bool keep_gathered = false;         ///< sharding_options::keep_gathered
  /// Per moment: chunk bytes the compute tier may hold while it computes (the placement's budget
  /// after the moment's recorded non-model peak). Shorter than the trace: no gather ahead there.
  std::vector<std::size_t> budget;
};

/** @brief The plan: per moment m, the groups whose allgather starts once m's scope is open (for
 *  moment m + 1), and the predicted compute-tier bytes. */
struct gather_plan {
  std::vector<std::vector<std::size_t>> ahead;  ///< per moment: groups gathered while it computes, for the next
  std::vector<std::size_t> need;      ///< per moment: owned parameter chunks in use + group buffers + gathers ahead
  std::vector<std::size_t> buffers;   ///< per moment: group buffers and reduction scratch live (gathers ahead included)
  std::size_t peak_buffer_bytes = 0;  ///< the most of `buffers`, the optimizer step's reductions included
  std::size_t gathers = 0;            ///< allgathers per iteration (ahead or not)
  std::size_t gathers_ahead = 0;      ///< of which start a moment ahead
  std::size_t reductions = 0;         ///< reduce-scatters per iteration
  /** @brief Whether moment @p m starts gathers for the next one. */
  [[nodiscard]] bool starts_ahead(std::size_t m) const noexcept { return m < ahead.size() && !ahead[m].empty(); }
};

/** @brief Replays one iteration of @p trace under shard_manager's rules and accepts, moment by
 *  moment, the gathers of the next moment's groups where @p in.budget allows them (all of a
 *  moment's or none). @p allowed (optional, per moment): restricts the moments that may gather
 *  ahead (the ranks' agreement). */
[[nodiscard]] inline gather_plan plan_gathers(const sharding_trace& trace, const gather_plan_inputs& in,
                                              const std::vector<bool>& allowed = {}) {
  constexpr std::size_t none = std::numeric_limits<std::size_t>::max();
  const std::size_t M = trace.size(), n = static_cast<std::size_t>(in.map.world);
  const std::size_t pb = in.param_chunk_bytes, gb = in.grad_chunk_bytes, group_p = n * pb, group_g = n * gb;
  std::size_t chunks = 0;
  for (std::size_t m = 0; m < M; ++m) {
    if (!trace.params[m].empty()) chunks = std::max<std::size_t>(chunks, trace.params[m].back() + 1u);
    if (!trace.grads[m].empty()) chunks = std::max<std::size_t>(chunks, trace.grads[m].back() + 1u);
  }
  const std::size_t groups = (chunks + n - 1) / n;
  const auto scope = [&](std::size_t m) { return m < M && trace.kinds[m] != moment_kind::optimizer; };
  // next_param[c] / next_grad[c] while scanning backwards: the first scope moment after m using c.
  std::vector<std::vector<std::size_t>> next_param(M), next_grad(M);
  {
    std::vector<std::size_t> np(chunks, none), ng(chunks, none);
    for (std::size_t m = M; m-- > 0;) {
      next_param[m] = np;
      next_grad[m] = ng;
      if (!scope(m)) continue;
      for (auto c : trace.params[m]) np[c] = m;
      for (auto c : trace.grads[m]) ng[c] = m;
    }
  }
  const auto members = [&](std::size_t g) { return std::min(n, chunks - g * n); };

  gather_plan p;
  p.ahead.resize(M);
  p.need.assign(M, 0);
  p.buffers.assign(M, 0);
  std::vector<bool> gathered(groups, false), attached(groups, false), reducing(groups, false);
  std::vector<std::size_t> in_flight;
  std::size_t live = 0;
  const auto peak = [&] { p.peak_buffer_bytes = std::max(p.peak_buffer_bytes, live); };
  const auto start_reduction = [&](std::size_t g) {
    reducing[g] = true;
    in_flight.push_back(g);
    live += gb;  // the owner's result
    ++p.reductions;
    peak();
  };
  const auto finish_reductions = [&] {
    for (auto g : in_flight) attached[g] = reducing[g] = false, live -= group_g + gb;
    in_flight.clear();
  };
  const auto gather = [&](std::size_t g) {
    gathered[g] = true;
    live += group_p;
    ++p.gathers;
  };

  for (std::size_t m = 0; m < M; ++m) {
    if (!scope(m)) {  // the step: every open gradient group reduced, gathered groups released
      for (std::size_t g = 0; g < groups; ++g) {
        if (attached[g] && !reducing[g]) start_reduction(g);
        if (gathered[g]) gathered[g] = false, live -= group_p;
      }
      finish_reductions();
      continue;
    }
    // prepare(m)
    std::size_t owned = 0;
    for (auto c : trace.grads[m])
      if (!attached[c / n]) attached[c / n] = true, live += group_g;
    for (auto c : trace.params[m]) {
      if (!gathered[c / n]) gather(c / n);
      if (in.map.owns(c)) owned += pb;
    }
    p.need[m] = live + owned;
    // Gathers ahead, for the next moment's groups not gathered now; each also pins this rank's
    // chunk of the group (its send buffer) unless m uses it already.
    if (scope(m + 1) && m < in.budget.size() && (allowed.empty() || (m < allowed.size() && allowed[m]))) {
      std::vector<std::size_t> next;
      std::size_t cost = 0;
      for (auto c : trace.params[m + 1]) {
        const std::size_t g = c / n;
        if (gathered[g] || std::find(next.begin(), next.end(), g) != next.end()) continue;
        next.push_back(g);
        const std::uint32_t own = static_cast<std::uint32_t>(g * n + static_cast<std::size_t>(in.map.rank));
        const bool in_use = std::binary_search(trace.params[m].begin(), trace.params[m].end(), own);
        cost += group_p + (in_use || static_cast<std::size_t>(in.map.rank) >= members(g) ? 0 : pb);
      }
      if (!next.empty() && p.need[m] + cost <= in.budget[m]) {
        for (auto g : next) gather(g);
        p.gathers_ahead += next.size();
        p.need[m] += cost;
        p.ahead[m] = std::move(next);
      }
    }
    p.buffers[m] = live;
    peak();
    // after_close(m)
    finish_reductions();
    for (std::size_t g = 0; g < groups; ++g) {
      if (attached[g] && !reducing[g]) {
        bool final = true;
        for (std::size_t k = g * n; k < g * n + members(g); ++k) final = final && next_grad[m][k] == none;
        if (final) start_reduction(g);
      }
      if (gathered[g]) {
        std::size_t next = none;
        for (std::size_t k = g * n; k < g * n + members(g); ++k) next = std::min(next, next_param[m][k]);
        if (next == none || (!in.keep_gathered && next > m + 1)) gathered[g] = false, live -= group_p;
      }
    }
  }
  // A trace without a step moment: the runtime's step reduces and releases the rest.
  for (std::size_t g = 0; g < groups; ++g)
    if (attached[g] && !reducing[g]) start_reduction(g);
  finish_reductions();
  return p;
}

}  // namespace chunkstar
