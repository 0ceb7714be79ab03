// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `runtime_options`: the numeric knobs of a chunk runtime (values, not types), and
 *         `gradient_mode`, how the gradients of several ranks relate.
 */
#pragma once

#include <chunkstar/core/dtype.hpp>
#include <chunkstar/core/gradient_mode.hpp>
#include <chunkstar/zero/sharding_options.hpp>
#include <chunkstar/layout/chunk_layout.hpp>

#include <cstddef>
#include <cstdint>

namespace chunkstar {

/** @brief `runtime_options::scopes_ahead` without a bound. */
inline constexpr std::size_t unbounded_scopes_ahead = static_cast<std::size_t>(-1);

/** @brief Numeric knobs of a runtime (values, not types). */
struct runtime_options {
  dtype param_type = dtype::f32;            ///< compute precision of params and grads
  optimizer_state_lists optimizer_state{};  ///< which optimizer-state lists exist (default Adam's; false: none)
  std::size_t prefetch_depth = 2;           ///< most loads in flight ahead of the next moment; 0 turns prefetch off
  /// With a disk tier (attach_disk): most disk reads in flight ahead of use (store/disk_planner.hpp);
  /// 0 turns disk prefetch off (chunks come from the disk when a moment needs them).
  std::size_t disk_prefetch_depth = 8;
  /// With a disk tier: how many moments ahead the disk prefetcher looks. Far enough to hide a read,
  /// near enough that what lands on the host in between (evictions from the compute tier, a step's
  /// offloads) rarely makes its choices worse than the demand path's (measured in docs/disk.md).
  std::size_t disk_prefetch_horizon = 2;
  /// With a disk tier: host room (in chunks) kept free of resident chunks for the buffers disk writes
  /// in flight still read; the host space's capacity bounds both together.
  std::size_t disk_staging_chunks = 2;
  std::size_t payload_alignment = 4096;  ///< alignment of chunk payloads (copies and SIMD like it)
  bool timeline = false;                 ///< record a Chrome-trace timeline (see `timeline_recorder()`)
  /// How many scopes closed on a stream (`scope::close(stream)`) may still have work running when
  /// the next scope opens; the opening waits on the host for the older ones. The host then decides
  /// moves, early updates and room near the device's time rather than an iteration ahead of it
  /// (an early update finding no room, the step carrying it over), and holds the buffers of a few
  /// scopes ahead, not of all. 0: each scope waits for the last one's work; unbounded_scopes_ahead:
  /// no bound. Nothing waits on host platforms (their work is done when a scope closes). Measured
  /// in docs/performance.md ("The host ahead of the device").
  std::size_t scopes_ahead = 1;
  /// The early steps' updates (arm_early_steps) run at the OS's idle priority (step_worker): the
  /// thread that drives compute takes a core back the moment it wakes, where at normal priority
  /// it waited up to a scheduler slice (measured: docs/performance.md, "The step inside backward").
  /// Set false where other threads keep every core busy at normal priority: the updates would then
  /// run only when those sleep (at the latest while the step or a scope waits for them).
  bool background_updates = true;
  /// how the gradients of ranks relate (the norm); sharding implies `sharded`
  gradient_mode gradients = gradient_mode::local;
  sharding_options sharding{};  ///< ZeRO: shard the model data over the communicator's ranks
};

}  // namespace chunkstar
