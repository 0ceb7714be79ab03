// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `cuda::host_stager`: the `Stager` of a `staged_communicator` on CUDA devices — pinned
 *         host buffers and synchronous copies — so a host-only transport (an MPI without CUDA
 *         support) carries collectives on device memory (Tier 1: host compiler and cudart only).
 *
 *  Use it where NCCL cannot go: more ranks than GPUs (NCCL puts one rank of a communicator per
 *  GPU), or no NCCL at all. `staged_communicator<mpi_communicator, cuda::host_stager>` is a device
 *  communicator (`takes_device_memory`), so the runtime hands it chunks on the device.
 */
#pragma once

#include <chunkstar/comm/staged_communicator.hpp>
#include <chunkstar/cuda/cuda_error.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>

namespace chunkstar::cuda {

/** @brief Pinned host memory and cudaMemcpy. From pinned memory cudaMemcpy has finished when it
 *  returns, in both directions, as the `Stager` concept asks; it runs on the legacy default stream,
 *  so buffers must be ready when the collective is called (the runtime makes sure: it waits for
 *  chunk copies and for the user's work before a collective reads them). */
struct host_stager {
  void* allocate_host(std::size_t n) {
    void* p = nullptr;
    CHUNKSTAR_CUDA_CHECK(cudaHostAlloc(&p, n, cudaHostAllocPortable));
    return p;
  }
  void free_host(void* p, std::size_t) noexcept { (void)cudaFreeHost(p); }
  void to_host(void* host, const void* device, std::size_t n) {
    if (n != 0) CHUNKSTAR_CUDA_CHECK(cudaMemcpy(host, device, n, cudaMemcpyDefault));
  }
  void to_device(void* device, const void* host, std::size_t n) {
    if (n != 0) CHUNKSTAR_CUDA_CHECK(cudaMemcpy(device, host, n, cudaMemcpyDefault));
  }
};

static_assert(Stager<host_stager>);

}  // namespace chunkstar::cuda
