// SPDX-License-Identifier: Apache-2.0
// The memory plan (chunkstar::plan_memory) of the GPT against what its runs measure: the device a
// resident run needs (`device_for_resident()`: model data, ZeRO's buffers, the non-model memory)
// within 5% of the device's measured peak, for one process, ZeRO in the group and the
// memory-saving modes and RTP, at N = 1-4, with the model's own per-moment non-model profile
// (`gpt::non_model_profile`, known before the run; it must bound the warm-up's trace at every
// moment) and with the warm-up's trace; and a run admitted at the plan's device floor trains
// without running out of memory. The figures are printed (docs/design.md's table).
#include "chunked_gpt.hpp"
#include "data.hpp"
#include "rtp_gpt.hpp"
#include "support/runtimes.hpp"

#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/placement/auto_placement.hpp>
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

using group_rt =
    chunk_runtime<fixed_chunk_layout, static_placement, belady_eviction, warmup_tracer, in_process_communicator>;

/** The one-process or ZeRO run on @p n ranks: the plan's device need from the model's own
 *  non-model profile (`gpt::non_model_profile`, known before the run) and from the warm-up's trace
 *  of it, and the largest measured peak. Checks that the model's profile bounds the trace at every
 *  moment. */
struct chunked_result {
  std::size_t from_model = 0, from_trace = 0, peak = 0;
};

chunked_result chunked(int n, sharding_options sharding) {
  const auto specs = gpt::param_specs(cfg, dtype::f32);
  const auto layout = layout_of(specs);
  const runtime_options o{.param_type = dtype::f32, .sharding = sharding};
  const std::vector<std::size_t> model_profile = gpt::non_model_profile<gpt::cpu_backend>(cfg, shape, dtype::f32);
  std::vector<std::size_t> traced;
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
    if (comm.rank() == 0) traced = traced_non_model(rt.tracer());
  });
  REQUIRE(traced.size() == model_profile.size());
  std::size_t tight = 0;  // the moments the model's profile meets exactly
  for (std::size_t m = 0; m < traced.size(); ++m) {
    CAPTURE(m);
    CHECK(model_profile[m] >= traced[m]);
    tight += model_profile[m] == traced[m];
  }
  CHECK(tight * 2 >= traced.size());  // an upper bound that is mostly exact, not a loose one
  const auto scopes = gpt::forward_scopes(cfg);
  return {plan_memory(specs, layout, o, n, scopes, model_profile).device_for_resident(),
          plan_memory(specs, layout, o, n, scopes, traced).device_for_resident(),
          *std::max_element(peak.begin(), peak.end())};
}

/** Rank @p rank's plan under RTP on @p n ranks: its shard tensors in a one-rank chunk runtime,
 *  opened stage by stage, beside the model's non-model bytes. */
template <class Model>
memory_plan rtp_plan(int n, int rank) {
  const auto specs = Model::shard_tensors(cfg, n, rank);
  return plan_memory(specs, layout_of(specs), {.param_type = dtype::f32}, 1, Model::stage_scopes(cfg, n, rank),
                     Model::compute_tier_bytes(cfg, n, shape.batch, shape.seq));
}

/** Two AdamW steps of the RTP GPT on @p n ranks, this rank's parts in @p rt (a chunk shard store). */
template <class Model, class Store, class Runtime>
void rtp_steps(in_process_communicator& comm, Runtime& rt, int n) {
  Store store(rt);
  Model model(comm, store, cfg, shape.batch, shape.seq);
  model.init(42);
  const auto data = gpt::load_text("", shape.seq);
  std::vector<int> tokens(shape.batch * shape.seq), targets(tokens.size());
  for (int step = 1; step <= 2; ++step) {
    gpt::fill_batch(data.train, 1, gpt::train_key(step, comm.rank()), shape.batch, shape.seq, tokens.data(),
                    targets.data());
    (void)model.forward(tokens.data(), targets.data());
    model.backward(tokens.data(), targets.data());
    (void)model.step({.lr = 3e-3f, .weight_decay = 0.1f}, param_groups::with_default_decay(0.1f), n, 1.0f);
  }
}

/** The RTP run on @p n ranks, each rank's parts in its own chunk runtime, resident. */
std::pair<std::size_t, std::size_t> rtp(int n) {
  using rt_type = chunk_runtime<fixed_chunk_layout, static_placement>;
  using store_type = rtp::chunk_shard_store<rt_type>;
  using model_type = gpt::rtp_gpt<in_process_communicator, store_type>;
  std::vector<std::size_t> need(static_cast<std::size_t>(n)), peak(static_cast<std::size_t>(n));
  run_ranks(n, [&](in_process_communicator& comm) {
    const auto layout = layout_of(model_type::shard_tensors(cfg, n, comm.rank()));
    const memory_plan plan = rtp_plan<model_type>(n, comm.rank());
    simulated_device_space dev({.capacity = std::size_t{1} << 30});
    host_space host;
    host_copy_engine copier;
    single_process_communicator one;
    rt_type rt(dev, host, copier, one, {.param_type = dtype::f32}, layout, static_placement::all_device());
    rtp_steps<model_type, store_type>(comm, rt, n);
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

TEST_CASE(
    "memory plan: the device need is within 5% of the measured peak for one process, ZeRO (both modes) and RTP at N = "
    "1-4") {
  const auto both = [](const std::string& mode, int n, const chunked_result& r) {
    check(mode + " (the model's profile)", n, {r.from_model, r.peak});
    check(mode + " (the warm-up's trace)", n, {r.from_trace, r.peak});
  };
  both("one process", 1, chunked(1, {}));
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    // The plan is the need: gathers further than one scope ahead (sharding_options::gather_depth)
    // only take room beyond it, which this unlimited device has; one scope ahead is the need's.
    both("ZeRO", n, chunked(n, {.enabled = true, .gather_depth = 1}));
    both("ZeRO memory-saving", n, chunked(n, {.enabled = true, .memory_saving = true}));
    if (n != 3) check("RTP", n, rtp(n));  // the tiny preset's 4 heads split over 1, 2 or 4 ranks
  }
}

TEST_CASE(
    "memory plan: a run admitted at the device floor trains without running out of memory (one process, ZeRO in both "
    "modes, N = 1-4)") {
  // The least device the plan admits, from the model's own profile before anything is built;
  // chunks move (auto placement, Belady), the host takes the rest.
  const auto specs = gpt::param_specs(cfg, dtype::f32);
  const auto layout = layout_of(specs);
  const auto profile = gpt::non_model_profile<gpt::cpu_backend>(cfg, shape, dtype::f32);
  for (int n = 1; n <= 4; ++n) {
    for (const bool saving : {false, true}) {
      if (n == 1 && saving) continue;
      CAPTURE(n);
      CAPTURE(saving);
      const runtime_options o{.param_type = dtype::f32, .sharding = {.enabled = n > 1, .memory_saving = saving}};
      const memory_plan plan = plan_memory(specs, layout, o, n, gpt::forward_scopes(cfg), profile);
      const tier_budgets budgets{.device = plan.device_floor()};
      REQUIRE(admit(plan, budgets).fits());
      REQUIRE_FALSE(admit(plan, {.device = plan.device_floor() - 1}).fits());
      MESSAGE("N = " << n << std::string(saving ? " memory-saving" : "") << ": device floor " << plan.device_floor()
                     << " B, resident " << plan.device_for_resident() << " B");
      run_ranks(n, [&](in_process_communicator& comm) {
        simulated_device_space dev({.capacity = budgets.device});
        host_space host;
        host_copy_engine copier;
        testing::fixed_group_runtime rt(dev, host, copier, comm, o, layout, auto_placement{});
        gpt::chunked_gpt<testing::fixed_group_runtime> model(rt, cfg, shape, 42);
        model.finalize();
        CHECK_NOTHROW(steps(rt, model, n, comm.rank()));
      });
    }
  }
}

TEST_CASE(
    "memory plan: an RTP run admitted at each rank's device floor trains without running out of memory (N = 1, 2, 4)") {
  // Each rank's parts and replicas in its own chunk runtime (a one-rank plan over the rank's
  // shard tensors and stage scopes), the device at the floor, chunks moving (auto placement).
  using rt_type = chunk_runtime<fixed_chunk_layout, auto_placement>;
  using store_type = rtp::chunk_shard_store<rt_type>;
  using model_type = gpt::rtp_gpt<in_process_communicator, store_type>;
  for (const int n : {1, 2, 4}) {
    CAPTURE(n);
    run_ranks(n, [&](in_process_communicator& comm) {
      const auto layout = layout_of(model_type::shard_tensors(cfg, n, comm.rank()));
      const memory_plan plan = rtp_plan<model_type>(n, comm.rank());
      REQUIRE(plan.device_floor() < plan.device_for_resident());  // chunks must move
      simulated_device_space dev({.capacity = plan.device_floor()});
      host_space host;
      host_copy_engine copier;
      single_process_communicator one;  // the store's runtime is a one-rank one
      rt_type rt(dev, host, copier, one, {.param_type = dtype::f32}, layout, auto_placement{});
      CHECK_NOTHROW(rtp_steps<model_type, store_type>(comm, rt, n));
    });
  }
}

}  // namespace memory_plan_gpt_test
