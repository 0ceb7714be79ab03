// SPDX-License-Identifier: Apache-2.0
// ZeRO on the CUDA platform for the multi-rank CUDA tests (zero_nccl, zero_staged): one rank's
// training of 6 one-chunk weights, whose gradients depend on the rank, the layer and the step; Adam
// on the device (or the host kernel on the simulated platform, for the reference).
#pragma once

#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/cuda/chunk_adam_kernels.cuh>
#include <chunkstar/cuda/cuda_platform.hpp>
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/placement/static_placement.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

namespace chunkstar {
namespace zero_cuda {

constexpr int layers = 6, steps = 4;
constexpr std::size_t elems = 3000;

/** One rank: 6 weights of one chunk each; each backward writes a gradient that depends on the
 *  rank, the layer and the step; Adam on the device (or the host kernel on the simulated one).
 *  Returns the owned fp32 weights by name. */
template <class Platform, class Kernels, class Comm>
std::map<std::string, std::vector<float>> train(Comm& comm, typename Platform::device_space& dev,
                                                typename Platform::host_space& host,
                                                typename Platform::copy_engine& copier, bool memory_saving) {
  using rt_t = chunk_runtime<fixed_chunk_layout, static_placement, belady_eviction, warmup_tracer, Comm, Platform>;
  rt_t rt(dev, host, copier, comm, {.sharding = {.enabled = true, .memory_saving = memory_saving}},
          fixed_chunk_layout({.chunk_elems = 4096}), static_placement::all_device());
  std::vector<param_id> ids;
  for (int i = 0; i < layers; ++i)
    ids.push_back(
        rt.register_param({"w" + std::to_string(i), {elems}, dtype::f32, tensor_role::weight}, [i](std::span<float> v) {
          for (std::size_t k = 0; k < v.size(); ++k)
            v[k] = std::sin(0.01f * static_cast<float>(k) + static_cast<float>(i));
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
        g[k] = std::cos(0.03f * static_cast<float>(k) + static_cast<float>(i + step)) *
               static_cast<float>(1 + comm.rank());
      if constexpr (can_access_v<host_exec, typename Platform::device_space>)
        std::copy(g.begin(), g.end(), span.begin());
      else REQUIRE(cudaMemcpy(span.data(), g.data(), g.size() * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
    }
    CHECK(opt.step(rt, 1e-2f, comm.size()).stepped);
  }
  std::map<std::string, std::vector<float>> out;
  std::vector<float> v(elems);
  for (std::size_t t = 0; t < ids.size(); ++t) {
    // fp32 weights are their own masters (a model of fp32 parameters has no master list).
    if (rt.where({chunk_kind::param, static_cast<std::uint32_t>(rt.plan().slots[t].chunk)}) == tier::remote) continue;
    rt.read_tensor(ids[t], chunk_kind::param, v);
    out["w" + std::to_string(t)] = v;
  }
  return out;
}

}  // namespace zero_cuda
}  // namespace chunkstar
