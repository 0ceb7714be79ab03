// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `runtime_options`: the numeric knobs of a chunk runtime (values, not types), and
 *         `gradient_mode`, how the gradients of several ranks relate.
 */
#pragma once

#include <chunkstar/core/dtype.hpp>
#include <chunkstar/layout/chunk_layout.hpp>

#include <cstddef>
#include <cstdint>

namespace chunkstar {

/** @brief How gradients relate across ranks, which decides how the global gradient norm is formed:
 *  `local` — each rank's gradients are its own (one rank, or independent ranks): norm of the local
 *  gradients; `replicated` — every rank holds the same, already summed gradients (data parallelism
 *  with all-reduced gradients, see data_parallel.hpp): the local norm is the global one;
 *  `sharded` — each rank holds a distinct part (ZeRO): the squared norms are summed over ranks. */
enum class gradient_mode : std::uint8_t { local, replicated, sharded };

/** @brief Knobs of ZeRO sharding (runtime/sharding.hpp). */
struct sharding_options {
  bool enabled = false;        ///< shard the model data over the communicator's ranks (1/N of it each)
  bool keep_gathered = false;  ///< keep gathered parameters from forward until their last backward use (FSDP's reshard_after_forward = false)
  bool reduce_in_fp32 = true;  ///< reduce 16-bit gradients in fp32 (false: in the gradient dtype; half the bytes)
  /// Start the allgathers of the next moment's groups once a scope is open, so they run while it
  /// computes, where the trace says the budget holds them (runtime/gather_plan.hpp); false: each
  /// gather waits for the scope that needs it.
  bool gather_ahead = true;
  /// PatrickStar's memory-saving mode: a remote parameter chunk is broadcast from its owner on its
  /// own and a gradient chunk reduced to its owner on its own, so only the chunks a scope uses are
  /// resident, never whole groups of N (for models where N-1 gather buffers do not fit). More
  /// collectives, smaller ones; the same bits. Gathers ahead are not made in this mode.
  bool memory_saving = false;
  /// Backward passes each rank accumulates per optimizer step (gradient accumulation: chunk_adam::
  /// step's micro_batches / world size, which it checks). The first iteration has no trace to say
  /// when a gradient is final; with this it reduces each gradient group after the last micro-batch's
  /// backward, as every later iteration does, so the first step has the reference's bits too.
  int micro_batches = 1;
};

/** @brief Numeric knobs of a runtime (values, not types). */
struct runtime_options {
  dtype param_type = dtype::f32;                ///< compute precision of params and grads
  optimizer_state_lists optimizer_state{};      ///< which optimizer-state lists exist (default Adam's; false: none)
  std::size_t prefetch_depth = 2;               ///< most loads in flight ahead of the next moment; 0 turns prefetch off
  /// With a disk tier (attach_disk): most disk reads in flight ahead of use (runtime/disk_planner.hpp);
  /// 0 turns disk prefetch off (chunks come from the disk when a moment needs them).
  std::size_t disk_prefetch_depth = 8;
  /// With a disk tier: how many moments ahead the disk prefetcher looks. Far enough to hide a read,
  /// near enough that what lands on the host in between (evictions from the compute tier, a step's
  /// offloads) rarely makes its choices worse than the demand path's (measured in docs/disk.md).
  std::size_t disk_prefetch_horizon = 2;
  /// With a disk tier: host room (in chunks) kept free of resident chunks for the buffers disk writes
  /// in flight still read; the host space's capacity bounds both together.
  std::size_t disk_staging_chunks = 2;
  std::size_t payload_alignment = 4096;         ///< alignment of chunk payloads (copies and SIMD like it)
  bool timeline = false;                        ///< record a Chrome-trace timeline (see `timeline_recorder()`)
  gradient_mode gradients = gradient_mode::local;  ///< how the gradients of ranks relate (the norm); sharding implies `sharded`
  sharding_options sharding{};                  ///< ZeRO: shard the model data over the communicator's ranks
};

}  // namespace chunkstar
