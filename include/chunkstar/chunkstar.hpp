// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Everything in Tier 0 (plain C++20): the concepts, their models, the runtime, its
 *         assemblies and the optimizer, data parallelism (ZeRO and replicated), RTP with its
 *         shard stores, the disk tier, checkpoints and rank agreement. CUDA (chunkstar/cuda/),
 *         NCCL (chunkstar/nccl/) and MPI (chunkstar/mpi/) headers are included separately, by
 *         the programs that link those targets; so is io_uring's engine (disk/uring_copy_engine.hpp).
 */
#pragma once

#include <chunkstar/config.hpp>

#include <chunkstar/core/dtype.hpp>
#include <chunkstar/core/error.hpp>
#include <chunkstar/core/memory_report.hpp>
#include <chunkstar/core/tensor_spec.hpp>
#include <chunkstar/core/units.hpp>

#include <chunkstar/memory/copy_engine.hpp>
#include <chunkstar/memory/host_copy_engine.hpp>
#include <chunkstar/memory/host_space.hpp>
#include <chunkstar/memory/memory_space.hpp>
#include <chunkstar/memory/simulated_device_space.hpp>

#include <chunkstar/layout/chunk_layout.hpp>
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/layout/searched_chunk_layout.hpp>

#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/comm/rank_agreement.hpp>
#include <chunkstar/comm/single_process.hpp>
#include <chunkstar/comm/staged_communicator.hpp>

#include <chunkstar/tracer/null_tracer.hpp>
#include <chunkstar/tracer/tracer.hpp>
#include <chunkstar/tracer/warmup_tracer.hpp>

#include <chunkstar/placement/auto_placement.hpp>
#include <chunkstar/placement/placement_policy.hpp>
#include <chunkstar/placement/static_placement.hpp>

#include <chunkstar/eviction/belady.hpp>
#include <chunkstar/eviction/eviction_strategy.hpp>
#include <chunkstar/eviction/lru.hpp>

#include <chunkstar/optim/adam.hpp>
#include <chunkstar/optim/clip.hpp>
#include <chunkstar/optim/grad_check.hpp>
#include <chunkstar/optim/loss_scaler.hpp>
#include <chunkstar/optim/lr_schedule.hpp>
#include <chunkstar/optim/param_groups.hpp>

#include <chunkstar/checkpoint/runtime_checkpoint.hpp>
#include <chunkstar/checkpoint/safetensors.hpp>

#include <chunkstar/disk/disk_copy_engine.hpp>
#include <chunkstar/disk/disk_space.hpp>
#include <chunkstar/disk/disk_tier.hpp>

#include <chunkstar/runtime/assemblies.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>
#include <chunkstar/core/tier.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>
#include <chunkstar/zero/replicated_gradients.hpp>
#include <chunkstar/runtime/memory_plan.hpp>
#include <chunkstar/observe/runtime_stats.hpp>
#include <chunkstar/observe/timeline.hpp>

#include <chunkstar/rtp/buffer_ops.hpp>
#include <chunkstar/rtp/checkpoint_view.hpp>
#include <chunkstar/rtp/chunk_shard_store.hpp>
#include <chunkstar/rtp/counter_init.hpp>
#include <chunkstar/rtp/model_part.hpp>
#include <chunkstar/rtp/partition.hpp>
#include <chunkstar/rtp/replicated.hpp>
#include <chunkstar/rtp/ring_order.hpp>
#include <chunkstar/rtp/rotation.hpp>
#include <chunkstar/rtp/shard_store.hpp>
#include <chunkstar/rtp/sharded_model.hpp>
#include <chunkstar/rtp/transit_buffers.hpp>
#include <chunkstar/rtp/vocab_kernels.hpp>
#include <chunkstar/rtp/vocab_parallel.hpp>
#include <chunkstar/rtp/weight_pair.hpp>
