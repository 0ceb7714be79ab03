// SPDX-License-Identifier: Apache-2.0
// The memory plan (chunkstar::plan_memory) of the GPT against what its runs measure: the device a
// resident run needs (`device_for_resident()`: model data, ZeRO's buffers, the non-model memory)
// within 5% of the device's measured peak, for one process, ZeRO in the group and the
// memory-saving modes and RTP, at N = 1-4. The non-model memory is the model's estimate
// (`non_model_bytes`, `compute_tier_bytes`) and, under ZeRO, where its peak and the buffers' peak
// fall at different moments, the warm-up's trace of it per moment (what PatrickStar plans from).
// The figures are printed (docs/design.md's table).
#include "chunked_gpt.hpp"
#include "data.hpp"
#include "rtp_gpt.hpp"
#include "support/runtimes.hpp"

#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/placement/static_placement.hpp>
#include <chunkstar/rtp/chunk_shard_store.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

using namespace chunkstar;

namespace memory_plan_gpt_test {

namespace {

const gpt::gpt_config cfg = gpt::parse_preset("tiny");
const gpt::batch_shape shape{2, 32};

fixed_chunk_layout layout_of(const std::vector<tensor_spec>& specs) {
  std::size_t largest = 0;
  for (const auto& s : specs) largest = std::max(largest, s.numel());
  return fixed_chunk_layout({.chunk_elems = (largest + 31) / 32 * 32});
}

/** Two AdamW steps of one rank, everything on the device; returns the device's peak. */
template <class Runtime, class Model>
void steps(Runtime& rt, Model& model, int world, int rank) {
  chunk_adam<> opt({.hyper = {.weight_decay = 0.1f}, .max_grad_norm = 1.0f}, param_groups::with_default_decay(0.1f));
  const auto data = gpt::load_text("", shape.seq);
  std::vector<int> tokens(shape.batch * shape.seq), targets(tokens.size());
  for (int step = 1; step <= 2; ++step) {
    gpt::fill_batch(data.train, 1, gpt::train_key(step, rank), shape.batch, shape.seq, tokens.data(), targets.data());
    (void)model.forward_backward(tokens.data(), targets.data());
    REQUIRE(opt.step(rt, 3e-3f, world).stepped);
  }
}

using group_rt = chunk_runtime<fixed_chunk_layout, static_placement, belady_eviction, warmup_tracer, in_process_communicator>;

/** The one-process or ZeRO run on @p n ranks: the plan's device need (from the warm-up's non-model
 *  profile under ZeRO) and the largest measured peak. */
std::pair<std::size_t, std::size_t> chunked(int n, sharding_options sharding) {
  const auto specs = gpt::param_specs(cfg, dtype::f32);
  const auto layout = layout_of(specs);
  const runtime_options o{.param_type = dtype::f32, .sharding = sharding};
  std::vector<std::size_t> profile{gpt::non_model_bytes<gpt::cpu_backend>(cfg, shape, dtype::f32)};
  std::vector<std::size_t> peak(static_cast<std::size_t>(n));
  run_ranks(n, [&](in_process_communicator& comm) {
    simulated_device_space dev({.capacity = std::size_t{1} << 30});
    host_space host;
    host_copy_engine copier;
    group_rt rt(dev, host, copier, comm, o, layout, static_placement::all_device());
    gpt::chunked_gpt<group_rt> model(rt, cfg, shape, 42);
    model.finalize();
    steps(rt, model, n, comm.rank());
    peak[static_cast<std::size_t>(comm.rank())] = dev.usage().peak;
    if (comm.rank() == 0 && sharding.enabled && n > 1) {
      profile = traced_non_model(rt.tracer());
    }
  });
  const memory_plan plan = plan_memory(specs, layout, o, n, gpt::forward_scopes(cfg), profile);
  return {plan.device_for_resident(), *std::max_element(peak.begin(), peak.end())};
}

/** The RTP run on @p n ranks, each rank's parts in its own chunk runtime, resident. */
std::pair<std::size_t, std::size_t> rtp(int n) {
  using rt_type = chunk_runtime<fixed_chunk_layout, static_placement>;
  using store_type = rtp::chunk_shard_store<rt_type>;
  using model_type = gpt::rtp_gpt<in_process_communicator, store_type>;
  std::vector<std::size_t> need(static_cast<std::size_t>(n)), peak(static_cast<std::size_t>(n));
  run_ranks(n, [&](in_process_communicator& comm) {
    const auto specs = model_type::shard_tensors(cfg, n, comm.rank());
    const auto layout = layout_of(specs);
    const memory_plan plan = plan_memory(specs, layout, {.param_type = dtype::f32}, 1, model_type::stage_scopes(cfg, n, comm.rank()),
                                         model_type::compute_tier_bytes(cfg, n, shape.batch, shape.seq));
    simulated_device_space dev({.capacity = std::size_t{1} << 30});
    host_space host;
    host_copy_engine copier;
    single_process_communicator one;
    rt_type rt(dev, host, copier, one, {.param_type = dtype::f32}, layout, static_placement::all_device());
    store_type store(rt);
    model_type model(comm, store, cfg, shape.batch, shape.seq);
    model.init(42);
    const auto data = gpt::load_text("", shape.seq);
    std::vector<int> tokens(shape.batch * shape.seq), targets(tokens.size());
    for (int step = 1; step <= 2; ++step) {
      gpt::fill_batch(data.train, 1, gpt::train_key(step, comm.rank()), shape.batch, shape.seq, tokens.data(), targets.data());
      (void)model.forward(tokens.data(), targets.data());
      model.backward(tokens.data(), targets.data());
      (void)model.step({.lr = 3e-3f, .weight_decay = 0.1f}, param_groups::with_default_decay(0.1f), n, 1.0f);
    }
    need[static_cast<std::size_t>(comm.rank())] = plan.device_for_resident();
    peak[static_cast<std::size_t>(comm.rank())] = dev.usage().peak;
  });
  return {*std::max_element(need.begin(), need.end()), *std::max_element(peak.begin(), peak.end())};
}

/** The plan against the measured peak: within 5% either way. */
void check(const std::string& mode, int n, std::pair<std::size_t, std::size_t> r) {
  const auto [plan, peak] = r;
  const double ratio = static_cast<double>(plan) / static_cast<double>(peak);
  MESSAGE(mode << ", N = " << n << ": plan " << plan << " B, measured peak " << peak << " B, plan / peak " << ratio);
  CHECK(std::abs(ratio - 1.0) <= 0.05);
}

}  // namespace

TEST_CASE("memory plan: the device need is within 5% of the measured peak for one process, ZeRO (both modes) and RTP at N = 1-4") {
  check("one process", 1, chunked(1, {}));
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    check("ZeRO", n, chunked(n, {.enabled = true}));
    check("ZeRO memory-saving", n, chunked(n, {.enabled = true, .memory_saving = true}));
    if (n != 3) check("RTP", n, rtp(n));  // the tiny preset's 4 heads split over 1, 2 or 4 ranks
  }
}

}  // namespace memory_plan_gpt_test
