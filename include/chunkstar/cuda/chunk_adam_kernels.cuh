// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Device kernels for `chunk_adam` on the CUDA platform (Tier 2, nvcc only): the fused
 *         gradient scan and the Adam step of chunks that live in device memory.
 */
#pragma once

#include <chunkstar/cuda/adam.cuh>
#include <chunkstar/runtime/chunk_adam.hpp>

#include <cuda_runtime_api.h>

namespace chunkstar::cuda {

/** @brief `chunk_adam<Scaler, device_adam_kernels>` runs these for chunks on the device, on the
 *  legacy default stream (`stream()`). The scan waits for its sum; the Adam step is asynchronous
 *  (`adam_async`): the optimizer pass records an event after each chunk's step, orders that chunk's
 *  moves after it, and goes on to the next chunk, so host-stepped chunks overlap device ones;
 *  `adam` is the synchronous form. */
struct device_adam_kernels {
  static grad_stats scan(const void* grad, dtype t, std::size_t count, float scale, int /*threads*/) {
    return optim_detail::with_element_type(t, [&](auto g) {
      using G = decltype(g);
      const std::span<const G> s(static_cast<const G*>(grad), count);
      double* d_sum = nullptr;
      adam_detail::check(cudaMalloc(&d_sum, sizeof(double)), "cudaMalloc (gradient scan)");
      grad_stats r;
      try {
        sum_of_squares_device<G>(s, scale, d_sum, nullptr);
        adam_detail::check(cudaMemcpy(&r.sum_sq, d_sum, sizeof(double), cudaMemcpyDeviceToHost),
                           "cudaMemcpy (gradient scan)");
      } catch (...) {
        cudaFree(d_sum);
        throw;
      }
      cudaFree(d_sum);
      r.all_finite = std::isfinite(r.sum_sq);
      return r;
    });
  }
  static void adam(const adam_chunk& c, const adam_hyper& h, const adam_step_args& a) {
    adam_async(c, h, a);
    adam_detail::check(cudaStreamSynchronize(nullptr), "cudaStreamSynchronize (chunk Adam step)");
  }
  static void adam_async(const adam_chunk& c, const adam_hyper& h, const adam_step_args& a) {
    adam_step_device(c, h, a, nullptr);
  }
  static cudaStream_t stream() noexcept { return nullptr; }
};

}  // namespace chunkstar::cuda
