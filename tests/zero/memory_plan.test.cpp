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

TEST_CASE("plan_memory: the model data per rank and ZeRO's buffer peak equal what the runtime measures, first iteration included, at N = 1-4 in every mode") {
  const auto specs = mlp_specs();
  const fixed_chunk_layout layout({.chunk_elems = testing::mlp_chunk_elems, .align_elems = 32});
  for (int ranks = 1; ranks <= 4; ++ranks)
    for (const sharding_options s : {sharding_options{.enabled = true}, sharding_options{.enabled = true, .keep_gathered = true},
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
        CHECK(p.device_for_resident() == p.model_bytes_per_rank + p.collective_bytes);
      }
    }
}

}  // namespace memory_plan_test
