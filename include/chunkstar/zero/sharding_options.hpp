// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `sharding_options`: the knobs of ZeRO sharding (zero/shard_manager.hpp).
 */
#pragma once

namespace chunkstar {

/** @brief Knobs of ZeRO sharding (zero/shard_manager.hpp). */
struct sharding_options {
  bool enabled = false;  ///< shard the model data over the communicator's ranks (1/N of it each)
  /// keep gathered parameters from forward until their last backward use (FSDP's reshard_after_forward = false)
  bool keep_gathered = false;
  bool reduce_in_fp32 = true;  ///< reduce 16-bit gradients in fp32 (false: in the gradient dtype; half the bytes)
  /// Start the allgathers of the next moment's groups once a scope is open, so they run while it
  /// computes, where the trace says the budget holds them (zero/gather_plan.hpp); false: each
  /// gather waits for the scope that needs it.
  bool gather_ahead = true;
  /// How many scopes ahead a gather may start (with gather_ahead): the groups of the next
  /// gather_depth scopes, where the budget holds them until they are used, so a scope whose compute
  /// is shorter than its gathers is hidden by the scopes before it; a group released whose next
  /// use is that near is kept instead of gathered again (gather_plan::keep). 1: the next scope
  /// only. The default, 2, measured in docs/zero.md ("Benchmark").
  int gather_depth = 2;
  /// With gather_ahead: the step gathers the groups the next iteration's first scope needs, each
  /// once this rank's chunk of it is stepped, so they travel while the step goes on (the budget
  /// allowing; docs/zero.md). Costs one allreduce of a double per iteration (the ranks agree they
  /// still hold them). false: the first scope gathers them itself.
  bool gather_at_step = true;
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

}  // namespace chunkstar
