// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief What the chunk runtime did: bytes moved per direction, loads (demand and ahead),
 *         evictions, prefetch hits, stalls, and peaks that agree with the spaces' own accounting.
 */
#pragma once

#include <cstddef>
#include <cstdint>

namespace chunkstar {

/** @brief Counters since construction (or the last `reset_stats()`), one meaning each. The bytes,
 *  `loads`, `evictions`, `offloads`, `materialised` and the peaks of chunk bytes are a deterministic
 *  function of the program and the policies, never of timing. How many loads went ahead of use
 *  (`prefetches`, `prefetch_hits`, `demand_loads`) can vary with timing, because the prefetch depth
 *  counts the loads still in flight; the times and `buffer_reuses` depend on timing too.
 *
 *  Moves: every copy of a chunk payload between the compute tier and the host is exactly one of
 *  `loads` (to the compute tier), `evictions` (to the host, to make room there) or `offloads` (to
 *  the host, for a host-side optimizer step); `loads = demand_loads + prefetches`. Copies between
 *  the host and a disk tier are `disk_reads` and `disk_writes`. With a disk tier, which chunks
 *  the disk prefetcher moves depends on what the compute tier's prefetcher has done by then, so
 *  the disk counters (unlike the compute tier's) can vary with timing.
 *
 *  Peaks: `peak_device_bytes` is the most the runtime held in the device space at once — chunk
 *  payloads, buffers in-flight copies still read, and non-model memory — so with nothing else
 *  allocating from that space it equals the space's own peak; `peak_device_chunk_bytes` and
 *  `peak_non_model_bytes` are its two parts, each at most it. `reset_stats()` restarts the peaks
 *  from the current levels. */
struct runtime_stats {
  std::uint64_t bytes_to_device = 0;  ///< chunk payload bytes copied host -> compute tier
  std::uint64_t bytes_to_host = 0;    ///< chunk payload bytes copied compute tier -> host
  std::uint64_t loads = 0;            ///< chunk copies to the compute tier (= demand_loads + prefetches)
  std::uint64_t evictions = 0;        ///< chunk copies to the host to make room on the compute tier
  std::uint64_t offloads = 0;         ///< chunk copies to the host for a host-side optimizer step
  /// loads started before the moment that uses the chunk (the prefetcher, or a step returning its param)
  std::uint64_t prefetches = 0;
  std::uint64_t prefetch_hits = 0;  ///< of those, the ones a later moment used (counted once, when it opens)
  std::uint64_t demand_loads = 0;   ///< loads started by the moment that needs the chunk (it waits for them)
  std::uint64_t materialised = 0;   ///< FREE chunks given a zeroed payload (gradients)
  std::uint64_t scopes = 0;         ///< access scopes opened
  std::uint64_t steps = 0;          ///< optimizer steps completed
  std::uint64_t device_steps = 0;   ///< chunk steps run on the compute tier
  std::uint64_t host_steps = 0;     ///< chunk steps run on the host
  /// of the host steps, those run on the early steps' worker (chunk_adam::prepare): inside
  /// backward, the last scope's chunks queued by the step, and those it carried over to the next
  /// forward; an early step redone in the pass counts twice in host_steps
  std::uint64_t early_steps = 0;
  double stall_s = 0;  ///< time the calling thread waited for copies
  /// Loads (and zero fills) that took over the device buffer of an eviction still in flight
  /// instead of waiting for it to be freed. Depends on timing, like the times.
  std::uint64_t buffer_reuses = 0;
  std::uint64_t gathers = 0;         ///< ZeRO: parameter groups allgathered
  std::uint64_t bytes_gathered = 0;  ///< ZeRO: bytes this rank received by those allgathers ((N-1) chunks each)
  std::uint64_t reductions = 0;      ///< ZeRO: gradient groups reduce-scattered
  /// ZeRO: bytes this rank sent by those reductions ((N-1) chunks per reduce-scatter; a chunk per memory-saving
  /// reduction it does not own)
  std::uint64_t bytes_reduced = 0;
  /// ZeRO: time the calling thread waited for reduce-scatters to complete. They start when a
  /// group's gradients are final and complete when the next scope closes (or before the step), so
  /// each overlaps the scope that follows: this is the part that did not. Depends on timing.
  double reduce_wait_s = 0;
  std::uint64_t gathers_ahead = 0;  ///< ZeRO: of the gathers, those started before the moment that uses them (gather_plan.hpp)
  std::uint64_t gathers_further = 0;  ///< ZeRO: of those, started more than one moment before it (sharding_options::gather_depth)
  /// ZeRO: gathers not needed: groups kept from one use to a later one the look-ahead reaches,
  /// instead of released and gathered again (gather_plan::keep).
  std::uint64_t gathers_kept = 0;
  /// ZeRO: of the gathers ahead, the next iteration's first groups, started during the step.
  std::uint64_t gathers_at_step = 0;
  /// ZeRO: time the calling thread waited for allgathers: synchronous ones whole, those started
  /// ahead for the part that did not overlap the scope before. Depends on timing.
  double gather_wait_s = 0;
  std::size_t peak_device_bytes = 0;        ///< most bytes the runtime held in the device space at once
  std::size_t peak_device_chunk_bytes = 0;  ///< most chunk payload bytes on the compute tier at once
  std::size_t peak_non_model_bytes = 0;     ///< most non-model bytes at once
  /// most chunk payload bytes on the host at once: resident chunks and those a disk copy still reads
  /// or fills together (the host space's capacity bounds them; resident ones alone get the capacity
  /// less disk_staging_chunks chunks, docs/disk.md)
  std::size_t peak_host_chunk_bytes = 0;
  /// most model data this rank held at once: payloads on every tier plus collective buffers
  std::size_t peak_model_bytes = 0;
  std::size_t peak_collective_bytes = 0;  ///< ZeRO: most bytes in group buffers and collective scratch at once
  // The disk tier (attach_disk): moves between the host and the disk, counted apart from the
  // compute tier's loads and evictions above (a chunk coming from the disk to the compute tier is
  // one disk read, then one load).
  std::uint64_t bytes_to_disk = 0;        ///< chunk payload bytes written host -> disk
  std::uint64_t bytes_from_disk = 0;      ///< chunk payload bytes read disk -> host
  std::uint64_t disk_writes = 0;          ///< chunk copies to the disk (to make room on the host)
  std::uint64_t disk_reads = 0;           ///< chunk copies from the disk (= disk_demand_reads + disk_prefetches)
  std::uint64_t disk_demand_reads = 0;    ///< disk reads started by the moment (or step) that needs the chunk
  std::uint64_t disk_prefetches = 0;      ///< disk reads started ahead of use (runtime_options::disk_prefetch_depth)
  std::uint64_t disk_failures = 0;        ///< disk copies that failed (the chunk stayed where it was)
  double disk_stall_s = 0;                ///< time the calling thread waited for disk copies
  std::size_t peak_disk_chunk_bytes = 0;  ///< most chunk payload bytes on the disk at once

  /** @brief Bytes moved between the compute tier and the host, both ways (the disk's: disk_bytes_moved()). */
  [[nodiscard]] std::uint64_t bytes_moved() const noexcept { return bytes_to_device + bytes_to_host; }
  /** @brief Bytes moved between host and disk, both ways. */
  [[nodiscard]] std::uint64_t disk_bytes_moved() const noexcept { return bytes_to_disk + bytes_from_disk; }
};

}  // namespace chunkstar
