// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `plan_gathers`: which ZeRO allgathers start ahead of their use, and how far, decided
 *         from the trace. A pure function: it replays shard_manager's rules (gather before use,
 *         release when the next use is not the next moment, reduce-scatter once final, each
 *         reduction in flight until the next scope has closed) over one traced iteration, and
 *         accepts, while moment m computes, the gathers of the groups moments m + 1 .. m + d need
 *         (d up to `depth`, the largest that fits) only where the compute tier's budget holds them
 *         beside everything m needs and, for a group held until a later moment, beside everything
 *         each moment in between needs; and, at the step, the gathers of the groups the next
 *         iteration's first scope needs, where the step's moments and that scope hold them. A group
 *         the last moment released (its next use not the very next moment) that m would gather
 *         ahead is kept instead (`keep`): the same bytes held at the same moments, one gather
 *         fewer (at depth 2: a transformer's last block, used again in backward two scopes after
 *         the head's forward). It also predicts the group buffers live at each moment (what a
 *         budget must leave for them).
 *
 *  Every rank plans from the same trace; budgets may differ per rank (each has its own non-model
 *  peaks), so the runtime agrees on the depth accepted at each moment (the minimum over ranks).
 *  At depth 1 an accepted moment changes nothing at other moments (the group is gathered one
 *  moment earlier and kept as it would have been), so one agreement suffices. Deeper, a group
 *  gathered early is not gathered later, so where the ranks' depths differ they plan again under
 *  the least, until every rank accepts the same depths (each round can only lower them): the plan
 *  then is every rank's own and stays within every rank's budget.
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
#include <utility>
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
  std::size_t depth = 1;              ///< most moments ahead a gather may start (sharding_options::gather_depth)
  bool at_step = true;                ///< the step may gather the next iteration's first groups (gather_at_step)
  /// Per moment: chunk bytes the compute tier may hold while it computes (the placement's budget
  /// after the moment's recorded non-model peak). Shorter than the trace: no gather ahead there.
  std::vector<std::size_t> budget;
};

/** @brief The plan: per moment m, the groups whose allgather starts once m's scope is open (for
 *  moments m + 1 .. m + depth[m]), and the predicted compute-tier bytes. */
struct gather_plan {
  std::vector<std::vector<std::size_t>> ahead;  ///< per moment: groups gathered while it computes, for later ones
  std::vector<std::vector<std::size_t>> until;  ///< per moment, beside `ahead`: the moment each group is for (kept till then)
  /// Per moment m: groups kept when m's scope closes, instead of released, for the moment of
  /// `keep_until` (accepted at m + 1 as its gathers ahead are, at `depth[m + 1]`, with no gather).
  std::vector<std::vector<std::size_t>> keep;
  std::vector<std::vector<std::size_t>> keep_until;  ///< per moment, beside `keep`
  std::vector<std::size_t> depth;               ///< per moment: how many moments ahead it gathers (0: none)
  std::vector<std::size_t> need;      ///< per moment: owned parameter chunks in use + group buffers + gathers ahead
  std::vector<std::size_t> demand;    ///< per moment: `need` without the gathers it starts ahead
  std::vector<std::size_t> buffers;   ///< per moment: group buffers and reduction scratch live (gathers ahead included)
  std::size_t peak_buffer_bytes = 0;  ///< the most of `buffers`, the optimizer step's reductions included
  std::size_t gathers = 0;            ///< allgathers per iteration (ahead or not)
  std::size_t gathers_ahead = 0;      ///< of which start a moment ahead
  std::size_t kept = 0;               ///< gathers saved per iteration: the groups in `keep`
  std::size_t reductions = 0;         ///< reduce-scatters per iteration
  /// The step's first moment when it gathers the groups of the next iteration's first scope
  /// (`ahead[step]`, each for `until[step]`, a moment of the next iteration); none: it does not.
  std::size_t step = std::numeric_limits<std::size_t>::max();
  /** @brief Whether moment @p m starts gathers for the next one. */
  [[nodiscard]] bool starts_ahead(std::size_t m) const noexcept { return m < ahead.size() && !ahead[m].empty(); }
};

/** @brief Replays one iteration of @p trace under shard_manager's rules and accepts, moment by
 *  moment, the gathers of the groups of the next `in.depth` moments where @p in.budget allows them
 *  (all of those moments' groups or none; the deepest that fits). @p max_depth (optional, per
 *  moment): restricts how far each moment may gather ahead (the ranks' agreement; 0: not at all). */
[[nodiscard]] inline gather_plan plan_gathers(const sharding_trace& trace, const gather_plan_inputs& in,
                                              const std::vector<std::size_t>& max_depth) {
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

  // Deeper than one moment: what each moment needs at depth 1 (its demand, before its own gathers
  // ahead) bounds what it needs here besides the groups held through it for a later moment
  // (`extra`), which a deeper gather must fit beside.
  std::vector<std::size_t> base_need, extra(M, 0);
  if (in.depth > 1) {
    gather_plan_inputs one = in;
    one.depth = 1;
    std::vector<std::size_t> clipped;
    for (const std::size_t d : max_depth) clipped.push_back(std::min<std::size_t>(d, 1));
    base_need = plan_gathers(trace, one, clipped).demand;
  }

  gather_plan p;
  p.ahead.resize(M);
  p.until.resize(M);
  p.keep.resize(M);
  p.keep_until.resize(M);
  p.depth.assign(M, 0);
  p.need.assign(M, 0);
  p.demand.assign(M, 0);
  p.buffers.assign(M, 0);
  std::vector<bool> gathered(groups, false), attached(groups, false), reducing(groups, false);
  std::vector<bool> released(groups, false);  // by the last moment's close: a gather ahead keeps it instead
  std::vector<std::size_t> held_until(groups, none), pinned(groups, 0);  // a gather ahead: its moment, its send buffer
  std::size_t pins = 0;                                                   // bytes of send buffers pinned now
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

  // The step (its first moment s) gathers the groups the next iteration's first scope u needs,
  // where the budget holds them, as this rank's chunk of each is stepped: they are held from then
  // on, so every later moment of the step must have room for them beside its own step's chunks
  // (the runtime's budget there is what the step leaves), and u for them beside its own needs,
  // this rank's chunk of a group pinned as a send buffer although u does not use it included.
  // u's own demand is unchanged: it would gather the same groups itself.
  const auto plan_step_gathers = [&](std::size_t s) {
    std::size_t u = 0;
    while (u < s && !scope(u)) ++u;
    const std::size_t allow = max_depth.empty() ? in.depth : s < max_depth.size() ? max_depth[s] : 0;
    if (!in.at_step || u >= s || allow == 0 || u >= in.budget.size() || trace.params[u].empty()) return;
    std::vector<std::size_t> next, target;
    std::size_t cost = 0, pinned_at_u = 0;
    for (auto c : trace.params[u]) {
      const std::size_t g = c / n;
      if (std::find(next.begin(), next.end(), g) != next.end()) continue;
      const std::uint32_t own = static_cast<std::uint32_t>(g * n + static_cast<std::size_t>(in.map.rank));
      const bool pin = static_cast<std::size_t>(in.map.rank) < members(g) &&
                       !std::binary_search(trace.params[u].begin(), trace.params[u].end(), own);
      next.push_back(g);
      target.push_back(u);
      cost += group_p + (pin ? pb : 0);
      pinned_at_u += pin ? pb : 0;
    }
    bool fits = p.demand[u] + pinned_at_u <= in.budget[u];
    for (std::size_t k = s; fits && k < M && !scope(k); ++k) fits = k < in.budget.size() && cost <= in.budget[k];
    if (!fits) return;
    p.step = s;
    p.gathers_ahead += next.size();
    p.need[s] = cost;
    p.depth[s] = 1;
    p.ahead[s] = std::move(next);
    p.until[s] = std::move(target);
  };

  for (std::size_t m = 0; m < M; ++m) {
    if (!scope(m)) {  // the step: every open gradient group reduced, gathered groups released
      for (std::size_t g = 0; g < groups; ++g) {
        if (attached[g] && !reducing[g]) start_reduction(g);
        if (gathered[g]) gathered[g] = false, live -= group_p;
        held_until[g] = none;
        pins -= std::exchange(pinned[g], 0);
        released[g] = false;
      }
      finish_reductions();
      if (p.step == none && m > 0 && scope(m - 1)) plan_step_gathers(m);
      continue;
    }
    // prepare(m): a gather started ahead for m completes (its send buffer unpinned)
    std::size_t owned = 0;
    for (auto c : trace.grads[m])
      if (!attached[c / n]) attached[c / n] = true, live += group_g;
    for (auto c : trace.params[m]) {
      if (held_until[c / n] == m) pins -= std::exchange(pinned[c / n], 0);
      if (!gathered[c / n]) gather(c / n);
      if (in.map.owns(c)) owned += pb;
    }
    p.need[m] = p.demand[m] = live + owned + pins;
    // Gathers ahead, for the groups of moments m + 1 .. m + d not gathered now, the deepest d
    // allowed that fits; each also pins this rank's chunk of the group (its send buffer) unless m
    // uses it already, until the moment it is for. A group the last close released is kept
    // instead (no gather, nothing pinned: its buffer never left), held from that close on.
    const std::size_t allow = max_depth.empty() ? in.depth : m < max_depth.size() ? std::min(max_depth[m], in.depth) : 0;
    if (scope(m + 1) && m < in.budget.size() && allow > 0) {
      for (std::size_t d = allow; d >= 1; --d) {
        std::vector<std::size_t> next, target, cost_of;
        std::vector<bool> kept;
        std::size_t cost = 0;
        bool whole = true;  // every moment up to m + d is a scope of this iteration
        for (std::size_t u = m + 1; u <= m + d; ++u) {
          if (!scope(u)) {
            whole = false;
            break;
          }
          for (auto c : trace.params[u]) {
            const std::size_t g = c / n;
            if (gathered[g] || std::find(next.begin(), next.end(), g) != next.end()) continue;
            const std::uint32_t own = static_cast<std::uint32_t>(g * n + static_cast<std::size_t>(in.map.rank));
            const bool in_use = std::binary_search(trace.params[m].begin(), trace.params[m].end(), own);
            next.push_back(g);
            target.push_back(u);
            kept.push_back(m > 0 && released[g]);
            cost_of.push_back(group_p +
                              (kept.back() || in_use || static_cast<std::size_t>(in.map.rank) >= members(g) ? 0 : pb));
            cost += cost_of.back();
          }
        }
        if (!whole || next.empty() || target.back() < m + d) continue;  // the same as a smaller depth
        bool fits = p.need[m] + cost <= in.budget[m];
        for (std::size_t k = m + 1; fits && k < m + d; ++k) {  // held through k for a later moment
          std::size_t add = 0;
          for (std::size_t i = 0; i < next.size(); ++i) add += target[i] > k ? cost_of[i] : 0;
          fits = k < in.budget.size() && base_need[k] + extra[k] + add <= in.budget[k];
        }
        if (!fits) continue;
        for (std::size_t i = 0; i < next.size(); ++i) {
          held_until[next[i]] = target[i];
          for (std::size_t k = m + 1; k < target[i]; ++k) extra[k] += cost_of[i];
          if (kept[i]) {
            gathered[next[i]] = true, live += group_p, ++p.kept;
            p.keep[m - 1].push_back(next[i]);
            p.keep_until[m - 1].push_back(target[i]);
            continue;
          }
          gather(next[i]);
          pinned[next[i]] = cost_of[i] - group_p;
          pins += pinned[next[i]];
          p.ahead[m].push_back(next[i]);
          p.until[m].push_back(target[i]);
          ++p.gathers_ahead;
        }
        p.need[m] += cost;
        p.depth[m] = d;
        break;
      }
    }
    p.buffers[m] = live;
    peak();
    // after_close(m)
    finish_reductions();
    for (std::size_t g = 0; g < groups; ++g) {
      released[g] = false;
      if (attached[g] && !reducing[g]) {
        bool final = true;
        for (std::size_t k = g * n; k < g * n + members(g); ++k) final = final && next_grad[m][k] == none;
        if (final) start_reduction(g);
      }
      if (held_until[g] != none && held_until[g] <= m) held_until[g] = none;
      if (gathered[g] && held_until[g] == none) {  // a group gathered ahead is kept for its moment
        std::size_t next = none;
        for (std::size_t k = g * n; k < g * n + members(g); ++k) next = std::min(next, next_param[m][k]);
        if (next == none || (!in.keep_gathered && next > m + 1))
          gathered[g] = false, live -= group_p, released[g] = true;
      }
    }
  }
  // A trace without a step moment: the runtime's step reduces and releases the rest.
  for (std::size_t g = 0; g < groups; ++g)
    if (attached[g] && !reducing[g]) start_reduction(g);
  finish_reductions();
  return p;
}

/** @brief plan_gathers with the moments that may gather ahead as flags (@p allowed; empty: all),
 *  each at up to `in.depth` moments. */
[[nodiscard]] inline gather_plan plan_gathers(const sharding_trace& trace, const gather_plan_inputs& in,
                                              const std::vector<bool>& allowed = {}) {
  std::vector<std::size_t> depth;
  for (const bool a : allowed) depth.push_back(a ? in.depth : 0);
  return plan_gathers(trace, in, depth);
}

}  // namespace chunkstar
