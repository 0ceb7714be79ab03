// SPDX-License-Identifier: Apache-2.0
// doctest main for CUDA tests: without a usable GPU, say why and exit 77 (CTest's "skipped").
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cstdio>

int main(int argc, char** argv) {
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    std::printf(
        "SKIPPED: no CUDA device found (cudaGetDeviceCount: %s, %d devices); "
        "run tests/gpu/run.sh on a GPU machine\n",
        status == cudaSuccess ? "ok" : cudaGetErrorString(status), devices);
    return 77;
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
