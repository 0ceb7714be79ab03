// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `CHUNKSTAR_CUDA_CHECK`: turns a failed CUDA runtime call into a typed chunkstar error
 *         naming the call, the CUDA error and where it happened (Tier 1: CUDA runtime host API).
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/memory_report.hpp>

#include <cuda_runtime_api.h>

#include <string>

namespace chunkstar::cuda {

/** @brief A CUDA runtime call failed; `code()` is what it returned. */
class cuda_error : public error {
 public:
  cuda_error(const std::string& what, cudaError_t code) : error(what), code_(code) {}
  /** @brief The CUDA status of the failed call. */
  [[nodiscard]] cudaError_t code() const noexcept { return code_; }

 private:
  cudaError_t code_;
};

namespace detail {

/** @brief "cudaMalloc(&p, n) failed: cudaErrorMemoryAllocation (out of memory) at file:line". */
[[nodiscard]] inline std::string describe_cuda_failure(cudaError_t status, const char* call, const char* file,
                                                       int line) {
  return std::string(call) + " failed: " + cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ") at " +
         file + ":" + std::to_string(line);
}

/** @brief Throws for a failed status: out_of_memory_error for cudaErrorMemoryAllocation (after
 *  clearing it, as it is not sticky), cuda_error for anything else. */
[[noreturn]] inline void throw_cuda_failure(cudaError_t status, const char* call, const char* file, int line) {
  const std::string what = describe_cuda_failure(status, call, file, line);
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    throw out_of_memory_error(what + "; free device or pinned memory, or lower the budget", 0, memory_report{});
  }
  throw cuda_error(what +
                       "; check the device is present and healthy (nvidia-smi), and that pointers and "
                       "streams belong to the current device",
                   status);
}

inline void check(cudaError_t status, const char* call, const char* file, int line) {
  if (status != cudaSuccess) throw_cuda_failure(status, call, file, line);
}

/** @brief Throws cuda_error for a device ordinal that cannot be made current (no GPU, no driver, an
 *  ordinal past the last device): names the ordinal, the failed call, how many devices this process
 *  sees, and the ways out. The first CUDA call of every device space, stream and copy engine goes
 *  through `device_guard`, so this is what a program built for CUDA says on a machine without one. */
[[noreturn]] inline void throw_device_unusable(int device, cudaError_t status, const char* call, const char* file,
                                               int line) {
  int devices = 0;
  const cudaError_t counted = cudaGetDeviceCount(&devices);
  if (counted != cudaSuccess) devices = 0;
  (void)cudaGetLastError();
  throw cuda_error(
      "CUDA device " + std::to_string(device) + " cannot be used: " + describe_cuda_failure(status, call, file, line) +
          "; this process sees " + std::to_string(devices) + " CUDA device(s)" +
          (counted == cudaSuccess ? std::string{}
                                  : std::string(" (cudaGetDeviceCount: ") + cudaGetErrorName(counted) + ")") +
          ": run where nvidia-smi lists a GPU and CUDA_VISIBLE_DEVICES includes it, pick an ordinal "
          "below the count, or build the runtime on the CPU platform (chunkstar::simulated_platform)",
      status);
}

}  // namespace detail
}  // namespace chunkstar::cuda

/** @brief Evaluates a CUDA runtime call; on failure throws `chunkstar::out_of_memory_error`
 *  (cudaErrorMemoryAllocation) or `chunkstar::cuda::cuda_error` (a `chunkstar::error`) whose
 *  message holds the call's text, cudaGetErrorString and the location. */
#define CHUNKSTAR_CUDA_CHECK(call) ::chunkstar::cuda::detail::check((call), #call, __FILE__, __LINE__)
