// SPDX-License-Identifier: Apache-2.0
// plan_memory (runtime/memory_plan.hpp) against what the runtime measures: the model data per
// rank and ZeRO's collective buffers at their peak, for the tests' MLP on 1-4 in-process ranks in
// the group mode (with and without keep_gathered) and the memory-saving mode; and scope_trace.
#include <chunkstar/runtime/memory_plan.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <vector>

#include "support/mlp_replica.hpp"
#include "support/runtimes.hpp"

namespace memory_plan_test {

using namespace chunkstar;
using chunkstar::testing::mlp_adam;
using chunkstar::testing::mlp_replica;

namespace {

/** The MLP's tensors and scopes as registered: per layer w then b, one scope per layer. */
std::vector<tensor_spec> mlp_specs() {
  std::vector<tensor_spec> s;
  for (int l = 0; l < testing::mlp_layers; ++l) {
    s.push_back({"w" + std::to_string(l), {testing::mlp_width, testing::mlp_width}, dtype::f32, tensor_role::weight});
    s.push_back({"b" + std::to_string(l), {testing::mlp_width}, dtype::f32, tensor_role::bias});
  }
  return s;
}
forward_scopes mlp_scopes() {
  forward_scopes s;
  for (std::size_t l = 0; l < static_cast<std::size_t>(testing::mlp_layers); ++l) s.push_back({2 * l, 2 * l + 1});
  return s;
}

struct measured {
  std::size_t model_bytes = 0, peak_collective = 0, first_iteration_peak = 0;
};

std::vector<measured> train(int ranks, sharding_options sharding) {
  std::vector<measured> out(static_cast<std::size_t>(ranks));
  run_ranks(ranks, [&](in_process_communicator& comm) {
    mlp_replica<in_process_communicator> r({.sharding = sharding}, 1 << 20, comm);
    auto opt = mlp_adam();
    std::size_t first = 0;
    for (int step = 1; step <= 3; ++step) {
      r.forward_backward(step, comm.rank(), [] {});
      REQUIRE(opt.step(r.rt, 2e-2f, ranks).stepped);
      if (step == 1) {
        first = r.rt.stats().peak_collective_bytes;
        r.rt.reset_stats();
      }
    }
    out[static_cast<std::size_t>(comm.rank())] = {r.rt.model_bytes(), r.rt.stats().peak_collective_bytes, first};
  });
  return out;
}

}  // namespace

TEST_CASE("scope_trace: forward scopes in order, backward in reverse with gradients, then the step") {
  const auto plan = fixed_chunk_layout({.chunk_elems = testing::mlp_chunk_elems, .align_elems = 32}).plan(mlp_specs());
  const auto t = scope_trace(plan, mlp_scopes());
  const std::size_t L = static_cast<std::size_t>(testing::mlp_layers);
  REQUIRE(t.size() == 2 * L + 1);
  for (std::size_t l = 0; l < L; ++l) {
    CHECK(t.kinds[l] == moment_kind::forward);
    CHECK(t.grads[l].empty());
    CHECK(t.kinds[2 * L - 1 - l] == moment_kind::backward);
    CHECK(t.params[2 * L - 1 - l] == t.params[l]);
    CHECK(t.grads[2 * L - 1 - l] == t.params[l]);
  }
  CHECK(t.kinds.back() == moment_kind::optimizer);
  CHECK_THROWS_AS((void)scope_trace(plan, {{0, 99}}), config_error);
}

TEST_CASE(
    "plan_memory: the model data per rank and ZeRO's buffer peak equal what the runtime measures, first iteration "
    "included, at N = 1-4 in every mode") {
  const auto specs = mlp_specs();
  const fixed_chunk_layout layout({.chunk_elems = testing::mlp_chunk_elems, .align_elems = 32});
  for (int ranks = 1; ranks <= 4; ++ranks)
    for (const sharding_options s :
         {sharding_options{.enabled = true}, sharding_options{.enabled = true, .keep_gathered = true},
          sharding_options{.enabled = true, .memory_saving = true},
          sharding_options{.enabled = true, .keep_gathered = true, .memory_saving = true}}) {
      CAPTURE(ranks);
      CAPTURE(s.keep_gathered);
      CAPTURE(s.memory_saving);
      const memory_plan p = plan_memory(specs, layout, {.sharding = s}, ranks, mlp_scopes());
      for (const auto& m : train(ranks, s)) {
        CHECK(p.model_bytes == m.model_bytes);
        CHECK(p.model_bytes_per_rank * static_cast<std::size_t>(ranks) == m.model_bytes);
        // The most the run holds at once, the first iteration (no trace yet) included: exactly,
        // but with memory_saving and keep_gathered together, where it is an upper bound.
        const std::size_t peak = std::max(m.peak_collective, m.first_iteration_peak);
        if (s.memory_saving && s.keep_gathered && ranks > 1) {
          CHECK(p.collective_bytes >= peak);
          CHECK(static_cast<double>(p.collective_bytes) <= 1.5 * static_cast<double>(peak));
        } else {
          CHECK(p.collective_bytes == peak);
        }
        CHECK(p.device_for_resident() <= p.model_bytes_per_rank + p.collective_bytes);  // the peaks need not coincide
      }
    }
}

TEST_CASE("plan_memory: one process trains on a device of device_floor() (chunks moving), and on none smaller") {
  const auto specs = mlp_specs();
  const fixed_chunk_layout layout({.chunk_elems = testing::mlp_chunk_elems, .align_elems = 32});
  single_process_communicator one;
  std::size_t non_model = 0;
  auto run = [&](std::size_t capacity) {
    mlp_replica<single_process_communicator> r({}, capacity, one);
    auto opt = mlp_adam();
    for (int step = 1; step <= 3; ++step) {
      r.forward_backward(step, 0, [] {});
      REQUIRE(opt.step(r.rt, 2e-2f, 1).stepped);
    }
    non_model = r.rt.stats().peak_non_model_bytes;
    return r.rt.stats().bytes_moved();
  };
  (void)run(1 << 20);  // measures the non-model peak
  const memory_plan p = plan_memory(specs, layout, {}, 1, mlp_scopes(), non_model);
  // The parameter and gradient chunks of the largest scope: here one layer's w and b, in one chunk.
  CHECK(p.largest_scope_bytes == 2 * p.param_chunk_bytes);
  CHECK(p.device_floor() == non_model + p.largest_scope_bytes);
  CHECK(p.device_floor() < p.device_for_resident());
  CHECK(run(p.device_floor()) > 0);
  CHECK_THROWS_AS(run(p.device_floor() - 64), out_of_memory_error);
  // The runtime itself admits the plan on that device, and refuses it, named, on a smaller one.
  mlp_replica<single_process_communicator> fits({}, p.device_floor(), one), short_of({}, p.device_floor() - 64, one);
  CHECK(fits.rt.admit(p).fits());
  CHECK_NOTHROW(fits.rt.require_admitted(p));
  CHECK(short_of.rt.admit(p).device_short == 64);
  CHECK_THROWS_WITH_AS(short_of.rt.require_admitted(p), doctest::Contains("the device is 64 B short"), config_error);
}

TEST_CASE("admit: a plan fits its budgets, or each tier's shortfall is named in bytes") {
  memory_plan p;
  p.model_bytes_per_rank = 1000, p.collective_bytes = 100, p.non_model_bytes = 50, p.largest_scope_bytes = 200;
  p.transient_peak_bytes = 150;                         // the two peaks at once
  p.resident_peak_bytes = 1150;                         // and everything the rank holds at its peak moment
  CHECK(admit(p, {.device = 350}).fits());              // the floor on the device, the rest on an unbounded host
  CHECK(admit(p, {.device = 1150, .host = 0}).fits());  // resident
  const admission small = admit(p, {.device = 349});
  CHECK(small.device_short == 1);
  CHECK(small.total_short == 0);
  CHECK(small.message.find("the device is 1 B short") != std::string::npos);
  const admission tight = admit(p, {.device = 350, .host = 300, .disk = 400});
  CHECK(tight.device_short == 0);
  CHECK(tight.total_short == 100);
  CHECK(tight.message.find("100 B short of the 1.12 KiB") != std::string::npos);
  CHECK(admit(p, {.device = 350, .host = 300, .disk = 500}).fits());  // a disk tier makes up the rest
  // With a disk tier the host holds at least eight fp32 chunks (a host-side step, the disk's traffic).
  p.chunks.chunk_elems = 16;  // 64 B chunks: 512 B
  CHECK(admit(p, {.device = 350, .host = 512, .disk = 1000}).fits());
  const admission thin = admit(p, {.device = 350, .host = 500, .disk = 1000});
  CHECK(thin.host_short == 12);
  CHECK(thin.message.find("with a disk tier the host is 12 B short of the 512 B") != std::string::npos);
  CHECK(admit(p, {.device = 350, .host = 500}).host_short == 0);  // no disk: no such floor
}

TEST_CASE("choose_sharding: the group mode when it fits, the memory-saving mode when only it does, saying why") {
  const auto specs = mlp_specs();
  const fixed_chunk_layout layout({.chunk_elems = testing::mlp_chunk_elems, .align_elems = 32});
  const runtime_options zero{.sharding = {.enabled = true}};
  const std::size_t act = testing::mlp_act_bytes;
  const std::span<const std::size_t> nm(&act, 1);
  for (int ranks = 2; ranks <= 4; ++ranks) {
    CAPTURE(ranks);
    const memory_plan group = plan_memory(specs, layout, zero, ranks, mlp_scopes(), act);
    runtime_options ms = zero;
    ms.sharding.memory_saving = true;
    const memory_plan saving = plan_memory(specs, layout, ms, ranks, mlp_scopes(), act);
    REQUIRE(saving.device_floor() < group.device_floor());
    // Room for the group mode: it stays.
    const auto roomy = choose_sharding(specs, layout, zero, ranks, mlp_scopes(), nm, {.device = group.device_floor()});
    CHECK_FALSE(roomy.switched);
    CHECK_FALSE(roomy.options.sharding.memory_saving);
    // Room for the memory-saving mode only: chosen, and said why.
    const auto tight = choose_sharding(specs, layout, zero, ranks, mlp_scopes(), nm, {.device = saving.device_floor()});
    CHECK(tight.switched);
    CHECK(tight.options.sharding.memory_saving);
    CHECK(tight.plan.collective_bytes == saving.collective_bytes);
    CHECK(tight.why.find("the group mode needs at least") != std::string::npos);
    // Room for neither: the options as given, which admit refuses.
    const auto none =
        choose_sharding(specs, layout, zero, ranks, mlp_scopes(), nm, {.device = saving.device_floor() - 1});
    CHECK_FALSE(none.switched);
    CHECK_FALSE(admit(none.plan, {.device = saving.device_floor() - 1}).fits());
    // And the memory-saving mode the plan chose trains on that device.
    run_ranks(ranks, [&](in_process_communicator& comm) {
      mlp_replica<in_process_communicator> r(tight.options, saving.device_floor(), comm);
      auto opt = mlp_adam();
      for (int step = 1; step <= 2; ++step) {
        r.forward_backward(step, comm.rank(), [] {});
        REQUIRE(opt.step(r.rt, 2e-2f, ranks).stepped);
      }
    });
  }
}

TEST_CASE(
    "largest_admitted: the largest model whose plan fits, where fitting is not monotone in the size (chunk packing)") {
  // A family of MLP-like models by width w: per layer a w x w weight and a w bias, one scope each.
  const auto plan_for = [](std::int64_t w) {
    std::vector<tensor_spec> specs;
    forward_scopes scopes;
    for (std::size_t l = 0; l < 4; ++l) {
      specs.push_back({"w" + std::to_string(l), {w, w}, dtype::f32, tensor_role::weight});
      specs.push_back({"b" + std::to_string(l), {w}, dtype::f32, tensor_role::bias});
      scopes.push_back({2 * l, 2 * l + 1});
    }
    const auto largest = static_cast<std::size_t>(w * w + w);
    return plan_memory(specs, fixed_chunk_layout({.chunk_elems = (largest + 31) / 32 * 32, .align_elems = 32}), {}, 1,
                       scopes, std::size_t{4096});
  };
  for (const tier_budgets b :
       {tier_budgets{.device = 64 << 10, .host = 256 << 10}, tier_budgets{.device = 20 << 10, .host = 1 << 20},
        tier_budgets{.device = 8 << 10, .host = 8 << 10}}) {
    std::int64_t brute = 0;
    for (std::int64_t w = 1; w <= 400; ++w)
      if (admit(plan_for(w), b).fits()) brute = w;
    CHECK(largest_admitted(1, 400, plan_for, b) == brute);
    if (brute > 0) CHECK_FALSE(admit(plan_for(brute + 1), b).fits());
    std::int64_t first_miss = 1;
    while (admit(plan_for(first_miss), b).fits()) ++first_miss;
    CHECK(first_miss < brute);  // a smaller model that does not fit: bisection would stop there
  }
  CHECK(largest_admitted(1, 400, plan_for, {.device = 100, .host = 100}) == 0);  // not even the smallest
}

}  // namespace memory_plan_test
