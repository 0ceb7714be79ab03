// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief The disk prefetch planner: a pure function from a snapshot of the chunks and the trace
 *         to the disk reads (and the writes that make host room for them) to start now, so chunks
 *         arrive from the disk before the compute tier's prefetcher or a host-side step wants them.
 *
 *  It looks ahead over the coming moments for chunks on disk that a moment needs "above the disk"
 *  (on the compute tier, or on the host for a host-side optimizer step), in order of need, and
 *  brings each up while the host has room or a host chunk can go down in exchange. The exchange
 *  rule keeps it Belady-consistent whatever the eviction strategy: a victim must be used strictly
 *  later than the chunk it makes room for (so nothing comes up only to push down something needed
 *  sooner), and among those the strategy picks. The runtime carries the list out; the planner moves
 *  nothing.
 */
#pragma once

#include <chunkstar/eviction/eviction_strategy.hpp>
#include <chunkstar/core/chunk_id.hpp>
#include <chunkstar/core/chunk_kind.hpp>
#include <chunkstar/core/moment_kind.hpp>
#include <chunkstar/core/tier.hpp>
#include <chunkstar/store/prefetch_planner.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace chunkstar {

/** @brief One transfer between the host and the disk. */
struct disk_op {
  enum class kind : std::uint8_t {
    write,  ///< move the chunk from the host to the disk (to make room)
    read,   ///< move the chunk from the disk to the host (ahead of its use)
  };
  kind what = kind::read;
  chunk_id id;
  friend constexpr bool operator==(const disk_op& a, const disk_op& b) noexcept {
    return a.what == b.what && a.id == b.id;
  }
};

/** @brief What the disk planner reads besides the needs and next uses. Chunks are dense like
 *  `prefetch_snapshot`'s: `chunks[kind * per_kind + index]`. */
struct disk_snapshot {
  std::size_t moment = 0;                            ///< the current moment of the trace
  std::size_t moments = 0;                           ///< moments per iteration (the trace's length)
  std::size_t per_kind = 0;                          ///< chunks per list
  std::array<std::size_t, num_chunk_kinds> bytes{};  ///< chunk bytes per list (0: no such list)
  std::vector<chunk_view> chunks;                    ///< tier, pins and ticks of every chunk
  std::vector<char> arriving;     ///< per chunk: a disk read into it is still unresolved (it cannot move yet)
  std::size_t host_resident = 0;  ///< chunk bytes on the host now (logical)
  std::size_t host_budget = 0;    ///< chunk bytes the host may hold
  std::size_t in_flight = 0;      ///< disk reads still unresolved
  std::size_t depth = 0;          ///< most disk reads in flight
  std::size_t horizon = never;  ///< moments ahead to look (the nearer, the fewer decisions later arrivals would change)

  [[nodiscard]] std::size_t dense(chunk_id id) const noexcept {
    return static_cast<std::size_t>(id.kind) * per_kind + id.index;
  }
  [[nodiscard]] chunk_id id_at(std::size_t x) const noexcept {
    return {static_cast<chunk_kind>(x / per_kind), static_cast<std::uint32_t>(x % per_kind)};
  }
};

/** @brief The disk transfers to start now. @p needs_at(k) → the chunks moment k needs above the
 *  disk (a range of chunk_id); @p next_use(id) → moments from now to the chunk's next use above the
 *  disk (`never`: none). Walks the coming moments in order; for each needed chunk on disk, while
 *  the host lacks room, a host chunk used strictly later (not pinned, not arriving) chosen by
 *  @p eviction goes down first. Stops at the first chunk that cannot come up (no such victim, or
 *  one this plan sent down) or when `depth` reads are in flight. Pure: reads its arguments only. */
template <EvictionStrategy E, class NeedsAt, class NextUse>
[[nodiscard]] std::vector<disk_op> plan_disk_prefetch(const disk_snapshot& s, NeedsAt&& needs_at, NextUse&& next_use,
                                                      const E& eviction) {
  std::vector<disk_op> ops;
  if (s.moments == 0 || s.depth == 0 || s.in_flight >= s.depth) return ops;
  const std::size_t total = s.chunks.size();
  std::vector<tier> where(total);
  std::vector<char> written(total, 0);  // sent down by this plan: reading it back is for a later plan
  for (std::size_t x = 0; x < total; ++x) where[x] = s.chunks[x].where;
  std::size_t host = s.host_resident, in_flight = s.in_flight;
  std::vector<eviction_candidate> candidates;
  for (std::size_t d = 1; d < s.moments && d <= s.horizon; ++d) {
    const std::size_t k = (s.moment + d) % s.moments;
    for (const chunk_id id : needs_at(k)) {
      const std::size_t x = s.dense(id);
      if (where[x] != tier::disk) continue;
      if (s.chunks[x].pinned || written[x] || in_flight >= s.depth) return ops;
      const std::size_t bytes = s.bytes[static_cast<std::size_t>(id.kind)];
      while (host + bytes > s.host_budget) {
        candidates.clear();
        for (std::size_t y = 0; y < total; ++y) {
          if (where[y] != tier::host) continue;
          const chunk_id c = s.id_at(y);
          const std::size_t next = next_use(c);
          if (next <= d) continue;  // used no later than the chunk it would make room for
          candidates.push_back({c, s.bytes[y / s.per_kind], s.chunks[y].last_use, next, s.chunks[y].loaded_at});
        }
        if (candidates.empty()) return ops;
        const chunk_id victim = candidates[eviction.pick(candidates)].id;
        // A chunk in use now (pinned) or still arriving is a candidate as the demand path will see
        // it once this moment ends: when it is the best victim, the exchange waits for it rather than
        // sending down a worse one (a chunk being stepped now is the step streaming's next victim).
        const std::size_t v = s.dense(victim);
        if (s.chunks[v].pinned || (v < s.arriving.size() && s.arriving[v])) return ops;
        ops.push_back({disk_op::kind::write, victim});
        where[s.dense(victim)] = tier::disk;
        written[s.dense(victim)] = 1;
        host -= s.bytes[static_cast<std::size_t>(victim.kind)];
      }
      ops.push_back({disk_op::kind::read, id});
      where[x] = tier::host;
      host += bytes;
      ++in_flight;
    }
  }
  return ops;
}

}  // namespace chunkstar
