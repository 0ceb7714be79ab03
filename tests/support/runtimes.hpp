// SPDX-License-Identifier: Apache-2.0
// The runtime assemblies most tests use, their parts and the host's SIMD kernels, compiled once in
// the test support library (support/runtimes/*.cpp) instead of again in every test file that uses
// them: a test file that includes this header calls their compiled members
// (runtime/explicit_instantiation.hpp). A runtime of a test's own (its policy, communicator or
// platform) still reuses the compiled chunk store and, with a common placement and eviction, the
// compiled residency manager and step pass.
#pragma once

#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/eviction/lru.hpp>
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/placement/static_placement.hpp>
#include <chunkstar/runtime/assemblies.hpp>
#include <chunkstar/runtime/explicit_instantiation.hpp>

namespace chunkstar::testing {

/** The defaults on a fixed layout: auto placement, Belady, one process, simulated device. */
using fixed_runtime = chunk_runtime<fixed_chunk_layout>;
/** A fixed split (static_placement): the resident reference of most same-bits tests. */
using fixed_static_runtime = chunk_runtime<fixed_chunk_layout, static_placement>;
/** Auto placement with LRU eviction. */
using fixed_lru_runtime = chunk_runtime<fixed_chunk_layout, auto_placement, lru_eviction>;
/** The same three over an in-process rank group (ZeRO and replicated data parallelism). */
using fixed_group_runtime =
    chunk_runtime<fixed_chunk_layout, auto_placement, belady_eviction, warmup_tracer, in_process_communicator>;
using fixed_static_group_runtime =
    chunk_runtime<fixed_chunk_layout, static_placement, belady_eviction, warmup_tracer, in_process_communicator>;
using fixed_lru_group_runtime =
    chunk_runtime<fixed_chunk_layout, auto_placement, lru_eviction, warmup_tracer, in_process_communicator>;

/** The same on the searched layout: the library's named assemblies (runtime/assemblies.hpp). */
using searched_runtime = patrickstar_runtime;
using searched_static_runtime = static_runtime;
using searched_lru_runtime = lru_runtime;

}  // namespace chunkstar::testing

// Compiled in support/runtimes/<placement>_<eviction>.cpp (each one policy pair's parts and
// assemblies), store.cpp and kernels.cpp.
#define CHUNKSTAR_TEST_RUNTIMES(KW, single, group, searched)  \
  CHUNKSTAR_RUNTIME_POLICIES(KW, single);                     \
  CHUNKSTAR_RUNTIME_SHARDS(KW, single);                       \
  CHUNKSTAR_RUNTIME_SHARDS(KW, group);                        \
  KW template class CHUNKSTAR_RUNTIME_SPECIALIZATION(single); \
  KW template class CHUNKSTAR_RUNTIME_SPECIALIZATION(group);  \
  KW template class CHUNKSTAR_RUNTIME_SPECIALIZATION(searched)
CHUNKSTAR_TEST_RUNTIMES(extern, chunkstar::testing::fixed_runtime, chunkstar::testing::fixed_group_runtime,
                        chunkstar::testing::searched_runtime);
CHUNKSTAR_TEST_RUNTIMES(extern, chunkstar::testing::fixed_static_runtime,
                        chunkstar::testing::fixed_static_group_runtime, chunkstar::testing::searched_static_runtime);
CHUNKSTAR_TEST_RUNTIMES(extern, chunkstar::testing::fixed_lru_runtime, chunkstar::testing::fixed_lru_group_runtime,
                        chunkstar::testing::searched_lru_runtime);
CHUNKSTAR_RUNTIME_STORE(extern, chunkstar::simulated_platform);
CHUNKSTAR_EXTERN_HOST_KERNELS;
