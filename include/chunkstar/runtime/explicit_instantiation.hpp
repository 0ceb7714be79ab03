// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Compiling a runtime assembly once per program instead of once per source file.
 *
 *  `chunk_runtime` is a template, so every source file that uses an assembly compiles the whole
 *  runtime again (20-30 CPU seconds at -O2 each). A project with several files declares its
 *  assemblies extern in a header those files include, and instantiates each in one source file:
 *  @code
 *  // my_runtime.hpp
 *  using my_runtime = chunkstar::chunk_runtime<chunkstar::fixed_chunk_layout, chunkstar::static_placement>;
 *  CHUNKSTAR_EXTERN_RUNTIME(my_runtime);
 *  // my_runtime.cpp (the only file that compiles the runtime's code)
 *  #include "my_runtime.hpp"
 *  CHUNKSTAR_INSTANTIATE_RUNTIME(my_runtime);
 *  @endcode
 *  Files that see the declaration call the compiled members (the runtime defines its real work out
 *  of line for this); small accessors and member templates such as step()'s wrapper stay inline.
 *  The bits are the same either way; without the declaration everything works, only slower to build.
 *  @p R is a name of the type (an alias); the declaration must come before the first use.
 *
 *  A program with several assemblies also shares their parts (CHUNKSTAR_RUNTIME_STORE, _POLICIES,
 *  _SHARDS below). The host's SIMD kernels (Adam for every gradient and parameter type, the gradient scans) are
 *  compiled for every ISA wherever an optimizer step is (chunk_adam): 5-10 CPU seconds a file.
 *  `CHUNKSTAR_EXTERN_HOST_KERNELS;` and, in one file, `CHUNKSTAR_INSTANTIATE_HOST_KERNELS;` do the
 *  same for them.
 */
#pragma once

#include <chunkstar/optim/adam.hpp>
#include <chunkstar/optim/grad_check.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>

#include <span>

/** @brief The specialization behind runtime type @p R, as explicit instantiation must spell it. */
#define CHUNKSTAR_RUNTIME_SPECIALIZATION(R)                                                       \
  ::chunkstar::chunk_runtime<R::layout_type, R::placement_type, R::eviction_type, R::tracer_type, \
                             R::communicator_type, R::platform_type>
/** @brief Declares runtime type @p R compiled elsewhere (in a header; follow it with `;`). */
#define CHUNKSTAR_EXTERN_RUNTIME(R) extern template class CHUNKSTAR_RUNTIME_SPECIALIZATION(R)
/** @brief Compiles runtime type @p R here (in one source file of the program; follow it with `;`). */
#define CHUNKSTAR_INSTANTIATE_RUNTIME(R) template class CHUNKSTAR_RUNTIME_SPECIALIZATION(R)

// The parts of a runtime, for a program with several assemblies that share them: the parts then
// compile once, and so does a runtime the program spells only in one file (a test's own policy)
// wherever its parts are common. Each part is declared as often as wanted and instantiated once:
//   STORE(P)       the chunk store of platform P (every assembly on P)
//   POLICIES(KW, R) the residency manager and the step pass of R (shared by assemblies that differ
//                  only in layout or communicator)
//   SHARDS(KW, R)  the ZeRO shard manager of R (shared by assemblies that differ only in layout)
// with KW `extern` in the header, nothing in the one source file.
#define CHUNKSTAR_RUNTIME_STORE(KW, P) KW template class ::chunkstar::chunk_store<P>
#define CHUNKSTAR_RUNTIME_RESIDENCY_(R) \
  ::chunkstar::residency_manager<R::platform_type, R::placement_type, R::eviction_type, R::tracer_type>
#define CHUNKSTAR_RUNTIME_POLICIES(KW, R)                                                   \
  KW template class CHUNKSTAR_RUNTIME_RESIDENCY_(R);                                        \
  KW template class ::chunkstar::optimizer_pass<::chunkstar::chunk_store<R::platform_type>, \
                                                CHUNKSTAR_RUNTIME_RESIDENCY_(R), R::tracer_type>
#define CHUNKSTAR_RUNTIME_SHARDS(KW, R)                                                    \
  KW template class ::chunkstar::shard_manager<::chunkstar::chunk_store<R::platform_type>, \
                                               CHUNKSTAR_RUNTIME_RESIDENCY_(R), R::tracer_type, R::communicator_type>

/** @brief One Adam update (gradient type @p G, parameter type @p P) and the scans of @p G gradients. */
#define CHUNKSTAR_HOST_KERNELS_OF(KW, G, P)                                                                         \
  KW template void ::chunkstar::adam_update<G, P>(std::span<float>, std::span<float>, std::span<float>,             \
                                                  std::span<const G>, std::span<P>, const ::chunkstar::adam_hyper&, \
                                                  const ::chunkstar::adam_step_args&)
#define CHUNKSTAR_HOST_SCANS_OF(KW, G)                                               \
  KW template double ::chunkstar::sum_of_squares<G>(std::span<const G>, float, int); \
  KW template bool ::chunkstar::all_finite<G>(std::span<const G>, int)
/** @brief The host kernels for every pair of element types (KW: `extern` or nothing). */
#define CHUNKSTAR_HOST_KERNELS(KW)                                             \
  CHUNKSTAR_HOST_KERNELS_OF(KW, float, float);                                 \
  CHUNKSTAR_HOST_KERNELS_OF(KW, float, ::chunkstar::float16);                  \
  CHUNKSTAR_HOST_KERNELS_OF(KW, float, ::chunkstar::bfloat16);                 \
  CHUNKSTAR_HOST_KERNELS_OF(KW, ::chunkstar::float16, float);                  \
  CHUNKSTAR_HOST_KERNELS_OF(KW, ::chunkstar::float16, ::chunkstar::float16);   \
  CHUNKSTAR_HOST_KERNELS_OF(KW, ::chunkstar::float16, ::chunkstar::bfloat16);  \
  CHUNKSTAR_HOST_KERNELS_OF(KW, ::chunkstar::bfloat16, float);                 \
  CHUNKSTAR_HOST_KERNELS_OF(KW, ::chunkstar::bfloat16, ::chunkstar::float16);  \
  CHUNKSTAR_HOST_KERNELS_OF(KW, ::chunkstar::bfloat16, ::chunkstar::bfloat16); \
  CHUNKSTAR_HOST_SCANS_OF(KW, float);                                          \
  CHUNKSTAR_HOST_SCANS_OF(KW, ::chunkstar::float16);                           \
  CHUNKSTAR_HOST_SCANS_OF(KW, ::chunkstar::bfloat16)
/** @brief Declares the host kernels compiled elsewhere (in a header; follow it with `;`). */
#define CHUNKSTAR_EXTERN_HOST_KERNELS CHUNKSTAR_HOST_KERNELS(extern)
/** @brief Compiles the host kernels here (in one source file of the program; follow it with `;`). */
#define CHUNKSTAR_INSTANTIATE_HOST_KERNELS CHUNKSTAR_HOST_KERNELS()
