// SPDX-License-Identifier: Apache-2.0
// The trainer's runtime assemblies (one communicator type for one process and MPI ranks alike: the
// transport is a run-time choice), compiled once in trainer_runtimes.cpp and, on CUDA builds,
// trainer_runtimes_cuda.cpp, beside train_gpt.cpp instead of inside it
// (chunkstar/runtime/explicit_instantiation.hpp).
#pragma once

#include <chunkstar/comm/communicator_ref.hpp>
#include <chunkstar/eviction/lru.hpp>
#include <chunkstar/placement/static_placement.hpp>
#include <chunkstar/runtime/explicit_instantiation.hpp>
#if GPT_HAS_CUDA_BACKEND
#include <chunkstar/cuda/cuda_platform.hpp>
#endif

namespace gpt {

template <class Placement, class Eviction, class Platform>
using trainer_runtime = chunkstar::chunk_runtime<chunkstar::searched_chunk_layout, Placement, Eviction,
                                                 chunkstar::warmup_tracer, chunkstar::communicator_ref, Platform>;
/** --policy patrickstar, lru, resident|offload on @p Platform. */
template <class Platform>
struct trainer_runtimes {
  using belady = trainer_runtime<chunkstar::auto_placement, chunkstar::belady_eviction, Platform>;
  using lru = trainer_runtime<chunkstar::auto_placement, chunkstar::lru_eviction, Platform>;
  using fixed = trainer_runtime<chunkstar::static_placement, chunkstar::belady_eviction, Platform>;
};
using sim_runtimes = trainer_runtimes<chunkstar::simulated_platform>;
#if GPT_HAS_CUDA_BACKEND
using cuda_runtimes = trainer_runtimes<chunkstar::cuda::cuda_platform>;
#endif

}  // namespace gpt

#define GPT_TRAINER_RUNTIMES(KW, Set, Platform)                    \
  CHUNKSTAR_RUNTIME_STORE(KW, Platform);                           \
  CHUNKSTAR_RUNTIME_POLICIES(KW, Set::belady);                     \
  CHUNKSTAR_RUNTIME_POLICIES(KW, Set::lru);                        \
  CHUNKSTAR_RUNTIME_POLICIES(KW, Set::fixed);                      \
  CHUNKSTAR_RUNTIME_SHARDS(KW, Set::belady);                       \
  CHUNKSTAR_RUNTIME_SHARDS(KW, Set::lru);                          \
  CHUNKSTAR_RUNTIME_SHARDS(KW, Set::fixed);                        \
  KW template class CHUNKSTAR_RUNTIME_SPECIALIZATION(Set::belady); \
  KW template class CHUNKSTAR_RUNTIME_SPECIALIZATION(Set::lru);    \
  KW template class CHUNKSTAR_RUNTIME_SPECIALIZATION(Set::fixed)
GPT_TRAINER_RUNTIMES(extern, gpt::sim_runtimes, chunkstar::simulated_platform);
#if GPT_HAS_CUDA_BACKEND
GPT_TRAINER_RUNTIMES(extern, gpt::cuda_runtimes, chunkstar::cuda::cuda_platform);
#endif
CHUNKSTAR_EXTERN_HOST_KERNELS;
