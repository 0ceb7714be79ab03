// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Named assemblies of `chunk_runtime`: the policy choices people ask for by name.
 */
#pragma once

#include <chunkstar/eviction/belady.hpp>
#include <chunkstar/eviction/lru.hpp>
#include <chunkstar/layout/searched_chunk_layout.hpp>
#include <chunkstar/placement/auto_placement.hpp>
#include <chunkstar/placement/static_placement.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>
#include <chunkstar/tracer/warmup_tracer.hpp>

namespace chunkstar {

/** @brief PatrickStar's assembly: searched layout, auto placement (budgets from the trace, the
 *  optimizer step on the device where the margin allows), Belady eviction, warm-up tracer, one
 *  process, simulated device. */
using patrickstar_runtime =
    chunk_runtime<searched_chunk_layout, auto_placement, belady_eviction, warmup_tracer, single_process_communicator>;

/** @brief PatrickStar's assembly with least-recently-used eviction (no trace needed to evict). */
using lru_runtime =
    chunk_runtime<searched_chunk_layout, auto_placement, lru_eviction, warmup_tracer, single_process_communicator>;

/** @brief A fixed split (ZeRO-Offload-like): `static_placement` decides what stays on the device. */
using static_runtime =
    chunk_runtime<searched_chunk_layout, static_placement, belady_eviction, warmup_tracer, single_process_communicator>;

/** @brief PatrickStar's assembly on the platform @p P (e.g. `cuda::cuda_platform`) over communicator @p Comm. */
template <Platform P, Communicator Comm = single_process_communicator>
using patrickstar_runtime_on =
    chunk_runtime<searched_chunk_layout, auto_placement, belady_eviction, warmup_tracer, Comm, P>;

}  // namespace chunkstar
