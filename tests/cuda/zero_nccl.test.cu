// ZeRO over NCCL: one rank per GPU (threads of this process, one NCCL communicator each), the
// sharded runtime on the CUDA platform (group buffers and gradients in device memory, gathers and
// reduce-scatters on the communicator's stream, Adam on the device). With two ranks a sum of two
// contributions is the same in any order, so the owned parameters must equal, bit for bit, those
// of the same two ranks in-process on the simulated platform (which `zero` ties to the reference).
// NCCL cannot put two ranks of one communicator on one GPU: with fewer than two GPUs the test
// says so and is skipped (exit 77).
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/cuda/chunk_adam_kernels.cuh>
#include <chunkstar/cuda/cuda_platform.hpp>
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/nccl/nccl_communicator.hpp>
#include <chunkstar/placement/static_placement.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace chunkstar {
namespace {

constexpr int layers = 6, steps = 4;
constexpr std::size_t elems = 3000;

/** One rank: 6 weights of one chunk each; each backward writes a gradient that depends on the
 *  rank, the layer and the step; Adam on the device (or the host kernel on the simulated one).
 *  Returns the owned fp32 master weights by name. */
template <class Platform, class Kernels, class Comm>
std::map<std::string, std::vector<float>> train(Comm& comm, typename Platform::device_space& dev, typename Platform::host_space& host,
                                                typename Platform::copy_engine& copier, bool memory_saving) {
  using rt_t = chunk_runtime<fixed_chunk_layout, static_placement, belady_eviction, warmup_tracer, Comm, Platform>;
  rt_t rt(dev, host, copier, comm, {.sharding = {.enabled = true, .memory_saving = memory_saving}}, fixed_chunk_layout({.chunk_elems = 4096}),
          static_placement::all_device());
  std::vector<param_id> ids;
  for (int i = 0; i < layers; ++i)
    ids.push_back(rt.register_param({"w" + std::to_string(i), {elems}, dtype::f32, tensor_role::weight}, [i](std::span<float> v) {
      for (std::size_t k = 0; k < v.size(); ++k) v[k] = std::sin(0.01f * static_cast<float>(k) + static_cast<float>(i));
    }));
  rt.finalize();
  chunk_adam<static_loss_scaler, Kernels> opt({.max_grad_norm = 1.0f});
  std::vector<float> g(elems);
  for (int step = 0; step < steps; ++step) {
    for (int i = 0; i < layers; ++i) (void)rt.forward("w" + std::to_string(i), {ids[i]});
    for (int i = layers - 1; i >= 0; --i) {
      auto s = rt.backward("w" + std::to_string(i), {ids[i]});
      auto span = s.template grad<float>(ids[i]);
      for (std::size_t k = 0; k < g.size(); ++k)
        g[k] = std::cos(0.03f * static_cast<float>(k) + static_cast<float>(i + step)) * static_cast<float>(1 + comm.rank());
      if constexpr (can_access_v<host_exec, typename Platform::device_space>)
        std::copy(g.begin(), g.end(), span.begin());
      else
        REQUIRE(cudaMemcpy(span.data(), g.data(), g.size() * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
    }
    CHECK(opt.step(rt, 1e-2f, comm.size()).stepped);
  }
  std::map<std::string, std::vector<float>> out;
  std::vector<float> v(elems);
  for (std::size_t t = 0; t < ids.size(); ++t) {
    if (rt.where({chunk_kind::master, static_cast<std::uint32_t>(rt.plan().slots[t].chunk)}) == tier::remote) continue;
    rt.read_tensor(ids[t], chunk_kind::master, v);
    out["w" + std::to_string(t)] = v;
  }
  return out;
}

TEST_CASE("ZeRO over NCCL, one rank per GPU: the owned parameters of 2 ranks equal the in-process group's bits") {
  int devices = 0;
  REQUIRE(cudaGetDeviceCount(&devices) == cudaSuccess);
  if (devices < 2) {
    std::printf("SKIPPED: ZeRO over NCCL needs 2 GPUs (NCCL puts one rank of a communicator per GPU); %d found\n", devices);
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
      expected[static_cast<std::size_t>(c.rank())] = train<simulated_platform, host_adam_kernels>(c, dev, host, copier, memory_saving);
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
          got[static_cast<std::size_t>(r)] = train<cuda::cuda_platform, cuda::device_adam_kernels>(comm, dev, host, copier, memory_saving);
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

}  // namespace
}  // namespace chunkstar
