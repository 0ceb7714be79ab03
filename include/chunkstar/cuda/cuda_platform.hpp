// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief The CUDA platform for `chunk_runtime`: a CUDA device space, pinned host memory and a
 *         stream-per-direction copy engine (Tier 1: host compiler and cudart only).
 */
#pragma once

#include <chunkstar/cuda/cuda_copy_engine.hpp>
#include <chunkstar/cuda/device_space.hpp>
#include <chunkstar/cuda/pinned_host_space.hpp>
#include <chunkstar/memory/platform.hpp>

namespace chunkstar::cuda {

/** @brief Chunks live on a CUDA device or in pinned host memory, so every move is an asynchronous
 *  DMA copy on the engine's streams. User kernels run on the user's `cudaStream_t`, handed back to
 *  the runtime when a scope closes (`scope::close(stream)`), so later moves of its chunks wait for
 *  them on the device. Use `chunk_adam<Scaler, cuda::device_adam_kernels>` (chunk_adam_kernels.cuh)
 *  to step chunks on the device (`chunk_adam<>` does not compile over this platform). Build the
 *  device space (`device_space_options::device`), the copy engine (`cuda_copy_engine(device)`) and,
 *  under ZeRO, the NCCL communicator on one ordinal, and `cudaSetDevice` to it for your own kernels
 *  (docs/gpu.md, "Your own model on CUDA"). */
using cuda_platform = platform<device_space, pinned_host_space, cuda_copy_engine, cudaStream_t>;

static_assert(Platform<cuda_platform>);

}  // namespace chunkstar::cuda
