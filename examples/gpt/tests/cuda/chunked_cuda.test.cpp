// SPDX-License-Identifier: Apache-2.0
// The GPT in chunks on a GPU (label cuda; without a GPU it exits 77, skipped): the CUDA backend on
// the CUDA platform (device and pinned host memory, the stream copy engine, device Adam).
//  * Same bits on the device whatever the budget, eviction policy and prefetch depth, in fp32 and
//    bf16 (cuBLAS in a fixed configuration: gpt_backend_cuda.hpp).
//  * The CUDA model tracks the CPU model over 20 AdamW steps within fp32 tolerance.
//  * fp16 with dynamic loss scaling trains and stays finite.
// The decisions these runs rely on (streams, waits, buffers) are checked on the CPU by
// backend_contract.test.cpp.
#include "chunked_gpt.hpp"
#include "chunked_setup.hpp"
#include "data.hpp"
#include "gpt_backend_cuda.hpp"
#include "support/runtimes.hpp"

#include <chunkstar/cuda/cuda_platform.hpp>
#include <chunkstar/eviction/lru.hpp>
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/placement/static_placement.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <vector>

using namespace chunkstar;

namespace chunked_cuda_test {

namespace {

using gpt::testing::run_result;

/** The shape these tests train; capacities leave 1 MiB beside the non-model memory. */
struct shape_info : gpt::testing::chunked_setup {
  explicit shape_info(dtype type) : chunked_setup(type, {4, 64}) {}
  template <class Backend>
  std::size_t capacity(double fraction) const {
    return chunked_setup::capacity<Backend>(fraction, 1u << 20);
  }
};

template <class Runtime, class Backend, class Kernels, class Scaler, class Device>
run_result train(Runtime& rt, Backend backend, Device& dev, const shape_info& s, int steps) {
  gpt::chunked_gpt<Runtime, Backend> model(rt, s.c, s.shape, 42, std::move(backend));
  model.finalize();
  chunk_adam<Scaler, Kernels> opt(
      {.hyper = {.beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = 0.1f}, .max_grad_norm = 1.0f},
      param_groups::with_default_decay(0.1f));
  const run_result r = gpt::testing::train_steps(rt, model, opt, s.shape, {.steps = steps});  // fp16 may skip a step
  CHECK(dev.usage().peak <= dev.capacity());
  return r;
}

template <class Placement, class Eviction, class Scaler = static_loss_scaler>
run_result on_gpu(dtype type, double fraction, Placement placement, std::size_t prefetch, int steps) {
  using rt_t = chunk_runtime<fixed_chunk_layout, Placement, Eviction, warmup_tracer, single_process_communicator,
                             cuda::cuda_platform>;
  const shape_info s(type);
  cuda::device_space dev({.capacity = s.capacity<gpt::cuda_backend>(fraction)});
  cuda::pinned_host_space host;
  cuda::cuda_copy_engine copier;
  rt_t rt(dev, host, copier, {.param_type = type, .prefetch_depth = prefetch}, s.layout, placement);
  return train<rt_t, gpt::cuda_backend, gpt::cuda_adam_kernels, Scaler>(rt, gpt::cuda_backend(0), dev, s, steps);
}

run_result on_cpu(dtype type, int steps) {
  using rt_t = chunk_runtime<fixed_chunk_layout, static_placement>;
  const shape_info s(type);
  simulated_device_space dev({.capacity = s.capacity<gpt::cpu_backend>(1.0)});
  host_space host;
  host_copy_engine copier;
  rt_t rt(dev, host, copier, {.param_type = type}, s.layout, static_placement::all_device());
  return train<rt_t, gpt::cpu_backend, host_adam_kernels, static_loss_scaler>(rt, gpt::cpu_backend{}, dev, s, steps);
}

}  // namespace

TEST_CASE("CUDA GPT: same bits whatever the budget, policy and prefetch depth (fp32, bf16)") {
  for (dtype type : {dtype::f32, dtype::bf16}) {
    CAPTURE(type);
    const auto ref = on_gpu<static_placement, belady_eviction>(type, 1.0, static_placement::all_device(), 2, 4);
    const auto moved = on_gpu<auto_placement, belady_eviction>(type, 0.3, auto_placement{}, 2, 4);
    CHECK(moved.stats.bytes_moved() > 0);  // the 30% budget really moved chunks
    CHECK(moved.losses == ref.losses);
    CHECK(moved.params == ref.params);
    const auto lru = on_gpu<auto_placement, lru_eviction>(type, 0.3, auto_placement{}, 0, 4);
    CHECK(lru.losses == ref.losses);
    CHECK(lru.params == ref.params);
    const auto deep = on_gpu<auto_placement, belady_eviction>(type, 0.5, auto_placement{}, 4, 4);
    CHECK(deep.losses == ref.losses);
    CHECK(deep.params == ref.params);
    const auto host = on_gpu<static_placement, belady_eviction>(type, 0.1, static_placement::all_host(), 2, 4);
    CHECK(host.stats.host_steps > 0);  // the SIMD host Adam on pinned memory
    CHECK(host.losses == ref.losses);
    CHECK(host.params == ref.params);
    const auto again = on_gpu<auto_placement, belady_eviction>(type, 0.3, auto_placement{}, 2, 4);
    CHECK(again.losses == moved.losses);  // a rerun repeats
  }
}

TEST_CASE("CUDA GPT: 20 AdamW steps track the CPU model within fp32 tolerance") {
  const int steps = 20;
  const auto gpu = on_gpu<auto_placement, belady_eviction>(dtype::f32, 0.3, auto_placement{}, 2, steps);
  const auto cpu = on_cpu(dtype::f32, steps);
  REQUIRE(gpu.losses.size() == cpu.losses.size());
  double worst = 0;
  for (std::size_t i = 0; i < cpu.losses.size(); ++i) {
    CAPTURE(i);
    const double d = std::abs(gpu.losses[i] - cpu.losses[i]) / std::max(1.0, std::abs(cpu.losses[i]));
    worst = std::max(worst, d);
    CHECK(d <= 2e-3);  // GEMMs sum in another order: fp32 rounding, amplified by 20 steps of training
  }
  MESSAGE("largest relative loss difference GPU vs CPU over ", steps, " steps: ", worst);
  CHECK(gpu.losses.back() < gpu.losses.front() - 0.3);  // and it trains
}

TEST_CASE("CUDA GPT: fp16 with dynamic loss scaling trains and stays finite") {
  const auto r = on_gpu<auto_placement, belady_eviction, dynamic_loss_scaler>(dtype::f16, 0.3, auto_placement{}, 2, 8);
  for (double l : r.losses) CHECK(std::isfinite(l));
  CHECK(r.losses[r.losses.size() - 2] < r.losses.front());
}

}  // namespace chunked_cuda_test
