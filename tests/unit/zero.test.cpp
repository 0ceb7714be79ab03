// ZeRO over N in-process ranks: each rank keeps 1/N of the model data (its own chunks), gathers the
// others' parameter chunks before use and reduce-scatters gradients to their owners. Every rank's
// owned parameters must be bit-identical to one process that computes the N micro-batches'
// gradients separately and sums them in rank order (the communicators' reduction order) — the
// same reference as replicated data parallelism — whatever the device budget.
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>

#include <doctest/doctest.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "support/mlp_replica.hpp"

using namespace chunkstar;
using chunkstar::testing::mlp_replica;

namespace {

constexpr int steps = 4;
constexpr std::size_t act_bytes = 12 * chunkstar::testing::mlp_batch * chunkstar::testing::mlp_width * sizeof(float);
constexpr std::size_t chunk_bytes = 256 * sizeof(float);

chunk_adam<> make_adam() { return chunk_adam<>({.hyper = {.lr = 2e-2f, .weight_decay = 0.01f}, .max_grad_norm = 0.05f, .threads = 1}); }

using params_by_name = std::map<std::string, std::vector<float>>;

template <class Comm>
params_by_name owned_params(const mlp_replica<Comm>& r) {
  params_by_name out;
  for (std::size_t t = 0; t < r.rt.params().size(); ++t) {
    const chunk_id id{chunk_kind::param, static_cast<std::uint32_t>(r.rt.plan().slots[t].chunk)};
    if (r.rt.where(id) == tier::remote) continue;
    std::vector<float> v(r.rt.params()[t].numel());
    r.rt.read_tensor(param_id{static_cast<std::uint32_t>(t)}, chunk_kind::param, v);
    out[r.rt.params()[t].name] = v;
  }
  return out;
}

/** One process: each micro-batch's gradient on its own, summed in rank order, then one step. */
params_by_name reference(int ranks) {
  mlp_replica<single_process_communicator> r({}, 1 << 20);
  auto opt = make_adam();
  for (int step = 1; step <= steps; ++step) {
    std::vector<float> sum;
    for (int mb = 0; mb < ranks; ++mb) {
      r.rt.zero_grad();
      r.forward_backward(step, mb, [] {});
      const auto g = r.all(chunk_kind::grad);
      if (mb == 0) sum = g;
      else
        for (std::size_t i = 0; i < g.size(); ++i) sum[i] += g[i];
    }
    r.rt.zero_grad();
    std::size_t at = 0;
    for (std::size_t t = 0; t < r.rt.params().size(); ++t) {
      const std::size_t n = r.rt.params()[t].numel();
      r.rt.write_tensor(param_id{static_cast<std::uint32_t>(t)}, chunk_kind::grad, std::span<const float>(sum.data() + at, n));
      at += n;
    }
    REQUIRE(opt.step(r.rt, 2e-2f, ranks).stepped);
  }
  return owned_params(r);
}

struct rank_result {
  params_by_name params;
  runtime_stats stats;
  std::size_t model_bytes = 0;
  std::vector<std::string> violations;
};

std::vector<rank_result> train_zero(int ranks, std::size_t capacity, bool keep_gathered) {
  std::vector<rank_result> out(static_cast<std::size_t>(ranks));
  run_ranks(ranks, [&](in_process_communicator& comm) {
    auto& me = out[static_cast<std::size_t>(comm.rank())];
    mlp_replica<in_process_communicator> r({.sharding = {.enabled = true, .keep_gathered = keep_gathered}}, capacity, comm);
    auto opt = make_adam();
    for (int step = 1; step <= steps; ++step) {
      r.forward_backward(step, comm.rank(), [] {});
      REQUIRE(opt.step(r.rt, 2e-2f, ranks).stepped);
      const auto v = r.rt.invariant_violations(true);
      me.violations.insert(me.violations.end(), v.begin(), v.end());
    }
    me.params = owned_params(r);
    me.stats = r.rt.stats();
    me.model_bytes = r.rt.model_bytes();
  });
  return out;
}

}  // namespace

TEST_CASE("ZeRO over 1-4 in-process ranks: owned parameters bit-identical to the rank-order reference, at any budget") {
  for (int ranks : {1, 2, 3, 4}) {
    CAPTURE(ranks);
    const auto expected = reference(ranks);
    for (bool tight : {false, true}) {
      for (bool keep : {false, true}) {
        // Tight: activations, the gather and gradient groups (N chunks each; kept groups stay
        // gathered through backward) and a few owned chunks, so owned chunks move to the host.
        const std::size_t capacity =
            tight ? act_bytes + (static_cast<std::size_t>(keep ? 3 : 2) * static_cast<std::size_t>(ranks) + 4) * chunk_bytes : std::size_t{1} << 20;
        CAPTURE(capacity);
        CAPTURE(keep);
        const auto got = train_zero(ranks, capacity, keep);
        params_by_name all;
        for (const auto& r : got) {
          for (const auto& v : r.violations) FAIL_CHECK(v);
          for (const auto& [name, values] : r.params) {
            CHECK(!all.contains(name));  // each tensor has exactly one owner
            all[name] = values;
          }
          if (ranks > 1) CHECK(r.stats.gathers > 0);
          if (tight && ranks > 1) CHECK(r.stats.bytes_to_host > 0);
        }
        CHECK(all.size() == expected.size());
        for (const auto& [name, values] : expected) {
          CAPTURE(name);
          CHECK(all[name] == values);
        }
      }
    }
  }
}
