// SPDX-License-Identifier: Apache-2.0
// ZeRO gathering more than one scope ahead (sharding_options::gather_depth) on a layered model, one
// chunk per layer, as a transformer's blocks are: a group of N layers is gathered while the layers
// before it compute, up to `depth` scopes early, and held until its scope has used it. Checked: the
// same bits as gathering on demand (every weight a backward reads is the gathered one: its
// gradient depends on it), with the step inside backward too; every rank starts the same gathers;
// the budget is kept, tight budgets included (what a budget with no room between scopes does is
// plan_gathers' business: tests/zero/zero.test.cpp).
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/placement/placement_policy.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <string_view>
#include <vector>

using namespace chunkstar;

namespace gather_depth_test {
namespace {

/** The device's whole budget for chunks (gathered groups included), every step on the host (where
 *  the step inside backward runs). */
struct host_steps {
  [[nodiscard]] std::size_t chunk_budget(const placement_inputs& in) const noexcept {
    return room_after(in.device_capacity, in.non_model_now);
  }
  [[nodiscard]] tier optimizer_tier(const placement_inputs&, std::size_t) const noexcept { return tier::host; }
  [[nodiscard]] static constexpr std::string_view name() noexcept { return "host_steps"; }
};
static_assert(PlacementPolicy<host_steps>);

using layered_runtime =
    chunk_runtime<fixed_chunk_layout, host_steps, belady_eviction, warmup_tracer, in_process_communicator>;

constexpr int layers = 8, steps = 5;
constexpr std::size_t elems = 256, chunk_bytes = elems * sizeof(float);

struct run_options {
  int ranks = 2;
  bool gather_ahead = true;
  int depth = 1;
  bool prepare = false;         // the step inside backward
  bool head = false;            // a head scope between forward and backward reads layer 0 (a tied weight)
  std::size_t capacity_chunks = 64;  // the device, in chunks: room for every gathered group
};

struct outcome {
  std::map<std::string, std::vector<float>> params;  // every owned layer's weights, all ranks
  std::vector<double> losses;                        // rank 0's per step
  std::vector<runtime_stats> stats;                  // per rank
};

outcome train(const run_options& o) {
  outcome out;
  std::vector<outcome> per_rank(static_cast<std::size_t>(o.ranks));
  run_ranks(o.ranks, [&](in_process_communicator& comm) {
    auto& me = per_rank[static_cast<std::size_t>(comm.rank())];
    simulated_device_space device({.capacity = o.capacity_chunks * chunk_bytes});
    host_space host;
    host_copy_engine copier;
    layered_runtime rt(device, host, copier, comm,
                       {.sharding = {.enabled = true, .gather_ahead = o.gather_ahead, .gather_depth = o.depth}},
                       fixed_chunk_layout({.chunk_elems = elems}), host_steps{});
    std::vector<param_id> ids;
    for (int l = 0; l < layers; ++l)
      ids.push_back(rt.register_param({"layer" + std::to_string(l), {static_cast<std::int64_t>(elems)}, dtype::f32,
                                       tensor_role::weight},
                                      [l](std::span<float> v) {
                                        for (std::size_t i = 0; i < v.size(); ++i)
                                          v[i] = 0.01f * static_cast<float>((static_cast<std::size_t>(l) * 7 + i) % 13);
                                      }));
    rt.finalize();
    chunk_adam<> opt({.hyper = {.lr = 1e-2f}, .max_grad_norm = 0.0f});
    for (int step = 1; step <= steps; ++step) {
      if (o.prepare) (void)opt.prepare(rt, 1e-2f, o.ranks);
      double loss = 0;
      for (int l = 0; l < layers; ++l) {
        auto s = rt.forward("layer" + std::to_string(l), {ids[static_cast<std::size_t>(l)]});
        for (const float w : s.template param<float>(ids[static_cast<std::size_t>(l)])) loss += w * w;
      }
      if (o.head) {  // the last layer's group is used again two scopes on (a transformer's turn)
        {
          auto s = rt.forward("head", {ids[0]});
          for (const float w : s.template param<float>(ids[0])) loss += 0.5 * w;
        }
        auto s = rt.backward("head", {ids[0]});
        const auto w = s.template param<float>(ids[0]);
        const auto g = s.template grad<float>(ids[0]);
        for (std::size_t i = 0; i < g.size(); ++i) g[i] = 0.5f * w[i] + 1e-3f * static_cast<float>(comm.rank());
      }
      for (int l = layers; l-- > 0;) {
        auto s = rt.backward("layer" + std::to_string(l), {ids[static_cast<std::size_t>(l)]});
        const auto w = s.template param<float>(ids[static_cast<std::size_t>(l)]);
        const auto g = s.template grad<float>(ids[static_cast<std::size_t>(l)]);
        // Depends on the gathered weights and on the rank: a stale or misplaced gather changes it.
        for (std::size_t i = 0; i < g.size(); ++i)
          g[i] = w[i] * (1.0f + 0.25f * static_cast<float>(comm.rank())) + 1e-3f * static_cast<float>(step);
      }
      REQUIRE(opt.step(rt, 1e-2f, o.ranks).stepped);
      me.losses.push_back(loss);
      for (const auto& v : rt.invariant_violations(true)) FAIL_CHECK(v);
    }
    for (int l = 0; l < layers; ++l) {
      if (!shard_map{comm.size(), comm.rank()}.owns(static_cast<std::size_t>(l))) continue;
      std::vector<float> v(elems);
      rt.read_tensor(ids[static_cast<std::size_t>(l)], chunk_kind::param, v);
      me.params["layer" + std::to_string(l)] = v;
    }
    me.stats.push_back(rt.stats());
    CHECK(rt.stats().peak_device_bytes <= device.capacity());
  });
  for (auto& r : per_rank) {
    out.params.insert(r.params.begin(), r.params.end());
    out.stats.push_back(r.stats.front());
  }
  out.losses = per_rank.front().losses;
  return out;
}

void same_bits(const outcome& a, const outcome& b) {
  CHECK(a.losses == b.losses);
  REQUIRE(a.params.size() == static_cast<std::size_t>(layers));
  REQUIRE(b.params.size() == a.params.size());
  for (const auto& [name, v] : a.params) {
    CAPTURE(name);
    CHECK(std::memcmp(v.data(), b.params.at(name).data(), v.size() * sizeof(float)) == 0);
  }
}

}  // namespace

TEST_CASE(
    "ZeRO gather_depth: a group gathered up to depth scopes early and held for its scope, the bits of gathering on "
    "demand, the same gathers on every rank") {
  for (const int ranks : {2, 3}) {
    for (const bool prepare : {false, true}) {
      CAPTURE(ranks);
      CAPTURE(prepare);
      const outcome on_demand = train({.ranks = ranks, .gather_ahead = false, .prepare = prepare});
      const outcome one = train({.ranks = ranks, .depth = 1, .prepare = prepare});
      same_bits(one, on_demand);
      for (const int depth : {2, 3}) {
        CAPTURE(depth);
        const outcome deep = train({.ranks = ranks, .depth = depth, .prepare = prepare});
        same_bits(deep, on_demand);
        for (std::size_t r = 0; r < deep.stats.size(); ++r) {
          CAPTURE(r);
          CHECK(deep.stats[r].gathers == one.stats[r].gathers);  // each group as often
          CHECK(deep.stats[r].gathers_ahead == deep.stats.front().gathers_ahead);
          CHECK(deep.stats[r].gathers_further == deep.stats.front().gathers_further);
          CHECK(deep.stats[r].gathers_further > 0);  // started more than a scope early
          CHECK(deep.stats[r].gathers_ahead >= one.stats[r].gathers_ahead);
          if (prepare) CHECK(deep.stats[r].early_steps > 0);
        }
        CHECK(one.stats.front().gathers_further == 0);
      }
    }
  }
}

TEST_CASE(
    "ZeRO gather_depth: a group used again within the look-ahead is kept instead of gathered again, the bits of "
    "gathering on demand, the same on every rank") {
  // Forward 0..7, a head reading layer 0, backward 7..0: the last layer's group is released after
  // forward and read again two scopes on, which depth 2 reaches (gather_plan.hpp).
  for (const int ranks : {2, 3}) {
    for (const bool prepare : {false, true}) {
      CAPTURE(ranks);
      CAPTURE(prepare);
      const outcome on_demand = train({.ranks = ranks, .gather_ahead = false, .prepare = prepare, .head = true});
      const outcome one = train({.ranks = ranks, .depth = 1, .prepare = prepare, .head = true});
      same_bits(one, on_demand);
      CHECK(one.stats.front().gathers_kept == 0);
      for (const int depth : {2, 3}) {
        CAPTURE(depth);
        const outcome deep = train({.ranks = ranks, .depth = depth, .prepare = prepare, .head = true});
        same_bits(deep, on_demand);
        for (std::size_t r = 0; r < deep.stats.size(); ++r) {
          CAPTURE(r);
          // Once a step, from the first traced iteration on (the first has no plan).
          CHECK(deep.stats[r].gathers_kept == static_cast<std::uint64_t>(steps - 1));
          CHECK(deep.stats[r].gathers + deep.stats[r].gathers_kept == one.stats[r].gathers);
        }
      }
    }
  }
}

TEST_CASE("ZeRO gather_depth under tight budgets: the bits of gathering on demand, within the budget") {
  // 9 chunks: the least this model trains in at 2 ranks (a group in use, its gradients, the group
  // reduced meanwhile, owned chunks). Gathers ahead then evict owned chunks that a later scope
  // loads again (the budget's rule counts what the moment uses, not what stays cached).
  const int ranks = 2;
  const outcome on_demand = train({.ranks = ranks, .gather_ahead = false, .capacity_chunks = 9});
  for (const std::size_t capacity : {9, 10, 12}) {
    CAPTURE(capacity);
    for (const int depth : {1, 3}) {
      CAPTURE(depth);
      const outcome got = train({.ranks = ranks, .depth = depth, .capacity_chunks = capacity});
      same_bits(got, on_demand);
      for (const auto& st : got.stats) CHECK(st.gathers_ahead == got.stats.front().gathers_ahead);
    }
  }
}

TEST_CASE("ZeRO gather_depth below 1 is refused, naming the option") {
  run_ranks(2, [&](in_process_communicator& comm) {
    simulated_device_space device({.capacity = 1 << 20});
    host_space host;
    host_copy_engine copier;
    try {
      layered_runtime rt(device, host, copier, comm, {.sharding = {.enabled = true, .gather_depth = 0}},
                         fixed_chunk_layout({.chunk_elems = elems}), host_steps{});
      FAIL_CHECK("accepted");
    } catch (const config_error& e) {
      CHECK(std::string(e.what()).find("sharding.gather_depth must be >= 1") != std::string::npos);
    }
  });
}

}  // namespace gather_depth_test
