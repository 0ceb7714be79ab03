/** @file
 *  @brief What the chunk runtime did: bytes moved per direction, evictions, prefetches, stalls, peaks.
 */
#pragma once

#include <chunkstar/tracer/tracer.hpp>

#include <cstddef>
#include <cstdint>

namespace chunkstar {

/** @brief Counters since construction (or the last `reset_stats()`). Every counter except the
 *  times and `buffer_reuses` is a deterministic function of the program and the policies, never of timing. */
struct runtime_stats {
  std::uint64_t bytes_to_device = 0;  ///< chunk payload bytes copied host -> compute tier
  std::uint64_t bytes_to_host = 0;    ///< chunk payload bytes copied compute tier -> host
  std::uint64_t loads = 0;            ///< chunk copies to the compute tier (demand and prefetch)
  std::uint64_t evictions = 0;        ///< chunk copies to the host to make room on the compute tier
  std::uint64_t offloads = 0;         ///< chunk copies to the host for a host-side optimizer step
  std::uint64_t prefetches = 0;       ///< loads started ahead of their scope
  std::uint64_t prefetch_hits = 0;    ///< scopes that found a needed chunk prefetched
  std::uint64_t demand_loads = 0;     ///< loads a scope had to wait for from the start
  std::uint64_t materialised = 0;     ///< FREE chunks given a zeroed payload (gradients)
  std::uint64_t scopes = 0;           ///< access scopes opened
  std::uint64_t steps = 0;            ///< optimizer steps
  std::uint64_t device_steps = 0;     ///< chunk steps run on the compute tier
  std::uint64_t host_steps = 0;       ///< chunk steps run on the host
  double stall_s = 0;                 ///< time spent waiting for copies
  /// Loads (and zero fills) that took over the device buffer of an eviction still in flight
  /// instead of waiting for it to be freed. Depends on timing, like the times.
  std::uint64_t buffer_reuses = 0;
  std::size_t peak_device_chunk_bytes = 0;  ///< most chunk bytes on the compute tier at once
  std::size_t peak_non_model_bytes = 0;     ///< most non-model bytes at once
  std::size_t peak_host_chunk_bytes = 0;    ///< most chunk bytes on the host at once

  /** @brief Bytes moved both ways. */
  [[nodiscard]] std::uint64_t bytes_moved() const noexcept { return bytes_to_device + bytes_to_host; }
};

}  // namespace chunkstar
