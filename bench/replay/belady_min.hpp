// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Offline references for a chunk-access trace, computed independently of the runtime:
 *         Belady's MIN (`belady_min`) and the exact optimum (`optimal_moves`, a min-cost flow)
 *         over groups of equal-sized chunks with a per-step capacity.
 *
 *  Problem (what the chunk runtime faces, stated without its code):
 *  - A sequence of steps; step t needs the set `need` of chunks resident on the device at once and
 *    allows at most `capacity` chunks on the device (capacity below |need| is raised to |need|: a
 *    scope's working set is always admitted).
 *  - Move semantics: a chunk lives in exactly one tier. Loading a chunk from the host costs one
 *    chunk of bytes; evicting one to the host costs one chunk of bytes.
 *  - A `droppable` chunk (a gradient) can be absent: it needs no load when first used (it is
 *    materialised zeroed on the device, for free), and every droppable chunk is dropped for free
 *    wherever it is at the end of a step marked `drop_after` (the end of the optimizer step).
 *
 *  MIN: at each step, load the missing chunks of `need`; whenever the device would exceed the
 *  capacity, evict the resident chunk (not in `need`) whose next use is furthest in the future,
 *  where a chunk that is dropped before it is used again ("dead") is used never. Loads happen only
 *  on demand. Ties are broken by lowest id (any choice among equal next uses gives the same cost).
 */
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>
#include <queue>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

namespace chunkstar::bench {

/** @brief One step of a MIN problem. Chunk ids are dense indices [0, num_chunks). */
struct min_step {
  std::vector<std::uint32_t> need;  ///< chunks that must be resident during the step
  std::size_t capacity = 0;         ///< chunks the device may hold during the step
  bool drop_after = false;          ///< drop every droppable chunk after this step
  std::vector<std::uint32_t> drop;  ///< drop these (droppable) chunks after this step
  int iteration = 0;                ///< which repetition of the trace the step belongs to (for costs per iteration)
};

/** @brief Where a chunk is before the first step. */
enum class min_place : std::uint8_t { absent, device, host };

/** @brief Moves counted by `belady_min`, in chunks. */
struct min_result {
  std::size_t loads = 0;                         ///< host -> device
  std::size_t evictions = 0;                     ///< device -> host
  std::size_t materialised = 0;                  ///< absent -> device (free)
  std::vector<std::size_t> moves_per_iteration;  ///< loads + evictions, indexed by min_step::iteration
  [[nodiscard]] std::size_t moves() const noexcept { return loads + evictions; }
};

/** @brief Whether droppable chunk @p c is dropped at the end of step @p s. */
inline bool drops(const min_step& s, std::uint32_t c) {
  return s.drop_after || std::find(s.drop.begin(), s.drop.end(), c) != s.drop.end();
}

/** @brief Runs MIN over @p steps. @p droppable and @p initial are indexed by chunk id. */
inline min_result belady_min(const std::vector<min_step>& steps, const std::vector<bool>& droppable,
                             std::vector<min_place> initial) {
  const std::size_t n = droppable.size();
  if (initial.size() != n) throw std::invalid_argument("belady_min: initial and droppable differ in size");
  constexpr std::size_t never = std::numeric_limits<std::size_t>::max();
  const std::size_t T = steps.size();
  int last_iteration = 0;
  for (const auto& s : steps) last_iteration = std::max(last_iteration, s.iteration);

  // next_use[t][c]: the first step > t that needs c, or never if none (or c is dropped first).
  // Built backwards in O(T * n); fine for the few thousand steps of a replay.
  std::vector<std::vector<std::size_t>> next_use(T, std::vector<std::size_t>(n, never));
  std::vector<std::size_t> upcoming(n, never);
  for (std::size_t t = T; t-- > 0;) {
    next_use[t] = upcoming;
    for (auto c : steps[t].need) {
      if (c >= n) throw std::invalid_argument("belady_min: chunk id out of range");
      upcoming[c] = t;
    }
    // A drop at the end of step t - 1 kills droppable chunks for steps before it.
    if (t > 0)
      for (std::size_t c = 0; c < n; ++c)
        if (droppable[c] && drops(steps[t - 1], static_cast<std::uint32_t>(c))) upcoming[c] = never;
  }

  min_result r;
  r.moves_per_iteration.assign(static_cast<std::size_t>(last_iteration) + 1, 0);
  std::vector<min_place> at = std::move(initial);
  std::size_t resident = 0;
  for (auto p : at) resident += p == min_place::device;
  std::vector<bool> in_need(n, false);

  for (std::size_t t = 0; t < T; ++t) {
    const auto& s = steps[t];
    auto& per_it = r.moves_per_iteration[static_cast<std::size_t>(s.iteration)];
    for (auto c : s.need) in_need[c] = true;
    std::size_t distinct = 0;
    for (std::size_t c = 0; c < n; ++c) distinct += in_need[c];
    const std::size_t cap = std::max(s.capacity, distinct);
    auto evict_furthest = [&] {
      std::size_t victim = n, best = 0;
      for (std::size_t c = 0; c < n; ++c) {
        if (at[c] != min_place::device || in_need[c]) continue;
        const std::size_t nu = next_use[t][c];
        if (victim == n || nu > best) victim = c, best = nu;
      }
      if (victim == n) throw std::logic_error("belady_min: nothing to evict (capacity below the working set)");
      at[victim] = min_place::host;
      --resident;
      ++r.evictions;
      ++per_it;
    };
    for (auto c : s.need) {
      if (at[c] == min_place::device) continue;
      while (resident + 1 > cap) evict_furthest();
      if (at[c] == min_place::absent) {
        if (!droppable[c]) throw std::invalid_argument("belady_min: a non-droppable chunk is absent");
        ++r.materialised;
      } else {
        ++r.loads;
        ++per_it;
      }
      at[c] = min_place::device;
      ++resident;
    }
    while (resident > cap) evict_furthest();  // the capacity shrank since the last step
    for (auto c : s.need) in_need[c] = false;
    if (s.drop_after || !s.drop.empty()) {
      for (std::size_t c = 0; c < n; ++c) {
        if (!droppable[c] || at[c] == min_place::absent || !drops(s, static_cast<std::uint32_t>(c))) continue;
        if (at[c] == min_place::device) --resident;
        at[c] = min_place::absent;
      }
    }
  }
  return r;
}

/** @brief The exact minimum of loads + evictions for the problem `belady_min` solves.
 *
 *  Belady's MIN is optimal when only loads cost, but with move semantics every eviction costs too,
 *  and a droppable chunk kept until its drop leaves for free, so "evict the dead gradient first"
 *  can lose to "keep it and evict something else" (bench/replay/belady_min_check.cpp has cases).
 *
 *  Formulation: with equal sizes, between two consecutive uses a chunk either stays resident (free,
 *  one slot during every step strictly between) or leaves right after the first use and comes back
 *  at the second (evict + load = 2; leaving earlier or loading later is never worse). A chunk's
 *  last use before a drop: stay until the drop (free) or leave (1). Last use in the window, or
 *  never used: stay to the end (free) or leave (1). A chunk on the device at the start: stay until
 *  its first use, or leave (then 2 with a later use, else 1). Choosing which intervals stay, under
 *  "kept intervals covering step t <= capacity_t - |need_t|", is a maximum-weight selection of
 *  intervals with time-varying width: a min-cost flow on the time line (interval matrices are
 *  totally unimodular, so the flow's integral optimum is the true optimum). */
inline std::size_t optimal_moves(const std::vector<min_step>& steps, const std::vector<bool>& droppable,
                                 const std::vector<min_place>& initial) {
  const std::size_t n = droppable.size();
  const std::size_t T = steps.size();
  if (initial.size() != n) throw std::invalid_argument("optimal_moves: initial and droppable differ in size");
  struct interval {
    std::size_t first, last;  // steps occupied if kept, inclusive; first > last means none
    long long weight;         // moves saved by keeping
  };
  std::vector<interval> intervals;
  std::size_t fixed = 0;  // moves no schedule avoids: loads of chunks that start on the host
  std::vector<std::size_t> free_slots(T);
  for (std::size_t t = 0; t < T; ++t) {
    std::vector<std::uint32_t> need = steps[t].need;
    std::sort(need.begin(), need.end());
    need.erase(std::unique(need.begin(), need.end()), need.end());
    free_slots[t] = std::max(steps[t].capacity, need.size()) - need.size();
  }
  for (std::size_t c = 0; c < n; ++c) {
    // Walk chunk c's life: `since` is the step after its last event while resident (or T: not resident).
    min_place at = initial[c];
    std::size_t since = 0;  // resident from step `since` (valid when at == device)
    for (std::size_t t = 0; t < T; ++t) {
      const auto& need = steps[t].need;
      if (std::find(need.begin(), need.end(), c) != need.end()) {
        if (at == min_place::device) {
          // Kept from `since` to t - 1, or left and came back.
          if (t > since) intervals.push_back({since, t - 1, 2});
        } else if (at == min_place::host) {
          ++fixed;
        }  // absent: materialised for free
        at = min_place::device;
        since = t + 1;
      }
      if (droppable[c] && drops(steps[t], static_cast<std::uint32_t>(c))) {
        if (at == min_place::device && since <= t) intervals.push_back({since, t, 1});
        at = min_place::absent;
      }
    }
    if (at == min_place::device && since < T) intervals.push_back({since, T - 1, 1});
  }

  // Min-cost flow on nodes 0..T: K units from 0 to T. Chain edge t -> t+1 carries what is not in a
  // kept interval at step t; at least K - free_slots[t] of it is forced (a large bonus M).
  std::size_t K = 0;
  for (auto f : free_slots) K = std::max(K, f);
  long long savings_total = 0;
  for (const auto& iv : intervals) savings_total += iv.weight;
  std::size_t baseline = fixed + static_cast<std::size_t>(savings_total);
  if (K == 0 || intervals.empty()) return baseline;
  const long long M = savings_total + 1;
  struct edge {
    std::size_t to, rev;
    long long cap, cost;
  };
  std::vector<std::vector<edge>> g(T + 1);
  auto add = [&](std::size_t a, std::size_t b, long long cap, long long cost) {
    if (cap <= 0) return;
    g[a].push_back({b, g[b].size(), cap, cost});
    g[b].push_back({a, g[a].size() - 1, 0, -cost});
  };
  long long forced = 0;
  for (std::size_t t = 0; t < T; ++t) {
    const auto k = static_cast<long long>(K), f = static_cast<long long>(free_slots[t]);
    add(t, t + 1, k - f, -M);
    forced += k - f;
    add(t, t + 1, f, 0);
  }
  for (const auto& iv : intervals)
    if (iv.first <= iv.last) add(iv.first, iv.last + 1, 1, -iv.weight);
  // Potentials from the DAG (every edge goes forward in time), then Dijkstra per augmentation.
  constexpr long long inf = std::numeric_limits<long long>::max() / 4;
  std::vector<long long> pot(T + 1, inf), dist(T + 1);
  pot[0] = 0;
  for (std::size_t v = 0; v <= T; ++v)
    if (pot[v] < inf)
      for (const auto& e : g[v])
        if (e.cap > 0) pot[e.to] = std::min(pot[e.to], pot[v] + e.cost);
  std::vector<std::size_t> prev_node(T + 1), prev_edge(T + 1);
  long long flow = 0, cost = 0;
  while (flow < static_cast<long long>(K)) {
    std::fill(dist.begin(), dist.end(), inf);
    dist[0] = 0;
    using item = std::pair<long long, std::size_t>;
    std::priority_queue<item, std::vector<item>, std::greater<>> pq;
    pq.push({0, 0});
    while (!pq.empty()) {
      const auto [d, v] = pq.top();
      pq.pop();
      if (d > dist[v]) continue;
      for (std::size_t i = 0; i < g[v].size(); ++i) {
        const auto& e = g[v][i];
        if (e.cap <= 0 || pot[e.to] >= inf) continue;
        const long long nd = d + e.cost + pot[v] - pot[e.to];
        if (nd < dist[e.to]) {
          dist[e.to] = nd;
          prev_node[e.to] = v;
          prev_edge[e.to] = i;
          pq.push({nd, e.to});
        }
      }
    }
    if (dist[T] >= inf) throw std::logic_error("optimal_moves: the time line is disconnected");
    for (std::size_t v = 0; v <= T; ++v)
      if (dist[v] < inf) pot[v] += dist[v];
    long long push = static_cast<long long>(K) - flow;
    for (std::size_t v = T; v != 0; v = prev_node[v]) push = std::min(push, g[prev_node[v]][prev_edge[v]].cap);
    for (std::size_t v = T; v != 0; v = prev_node[v]) {
      auto& e = g[prev_node[v]][prev_edge[v]];
      e.cap -= push;
      g[v][e.rev].cap += push;
      cost += push * e.cost;
    }
    flow += push;
  }
  const long long saved = -(cost + M * forced);
  return baseline - static_cast<std::size_t>(saved);
}

}  // namespace chunkstar::bench
