// SPDX-License-Identifier: Apache-2.0
// ZeRO over NCCL: one rank per GPU (threads of this process, one NCCL communicator each), the
// sharded runtime on the CUDA platform (group buffers and gradients in device memory, gathers and
// reduce-scatters on the communicator's stream, Adam on the device). With two ranks a sum of two
// contributions is the same in any order, so the owned parameters must equal, bit for bit, those
// of the same two ranks in-process on the simulated platform (which `zero` ties to the reference).
// NCCL cannot put two ranks of one communicator on one GPU: with fewer than two GPUs the test
// says so and is skipped (exit 77); zero_staged runs ZeRO's CUDA path on one GPU.
#include "zero_ranks.cuh"

#include <chunkstar/nccl/nccl_communicator.hpp>

#include <cstdio>
#include <cstdlib>
#include <thread>

namespace chunkstar {
namespace zero_nccl_test {

using zero_cuda::train;

TEST_CASE("ZeRO over NCCL, one rank per GPU: the owned parameters of 2 ranks equal the in-process group's bits") {
  int devices = 0;
  REQUIRE(cudaGetDeviceCount(&devices) == cudaSuccess);
  if (devices < 2) {
    std::printf("SKIPPED: ZeRO over NCCL needs 2 GPUs (NCCL puts one rank of a communicator per GPU); %d found\n",
                devices);
    std::exit(77);
  }
  for (bool memory_saving : {false, true}) {
    CAPTURE(memory_saving);
    constexpr int ranks = 2;
    std::vector<std::map<std::string, std::vector<float>>> expected(ranks), got(ranks);
    run_ranks(ranks, [&](in_process_communicator& c) {
      simulated_device_space dev({.capacity = 64 << 20});
      host_space host;
      host_copy_engine copier;
      expected[static_cast<std::size_t>(c.rank())] =
          train<simulated_platform, host_adam_kernels>(c, dev, host, copier, memory_saving);
    });
    ncclUniqueId id{};
    REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
    std::vector<std::thread> threads;
    std::vector<std::string> errors(ranks);
    for (int r = 0; r < ranks; ++r)
      threads.emplace_back([&, r] {
        try {
          REQUIRE(cudaSetDevice(r) == cudaSuccess);
          nccl::nccl_communicator comm(id, r, ranks, r);
          cuda::device_space dev({.capacity = 64u << 20});
          cuda::pinned_host_space host;
          cuda::cuda_copy_engine copier;
          got[static_cast<std::size_t>(r)] =
              train<cuda::cuda_platform, cuda::device_adam_kernels>(comm, dev, host, copier, memory_saving);
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(r)] = e.what();
        }
      });
    for (auto& t : threads) t.join();
    for (int r = 0; r < ranks; ++r) {
      CAPTURE(r);
      CHECK(errors[static_cast<std::size_t>(r)].empty());
      CHECK(!got[static_cast<std::size_t>(r)].empty());
      CHECK(got[static_cast<std::size_t>(r)] == expected[static_cast<std::size_t>(r)]);
    }
  }
}

}  // namespace zero_nccl_test
}  // namespace chunkstar
