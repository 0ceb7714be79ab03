// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `residency_manager`: which chunks are on the compute tier at each moment. It asks the
 *         placement for budgets and the eviction strategy for victims (among candidates it
 *         filters: never a pinned chunk or one the current moment needs), makes a moment's chunks
 *         resident (evicting as needed), and carries out the prefetch planner's transfers. The
 *         chunk store moves the bytes.
 *
 *  After a throw (no room, a copy engine or policy that throws) every chunk is in a consistent
 *  tier: the moves done before the failure stand, the failed one did not happen, nothing is pinned
 *  by the manager (it never pins).
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/units.hpp>
#include <chunkstar/eviction/eviction_strategy.hpp>
#include <chunkstar/placement/placement_policy.hpp>
#include <chunkstar/store/chunk_store.hpp>
#include <chunkstar/store/disk_planner.hpp>
#include <chunkstar/store/compute_level.hpp>
#include <chunkstar/store/prefetch_planner.hpp>
#include <chunkstar/tracer/tracer.hpp>

#include <algorithm>
#include <cstddef>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

namespace chunkstar {

/** @brief Budgets, victims and residency on the compute tier, and on the host when a disk tier
 *  is attached: a chunk that must come to the host (an eviction from the compute tier, a read from
 *  the disk, a host-side step) first makes room there by sending host chunks down to the disk,
 *  the victims the same strategy picks with next uses "above the disk" (host_next_use): what is
 *  needed latest goes furthest down. */
template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
class residency_manager {
 public:
  using store_type = chunk_store<P>;

  residency_manager(store_type& store, const Placement& placement, const Eviction& eviction, const TracerT& tracer,
                    const compute_level& level, std::size_t prefetch_depth, runtime_stats& stats,
                    std::size_t disk_prefetch_depth = 0, std::size_t disk_prefetch_horizon = 0,
                    std::size_t disk_staging_chunks = 0)
      : store_(store),
        placement_(placement),
        eviction_(eviction),
        tracer_(tracer),
        level_(level),
        depth_(prefetch_depth),
        stats_(stats),
        disk_depth_(disk_prefetch_depth),
        disk_horizon_(disk_prefetch_horizon),
        staging_(disk_staging_chunks) {}

  // --- budgets -------------------------------------------------------------------------------------
  /** @brief The placement's view at moment @p m (the current non-model use is today's). */
  [[nodiscard]] placement_inputs inputs(std::size_t m) const;
  [[nodiscard]] placement_inputs inputs() const { return inputs(tracer_.current_moment()); }

  /** @brief Chunk bytes the compute tier may hold at moment @p m: the policy's budget, never above
   *  what the device has left after non-model data. */
  [[nodiscard]] std::size_t budget_at(std::size_t m) const;
  [[nodiscard]] std::size_t budget_now() const { return budget_at(tracer_.current_moment()); }
  /** @brief From the trace: chunk bytes the compute tier may hold while moment @p m computes (its
   *  recorded non-model peak live), for plans made ahead (prefetch, ZeRO's gathers ahead). */
  [[nodiscard]] std::size_t planned_budget(std::size_t m) const;

  /** @brief Non-model bytes the trace says this moment (or the next) may still allocate: room a
   *  new chunk buffer must leave free. */
  [[nodiscard]] std::size_t device_reserve() const;

  /** @brief Where chunk index @p c's optimizer step runs (the placement's choice). */
  [[nodiscard]] tier optimizer_tier(std::size_t c) const { return placement_.optimizer_tier(inputs(), c); }

  // --- the demand path -----------------------------------------------------------------------------
  /** @brief Makes every chunk in @p ids resident on the compute tier within the budget, evicting
   *  victims the strategy picks, and waits for them (a chunk loaded ahead counts a prefetch hit).
   *  @p who names the scope in errors. */
  void make_resident_on_device(std::span<const chunk_id> ids, std::string_view who, std::size_t m);

  /** @brief Makes chunk @p id resident on the host (a host-side optimizer step) and waits for it;
   *  host room is made without touching @p keep (the step's other lists). */
  void make_resident_on_host(chunk_id id, const std::unordered_set<chunk_id>& keep = {});

  /** @brief Starts moving @p ids (on the host or the disk) back to the compute tier, in order, while
   *  they fit in the budget without evicting anything (after a sleep); the rest load on demand.
   *  Counted as loads ahead (a later scope's wait for one is a prefetch hit). */
  void bring_back(std::span<const chunk_id> ids);

  /** @brief Starts moving chunk @p id from the compute tier to the host for a host-side step,
   *  making host room first (not from @p keep). */
  void offload(chunk_id id, const std::unordered_set<chunk_id>& keep = {});

  // --- the host tier (with a disk) -----------------------------------------------------------------
  /** @brief Chunk bytes the host may hold: its space's capacity, less (with a disk tier) room for
   *  `disk_staging_chunks` payloads that disk writes in flight still read, so the next read from
   *  the disk finds a buffer instead of waiting for a write to land. */
  [[nodiscard]] std::size_t host_budget() const;

  /** @brief With a disk tier, sends host chunks (not pinned, not in @p keep) to the disk until
   *  @p bytes more fit the host budget; victims picked by the strategy with next uses above the
   *  disk from moment @p reference. Soft like the compute tier's budget: when nothing can go, the
   *  caller's allocation decides (a typed error if the host is physically full). */
  void make_host_room(std::size_t bytes, const std::unordered_set<chunk_id>& keep, std::size_t reference);

  /** @brief Sends one host chunk to the disk (see make_host_room). False when none can go. */
  bool evict_one_to_disk(const std::unordered_set<chunk_id>& keep, std::size_t reference);

  /** @brief Called by make_host_room when the host is over its budget and every chunk left there
   *  is pinned: waits for the work that holds chunks pinned and can be waited for (the optimizer
   *  steps started inside backward) and releases them; returns whether it released any. Unset:
   *  nothing to wait for. */
  std::function<bool()> release_host_pins;

  /** @brief Moments from @p m to chunk @p id's next use above the disk: on the compute tier (the
   *  trace's accesses) or on the host by a host-side step of its chunk index (the step's moment,
   *  recorded by note_step); `never` without a trace. */
  [[nodiscard]] std::size_t host_next_use(chunk_id id, std::size_t m) const;

  /** @brief Chunk index @p c steps at moment @p m of the iteration on tier @p where (the optimizer
   *  pass says so as it runs; the next iteration's trace holds the same moments and the placement
   *  makes the same choice). Only host-side steps are kept: the trace has the device ones. */
  void note_step(std::size_t c, std::size_t m, tier where);

  /** @brief Starts reading chunk @p id from the disk to the host, host room made first (not from
   *  @p keep; victims by next use from @p reference); @p ahead: a prefetch, not a demand. */
  void read_from_disk(chunk_id id, const std::unordered_set<chunk_id>& keep, std::size_t reference, bool ahead);

  /** @brief Evicts one chunk from the compute tier (not pinned, not in @p keep), the victim the
   *  strategy picks with next uses measured from moment @p reference (`never`: none). False when
   *  nothing can go. */
  bool evict_one(const std::unordered_set<chunk_id>& keep, std::size_t reference);

  /** @brief Evicts victims until @p bytes more chunk bytes fit the budget (or the device's room),
   *  for a group buffer about to be allocated (ZeRO); @p who names the scope in errors. */
  void make_room(std::size_t bytes, std::string_view who,
                 std::string_view what = "a group of chunks (ZeRO gather or reduce)");

  /** @brief Makes room for @p bytes of non-model memory: finished copies retire first, then one
   *  victim goes. False when nothing more can be freed. */
  bool free_one_for_non_model();

  // --- prefetch ------------------------------------------------------------------------------------
  /** @brief Starts now the transfers the demand path will make at the coming moments of the trace
   *  (see plan_prefetch), never loading a chunk for which @p skip returns true. An optimisation:
   *  a transfer that fails (no room, a copy engine error) ends the prefetch and is left to the
   *  demand path, which reports it; internal errors propagate. */
  template <class Skip>
  void prefetch(std::size_t m, Skip&& skip) {
    if (!trace_ready() || m == never) return;
    prefetch_from_disk(m);
    if (depth_ == 0) return;
    std::vector<transfer_op> ops;
    try {
      needs_.refresh(tracer_);
      ops = plan_prefetch(snapshot(m), tracer_, needs_, eviction_, budgets(), skip);
    } catch (const state_error&) {
      throw;
    } catch (const std::exception&) {
      return;  // a policy that failed plans nothing now; the demand path will ask it again
    }
    for (const auto& op : ops) {
      try {
        carry_out(op);
      } catch (const state_error&) {
        throw;
      } catch (const std::exception&) {
        return;
      }
    }
  }
  void prefetch(std::size_t m);

  /** @brief Starts now the disk reads (and the writes that make host room for them) that
   *  plan_disk_prefetch chooses at moment @p m. An optimisation, like prefetch. */
  void prefetch_from_disk(std::size_t m);

  /** @brief Loads chunk @p id ahead of its use (counted as a prefetch; a scope finding it counts a
   *  hit). @p touch: for LRU, a chunk the prefetcher just fetched is not the stalest. */
  void load_ahead(chunk_id id, bool touch = true);

  /** @brief The memory report of the stores' spaces plus the runtime's view. */
  [[nodiscard]] memory_report report() const;

 private:
  [[nodiscard]] bool trace_ready() const { return tracer_.ready() && !level_.untraced; }

  /** The trace's highest non-model peak; recomputed only when the trace or a recorded peak changed. */
  [[nodiscard]] std::size_t trace_peak_max() const;
  /** @brief The traced non-model peak over the optimizer step's moments (0 if it has none). */
  [[nodiscard]] std::size_t trace_peak_step() const;

  /** Fills candidates_ with the chunks @p eligible accepts, next uses measured from @p reference. */
  template <class Eligible>
  void collect_candidates(std::size_t reference, Eligible&& eligible) {
    candidates_.clear();
    store_.for_each([&](chunk_id id, const typename store_type::slot& s) {
      if (!eligible(id, s)) return;
      std::size_t next = never;
      if constexpr (Eviction::uses_trace) {
        if (reference != never) next = tracer_.next_use(id, reference);
      }
      candidates_.push_back({id, store_.bytes_of(id.kind), s.last_use, next, s.loaded_at});
    });
  }

  [[nodiscard]] prefetch_snapshot snapshot(std::size_t m) const;

  [[nodiscard]] disk_snapshot disk_snapshot_at(std::size_t m) const;
  [[nodiscard]] prefetch_budgets budgets() const;

  void carry_out(const transfer_op& op);

  store_type& store_;
  const Placement& placement_;
  const Eviction& eviction_;
  const TracerT& tracer_;
  const compute_level& level_;
  std::size_t depth_;
  runtime_stats& stats_;
  std::vector<eviction_candidate> candidates_;
  trace_needs needs_;
  std::size_t disk_depth_ = 0;
  std::size_t disk_horizon_ = 0;
  std::size_t staging_ = 0;
  std::vector<std::size_t> step_moment_;  // per chunk index: the moment of its host-side step (note_step), or never
  std::vector<std::size_t> moment_step_;  // per moment: the chunk index stepped on the host then, or never
  mutable std::size_t peak_max_ = 0, peak_step_ = 0;  // trace_peak_max, trace_peak_step
  mutable std::pair<std::size_t, std::size_t> peak_max_key_{never, never};
};

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
placement_inputs residency_manager<P, Placement, Eviction, TracerT>::inputs(std::size_t m) const {
  placement_inputs in;
  in.moment = m;
  in.device_capacity = store_.device().capacity();
  in.non_model_now = level_.non_model;
  in.trace_ready = trace_ready();
  in.kind = in.trace_ready ? tracer_.kind_of(m) : level_.kind;
  if (in.trace_ready) {
    // The current moment's peak from here on (it falls once its activations are freed).
    in.non_model_peak_here =
        m == tracer_.current_moment() ? tracer_.non_model_peak_from(m, level_.changes) : tracer_.non_model_peak(m);
    in.non_model_peak_next = tracer_.non_model_peak(m + 1);
    in.non_model_peak_max = trace_peak_max();
    in.non_model_peak_step = trace_peak_step();
  }
  for (auto k : all_chunk_kinds) {
    if (!store_.has(k)) continue;
    const auto& d = store_.desc(k);
    in.total_chunk_bytes += d.chunk_bytes * d.num_chunks;
    in.step_chunk_bytes += d.chunk_bytes;
    if (k == chunk_kind::param || k == chunk_kind::grad) in.compute_chunk_bytes += d.chunk_bytes * d.num_chunks;
  }
  in.num_chunks = store_.num_chunks();
  return in;
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
std::size_t residency_manager<P, Placement, Eviction, TracerT>::budget_at(std::size_t m) const {
  const auto in = inputs(m);
  return std::min(placement_.chunk_budget(in), room_after(in.device_capacity, in.non_model_now));
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
std::size_t residency_manager<P, Placement, Eviction, TracerT>::planned_budget(std::size_t m) const {
  auto in = inputs(m);
  in.non_model_now = tracer_.non_model_peak(m);  // its use when it opens is within its recorded peak
  return std::min(placement_.chunk_budget(in), room_after(in.device_capacity, in.non_model_now));
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
std::size_t residency_manager<P, Placement, Eviction, TracerT>::device_reserve() const {
  if (!trace_ready()) return 0;
  const auto m = tracer_.current_moment();
  return room_after(std::max(tracer_.non_model_peak(m), tracer_.non_model_peak(m + 1)), level_.non_model);
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
void residency_manager<P, Placement, Eviction, TracerT>::make_resident_on_device(std::span<const chunk_id> ids,
                                                                                 std::string_view who, std::size_t m) {
  const std::unordered_set<chunk_id> keep(ids.begin(), ids.end());
  std::size_t working = 0;
  for (auto id : ids) working += store_.bytes_of(id.kind);
  const std::size_t hard = room_after(store_.device().capacity(), level_.non_model);
  if (working > hard)
    throw out_of_memory_error("scope '" + std::string(who) + "' needs " + format_bytes(working) +
                                  " of chunks on the compute tier but only " + format_bytes(hard) +
                                  " is left after non-model data: give the device space at least " +
                                  format_bytes(working + level_.non_model) +
                                  " (its capacity), or use smaller chunks (fixed_layout_options::chunk_elems, "
                                  "searched_layout_options::max_chunk_elems); memory_plan::device_floor() "
                                  "(plan_memory) gives the least device a whole run needs, before anything is built",
                              working, report());
  const std::size_t budget = std::max(budget_now(), working);
  for (auto id : ids)  // first, so the disk reads run while the compute tier makes room
    if (store_.at(id).where == tier::disk) read_from_disk(id, keep, m, false);
  for (auto id : ids) {
    auto& s = store_.at(id);
    if (s.where == tier::device) continue;
    // Within the budget if possible; the budget is soft (it anticipates later activations), only
    // the device's room is hard.
    while (store_.device_in_use() + store_.bytes_of(id.kind) > budget) {
      if (evict_one(keep, m)) continue;
      if (store_.device_in_use() + store_.bytes_of(id.kind) <= hard) break;
      throw out_of_memory_error(
          "scope '" + std::string(who) + "' needs " + format_bytes(working) +
              " of chunks on the compute tier but nothing more can be evicted (every other chunk there is in use): "
              "raise the device space's capacity (memory_plan::device_floor(), from plan_memory, gives the least "
              "device a whole run needs)",
          working, report());
    }
    if (s.where == tier::free) {
      store_.materialise(id, tier::device, device_reserve());
    } else {
      store_.move(id, tier::device, move_reason::load, device_reserve());
      ++stats_.demand_loads;
    }
  }
  // The budget may have shrunk since the last moment (the tide): give back the surplus now, before
  // this moment's activations need it.
  while (store_.device_in_use() > budget && evict_one(keep, m)) {
  }
  for (auto id : ids) {
    auto& s = store_.at(id);
    if (s.prefetched) {
      ++stats_.prefetch_hits;
      s.prefetched = false;
    }
    store_.wait(s);
  }
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
void residency_manager<P, Placement, Eviction, TracerT>::make_resident_on_host(
    chunk_id id, const std::unordered_set<chunk_id>& keep) {
  auto& s = store_.at(id);
  if (s.where == tier::free) {
    make_host_room(store_.bytes_of(id.kind), keep, tracer_.current_moment());
    store_.materialise(id, tier::host);
  } else if (s.where == tier::device) {
    offload(id, keep);
  } else if (s.where == tier::disk) {
    read_from_disk(id, keep, tracer_.current_moment(), false);
  }
  store_.wait(s);
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
void residency_manager<P, Placement, Eviction, TracerT>::offload(chunk_id id,
                                                                 const std::unordered_set<chunk_id>& keep) {
  make_host_room(store_.bytes_of(id.kind), keep, tracer_.current_moment());
  store_.at(id).prefetched = false;
  store_.move(id, tier::host, move_reason::offload);
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
std::size_t residency_manager<P, Placement, Eviction, TracerT>::host_budget() const {
  if (!store_.has_disk()) return store_.host().capacity();
  std::size_t largest = 0;
  for (auto k : all_chunk_kinds)
    if (store_.has(k)) largest = std::max(largest, store_.footprint(tier::host, store_.bytes_of(k)));
  return room_after(store_.host().capacity(), staging_ * largest);
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
void residency_manager<P, Placement, Eviction, TracerT>::make_host_room(std::size_t bytes,
                                                                        const std::unordered_set<chunk_id>& keep,
                                                                        std::size_t reference) {
  if (!store_.has_disk()) return;
  bytes = store_.footprint(tier::host, bytes);
  while (store_.resident(tier::host) + bytes > host_budget()) {
    if (evict_one_to_disk(keep, reference)) continue;
    if (!release_host_pins || !release_host_pins()) return;  // nothing more can go: the caller decides
  }
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
bool residency_manager<P, Placement, Eviction, TracerT>::evict_one_to_disk(const std::unordered_set<chunk_id>& keep,
                                                                           std::size_t reference) {
  candidates_.clear();
  store_.for_each([&](chunk_id id, const typename store_type::slot& s) {
    if (s.where != tier::host || s.pinned || keep.contains(id)) return;
    candidates_.push_back({id, store_.bytes_of(id.kind), s.last_use,
                           reference == never ? never : host_next_use(id, reference), s.loaded_at});
  });
  if (candidates_.empty()) return false;
  store_.move(candidates_[eviction_.pick(candidates_)].id, tier::disk, move_reason::evict);
  return true;
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
std::size_t residency_manager<P, Placement, Eviction, TracerT>::host_next_use(chunk_id id, std::size_t m) const {
  if (!trace_ready() || m == never) return never;
  std::size_t next = tracer_.next_use(id, m);
  const std::size_t n = tracer_.num_moments();
  if (id.index < step_moment_.size() && step_moment_[id.index] < n) {
    const std::size_t sm = step_moment_[id.index], mm = m % n;
    next = std::min(next, sm > mm ? sm - mm : n - mm + sm);
  }
  return next;
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
void residency_manager<P, Placement, Eviction, TracerT>::note_step(std::size_t c, std::size_t m, tier where) {
  if (step_moment_.size() < store_.num_chunks()) step_moment_.resize(store_.num_chunks(), never);
  if (c >= step_moment_.size()) return;
  if (step_moment_[c] != never && step_moment_[c] < moment_step_.size()) moment_step_[step_moment_[c]] = never;
  step_moment_[c] = where == tier::host ? m : never;
  if (where != tier::host || m == never) return;
  if (moment_step_.size() <= m) moment_step_.resize(m + 1, never);
  moment_step_[m] = c;
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
void residency_manager<P, Placement, Eviction, TracerT>::read_from_disk(chunk_id id,
                                                                        const std::unordered_set<chunk_id>& keep,
                                                                        std::size_t reference, bool ahead) {
  make_host_room(store_.bytes_of(id.kind), keep, reference);
  store_.move(id, tier::host, move_reason::load);
  ++(ahead ? stats_.disk_prefetches : stats_.disk_demand_reads);
  if (ahead) store_.at(id).last_use = store_.tick();  // for LRU, a chunk just fetched is not the stalest
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
bool residency_manager<P, Placement, Eviction, TracerT>::evict_one(const std::unordered_set<chunk_id>& keep,
                                                                   std::size_t reference) {
  collect_candidates(reference, [&](chunk_id id, const typename store_type::slot& s) {
    return s.where == tier::device && !s.pinned && !keep.contains(id);
  });
  if (candidates_.empty()) return false;
  const auto victim = candidates_[eviction_.pick(candidates_)].id;
  store_.at(victim).prefetched = false;
  make_host_room(store_.bytes_of(victim.kind), keep, reference);  // the cascade: the host makes room first
  store_.move(victim, tier::host, move_reason::evict);
  return true;
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
void residency_manager<P, Placement, Eviction, TracerT>::make_room(std::size_t bytes, std::string_view who,
                                                                   std::string_view what) {
  const std::size_t budget = budget_now();
  while (store_.device_in_use() + bytes > budget && evict_one({}, tracer_.current_moment())) {
  }
  const std::size_t hard = room_after(store_.device().capacity(), level_.non_model);
  if (store_.device_in_use() + bytes > hard && !evict_one({}, never))
    throw out_of_memory_error(
        "scope '" + std::string(who) + "' needs " + format_bytes(bytes) + " more on the compute tier for " +
            std::string(what) +
            " and nothing more can be evicted: raise the device space's capacity, or use smaller chunks "
            "(memory_plan::device_floor(), from plan_memory, gives the least device a whole run needs)",
        bytes, report());
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
bool residency_manager<P, Placement, Eviction, TracerT>::free_one_for_non_model() {
  return store_.retire_one(tier::device) || evict_one({}, never);
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
void residency_manager<P, Placement, Eviction, TracerT>::prefetch(std::size_t m) {
  prefetch(m, [](chunk_id) { return false; });
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
void residency_manager<P, Placement, Eviction, TracerT>::prefetch_from_disk(std::size_t m) {
  if (!store_.has_disk() || disk_depth_ == 0 || !trace_ready() || m == never) return;
  std::vector<disk_op> ops;
  try {
    needs_.refresh(tracer_);
    const auto snap = disk_snapshot_at(m);
    std::vector<chunk_id> at_k;
    ops = plan_disk_prefetch(
        snap,
        [&](std::size_t k) -> std::span<const chunk_id> {
          at_k.assign(needs_.at(k).begin(), needs_.at(k).end());
          if (const auto c = k < moment_step_.size() ? moment_step_[k] : never; c != never)
            for (auto kind : all_chunk_kinds)
              if (store_.has(kind)) at_k.push_back({kind, static_cast<std::uint32_t>(c)});
          return at_k;
        },
        [&](chunk_id id) { return host_next_use(id, m); }, eviction_);
  } catch (const state_error&) {
    throw;
  } catch (const std::exception&) {
    return;
  }
  for (const auto& op : ops) {
    try {
      if (op.what == disk_op::kind::write) store_.move(op.id, tier::disk, move_reason::evict);
      else read_from_disk(op.id, {}, m, true);
    } catch (const state_error&) {
      throw;
    } catch (const std::exception&) {
      return;
    }
  }
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
void residency_manager<P, Placement, Eviction, TracerT>::bring_back(std::span<const chunk_id> ids) {
  const std::size_t budget = budget_now();
  for (auto id : ids) {
    const auto& s = store_.at(id);
    if (s.where != tier::host && s.where != tier::disk) continue;
    if (store_.device_in_use() + store_.bytes_of(id.kind) > budget) return;
    if (s.where == tier::disk) read_from_disk(id, {}, tracer_.current_moment(), false);
    load_ahead(id, false);
  }
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
void residency_manager<P, Placement, Eviction, TracerT>::load_ahead(chunk_id id, bool touch) {
  store_.move(id, tier::device, move_reason::load, device_reserve());
  auto& s = store_.at(id);
  s.prefetched = true;
  if (touch) s.last_use = store_.tick();
  ++stats_.prefetches;
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
memory_report residency_manager<P, Placement, Eviction, TracerT>::report() const {
  memory_report r = store_.report();
  r.spaces.push_back(
      {"non-model on device", store_.device().capacity(), level_.non_model, stats_.peak_non_model_bytes, 0});

  return r;
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
std::size_t residency_manager<P, Placement, Eviction, TracerT>::trace_peak_max() const {
  const auto st = tracer_.stats();
  const std::pair<std::size_t, std::size_t> key{st.traces, st.memory_divergences};
  if (key != peak_max_key_) {
    peak_max_ = peak_step_ = 0;
    for (std::size_t i = 0; i < tracer_.num_moments(); ++i) {
      peak_max_ = std::max(peak_max_, tracer_.non_model_peak(i));
      if (tracer_.kind_of(i) == moment_kind::optimizer) peak_step_ = std::max(peak_step_, tracer_.non_model_peak(i));
    }
    peak_max_key_ = key;
  }
  return peak_max_;
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
std::size_t residency_manager<P, Placement, Eviction, TracerT>::trace_peak_step() const {
  (void)trace_peak_max();  // both from one pass over the trace
  return peak_step_;
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
prefetch_snapshot residency_manager<P, Placement, Eviction, TracerT>::snapshot(std::size_t m) const {
  prefetch_snapshot s;
  s.moment = m;
  s.per_kind = store_.num_chunks();
  s.chunks.resize(num_chunk_kinds * s.per_kind);
  store_.for_each([&](chunk_id id, const typename store_type::slot& sl) {
    s.bytes[static_cast<std::size_t>(id.kind)] = store_.bytes_of(id.kind);
    s.chunks[s.dense(id)] = {sl.where, sl.pinned > 0, sl.last_use, sl.loaded_at};
    if (sl.where == tier::device && sl.prefetched && sl.pending && !sl.pending->ready()) ++s.in_flight;
    if (sl.disk_pending && sl.where == tier::host) {
      s.arriving.resize(s.chunks.size(), 0);
      s.arriving[s.dense(id)] = 1;
    }
  });
  s.device_resident = store_.device_in_use();
  s.tick = store_.current_tick();
  s.releasing = level_.releasing;
  s.fits = budget_now();
  s.depth = depth_;
  s.zero_free = !level_.sharded;
  return s;
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
disk_snapshot residency_manager<P, Placement, Eviction, TracerT>::disk_snapshot_at(std::size_t m) const {
  disk_snapshot s;
  s.moment = m;
  s.moments = tracer_.num_moments();
  s.per_kind = store_.num_chunks();
  s.chunks.resize(num_chunk_kinds * s.per_kind);
  s.arriving.assign(s.chunks.size(), 0);
  store_.for_each([&](chunk_id id, const typename store_type::slot& sl) {
    s.bytes[static_cast<std::size_t>(id.kind)] = store_.footprint(tier::host, store_.bytes_of(id.kind));
    s.chunks[s.dense(id)] = {sl.where, sl.pinned > 0, sl.last_use, sl.loaded_at};
    if (sl.disk_pending && sl.where == tier::host) {
      s.arriving[s.dense(id)] = 1;
      ++s.in_flight;
    }
  });
  s.host_resident = store_.resident(tier::host);
  s.host_budget = host_budget();
  s.depth = disk_depth_;
  s.horizon = disk_horizon_;
  return s;
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
prefetch_budgets residency_manager<P, Placement, Eviction, TracerT>::budgets() const {
  return {[this](std::size_t k) {
            auto at_k = inputs(k);
            at_k.non_model_now = tracer_.non_model_peak(k);  // its use when it opens is within its recorded peak
            return placement_.chunk_budget(at_k);
          },
          [this](std::size_t k) { return budget_at(k); }};
}

template <Platform P, PlacementPolicy Placement, EvictionStrategy Eviction, Tracer TracerT>
void residency_manager<P, Placement, Eviction, TracerT>::carry_out(const transfer_op& op) {
  switch (op.what) {
    case transfer_op::kind::evict:
      store_.at(op.id).prefetched = false;
      store_.move(op.id, tier::host, move_reason::evict);
      break;
    case transfer_op::kind::load: load_ahead(op.id); break;
    case transfer_op::kind::zero:
      store_.materialise(op.id, tier::device, device_reserve());  // a zero fill, not a transfer (no hit)
      store_.touch(op.id);                                        // like a fetched chunk: prepared now, not the stalest
      break;
  }
}

}  // namespace chunkstar
