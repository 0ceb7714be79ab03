// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Build configuration: which back-ends exist, and the few portability macros.
 *
 *  The set of types and members never depends on the compiler (`__CUDACC__`), only on what the
 *  CMake configuration found, recorded in the generated `config_generated.hpp`. A vendored copy
 *  without CMake falls back to "Tier 0 only".
 */
#pragma once

#if __has_include(<chunkstar/config_generated.hpp>)
#include <chunkstar/config_generated.hpp>
#else
#define CHUNKSTAR_VERSION_MAJOR 0
#define CHUNKSTAR_VERSION_MINOR 1
#define CHUNKSTAR_VERSION_PATCH 0
#define CHUNKSTAR_CONFIG_HAS_CUDA 0
#define CHUNKSTAR_CONFIG_HAS_NCCL 0
#define CHUNKSTAR_CONFIG_HAS_MPI 0
#endif
#ifndef CHUNKSTAR_CONFIG_HAS_URING  // also absent from headers generated before the disk tier
#define CHUNKSTAR_CONFIG_HAS_URING 0
#endif

/// 1 when this build found the CUDA toolkit (Tier 1 headers under chunkstar/cuda/ are usable).
#define CHUNKSTAR_HAS_CUDA() (CHUNKSTAR_CONFIG_HAS_CUDA)
/// 1 when this build found NCCL.
#define CHUNKSTAR_HAS_NCCL() (CHUNKSTAR_CONFIG_HAS_NCCL)
/// 1 when this build found MPI.
#define CHUNKSTAR_HAS_MPI() (CHUNKSTAR_CONFIG_HAS_MPI)
/// 1 when this build found liburing (chunkstar/disk/uring_copy_engine.hpp is usable; link chunkstar::uring).
#define CHUNKSTAR_HAS_URING() (CHUNKSTAR_CONFIG_HAS_URING)

// Small pure functions that kernels also need: host+device under nvcc, plain inline elsewhere.
// Only the annotation changes, never the declaration's existence.
#if defined(__CUDACC__)
#define CHUNKSTAR_HOST_DEVICE __host__ __device__ inline
#else
#define CHUNKSTAR_HOST_DEVICE inline
#endif

#if defined(__GNUC__) || defined(__clang__)
#define CHUNKSTAR_FORCEINLINE inline __attribute__((always_inline))
#else
#define CHUNKSTAR_FORCEINLINE inline
#endif
