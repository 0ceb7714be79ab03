// SPDX-License-Identifier: Apache-2.0
// ZeRO gathering the next iteration's first groups during the step (gather_plan::step): once a
// rank has stepped its chunk of such a group, the group's allgather starts and travels while the
// step goes on; the next iteration's first scope finds it gathered. Checked on a layered model,
// one chunk per layer: the bits of gathering on demand, with the step on the host or the device,
// inside backward or after it; the gather starting between the rank's first and second chunk
// updates; and what happens between the step and the next forward on one rank only — parameters
// written, the runtime put to sleep — or on all (an evaluation): every rank gathers again where
// one rank's copy could be stale, the written values reach every rank, and nothing hangs. Inside
// an iteration a write to a parameter gathered for its scopes is refused, on the owner and off it.
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/placement/placement_policy.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>

#include <doctest/doctest.h>

#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

using namespace chunkstar;

namespace step_gathers_test {
namespace {

/** The device's whole budget for chunks, every step on tier @p Where. */
template <tier Where>
struct steps_on {
  [[nodiscard]] std::size_t chunk_budget(const placement_inputs& in) const noexcept {
    return room_after(in.device_capacity, in.non_model_now);
  }
  [[nodiscard]] tier optimizer_tier(const placement_inputs&, std::size_t) const noexcept { return Where; }
  [[nodiscard]] static constexpr std::string_view name() noexcept { return "steps_on"; }
};
static_assert(PlacementPolicy<steps_on<tier::host>>);

template <tier Where>
using layered_runtime =
    chunk_runtime<fixed_chunk_layout, steps_on<Where>, belady_eviction, warmup_tracer, in_process_communicator>;

constexpr int layers = 8, steps = 5;
constexpr std::size_t elems = 256;

/** What a rank does between a step and the next forward. */
enum class between { nothing, write, sleep, evaluate };

struct run_options {
  int ranks = 2;
  bool gather_ahead = true;
  bool at_step = true;  // sharding_options::gather_at_step
  tier step_tier = tier::host;
  bool adam = true;      // chunk_adam; false: a plain update through step() that logs its chunks
  bool prepare = false;  // chunk_adam's step inside backward
  between what = between::nothing;
  int who = 0;  // the rank that writes or sleeps
  bool write_in_forward = false;  // every rank tries to write layer 3 inside its forward scope
};

struct outcome {
  std::map<std::string, std::vector<float>> params;  // every owned layer's weights, all ranks
  std::vector<std::vector<float>> first_layer;       // per rank: layer 0's weights each forward saw
  std::vector<std::vector<double>> evaluations;      // per rank: each evaluation's loss
  std::vector<runtime_stats> stats;                  // per rank
  std::vector<std::vector<std::string>> refused;     // per rank: the errors of the writes refused
  /// Per rank and step (the plain update): each chunk updated, and the collectives issued before it.
  std::vector<std::vector<std::vector<std::pair<std::size_t, std::uint64_t>>>> updates;
};

template <tier Where>
outcome train(const run_options& o) {
  outcome out;
  const auto n = static_cast<std::size_t>(o.ranks);
  out.first_layer.resize(n);
  out.evaluations.resize(n);
  out.stats.resize(n);
  out.updates.resize(n);
  out.refused.resize(n);
  std::vector<std::map<std::string, std::vector<float>>> owned(n);
  run_ranks(o.ranks, [&](in_process_communicator& comm) {
    const auto me = static_cast<std::size_t>(comm.rank());
    simulated_device_space device({.capacity = 64 * elems * sizeof(float)});
    host_space host;
    host_copy_engine copier;
    layered_runtime<Where> rt(
        device, host, copier, comm,
        {.sharding = {.enabled = true, .gather_ahead = o.gather_ahead, .gather_at_step = o.at_step}},
        fixed_chunk_layout({.chunk_elems = elems}), steps_on<Where>{});
    std::vector<param_id> ids;
    for (int l = 0; l < layers; ++l)
      ids.push_back(rt.register_param(
          {"layer" + std::to_string(l), {static_cast<std::int64_t>(elems)}, dtype::f32, tensor_role::weight},
          [l](std::span<float> v) {
            for (std::size_t i = 0; i < v.size(); ++i)
              v[i] = 0.01f * static_cast<float>((static_cast<std::size_t>(l) * 7 + i) % 13);
          }));
    rt.finalize();
    const auto name = [](int l) { return "layer" + std::to_string(l); };
    const auto pid = [&](int l) { return ids[static_cast<std::size_t>(l)]; };
    for (int l = 0; l < layers; ++l) {  // nothing gathered yet: another rank's layer is read on its owner
      CHECK(rt.owner(pid(l)) == l % o.ranks);  // one chunk per layer
      std::vector<float> v(elems);
      if (rt.owner(pid(l)) != comm.rank())
        CHECK_THROWS_WITH_AS(rt.read_tensor(pid(l), chunk_kind::param, v),
                             doctest::Contains(("read or write it on rank " + std::to_string(l % o.ranks)).c_str()),
                             state_error);
    }
    chunk_adam<> opt({.hyper = {.lr = 1e-2f}, .max_grad_norm = 0.0f});
    for (int step = 1; step <= steps; ++step) {
      if (o.adam && o.prepare) (void)opt.prepare(rt, 1e-2f, o.ranks);
      for (int l = 0; l < layers; ++l) {
        auto s = rt.forward(name(l), {pid(l)});
        const auto w = s.template param<float>(pid(l));
        if (l == 0) out.first_layer[me].insert(out.first_layer[me].end(), w.begin(), w.end());
        if (o.write_in_forward && l == 3) {
          const std::vector<float> v(elems, 9.0f);
          try {
            rt.write_tensor(pid(l), chunk_kind::param, v);
          } catch (const state_error& e) {
            out.refused[me].emplace_back(e.what());
          }
        }
      }
      for (int l = layers; l-- > 0;) {
        auto s = rt.backward(name(l), {pid(l)});
        const auto w = s.template param<float>(pid(l));
        const auto g = s.template grad<float>(pid(l));
        // Depends on the gathered weights and on the rank: a stale or misplaced gather changes it.
        for (std::size_t i = 0; i < g.size(); ++i)
          g[i] = w[i] * (1.0f + 0.25f * static_cast<float>(comm.rank())) + 1e-3f * static_cast<float>(step);
      }
      if (o.adam) {
        REQUIRE(opt.step(rt, 1e-2f, o.ranks).stepped);
      } else {
        auto& log = out.updates[me].emplace_back();
        rt.step([&](const step_chunk& c) {
          log.emplace_back(c.index, comm.stats().collectives);
          auto* p = static_cast<float*>(c.param);
          const auto* g = static_cast<const float*>(c.grad);
          for (std::size_t i = 0; i < c.elems; ++i) p[i] -= 0.05f * g[i];
        });
      }
      for (const auto& v : rt.invariant_violations(true)) FAIL_CHECK(v);
      if (step == steps) break;
      if (o.what == between::write && comm.rank() == o.who) {  // layer 0 is rank 0's
        std::vector<float> v(elems, 0.5f + 0.01f * static_cast<float>(step));
        rt.write_tensor(pid(0), chunk_kind::param, v);
      } else if (o.what == between::sleep && comm.rank() == o.who) {
        rt.sleep();
        rt.wake();
      } else if (o.what == between::evaluate) {
        auto eval = rt.untraced();
        double loss = 0;
        for (int l = 0; l < layers; ++l) {
          auto s = rt.forward(name(l), {pid(l)});
          for (const float w : s.template param<float>(pid(l))) loss += w;
        }
        out.evaluations[me].push_back(loss);
      }
    }
    for (int l = 0; l < layers; ++l) {
      if (!rt.shards().owns(static_cast<std::size_t>(l))) continue;
      std::vector<float> v(elems);
      rt.read_tensor(pid(l), chunk_kind::param, v);
      owned[me][name(l)] = v;
    }
    out.stats[me] = rt.stats();
  });
  for (auto& r : owned) out.params.insert(r.begin(), r.end());
  return out;
}

outcome train(const run_options& o) {
  return o.step_tier == tier::device ? train<tier::device>(o) : train<tier::host>(o);
}

void same_bits(const outcome& a, const outcome& b) {
  REQUIRE(a.params.size() == static_cast<std::size_t>(layers));
  REQUIRE(b.params.size() == a.params.size());
  for (const auto& [name, v] : a.params) {
    CAPTURE(name);
    CHECK(std::memcmp(v.data(), b.params.at(name).data(), v.size() * sizeof(float)) == 0);
  }
  CHECK(a.first_layer == b.first_layer);
  CHECK(a.evaluations == b.evaluations);
}

}  // namespace

TEST_CASE(
    "ZeRO, the next iteration's first group gathered during the step: the bits of gathering on demand, on every "
    "rank the same gathers, the first scope waiting for none it started itself") {
  for (const int ranks : {2, 3}) {
    for (const tier where : {tier::host, tier::device}) {
      for (const bool prepare : {false, true}) {
        CAPTURE(ranks);
        CAPTURE(tier_name(where));
        CAPTURE(prepare);
        const outcome on_demand =
            train({.ranks = ranks, .gather_ahead = false, .step_tier = where, .prepare = prepare});
        const outcome got = train({.ranks = ranks, .step_tier = where, .prepare = prepare});
        same_bits(got, on_demand);
        for (std::size_t r = 0; r < got.stats.size(); ++r) {
          CAPTURE(r);
          CHECK(got.stats[r].gathers_at_step == steps - 1);  // every step with a trace (from the second on)
          CHECK(got.stats[r].gathers == got.stats.front().gathers);
          // Group 0 once per iteration, as on demand, and once more by the last step, for an
          // iteration that does not come.
          CHECK(got.stats[r].gathers == on_demand.stats[r].gathers + 1);
          if (prepare && where == tier::host) CHECK(got.stats[r].early_steps > 0);
        }
        CHECK(on_demand.stats.front().gathers_at_step == 0);
        // Turned off, the first scope gathers group 0 itself: the same bits, the gathers of on demand.
        const outcome off = train({.ranks = ranks, .at_step = false, .step_tier = where, .prepare = prepare});
        same_bits(off, on_demand);
        for (std::size_t r = 0; r < off.stats.size(); ++r) {
          CHECK(off.stats[r].gathers_at_step == 0);
          CHECK(off.stats[r].gathers == on_demand.stats[r].gathers);
        }
      }
    }
  }
}

TEST_CASE("ZeRO, the step's gather of group 0 starts once this rank's chunk of it is updated, before its next chunk") {
  for (const int ranks : {2, 3}) {
    for (const tier where : {tier::host, tier::device}) {
      CAPTURE(ranks);
      CAPTURE(tier_name(where));
      const outcome got = train({.ranks = ranks, .step_tier = where, .adam = false});
      same_bits(got, train({.ranks = ranks, .gather_ahead = false, .step_tier = where, .adam = false}));
      for (std::size_t r = 0; r < got.updates.size(); ++r) {
        CAPTURE(r);
        REQUIRE(got.updates[r].size() == static_cast<std::size_t>(steps));
        for (std::size_t s = 0; s < got.updates[r].size(); ++s) {
          CAPTURE(s);
          const auto& u = got.updates[r][s];
          REQUIRE(u.size() >= 2);
          CHECK(u[0].first == r);          // group 0's chunk of this rank first
          CHECK(u[1].first == r + ranks);  // then group 1's
          // Between them the allgather of group 0 for the next iteration (the step of the first
          // iteration has no trace yet: nothing); none later in the step.
          CHECK(u[1].second - u[0].second == (s == 0 ? 0u : 1u));
          CHECK(u.back().second == u[1].second);
        }
      }
    }
  }
}

TEST_CASE(
    "ZeRO, between the step and the next forward: one rank writing parameters or sleeping makes every rank gather "
    "again (the written values reach every rank, nothing hangs); an evaluation uses the gathered group") {
  for (const int ranks : {2, 3}) {
    for (const between what : {between::write, between::sleep, between::evaluate}) {
      for (const int who : {0, 1}) {
        if (what == between::write && who != 0) continue;     // layer 0 is rank 0's to write
        if (what == between::evaluate && who != 0) continue;  // every rank evaluates
        CAPTURE(ranks);
        CAPTURE(static_cast<int>(what));
        CAPTURE(who);
        const outcome on_demand = train({.ranks = ranks, .gather_ahead = false, .what = what, .who = who});
        const outcome got = train({.ranks = ranks, .what = what, .who = who});
        same_bits(got, on_demand);
        if (what == between::write)  // each forward after a write saw it, on every rank
          for (const auto& seen : got.first_layer)
            for (int step = 2; step <= steps; ++step)
              CHECK(seen[static_cast<std::size_t>(step - 1) * elems] == 0.5f + 0.01f * static_cast<float>(step - 1));
        for (std::size_t r = 0; r < got.stats.size(); ++r) {
          CAPTURE(r);
          CHECK(got.stats[r].gathers_at_step == steps - 1);  // started at every step, then released
          CHECK(got.stats[r].gathers == got.stats.front().gathers);
          // Released unused after the steps 2 to 4 and gathered again: one gather more each; an
          // evaluation uses it instead of gathering it (then the forward gathers it again). And
          // the last step's.
          CHECK(got.stats[r].gathers == on_demand.stats[r].gathers + 1 + (what == between::evaluate ? 0u : steps - 2u));
        }
      }
    }
  }
}

TEST_CASE(
    "ZeRO, a parameter written while its group is gathered for the iteration's scopes: refused on every rank with "
    "a state_error naming it and its owner, nothing written (the bits of no write)") {
  for (const int ranks : {2, 3}) {
    for (const bool ahead : {false, true}) {
      CAPTURE(ranks);
      CAPTURE(ahead);
      const outcome got = train({.ranks = ranks, .gather_ahead = ahead, .write_in_forward = true});
      same_bits(got, train({.ranks = ranks, .gather_ahead = ahead}));
      const int owner = 3 % ranks;  // layer 3's chunk
      for (std::size_t r = 0; r < got.refused.size(); ++r) {
        CAPTURE(r);
        REQUIRE(got.refused[r].size() == static_cast<std::size_t>(steps));  // every iteration's try
        for (const auto& what : got.refused[r]) {
          CHECK(what.find("parameter 'layer3'") != std::string::npos);
          CHECK(what.find("between iterations") != std::string::npos);
          if (static_cast<int>(r) == owner) CHECK(what.find("the other ranks' copies") != std::string::npos);
          else CHECK(what.find("a copy of rank " + std::to_string(owner) + "'s chunk") != std::string::npos);
        }
      }
    }
  }
}

}  // namespace step_gathers_test
