// SPDX-License-Identifier: Apache-2.0
// The chunk runtime: state machine, budgets, divergence, errors, and the same-bits invariant.
#include <chunkstar/eviction/lru.hpp>
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/placement/static_placement.hpp>
#include <chunkstar/runtime/assemblies.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>
#include <chunkstar/tracer/null_tracer.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "support/runtimes.hpp"
#include "support/toy_model.hpp"

using namespace chunkstar;

namespace chunk_runtime_test {
using chunkstar::testing::toy_config;
using chunkstar::testing::toy_result;

TEST_CASE("tensor state machine: legal and illegal transitions") {
  using S = tensor_state;
  using E = tensor_event;
  CHECK(transition(S::hold, E::open_scope) == S::compute);
  CHECK(transition(S::free, E::open_scope) == S::compute);
  CHECK(transition(S::hold_after_fwd, E::open_scope) == S::compute);
  CHECK(transition(S::hold_after_bwd, E::open_scope) == S::compute);
  CHECK(transition(S::compute, E::close_forward) == S::hold_after_fwd);
  CHECK(transition(S::compute, E::close_backward) == S::hold_after_bwd);
  CHECK(transition(S::hold_after_fwd, E::end_iteration) == S::hold);
  CHECK(transition(S::hold_after_bwd, E::end_iteration) == S::hold);
  CHECK(transition(S::free, E::end_iteration) == S::free);
  CHECK(transition(S::hold, E::release) == S::free);
  CHECK_THROWS_AS(transition(S::compute, E::open_scope, "w"), state_error);
  CHECK_THROWS_AS(transition(S::hold, E::close_forward, "w"), state_error);
  CHECK_THROWS_AS(transition(S::hold_after_fwd, E::close_backward, "w"), state_error);
  CHECK_THROWS_AS(transition(S::compute, E::end_iteration, "w"), state_error);
  CHECK_THROWS_AS(transition(S::compute, E::release, "w"), state_error);
  try {
    (void)transition(S::compute, E::release, "blocks.3.weight");
  } catch (const state_error& e) {
    CHECK(std::string(e.what()).find("blocks.3.weight") != std::string::npos);
    CHECK(std::string(e.what()).find("COMPUTE") != std::string::npos);
  }
}

namespace {

using lru_rt = chunk_runtime<fixed_chunk_layout, auto_placement, lru_eviction>;

fixed_chunk_layout small_layout() { return fixed_chunk_layout({.chunk_elems = 2048, .align_elems = 32}); }

}  // namespace

TEST_CASE("scopes drive tensor states; moving a chunk in COMPUTE is a typed error") {
  simulated_device_space dev({.capacity = 1 << 20});
  host_space host;
  host_copy_engine copier;
  lru_rt rt(dev, host, copier, {}, small_layout());
  const auto a = rt.register_param({"a", {32, 32}, dtype::f32, tensor_role::weight}, [](std::span<float> v) {
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i);
  });
  const auto b = rt.register_param({"b", {32}, dtype::f32, tensor_role::bias});
  CHECK_THROWS_AS(rt.register_param({"a", {1}, dtype::f32, tensor_role::bias}), config_error);
  CHECK_THROWS_AS(rt.register_param({"c", {1}, dtype::bf16, tensor_role::bias}), config_error);
  rt.finalize();
  CHECK_THROWS_AS(rt.register_param({"late", {1}, dtype::f32, tensor_role::bias}), state_error);
  CHECK(rt.state(a) == tensor_state::hold);
  {
    auto s = rt.forward("layer0", {a, b});
    CHECK(rt.state(a) == tensor_state::compute);
    CHECK(rt.chunk_state({chunk_kind::param, 0}) == tensor_state::compute);
    CHECK(rt.where({chunk_kind::param, 0}) == tier::device);
    CHECK(s.param<float>(a)[5] == 5.0f);
    CHECK_THROWS_AS((void)s.param<bfloat16>(a), config_error);
    CHECK_THROWS_AS((void)s.grad<float>(a), state_error);
    CHECK_THROWS_AS(rt.offload({chunk_kind::param, 0}), state_error);
    CHECK_THROWS_AS(rt.end_iteration(), state_error);
  }
  CHECK(rt.state(a) == tensor_state::hold_after_fwd);
  {
    auto s = rt.backward("layer0", {a, b});
    auto g = s.grad<float>(a);
    CHECK(g[0] == 0.0f);  // FREE gradients come back zeroed
    g[0] = 2.0f;
  }
  CHECK(rt.state(b) == tensor_state::hold_after_bwd);
  rt.offload({chunk_kind::param, 0});
  CHECK(rt.where({chunk_kind::param, 0}) == tier::host);
  std::vector<float> out(32 * 32);
  rt.read_tensor(a, chunk_kind::grad, out);
  CHECK(out[0] == 2.0f);
  rt.end_iteration();
  CHECK(rt.state(a) == tensor_state::hold);
}

TEST_CASE("a budget too small for one scope's working set names the scope and the bytes") {
  // 2048 f32 elements = 8 KiB per chunk; a backward scope needs param + grad = 16 KiB.
  simulated_device_space dev({.capacity = 12 * 1024});
  host_space host;
  host_copy_engine copier;
  lru_rt rt(dev, host, copier, {}, small_layout());
  const auto w = rt.register_param({"blocks.0.weight", {2000}, dtype::f32, tensor_role::weight});
  rt.finalize();
  { auto s = rt.forward("blocks.0", {w}); }
  try {
    auto s = rt.backward("blocks.0", {w});
    FAIL("expected out_of_memory_error");
  } catch (const out_of_memory_error& e) {
    const std::string what = e.what();
    CHECK(what.find("blocks.0") != std::string::npos);
    CHECK(what.find("16.0 KiB") != std::string::npos);
    CHECK(e.requested_bytes() == 16 * 1024);
    CHECK(e.report().spaces.size() >= 2);
  }
}

TEST_CASE("same bits whatever the budget, eviction policy and prefetch") {
  toy_config base;
  base.steps = 4;
  // Reference: everything resident on the compute tier, nothing ever moves down.
  const toy_result reference = chunkstar::testing::train_toy<chunk_runtime<fixed_chunk_layout, static_placement>>(
      base, 1.0, static_placement::all_device());
  REQUIRE(reference.losses.size() == 4);
  CHECK(reference.losses.back() < reference.losses.front());  // it learns
  CHECK(reference.stats.bytes_to_host == 0);
  CHECK(reference.stats.device_steps == reference.stats.steps * 8);

  for (double budget : {0.5, 0.2}) {
    for (std::size_t prefetch : {std::size_t{0}, std::size_t{2}}) {
      toy_config c = base;
      c.prefetch = prefetch;
      CAPTURE(budget);
      CAPTURE(prefetch);
      const auto lru = chunkstar::testing::train_toy<lru_rt>(c, budget);
      const auto bel = chunkstar::testing::train_toy<chunk_runtime<fixed_chunk_layout>>(c, budget);
      CHECK(lru.stats.bytes_to_host > 0);  // model data really left the compute tier
      CHECK(bel.stats.bytes_to_host > 0);
      if (budget < 0.5) CHECK(bel.stats.evictions > 0);
      CHECK(lru.params == reference.params);  // bitwise (float ==, no NaNs here)
      CHECK(bel.params == reference.params);
      CHECK(lru.losses == reference.losses);
      CHECK(bel.losses == reference.losses);
      CHECK(bel.stats.bytes_moved() <= lru.stats.bytes_moved());
      CHECK(bel.peak_device <= bel.capacity);
      CHECK(lru.peak_device <= lru.capacity);
    }
  }
  // Static placements give the same bits too.
  const auto all_host = chunkstar::testing::train_toy<chunk_runtime<fixed_chunk_layout, static_placement>>(
      base, 1.0, static_placement::all_host());
  CHECK(all_host.params == reference.params);
  CHECK(all_host.stats.host_steps > 0);
  const auto half = chunkstar::testing::train_toy<chunk_runtime<fixed_chunk_layout, static_placement>>(
      base, 1.0, static_placement::fraction(0.5));
  CHECK(half.params == reference.params);
}

TEST_CASE("divergence from the trace is detected, counted, survived and re-traced") {
  simulated_device_space dev({.capacity = 64 * 1024});
  host_space host;
  host_copy_engine copier;
  chunk_runtime<fixed_chunk_layout> rt(dev, host, copier, {}, small_layout());
  std::vector<param_id> ids;
  for (int i = 0; i < 6; ++i)
    ids.push_back(rt.register_param({"w" + std::to_string(i), {2000}, dtype::f32, tensor_role::weight}));
  rt.finalize();
  auto iteration = [&](std::vector<int> order) {
    for (int i : order) {
      auto s = rt.forward("layer" + std::to_string(i), {ids[static_cast<std::size_t>(i)]});
      auto* act = rt.allocate_non_model(4096);
      rt.deallocate_non_model(act, 4096);
    }
    rt.end_iteration();
  };
  iteration({0, 1, 2, 3, 4, 5});
  CHECK(rt.tracer().ready());
  iteration({0, 1, 2, 3, 4, 5});
  CHECK(rt.tracer().stats().divergences == 0);
  iteration({0, 1, 3, 2, 4, 5});  // a different order: diverges at the third scope
  CHECK(rt.tracer().stats().divergences == 1);
  CHECK(rt.tracer().stats().traces == 2);  // re-traced at the end of that iteration
  iteration({0, 1, 3, 2, 4, 5});
  CHECK(rt.tracer().stats().divergences == 1);
  iteration({0, 1, 3});  // fewer moments
  CHECK(rt.tracer().stats().divergences == 2);
  // More non-model memory than recorded: counted, and budgets follow.
  iteration({0, 1, 3});
  {
    auto s = rt.forward("layer0", {ids[0]});
    auto* big = rt.allocate_non_model(16384);
    CHECK(rt.tracer().stats().memory_divergences == 1);
    rt.deallocate_non_model(big, 16384);
  }
  rt.end_iteration();
}

TEST_CASE("tied parameters: used in several scopes, nested or not, gradients accumulate") {
  simulated_device_space dev({.capacity = 1 << 20});
  host_space host;
  host_copy_engine copier;
  lru_rt rt(dev, host, copier, {}, small_layout());
  const auto emb = rt.register_param({"wte", {64}, dtype::f32, tensor_role::embedding});
  const auto other = rt.register_param({"w", {64}, dtype::f32, tensor_role::weight});
  rt.finalize();
  {
    auto embed = rt.forward("embed", {emb});
    {
      auto head = rt.forward("head", {emb, other});  // nested use of the tied weight
      CHECK(rt.state(emb) == tensor_state::compute);
    }
    CHECK(rt.state(emb) == tensor_state::compute);  // still used by the outer scope
    CHECK(rt.state(other) == tensor_state::hold_after_fwd);
  }
  CHECK(rt.state(emb) == tensor_state::hold_after_fwd);
  {
    auto head = rt.backward("head", {emb, other});
    head.grad<float>(emb)[3] += 1.5f;
  }
  rt.offload({chunk_kind::grad, 0});  // moving between uses keeps the partial sum
  {
    auto embed = rt.backward("embed", {emb});
    embed.grad<float>(emb)[3] += 2.0f;
  }
  std::vector<float> g(64);
  rt.read_tensor(emb, chunk_kind::grad, g);
  CHECK(g[3] == 3.5f);
  rt.end_iteration();
}

TEST_CASE("timeline: a Chrome trace with scopes, transfers and counters") {
  simulated_device_space dev({.capacity = 24 * 1024});
  host_space host;
  host_copy_engine copier;
  chunk_runtime<fixed_chunk_layout> rt(dev, host, copier, {.timeline = true}, small_layout());
  std::vector<param_id> ids;
  for (int i = 0; i < 4; ++i)
    ids.push_back(rt.register_param({"w" + std::to_string(i), {2000}, dtype::f32, tensor_role::weight}));
  rt.finalize();
  for (int it = 0; it < 2; ++it) {
    for (auto id : ids) auto s = rt.forward("f", {id});
    rt.end_iteration();
  }
  const std::string json = rt.timeline_recorder().to_chrome_trace();
  CHECK(json.find("\"traceEvents\"") != std::string::npos);
  CHECK(json.find("\"ph\":\"X\",\"name\":\"forward\"") != std::string::npos);
  CHECK(json.find("\"ph\":\"X\",\"name\":\"chunk\"") != std::string::npos);  // a transfer span
  CHECK(json.find("\"ph\":\"C\",\"name\":\"device\"") != std::string::npos);
  // Balanced braces and brackets: the document is well formed.
  int depth = 0;
  for (char c : json) {
    depth += (c == '{' || c == '[') - (c == '}' || c == ']');
    CHECK(depth >= 0);
  }
  CHECK(depth == 0);
  const std::string path = "chunkstar_timeline_test.json";
  rt.timeline_recorder().write_chrome_trace(path);
  CHECK_THROWS_AS(rt.timeline_recorder().write_chrome_trace("/nonexistent-dir/x.json"), io_error);
  std::remove(path.c_str());
}

TEST_CASE("worked example of docs/design.md: budgets from the trace, Belady's victim") {
  constexpr std::size_t KiB = 1024;
  simulated_device_space dev({.capacity = 48 * KiB});
  host_space host;
  host_copy_engine copier;
  chunk_runtime<fixed_chunk_layout> rt(dev, host, copier, {.prefetch_depth = 0}, small_layout());
  std::vector<param_id> w;
  for (int l = 0; l < 4; ++l)
    w.push_back(rt.register_param({"l" + std::to_string(l), {2000}, dtype::f32, tensor_role::weight}));
  rt.finalize();
  CHECK(rt.model_bytes() == 128 * KiB);
  auto iteration = [&](auto&& at_bwd_l3) {
    std::vector<void*> acts;
    for (int l = 0; l < 4; ++l) {
      auto s = rt.forward("l" + std::to_string(l), {w[static_cast<std::size_t>(l)]});
      acts.push_back(rt.allocate_non_model(4 * KiB));
    }
    for (int l = 3; l >= 0; --l) {
      auto s = rt.backward("l" + std::to_string(l), {w[static_cast<std::size_t>(l)]});
      if (l == 3) at_bwd_l3();
      rt.deallocate_non_model(acts.back(), 4 * KiB);
      acts.pop_back();
    }
    rt.step([](const step_chunk&) {});
  };
  iteration([] {});
  REQUIRE(rt.tracer().ready());
  CHECK(rt.tracer().num_moments() == 12);  // 8 scopes and one optimizer moment per chunk
  const std::size_t expected_peaks[] = {4, 8, 12, 16, 16, 12, 8, 4, 0, 0, 0, 0};
  for (std::size_t m = 0; m < 12; ++m) CHECK(rt.tracer().non_model_peak(m) == expected_peaks[m] * KiB);
  iteration([&] {
    CHECK(rt.chunk_budget() == 32 * KiB);
    CHECK(rt.where({chunk_kind::param, 0}) == tier::host);  // Belady's victim: next used furthest ahead
    CHECK(rt.where({chunk_kind::param, 1}) == tier::device);
    CHECK(rt.where({chunk_kind::param, 2}) == tier::device);
  });
  CHECK(rt.stats().host_steps == 8);  // margin < 0: every chunk steps on the host
}

TEST_CASE("untraced sections (evaluation) keep the training trace and the results") {
  simulated_device_space dev({.capacity = 40 * 1024});
  host_space host;
  host_copy_engine copier;
  chunk_runtime<fixed_chunk_layout> rt(dev, host, copier, {}, small_layout());
  std::vector<param_id> ids;
  for (int i = 0; i < 6; ++i)
    ids.push_back(rt.register_param({"w" + std::to_string(i), {2000}, dtype::f32, tensor_role::weight},
                                    [i](std::span<float> v) { std::fill(v.begin(), v.end(), static_cast<float>(i)); }));
  rt.finalize();
  auto train_iteration = [&] {
    for (auto id : ids) auto s = rt.forward("f", {id});
    for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
      auto s = rt.backward("b", {*it});
      s.grad<float>(*it)[0] += 1.0f;
    }
    rt.step([](const step_chunk& c) {
      auto* p = static_cast<float*>(c.param);
      const auto* g = static_cast<const float*>(c.grad);
      for (std::size_t i = 0; i < 2048; ++i) p[i] -= 0.5f * g[i];
    });
  };
  train_iteration();
  train_iteration();
  const auto divergences = rt.tracer().stats().divergences;
  {
    auto eval = rt.untraced();
    for (auto it = ids.rbegin(); it != ids.rend(); ++it) {  // a different order than training
      auto s = rt.forward("eval", {*it});
      CHECK(s.param<float>(*it)[1] == static_cast<float>(it - ids.rbegin() == 0 ? 5 : 5 - (it - ids.rbegin())));
    }
    CHECK_THROWS_AS(rt.step([](const step_chunk&) {}), state_error);
    CHECK_THROWS_AS((void)rt.untraced(), state_error);
  }
  CHECK(rt.state(ids[0]) == tensor_state::hold);
  train_iteration();
  CHECK(rt.tracer().stats().divergences == divergences);  // the eval pass did not disturb the trace
  CHECK(rt.tracer().ready());
  std::vector<float> v(2000);
  rt.read_tensor(ids[2], chunk_kind::param, v);
  CHECK(v[0] == 2.0f - 1.5f);  // three steps of -0.5 * 1
}

TEST_CASE("prefetch: loads ahead into free budget, hits, and never adds traffic") {
  auto run = [](std::size_t depth) {
    simulated_device_space dev({.capacity = 3 * 8192});  // three of the six chunks fit
    host_space host;
    host_copy_engine copier(copy_model{.bandwidth_bytes_per_s = 1e9});
    chunk_runtime<fixed_chunk_layout> rt(dev, host, copier, {.optimizer_state = false, .prefetch_depth = depth},
                                         small_layout());
    std::vector<param_id> ids;
    for (int i = 0; i < 6; ++i)
      ids.push_back(rt.register_param({"w" + std::to_string(i), {2000}, dtype::f32, tensor_role::weight}));
    rt.finalize();
    for (int it = 0; it < 4; ++it) {
      for (auto id : ids) auto s = rt.forward(rt.spec(id).name, {id});
      rt.end_iteration();
      // As after a host-side optimizer step: everything is on the host, the device is empty, and
      // the next iteration's first chunks can be fetched ahead into free budget.
      for (std::uint32_t c = 0; c < 6; ++c) rt.offload({chunk_kind::param, c});
    }
    return rt.stats();
  };
  const auto off = run(0), on = run(1);
  CHECK(off.prefetches == 0);
  CHECK(on.prefetches > 0);
  CHECK(on.prefetch_hits > 0);
  CHECK(on.bytes_moved() == off.bytes_moved());
  CHECK(on.demand_loads < off.demand_loads);
}

namespace {

/** A layered model whose forward scopes allocate their activations and whose backward scopes free
 *  them (so the budget follows the tide, within moments too), stepped where RT's placement says.
 *  Returns the stats of the iterations after `warmup` and the final parameters. */
template <class RT>
std::pair<runtime_stats, std::vector<float>> train_layers(double budget_fraction, std::size_t depth, int warmup,
                                                          int measured) {
  constexpr int layers = 8;
  constexpr std::size_t act = 4096, chunk_bytes = 2048 * sizeof(float);
  std::size_t acts_peak = 0;
  for (int l = 0; l < layers; ++l) acts_peak += act * static_cast<std::size_t>(1 + l % 3);
  const std::size_t model = 2 * layers * chunk_bytes;  // params and grads
  simulated_device_space dev(
      {.capacity = acts_peak + static_cast<std::size_t>(budget_fraction * static_cast<double>(model)),
       .link = {.bandwidth_bytes_per_s = 2e9, .latency_s = 5e-6}});
  host_space host;
  host_copy_engine copier(copy_model{.bandwidth_bytes_per_s = 2e9, .latency_s = 5e-6});
  RT rt(dev, host, copier, {.optimizer_state = false, .prefetch_depth = depth}, small_layout());
  std::vector<param_id> w;
  for (int l = 0; l < layers; ++l)
    w.push_back(
        rt.register_param({"l" + std::to_string(l), {2000}, dtype::f32, tensor_role::weight}, [l](std::span<float> v) {
          for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(l) + 1e-3f * static_cast<float>(i % 97);
        }));
  rt.finalize();
  runtime_stats before;
  for (int it = 0; it < warmup + measured; ++it) {
    if (it == warmup) before = rt.stats();
    std::vector<std::pair<void*, std::size_t>> acts;
    for (int l = 0; l < layers; ++l) {
      auto s = rt.forward("l" + std::to_string(l), {w[static_cast<std::size_t>(l)]});
      const std::size_t bytes = act * static_cast<std::size_t>(1 + l % 3);
      acts.emplace_back(rt.allocate_non_model(bytes), bytes);
      CHECK(s.template param<float>(w[static_cast<std::size_t>(l)])[5] != 0.0f);
    }
    for (int l = layers - 1; l >= 0; --l) {
      auto s = rt.backward("l" + std::to_string(l), {w[static_cast<std::size_t>(l)]});
      const auto p = s.template param<float>(w[static_cast<std::size_t>(l)]);
      auto g = s.template grad<float>(w[static_cast<std::size_t>(l)]);
      for (std::size_t i = 0; i < g.size(); i += 7) g[i] += 0.25f * p[i];
      rt.deallocate_non_model(acts.back().first, acts.back().second);
      acts.pop_back();
    }
    rt.step([](const step_chunk& c) {
      auto* p = static_cast<float*>(c.param);
      const auto* g = static_cast<const float*>(c.grad);
      for (std::size_t i = 0; i < 2000; ++i) p[i] -= 0.5f * g[i];
    });
  }
  CHECK(dev.peak() <= dev.capacity());
  runtime_stats d = rt.stats();
  d.bytes_to_device -= before.bytes_to_device;
  d.bytes_to_host -= before.bytes_to_host;
  d.evictions -= before.evictions;
  d.loads -= before.loads;
  d.prefetch_hits -= before.prefetch_hits;
  d.demand_loads -= before.demand_loads;
  std::vector<float> params;
  for (auto id : w) {
    std::vector<float> v(2000);
    rt.read_tensor(id, chunk_kind::param, v);
    params.insert(params.end(), v.begin(), v.end());
  }
  return {d, params};
}

}  // namespace

/** auto_placement's budgets with every step on the compute tier (so the steps' loads and gradient
 *  releases are part of what prefetch replays, as in bench_replay). */
struct device_step_placement {
  auto_placement tide{};
  [[nodiscard]] std::size_t chunk_budget(const placement_inputs& in) const noexcept { return tide.chunk_budget(in); }
  [[nodiscard]] tier optimizer_tier(const placement_inputs&, std::size_t) const noexcept { return tier::device; }
  [[nodiscard]] static constexpr std::string_view name() noexcept { return "device steps"; }
};

TEST_CASE_TEMPLATE("prefetch replays the demand path: the same bytes and victims, only earlier", P, auto_placement,
                   device_step_placement) {
  using belady_rt = chunk_runtime<fixed_chunk_layout, P, belady_eviction>;
  using lru_p_rt = chunk_runtime<fixed_chunk_layout, P, lru_eviction>;
  // Two warm-up iterations: the first records the trace, the second settles into the steady state
  // prefetch keeps; from then on every eviction and load is the demand path's own.
  for (double budget : {0.45, 0.3, 0.2}) {
    CAPTURE(budget);
    const auto [bel_off, bel_params] = train_layers<belady_rt>(budget, 0, 2, 4);
    const auto [lru_off, lru_params] = train_layers<lru_p_rt>(budget, 0, 2, 4);
    CHECK(bel_off.bytes_to_host > 0);
    CHECK(bel_off.bytes_to_device > 0);
    CHECK(bel_off.bytes_moved() <= lru_off.bytes_moved());
    CHECK(bel_params == lru_params);
    for (std::size_t depth : {std::size_t{1}, std::size_t{4}}) {
      CAPTURE(depth);
      const auto [bel_on, bel_on_params] = train_layers<belady_rt>(budget, depth, 2, 4);
      const auto [lru_on, lru_on_params] = train_layers<lru_p_rt>(budget, depth, 2, 4);
      CHECK(bel_on.bytes_to_device == bel_off.bytes_to_device);
      CHECK(bel_on.bytes_to_host == bel_off.bytes_to_host);
      CHECK(bel_on.evictions == bel_off.evictions);
      CHECK(lru_on.bytes_to_device == lru_off.bytes_to_device);
      CHECK(lru_on.bytes_to_host == lru_off.bytes_to_host);
      if (bel_off.demand_loads > 0) CHECK(bel_on.prefetch_hits > 0);
      if (bel_off.demand_loads > 0) CHECK(bel_on.demand_loads < bel_off.demand_loads);
      CHECK(bel_on_params == bel_params);  // and the same bits
      CHECK(lru_on_params == bel_params);
    }
  }
}

namespace {

struct turn_run {
  std::vector<float> lists;                 // param, master, momentum, variance of every layer
  std::vector<std::uint64_t> device_steps;  // per iteration
  std::vector<tier> state_at_forward_peak;  // chunk 0's momentum, once an iteration, at the last forward scope
  std::size_t peak = 0, capacity = 0;
};

/** Six bf16 layers of one chunk each (1 KiB weights, 1 KiB gradients, 6 KiB of Adam state: master,
 *  momentum, variance), trained with chunk_adam (prepare() when @p early); each forward scope
 *  allocates 4 KiB of activations, freed in its backward. The device holds the param and grad
 *  chunks, the activations' peak and 1 KiB: no margin, but at the step, with the activations
 *  gone, room for three chunks' state; a larger @p capacity where given. */
template <class Placement>
turn_run train_turn(Placement placement, bool early, std::size_t capacity = 0) {
  constexpr std::size_t KiB = 1024, act = 4 * KiB;
  constexpr int layers = 6, steps = 5;
  turn_run out;
  out.capacity = capacity ? capacity : layers * (2 * KiB + act) + KiB;
  simulated_device_space dev({.capacity = out.capacity});
  host_space host;
  host_copy_engine copier;
  chunk_runtime<fixed_chunk_layout, Placement> rt(dev, host, copier, {.param_type = dtype::bf16},
                                                  fixed_chunk_layout({.chunk_elems = 512, .align_elems = 32}),
                                                  placement);
  std::vector<param_id> w;
  for (int l = 0; l < layers; ++l)
    w.push_back(
        rt.register_param({"l" + std::to_string(l), {500}, dtype::bf16, tensor_role::weight}, [l](std::span<float> v) {
          for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::sin(0.05f * static_cast<float>(i + 7 * l));
        }));
  rt.finalize();
  chunk_adam<> opt(chunk_adam_options{.hyper = {.weight_decay = 0.01f}, .max_grad_norm = 1.0f});
  for (int it = 0; it < steps; ++it) {
    const auto before = rt.stats().device_steps;
    if (early) (void)opt.prepare(rt, 1e-2f);
    std::vector<void*> acts;
    for (int l = 0; l < layers; ++l) {
      auto s = rt.forward("f" + std::to_string(l), {w[static_cast<std::size_t>(l)]});
      acts.push_back(rt.allocate_non_model(act));
      if (l == layers - 1) out.state_at_forward_peak.push_back(rt.where({chunk_kind::momentum, 0}));
    }
    for (int l = layers - 1; l >= 0; --l) {
      auto s = rt.backward("b" + std::to_string(l), {w[static_cast<std::size_t>(l)]});
      auto g = s.template grad<bfloat16>(w[static_cast<std::size_t>(l)]);
      for (std::size_t i = 0; i < g.size(); ++i)
        g[i] = from_float<bfloat16>(0.3f * std::cos(0.11f * static_cast<float>(i) + static_cast<float>(l + 5 * it)));
      rt.deallocate_non_model(acts.back(), act);
      acts.pop_back();
    }
    (void)opt.step(rt, 1e-2f);
    out.device_steps.push_back(rt.stats().device_steps - before);
  }
  for (auto k : {chunk_kind::param, chunk_kind::master, chunk_kind::momentum, chunk_kind::variance})
    for (auto id : w) {
      std::vector<float> v(500);
      rt.read_tensor(id, k, v);
      out.lists.insert(out.lists.end(), v.begin(), v.end());
    }
  out.peak = dev.peak();
  return out;
}

}  // namespace

TEST_CASE(
    "auto placement's turn: the chunks the next forward reads first step on the device, their state "
    "comes up for the step and leaves for the activations, the same bits") {
  const turn_run reference = train_turn(static_placement::all_device(), false, std::size_t{1} << 20);
  CHECK(reference.device_steps.back() == 6);
  for (const bool early : {false, true}) {
    CAPTURE(early);
    const turn_run turn = train_turn(auto_placement{}, early);
    const turn_run host = train_turn(auto_placement{.turn_chunks = 0}, early);
    CHECK(turn.lists == reference.lists);  // bitwise: where a step runs never changes a number
    CHECK(host.lists == reference.lists);
    // Untraced first iteration: all on the host; from the second step on, the first two chunks
    // (the room at the step holds three chunks' state; turn_chunks = 2) step on the device.
    CHECK(turn.device_steps == std::vector<std::uint64_t>{0, 2, 2, 2, 2});
    CHECK(host.device_steps == std::vector<std::uint64_t>{0, 0, 0, 0, 0});
    // The state went back down when the next forward's activations needed the room: at the last
    // forward scope the params (6 KiB) and chunks 0 and 1's state (12 KiB) would not fit beside the
    // activations (24 KiB) in 37 KiB.
    for (const tier t : turn.state_at_forward_peak) CHECK(t != tier::device);
    CHECK(turn.peak <= turn.capacity);
  }
}

TEST_CASE("the tide within a moment: freeing activations raises the budget and starts the next loads") {
  constexpr std::size_t KiB = 1024;
  simulated_device_space dev({.capacity = 64 * KiB});
  host_space host;
  host_copy_engine copier;
  chunk_runtime<fixed_chunk_layout> rt(dev, host, copier, {.optimizer_state = false, .prefetch_depth = 1},
                                       small_layout());
  std::vector<param_id> w;
  for (int l = 0; l < 4; ++l)
    w.push_back(rt.register_param({"l" + std::to_string(l), {2000}, dtype::f32, tensor_role::weight}));
  rt.finalize();
  std::size_t rises = 0, started = 0;
  for (int it = 0; it < 3; ++it) {
    std::vector<void*> acts;
    for (int l = 0; l < 4; ++l) {
      auto s = rt.forward("l" + std::to_string(l), {w[static_cast<std::size_t>(l)]});
      acts.push_back(rt.allocate_non_model(12 * KiB));
    }
    for (int l = 3; l >= 0; --l) {
      auto s = rt.backward("l" + std::to_string(l), {w[static_cast<std::size_t>(l)]});
      const auto budget = rt.chunk_budget();
      const auto prefetches = rt.stats().prefetches;
      rt.deallocate_non_model(acts.back(), 12 * KiB);
      acts.pop_back();
      if (it == 2 && l > 0) {  // traced: the rest of this moment allocates nothing more
        CHECK(rt.chunk_budget() == budget + 12 * KiB);
        rises += 1;
        started += rt.stats().prefetches - prefetches;
      }
    }
    rt.step([](const step_chunk&) {});
  }
  CHECK(rises == 3);
  CHECK(started > 0);  // the next layer's chunks started loading inside this moment
  CHECK(rt.tracer().stats().memory_divergences == 0);
}

TEST_CASE("a chunk moves again before its last copy landed: copies are ordered, data intact") {
  simulated_device_space dev({.capacity = 2 * 8192, .link = {.bandwidth_bytes_per_s = 5e7}});
  host_space host;
  host_copy_engine copier(copy_model{.bandwidth_bytes_per_s = 5e7});  // 8 KiB takes ~160 us
  chunk_runtime<fixed_chunk_layout> rt(dev, host, copier, {.optimizer_state = false, .prefetch_depth = 0},
                                       small_layout());
  std::vector<param_id> w;
  for (int l = 0; l < 3; ++l)
    w.push_back(
        rt.register_param({"l" + std::to_string(l), {2000}, dtype::f32, tensor_role::weight}, [l](std::span<float> v) {
          for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(100 * l) + static_cast<float>(i);
        }));
  rt.finalize();
  for (int round = 0; round < 20; ++round) {
    for (int l = 0; l < 3; ++l) {
      const auto id = w[static_cast<std::size_t>(l)];
      {
        auto s = rt.forward("f", {id});
        const auto v = s.param<float>(id);
        CHECK(v[0] == static_cast<float>(100 * l));
        CHECK(v[1999] == static_cast<float>(100 * l + 1999));
        v[1] = static_cast<float>(100 * l + 1);  // rewrite what is there
      }
      // Down and straight back up while the first copy is still on the slow link: the load takes
      // over the buffer the eviction reads, ordered after it on the copy engine.
      rt.offload({chunk_kind::param, static_cast<std::uint32_t>(l)});
      auto s = rt.forward("f", {id});
      CHECK(s.param<float>(id)[1000] == static_cast<float>(100 * l + 1000));
    }
  }
  CHECK(rt.stats().buffer_reuses > 0);
  CHECK(dev.peak() <= dev.capacity());
}

TEST_CASE("an input batch allocated before the first scope counts towards the first moment, never as a divergence") {
  simulated_device_space dev({.capacity = 1 << 20});
  host_space host;
  host_copy_engine copier;
  chunk_runtime<fixed_chunk_layout> rt(dev, host, copier, {.optimizer_state = false},
                                       fixed_chunk_layout({.chunk_elems = 256}));
  const auto a = rt.register_param({"a", {128}, dtype::f32, tensor_role::weight});
  const auto b = rt.register_param({"b", {128}, dtype::f32, tensor_role::weight});
  rt.finalize();
  for (int it = 0; it < 6; ++it) {
    auto batch = rt.allocate_buffer<float>(1024);  // between iterations: before the first scope
    {
      auto act = rt.allocate_buffer<float>(256);
      (void)rt.forward("a", {a});
      (void)rt.forward("b", {b});
    }
    (void)rt.backward("b", {b});
    (void)rt.backward("a", {a});
    batch.reset();
    rt.zero_grad();
    rt.end_iteration();
  }
  CHECK(rt.tracer().stats().divergences == 0);
  CHECK(rt.tracer().stats().memory_divergences == 0);
  CHECK(rt.tracer().non_model_peak(0) >= 1024 * sizeof(float));  // the batch is part of moment 0
}

TEST_CASE("the simplest construction, and a communicator held by reference") {
  simulated_device_space device({.capacity = 1 << 20});
  host_space host;
  host_copy_engine copier;
  patrickstar_runtime rt(device, host, copier);  // default layout fitted to the tensors
  const auto p = rt.register_param({"w", {100, 30}, dtype::f32, tensor_role::weight});
  rt.finalize();
  CHECK(rt.plan().chunk_elems >= 3008);
  CHECK(rt.plan().chunk_elems <= 4 * 3008);
  single_process_communicator comm;
  chunk_runtime<fixed_chunk_layout> by_ref(device, host, copier, comm, {}, fixed_chunk_layout({.chunk_elems = 64}));
  CHECK(&by_ref.communicator() == &comm);
  (void)p;
}

TEST_CASE("a remote chunk is never read as zeros: reading or writing it is a state_error naming its owner") {
  simulated_device_space dev({.capacity = 1 << 20});
  host_space host;
  host_copy_engine copier;
  runtime_stats stats;
  chunk_store<simulated_platform> store(dev, host, copier, 64, stats);
  const chunk_list_desc lists[] = {{chunk_kind::param, dtype::f32, 256, 2}, {chunk_kind::grad, dtype::f32, 256, 2}};
  store.build(lists, 2);
  store.allocate_initial();
  store.release({chunk_kind::param, 1});
  store.at({chunk_kind::param, 1}).where = tier::remote;  // as ZeRO leaves a chunk another rank owns
  std::vector<float> v(8);
  CHECK_THROWS_WITH_AS(chunk_values(store).read({chunk_kind::param, 1}, 0, v), doctest::Contains("held by rank 1"),
                       state_error);
  CHECK_THROWS_AS(chunk_values(store).write({chunk_kind::param, 1}, 0, v), state_error);
  chunk_values(store).read({chunk_kind::grad, 1}, 0, v);  // FREE: zeros
  CHECK(v == std::vector<float>(8, 0.0f));
  store.at({chunk_kind::param, 1}).where = tier::free;
}

}  // namespace chunk_runtime_test
