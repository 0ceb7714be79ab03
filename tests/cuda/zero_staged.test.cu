// SPDX-License-Identifier: Apache-2.0
// ZeRO on one GPU: 3 ranks (threads of this process) share GPU 0, each with its own device space,
// pinned host space and copy engine, and a staged_communicator over the in-process group with
// cuda::host_stager (pinned buffers, cudaMemcpy): what `train_gpt --parallel zero --device cuda`
// uses over MPI when ranks outnumber GPUs. Group buffers, gathers and reductions live in device
// memory and the Adam steps run on the device; the reductions are the in-process group's rank-order
// fold, so every rank's owned parameters equal, bit for bit, the same ranks on the simulated
// platform with the host Adam kernel.
#include "zero_ranks.cuh"

#include <chunkstar/cuda/host_stager.hpp>

#include <cuda_runtime_api.h>

namespace chunkstar {
namespace zero_staged_test {

using zero_cuda::train;

TEST_CASE(
    "ZeRO with 3 ranks on one GPU through host staging: the owned parameters equal the simulated platform's bits") {
  for (bool memory_saving : {false, true}) {
    CAPTURE(memory_saving);
    constexpr int ranks = 3;
    std::vector<std::map<std::string, std::vector<float>>> expected(ranks), got(ranks);
    run_ranks(ranks, [&](in_process_communicator& c) {
      simulated_device_space dev({.capacity = 64 << 20});
      host_space host;
      host_copy_engine copier;
      expected[static_cast<std::size_t>(c.rank())] =
          train<simulated_platform, host_adam_kernels>(c, dev, host, copier, memory_saving);
    });
    std::vector<std::pair<std::uint64_t, std::uint64_t>> staged(ranks);
    run_ranks(ranks, [&](in_process_communicator& inner) {
      REQUIRE(cudaSetDevice(0) == cudaSuccess);
      staged_communicator<in_process_communicator, cuda::host_stager> comm(inner);
      cuda::device_space dev({.capacity = 64u << 20});
      cuda::pinned_host_space host;
      cuda::cuda_copy_engine copier;
      got[static_cast<std::size_t>(comm.rank())] =
          train<cuda::cuda_platform, cuda::device_adam_kernels>(comm, dev, host, copier, memory_saving);
      staged[static_cast<std::size_t>(comm.rank())] = comm.staged_bytes();
    });
    for (int r = 0; r < ranks; ++r) {
      CAPTURE(r);
      const auto k = static_cast<std::size_t>(r);
      CHECK(staged[k].first > 0);
      CHECK(staged[k].second > 0);
      CHECK(!got[k].empty());
      CHECK(got[k] == expected[k]);
    }
  }
}

}  // namespace zero_staged_test
}  // namespace chunkstar
