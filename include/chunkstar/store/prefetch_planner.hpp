// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief The prefetch planner: a pure function from a snapshot of the chunks and the trace to the
 *         list of transfers to start now. It replays what the demand path will do at the coming
 *         moments — with the same eviction strategy, the same candidates and the same budgets — and
 *         returns those same evictions and loads, in order, up to the first that cannot happen yet.
 *         The runtime carries them out; the planner moves nothing.
 *
 *  Later operations (gather a remote chunk, rotate a shard, read from disk) are further kinds of
 *  `transfer_op`.
 */
#pragma once

#include <chunkstar/eviction/eviction_strategy.hpp>
#include <chunkstar/layout/chunk_layout.hpp>
#include <chunkstar/core/chunk_id.hpp>
#include <chunkstar/core/chunk_kind.hpp>
#include <chunkstar/core/moment_kind.hpp>
#include <chunkstar/core/tier.hpp>
#include <chunkstar/tracer/tracer.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

namespace chunkstar {

/** @brief One transfer the runtime starts. */
struct transfer_op {
  enum class kind : std::uint8_t {
    evict,  ///< move the chunk from the compute tier to the host
    load,   ///< move the chunk from the host to the compute tier (ahead of its use)
    zero,   ///< give a FREE chunk a zeroed payload on the compute tier
  };
  kind what = kind::load;
  chunk_id id;
  friend constexpr bool operator==(const transfer_op& a, const transfer_op& b) noexcept {
    return a.what == b.what && a.id == b.id;
  }
};

/** @brief The distinct chunks each moment of a trace uses, in order of first use; rebuilt only
 *  when the trace changes. */
class trace_needs {
 public:
  template <Tracer T>
  void refresh(const T& tracer) {
    const auto key = tracer.stats().traces;
    if (key == key_ && needs_.size() == tracer.num_moments()) return;
    needs_.assign(tracer.num_moments(), {});
    for (const auto& a : tracer.accesses()) {
      auto& v = needs_.at(a.moment);
      if (std::find(v.begin(), v.end(), a.id) == v.end()) v.push_back(a.id);
    }
    key_ = key;
  }
  [[nodiscard]] std::span<const chunk_id> at(std::size_t m) const { return needs_.at(m); }
  [[nodiscard]] std::size_t size() const noexcept { return needs_.size(); }

 private:
  std::vector<std::vector<chunk_id>> needs_;
  std::size_t key_ = never;
};

/** @brief What the planner sees of one chunk: its logical tier, pins and ticks. */
struct chunk_view {
  tier where = tier::free;
  bool pinned = false;
  std::size_t last_use = 0;
  std::size_t loaded_at = 0;
};

/** @brief Everything the planner reads besides the trace and the policies. Chunks are dense:
 *  `chunks[kind * per_kind + index]`; absent lists have `bytes[kind] == 0`. */
struct prefetch_snapshot {
  std::size_t moment = 0;                            ///< the current moment of the trace
  std::size_t per_kind = 0;                          ///< chunks per list
  std::array<std::size_t, num_chunk_kinds> bytes{};  ///< chunk bytes per list (0: no such list)
  std::vector<chunk_view> chunks;
  std::size_t device_resident = 0;  ///< chunk bytes on the compute tier now (logical)
  std::size_t tick = 0;             ///< the store's tick now
  std::size_t in_flight = 0;        ///< prefetched loads still in flight
  std::size_t releasing = never;    ///< chunk index whose gradient the current moment (a step) frees at its end
  std::size_t fits = 0;             ///< the current moment's budget
  std::size_t depth = 0;            ///< most loads in flight beyond the next moment
  bool zero_free = true;       ///< a FREE chunk may be given a zeroed payload ahead (not under ZeRO: its group does)
  std::vector<char> arriving;  ///< per chunk (dense), or empty: on the host but its read from the disk is unresolved

  [[nodiscard]] std::size_t dense(chunk_id id) const noexcept {
    return static_cast<std::size_t>(id.kind) * per_kind + id.index;
  }
};

/** @brief How the planner asks the runtime about a coming moment @p k (pure functions of the trace):
 *  `sim_budget(k)` the placement's chunk budget at k with k's recorded non-model peak in use, and
 *  `budget_at(k)` the budget the demand path will apply at k. */
struct prefetch_budgets {
  std::function<std::size_t(std::size_t)> sim_budget;
  std::function<std::size_t(std::size_t)> budget_at;
};

/** @brief The transfers to start now, during moment `s.moment`. The simulated state evolves as the
 *  real one will: the chunks in use now are released, a step releases its gradient, LRU ticks
 *  advance with the recorded accesses, budgets follow the placement. The same eviction strategy
 *  then picks the same victims, so carrying the list out moves exactly the bytes the demand path
 *  would, only earlier. The list stops at the first step that cannot happen yet: a victim in use now
 *  or used before its planned eviction, a load that does not fit the smallest budget until its use,
 *  a chunk @p skip rejects, or more than `depth` loads in flight (the next moment's loads always go).
 *  Pure: reads its arguments only. */
template <Tracer T, EvictionStrategy E, class Skip>
[[nodiscard]] std::vector<transfer_op> plan_prefetch(const prefetch_snapshot& s, const T& tracer,
                                                     const trace_needs& needs, const E& eviction,
                                                     const prefetch_budgets& budgets, Skip&& skip) {
  std::vector<transfer_op> ops;
  const std::size_t n = tracer.num_moments();
  if (n == 0 || needs.size() != n) return ops;
  const std::size_t total = s.chunks.size();
  // The simulation (what will be on the device at each coming moment) and a mirror of the real
  // state after the ops planned so far (what carrying them out leaves).
  std::vector<char> sim_on(total, 0), keep(total, 0);
  std::vector<std::size_t> sim_tick(total), sim_loaded(total);
  std::vector<tier> real(total);
  std::size_t sim_resident = 0, real_resident = s.device_resident, tick = s.tick, in_flight = s.in_flight;
  for (std::size_t x = 0; x < total; ++x) {
    sim_tick[x] = s.chunks[x].last_use;
    sim_loaded[x] = s.chunks[x].loaded_at;
    real[x] = s.chunks[x].where;
    if (s.chunks[x].where == tier::device) {
      sim_on[x] = 1;
      sim_resident += s.bytes[x / s.per_kind];
    }
  }
  const auto bytes_of = [&](chunk_id id) { return s.bytes[static_cast<std::size_t>(id.kind)]; };
  const auto sim_drop = [&](chunk_id id) {
    if (std::exchange(sim_on[s.dense(id)], 0)) sim_resident -= bytes_of(id);
  };
  std::vector<eviction_candidate> candidates;

  std::size_t releases = s.releasing;
  std::size_t fits = s.fits;  // smallest budget of the moments from now to the planned one
  for (std::size_t d = 1; d < n; ++d) {
    const std::size_t k = (s.moment + d) % n;
    if (releases != never) sim_drop({chunk_kind::grad, static_cast<std::uint32_t>(releases)});
    releases = never;
    const auto needed = needs.at(k);
    for (auto id : needed) sim_tick[s.dense(id)] = ++tick;
    if (tracer.kind_of(k) == moment_kind::optimizer) {
      if (needed.empty()) return ops;  // a host-side step: its moves are the step's own, not simulated
      releases = needed.front().index;
    }
    std::size_t working = 0;
    for (auto id : needed) {
      working += bytes_of(id);
      keep[s.dense(id)] = 1;
    }
    const std::size_t budget = std::max(budgets.sim_budget(k), working);
    const bool done = [&] {
      // The victim the demand path would pick at moment k.
      auto evict = [&]() -> bool {
        candidates.clear();
        for (std::size_t x = 0; x < total; ++x) {
          if (!sim_on[x] || keep[x]) continue;
          const chunk_id id{static_cast<chunk_kind>(x / s.per_kind), static_cast<std::uint32_t>(x % s.per_kind)};
          std::size_t next = never;
          if constexpr (E::uses_trace) next = tracer.next_use(id, k);
          candidates.push_back({id, s.bytes[x / s.per_kind], sim_tick[x], next, sim_loaded[x]});
        }
        if (candidates.empty()) return false;
        const auto victim = candidates[eviction.pick(candidates)].id;
        sim_drop(victim);
        // Early only if nothing uses it before moment k: not now, not in between.
        if (s.chunks[s.dense(victim)].pinned || tracer.next_use(victim, s.moment) < d) return false;
        ops.push_back({transfer_op::kind::evict, victim});
        real[s.dense(victim)] = tier::host;
        real_resident -= bytes_of(victim);
        return true;
      };
      for (auto id : needed) {
        const std::size_t x = s.dense(id);
        if (sim_on[x]) continue;
        const std::size_t bytes = bytes_of(id);
        while (sim_resident + bytes > budget)
          if (!evict()) return false;
        // On the device for real, absent only in the simulation: a gradient whose step (and
        // release) is still to come. Loading it is for after that release, not now.
        if (real[x] == tier::device || s.chunks[x].pinned || skip(id) || real_resident + bytes > fits) return false;
        if (x < s.arriving.size() && s.arriving[x])
          return false;  // still coming from the disk: load it once it is here
        const bool transfer = real[x] == tier::host;
        if (transfer && d > 1 && in_flight >= s.depth) return false;
        if (!transfer && (real[x] != tier::free || !s.zero_free))
          return false;  // remote, disk, or a ZeRO gradient: not this planner's move
        sim_on[x] = 1;
        sim_resident += bytes;
        sim_loaded[x] = ++tick;  // as the demand path stamps its arrival, after the moment's accesses
        ops.push_back({transfer ? transfer_op::kind::load : transfer_op::kind::zero, id});
        real[x] = tier::device;
        real_resident += bytes;
        if (transfer) ++in_flight;
      }
      while (sim_resident > budget)  // the tide goes out: the surplus leaves too
        if (!evict()) return false;
      return true;
    }();
    for (auto id : needed) keep[s.dense(id)] = 0;
    if (!done) return ops;
    fits = std::min(fits, budgets.budget_at(k));
  }
  return ops;
}

}  // namespace chunkstar
