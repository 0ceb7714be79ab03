// SPDX-License-Identifier: Apache-2.0
// ZeRO over N in-process ranks: each rank keeps 1/N of the model data (its own chunks), gathers the
// others' parameter chunks before use and reduce-scatters gradients to their owners. Every rank's
// owned parameters must be bit-identical to one process that computes the N micro-batches'
// gradients separately and sums them in rank order (the communicators' reduction order) — the
// same reference as replicated data parallelism — whatever the device budget.
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "support/mlp_replica.hpp"
#include "support/runtimes.hpp"

using namespace chunkstar;

namespace zero_test {
using chunkstar::testing::mlp_adam;
using chunkstar::testing::mlp_replica;

namespace {

constexpr int steps = 10;
constexpr std::size_t act_bytes = chunkstar::testing::mlp_act_bytes, chunk_bytes = chunkstar::testing::mlp_chunk_bytes;

using params_by_name = std::map<std::string, std::vector<float>>;
using losses_by_step = std::vector<std::vector<float>>;  // [step][micro-batch = rank]

struct trained {
  params_by_name params;
  losses_by_step losses;
};

template <class Replica>
params_by_name owned_params(const Replica& r) {
  params_by_name out;
  for (std::size_t t = 0; t < r.rt.params().size(); ++t) {
    const chunk_id id{chunk_kind::param, static_cast<std::uint32_t>(r.rt.plan().slots[t].chunk)};
    if (!r.rt.shards().owns(id.index)) continue;  // gathered (device) between steps, too
    std::vector<float> v(r.rt.params()[t].numel());
    r.rt.read_tensor(param_id{static_cast<std::uint32_t>(t)}, chunk_kind::param, v);
    out[r.rt.params()[t].name] = v;
  }
  return out;
}

/** One process: each rank's micro-batch gradient on its own — with @p micro micro-batches per
 *  rank, accumulated in the gradient chunks as its backward runs, as ZeRO with accumulation does —
 *  the ranks' gradients summed in rank order, then one step; @p n_steps steps. Losses per step, one
 *  per micro-batch. */
trained reference(int ranks, int micro = 1, int n_steps = steps) {
  mlp_replica<single_process_communicator> r({}, 1 << 20);
  auto opt = mlp_adam();
  losses_by_step losses(static_cast<std::size_t>(n_steps));
  for (int step = 1; step <= n_steps; ++step) {
    std::vector<float> sum;
    for (int rank = 0; rank < ranks; ++rank) {
      r.rt.zero_grad();
      for (int a = 0; a < micro; ++a)
        losses[static_cast<std::size_t>(step - 1)].push_back(r.forward_backward(step, rank * micro + a, [] {}));
      const auto g = r.all(chunk_kind::grad);
      if (rank == 0) sum = g;
      else
        for (std::size_t i = 0; i < g.size(); ++i) sum[i] += g[i];
    }
    r.rt.zero_grad();
    r.write_all(chunk_kind::grad, sum);
    REQUIRE(opt.step(r.rt, 2e-2f, ranks * micro).stepped);
  }
  return {owned_params(r), losses};
}

/** One process, plain gradient accumulation: the micro-batches' gradients add up in the gradient
 *  chunks as backward runs (a different summation order from the rank-order reference). */
params_by_name accumulated(int ranks) {
  mlp_replica<single_process_communicator> r({}, 1 << 20);
  auto opt = mlp_adam();
  for (int step = 1; step <= steps; ++step) {
    for (int mb = 0; mb < ranks; ++mb) r.forward_backward(step, mb, [] {});
    REQUIRE(opt.step(r.rt, 2e-2f, ranks).stepped);
  }
  return owned_params(r);
}

struct rank_result {
  std::vector<float> losses;  // per step
  params_by_name params;
  runtime_stats stats;
  std::size_t model_bytes = 0;
  std::vector<std::string> violations;
};

template <class Placement = auto_placement, class Eviction = belady_eviction>
std::vector<rank_result> train_zero(int ranks, std::size_t capacity, bool keep_gathered, std::size_t prefetch_depth = 2,
                                    bool gather_ahead = true, bool memory_saving = false) {
  std::vector<rank_result> out(static_cast<std::size_t>(ranks));
  run_ranks(ranks, [&](in_process_communicator& comm) {
    auto& me = out[static_cast<std::size_t>(comm.rank())];
    mlp_replica<in_process_communicator, Placement, Eviction> r({.prefetch_depth = prefetch_depth,
                                                                 .sharding = {.enabled = true,
                                                                              .keep_gathered = keep_gathered,
                                                                              .gather_ahead = gather_ahead,
                                                                              .memory_saving = memory_saving}},
                                                                capacity, comm);
    auto opt = mlp_adam();
    for (int step = 1; step <= steps; ++step) {
      me.losses.push_back(r.forward_backward(step, comm.rank(), [] {}));
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

/** A quarter of the chunks on the compute tier, the rest stepped on the host. */
struct quarter_on_device : static_placement {
  quarter_on_device() : static_placement{0.25} {}
};

}  // namespace

TEST_CASE(
    "ZeRO over 1-4 in-process ranks: losses and owned parameters after 10 steps bit-identical to the rank-order "
    "reference, at any budget") {
  for (int ranks : {1, 2, 3, 4}) {
    CAPTURE(ranks);
    const auto expected = reference(ranks);
    for (bool tight : {false, true}) {
      for (bool keep : {false, true}) {
        // Tight: activations, the gather and gradient groups (N chunks each; kept groups stay
        // gathered through backward) and a few owned chunks, so owned chunks move to the host.
        const std::size_t capacity =
            tight ? act_bytes +
                        (static_cast<std::size_t>(keep ? 3 : 2) * static_cast<std::size_t>(ranks) + 4) * chunk_bytes
                  : std::size_t{1} << 20;
        CAPTURE(capacity);
        CAPTURE(keep);
        const auto got = train_zero(ranks, capacity, keep);
        params_by_name all;
        for (std::size_t k = 0; k < got.size(); ++k)
          for (int step = 1; step <= steps; ++step)
            CHECK(got[k].losses[static_cast<std::size_t>(step - 1)] ==
                  expected.losses[static_cast<std::size_t>(step - 1)][k]);
        for (const auto& r : got) {
          for (const auto& v : r.violations) FAIL_CHECK(v);
          for (const auto& [name, values] : r.params) {
            CHECK(!all.contains(name));  // each tensor has exactly one owner
            all[name] = values;
          }
          if (ranks > 1) CHECK(r.stats.gathers > 0);
          if (tight && ranks > 1) CHECK(r.stats.bytes_to_host > 0);
        }
        CHECK(all.size() == expected.params.size());
        for (const auto& [name, values] : expected.params) {
          CAPTURE(name);
          CHECK(all[name] == values);
        }
      }
    }
  }
}

TEST_CASE(
    "ZeRO with gradient accumulation: the reference's bits from the first step (sharding.micro_batches), in both "
    "modes") {
  for (const auto& [ranks, micro] : {std::pair{1, 2}, std::pair{2, 2}, std::pair{3, 2}, std::pair{2, 3}}) {
    for (int n_steps : {1, 3}) {  // the first step alone, and the steps after it
      const auto expected = reference(ranks, micro, n_steps).params;
      for (bool memory_saving : {false, true}) {
        CAPTURE(ranks);
        CAPTURE(micro);
        CAPTURE(n_steps);
        CAPTURE(memory_saving);
        std::vector<params_by_name> owned(static_cast<std::size_t>(ranks));
        run_ranks(ranks, [&](in_process_communicator& comm) {
          mlp_replica<in_process_communicator> r(
              {.sharding = {.enabled = true, .memory_saving = memory_saving, .micro_batches = micro}}, 1 << 20, comm);
          auto opt = mlp_adam();
          for (int step = 1; step <= n_steps; ++step) {
            for (int a = 0; a < micro; ++a) r.forward_backward(step, comm.rank() * micro + a, [] {});
            REQUIRE(opt.step(r.rt, 2e-2f, ranks * micro).stepped);
          }
          owned[static_cast<std::size_t>(comm.rank())] = owned_params(r);
        });
        params_by_name all;
        for (const auto& p : owned) all.insert(p.begin(), p.end());
        CHECK(all.size() == expected.size());
        std::size_t differ = 0;
        for (const auto& [name, values] : expected) differ += all[name] != values;
        CHECK(differ == 0);
      }
    }
  }
}

TEST_CASE(
    "ZeRO with gradient accumulation: a step with more micro-batches per rank than sharding.micro_batches is refused, "
    "naming the fix") {
  run_ranks(2, [&](in_process_communicator& comm) {
    mlp_replica<in_process_communicator> r({.sharding = {.enabled = true}}, 1 << 20, comm);
    auto opt = mlp_adam();
    for (int a = 0; a < 2; ++a) r.forward_backward(1, comm.rank() * 2 + a, [] {});
    try {
      (void)opt.step(r.rt, 2e-2f, 4);
      FAIL_CHECK("accepted");
    } catch (const config_error& e) {
      const std::string what = e.what();
      CHECK_MESSAGE(what.find("runtime_options::sharding.micro_batches 1") != std::string::npos, what);
      CHECK_MESSAGE(what.find("each rank accumulates per step (2)") != std::string::npos, what);
    }
  });
  CHECK_THROWS_AS((mlp_replica<single_process_communicator>({.sharding = {.micro_batches = 0}}, 1 << 20)),
                  config_error);
}

TEST_CASE(
    "ZeRO over 2-4 ranks is within 1e-6 (relative, over all parameters) of plain gradient accumulation on one rank") {
  for (int ranks : {2, 3, 4}) {
    CAPTURE(ranks);
    const auto plain = accumulated(ranks);
    params_by_name all;
    for (const auto& r : train_zero(ranks, std::size_t{1} << 20, false)) all.insert(r.params.begin(), r.params.end());
    REQUIRE(all.size() == plain.size());
    double diff = 0, norm = 0;
    for (const auto& [name, values] : plain)
      for (std::size_t i = 0; i < values.size(); ++i) {
        const double d = static_cast<double>(all[name][i]) - values[i];
        diff += d * d;
        norm += static_cast<double>(values[i]) * values[i];
      }
    MESSAGE("ranks " << ranks << ": |zero - accumulated| / |accumulated| = " << std::sqrt(diff / norm));
    CHECK(diff > 0);  // a different summation order: not the same bits (else the test proves nothing)
    CHECK(std::sqrt(diff) <= 1e-6 * std::sqrt(norm));
  }
}

TEST_CASE(
    "ZeRO at 3 ranks: the same bits whatever the placement, eviction policy, prefetch depth, budget and gathers "
    "ahead") {
  constexpr int ranks = 3;
  const std::size_t tight = act_bytes + (2 * static_cast<std::size_t>(ranks) + 4) * chunk_bytes,
                    loose = std::size_t{1} << 20;
  const auto expected = train_zero(ranks, loose, false);
  auto same = [&](const std::vector<rank_result>& got) {
    for (std::size_t k = 0; k < got.size(); ++k) {
      for (const auto& v : got[k].violations) FAIL_CHECK(v);
      CHECK(got[k].losses == expected[k].losses);
      CHECK(got[k].params == expected[k].params);
    }
  };
  for (std::size_t capacity : {tight, loose}) {
    for (std::size_t depth : {std::size_t{0}, std::size_t{1}, std::size_t{4}}) {
      CAPTURE(capacity);
      CAPTURE(depth);
      same(train_zero<auto_placement, belady_eviction>(ranks, capacity, false, depth));
      same(train_zero<auto_placement, lru_eviction>(ranks, capacity, false, depth));
      same(train_zero<quarter_on_device, belady_eviction>(ranks, capacity, false, depth));
      same(train_zero<quarter_on_device, lru_eviction>(ranks, capacity, false, depth));
      same(train_zero<auto_placement, belady_eviction>(ranks, capacity, false, depth, /*gather_ahead=*/false));
    }
  }
}

TEST_CASE("ZeRO bytes: what the communicator counts per iteration equals the theory exactly") {
  // Four layers, one chunk each (1 KiB per list), so U = ceil(4 / N) groups are in use. Per
  // iteration, once the trace exists: forward gathers each group once (a group stays gathered
  // across its consecutive layers); backward gathers them again, except the last group, whose next
  // use is the very next moment (kept gathered: only the forward's gathers), and except a group
  // whose next use the look-ahead reaches when it is released (gather_depth 2, the default: at most
  // three moments on, gather_plan::keep); each group's
  // gradients are reduce-scattered once; the norm is one allreduce of a double per chunk; the
  // step's arguments, one more of 5 doubles per rank (step_agreement). The
  // first iteration with a trace (step 2) adds the ranks' agreement on the gathers ahead: one
  // allreduce of two doubles per moment of the trace (the least and the most depth any rank
  // accepts there: sharding_options::gather_depth's default, 2, agrees in one round when they match).
  // From then on each step gathers group 0 for the next iteration (counted in the step's
  // iteration: step 2 has one gather more), and the next iteration's first scope agrees, one
  // allreduce of a double, that every rank still holds it (steps 3 on).
  for (int ranks : {2, 3, 4}) {
    for (bool keep : {false, true}) {
      CAPTURE(ranks);
      CAPTURE(keep);
      const std::uint64_t n = static_cast<std::uint64_t>(ranks), used = (4 + n - 1) / n, padded = used * n;
      // Group k < used - 1 is released after forward's layer (k + 1) n - 1 (moment (k + 1) n - 1)
      // and used again by its backward (moment 8 - (k + 1) n): kept where that is 3 moments on or
      // less, (k + 1) n >= 3 (at N = 3 group 0, 3 moments on).
      std::uint64_t kept = 0;
      for (std::uint64_t k = 0; !keep && k + 1 < used; ++k) kept += (k + 1) * n >= 3;
      const std::uint64_t gathers = keep ? used : 2 * used - 1 - kept, reductions = used;
      const std::uint64_t theory =  // and the step's arguments: 5 per rank (step_agreement)
          (n - 1) * (gathers * chunk_bytes + reductions * chunk_bytes + (padded + 5 * n) * sizeof(double));
      std::vector<std::vector<comm_stats>> per_iteration(static_cast<std::size_t>(ranks));
      std::vector<runtime_stats> last(static_cast<std::size_t>(ranks));
      std::vector<std::uint64_t> moments(static_cast<std::size_t>(ranks));
      run_ranks(ranks, [&](in_process_communicator& comm) {
        mlp_replica<in_process_communicator> r({.sharding = {.enabled = true, .keep_gathered = keep}}, 1 << 20, comm);
        auto opt = mlp_adam();
        for (int step = 1; step <= steps; ++step) {
          const comm_stats before = comm.stats();
          const runtime_stats rs = r.rt.stats();
          r.forward_backward(step, comm.rank(), [] {});
          REQUIRE(opt.step(r.rt, 2e-2f, ranks).stepped);
          comm_stats d = comm.stats();
          d.bytes_sent -= before.bytes_sent;
          d.bytes_received -= before.bytes_received;
          d.collectives -= before.collectives;
          per_iteration[static_cast<std::size_t>(comm.rank())].push_back(d);
          moments[static_cast<std::size_t>(comm.rank())] = r.rt.tracer().num_moments();
          if (step == steps) {
            last[static_cast<std::size_t>(comm.rank())] = r.rt.stats();
            CHECK(last[static_cast<std::size_t>(comm.rank())].gathers - rs.gathers == gathers);
            CHECK(last[static_cast<std::size_t>(comm.rank())].gathers_kept - rs.gathers_kept == kept);
            CHECK(last[static_cast<std::size_t>(comm.rank())].reductions - rs.reductions == reductions);
          }
        }
      });
      for (int k = 0; k < ranks; ++k)
        for (int step = 2; step <= steps; ++step) {
          CAPTURE(k);
          CAPTURE(step);
          const auto& d = per_iteration[static_cast<std::size_t>(k)][static_cast<std::size_t>(step - 1)];
          const std::uint64_t agreement =
              step == 2 ? (n - 1) * 2 * moments[static_cast<std::size_t>(k)] * sizeof(double) : 0;
          const std::uint64_t for_next = step == 2 ? (n - 1) * chunk_bytes : (n - 1) * sizeof(double);
          CHECK(d.bytes_sent == theory + agreement + for_next);
          CHECK(d.bytes_received == theory + agreement + for_next);
          CHECK(d.collectives == gathers + reductions + 1 + 1 + 1 + (step == 2 ? 1 : 0));
        }
    }
  }
}

TEST_CASE(
    "ZeRO memory: each rank's model-data peak is its 1/N share plus the collective buffers; the device stays within "
    "its budget") {
  for (int ranks : {2, 3, 4}) {
    std::uint64_t loose_ahead = 0;
    for (bool tight : {false, true}) {
      CAPTURE(ranks);
      CAPTURE(tight);
      const std::size_t capacity =
          tight ? act_bytes + (2 * static_cast<std::size_t>(ranks) + 3) * chunk_bytes : std::size_t{1} << 20;
      const auto got = train_zero(ranks, capacity, false);
      for (const auto& r : got) {
        const std::size_t share = r.model_bytes / static_cast<std::size_t>(ranks);
        // At most two parameter groups gathered at once (the current one, and the next one
        // gathered ahead or the last forward one kept for backward), two gradient groups (one accumulating, one whose
        // reduce-scatter
        // overlaps the next scope), and one chunk of reduce scratch.
        const std::size_t collective_bound = 4 * static_cast<std::size_t>(ranks) * chunk_bytes + chunk_bytes;
        CHECK(r.stats.peak_collective_bytes > 0);
        CHECK(r.stats.peak_collective_bytes <= collective_bound);
        CHECK(r.stats.peak_model_bytes <= share + r.stats.peak_collective_bytes);
        CHECK(r.stats.peak_device_bytes <= capacity);
        // Gathers ahead, and groups kept instead of gathered again, where the budget holds them
        // (plan_gathers): at 2 and 3 ranks the tight budget holds two thirds of them (at 3 ranks
        // the loose one keeps a group and the tight one does not); every rank starts the same
        // ones (the plan is agreed).
        const std::uint64_t ahead = r.stats.gathers_ahead + r.stats.gathers_kept;
        if (!tight) loose_ahead = ahead;
        CHECK(r.stats.gathers_ahead == got.front().stats.gathers_ahead);
        CHECK(r.stats.gathers_kept == got.front().stats.gathers_kept);
        if (tight) CHECK(ahead <= loose_ahead);
        if (tight && ranks <= 3) CHECK(ahead < loose_ahead);
        if (!tight && ranks == 3) CHECK(r.stats.gathers_kept > 0);
        if (ranks == 2 || ranks == 3) CHECK(r.stats.gathers_ahead > 0);
      }
    }
  }
}

namespace {

/** An in-process rank that logs when a reduce-scatter, a rooted reduce or an allgather starts
 *  and when the runtime waits for it; everything else is forwarded unchanged. */
class recording_communicator {
 public:
  recording_communicator(in_process_communicator& c, std::vector<std::string>& log) : c_(c), log_(log) {}
  [[nodiscard]] int rank() const { return c_.rank(); }
  [[nodiscard]] int size() const { return c_.size(); }
  void allreduce(void* p, std::size_t n, dtype t, reduce_op op) { c_.allreduce(p, n, t, op); }
  void allreduce(std::span<double> d, reduce_op op) { c_.allreduce(d, op); }
  void allgather(const void* s, void* r, std::size_t n) {
    log_.push_back("allgather");
    c_.allgather(s, r, n);
  }
  void reduce_scatter(const void* s, void* r, std::size_t n, dtype t, reduce_op op) {
    log_.push_back("reduce-scatter");
    c_.reduce_scatter(s, r, n, t, op);
  }
  void reduce(const void* s, void* r, std::size_t n, dtype t, reduce_op op, int root) {
    log_.push_back("reduce");
    c_.reduce(s, r, n, t, op, root);
  }
  void broadcast(void* p, std::size_t n, int root) { c_.broadcast(p, n, root); }
  void ring_shift(const void* s, void* r, std::size_t n) { c_.ring_shift(s, r, n); }
  void barrier() { c_.barrier(); }
  comm_handle allreduce_async(void* p, std::size_t n, dtype t, reduce_op op) { return c_.allreduce_async(p, n, t, op); }
  comm_handle allreduce_async(std::span<double> d, reduce_op op) { return c_.allreduce_async(d, op); }
  comm_handle allgather_async(const void* s, void* r, std::size_t n) {
    log_.push_back("gather-start");
    return comm_handle(std::make_shared<logged>(c_.allgather_async(s, r, n), log_, "gather-wait"));
  }
  comm_handle reduce_scatter_async(const void* s, void* r, std::size_t n, dtype t, reduce_op op) {
    log_.push_back("reduce-start");
    return comm_handle(std::make_shared<logged>(c_.reduce_scatter_async(s, r, n, t, op), log_, "reduce-wait"));
  }
  comm_handle reduce_async(const void* s, void* r, std::size_t n, dtype t, reduce_op op, int root) {
    log_.push_back("reduce-start");
    return comm_handle(std::make_shared<logged>(c_.reduce_async(s, r, n, t, op, root), log_, "reduce-wait"));
  }

  comm_handle broadcast_async(void* p, std::size_t n, int root) { return c_.broadcast_async(p, n, root); }
  comm_handle ring_shift_async(const void* s, void* r, std::size_t n) { return c_.ring_shift_async(s, r, n); }

 private:
  struct logged {
    comm_handle inner;
    std::vector<std::string>& log;
    const char* label;
    logged(comm_handle h, std::vector<std::string>& l, const char* what) : inner(std::move(h)), log(l), label(what) {}
    void wait() {
      log.push_back(label);
      inner.wait();
    }
    bool ready() { return inner.ready(); }
  };
  in_process_communicator& c_;
  std::vector<std::string>& log_;
};
static_assert(Communicator<recording_communicator>);

/** One rank's training of the MLP over a recording_communicator (a loose budget, 10 steps). */
struct recorded_rank {
  std::vector<std::string> log;  // the communicator's, with "iteration" before each, "computed" after
                                 // each backward scope (and forward one, if asked), "step" before each step
  params_by_name params;         // owned, at the end
  runtime_stats stats;
  std::vector<std::string> violations;
};
std::vector<recorded_rank> train_recorded(int ranks, sharding_options sharding, bool log_forward = false) {
  std::vector<recorded_rank> out(static_cast<std::size_t>(ranks));
  run_ranks(ranks, [&](in_process_communicator& inner) {
    auto& me = out[static_cast<std::size_t>(inner.rank())];
    recording_communicator comm(inner, me.log);
    mlp_replica<recording_communicator> r({.sharding = sharding}, 1 << 20, comm);
    auto opt = mlp_adam();
    const auto computed = [&] { me.log.push_back("computed"); };
    for (int step = 1; step <= steps; ++step) {
      me.log.push_back("iteration");
      if (log_forward) r.forward_backward(step, comm.rank(), computed, computed);
      else r.forward_backward(step, comm.rank(), computed);
      me.log.push_back("step");
      REQUIRE(opt.step(r.rt, 2e-2f, ranks).stepped);
    }
    me.params = owned_params(r);
    me.stats = r.rt.stats();
    me.violations = r.rt.invariant_violations(true);
  });
  return out;
}

}  // namespace

TEST_CASE(
    "ZeRO overlap: a group's reduce-scatter runs while the next backward scope computes, and completes before the "
    "step") {
  // 4 layers of one chunk each. Once the trace exists, a gradient group whose last contribution
  // came from layer l is reduced asynchronously when the next scope opens and waited for when
  // that scope has closed, so its communication overlaps layer l-1's backward; the group that
  // finishes last (layer 0's) has no scope after it and completes before the step.
  for (int ranks : {2, 3}) {
    CAPTURE(ranks);
    const std::size_t used = (4 + static_cast<std::size_t>(ranks) - 1) / static_cast<std::size_t>(ranks);
    const auto got = train_recorded(ranks, {.enabled = true});
    for (const auto& [log, params, stats, violations] : got) {
      // Per iteration after the first: how many reductions saw a backward scope computed between
      // their start and the wait for them, and how many ran at all.
      std::vector<std::size_t> overlapped, started;
      bool open = false;
      std::size_t computed_since_start = 0;
      for (const auto& e : log) {
        if (e == "iteration") overlapped.push_back(0), started.push_back(0);
        else if (e == "reduce-start") open = true, computed_since_start = 0, ++started.back();
        else if (e == "computed" && open) ++computed_since_start;
        else if (e == "reduce-wait") {
          if (computed_since_start > 0) ++overlapped.back();
          open = false;
        }
        CHECK(e != "reduce-scatter");  // the runtime never blocks on a reduce-scatter it could overlap
      }
      REQUIRE(overlapped.size() == static_cast<std::size_t>(steps));
      // From the first iteration on: without a trace yet, a chunk's gradient is final once backward
      // has used it as often as forward did (gradient_final_untraced), so the first iteration too
      // reduces group by group instead of holding every gradient group until the step.
      for (std::size_t it = 0; it < overlapped.size(); ++it) {
        CAPTURE(it);
        CHECK(started[it] == used);
        CHECK(overlapped[it] == used - 1);
      }
    }
    const auto expected = reference(ranks);  // and the bits are the reference's
    for (const auto& mine : got)
      for (const auto& [name, v] : mine.params) CHECK_MESSAGE(v == expected.params.at(name), name);
  }
}

TEST_CASE(
    "ZeRO: for_each_grad_chunk (the norm's scan) visits the gradients already final while the last reductions travel, "
    "then each reduction's as it lands") {
  // 4 layers of one chunk each. The step's last reductions start once backward has ended; a scan
  // over the owned gradients (chunk_adam's norm, here the user's own) reads those already reduced
  // before it waits for them, and the rest in the order their reductions land: each owned chunk
  // once, none before its group's reduction was waited for, the bits of the step unchanged.
  for (int ranks : {2, 3}) {
    CAPTURE(ranks);
    const std::size_t n = static_cast<std::size_t>(ranks);
    std::vector<recorded_rank> got(n);
    run_ranks(ranks, [&](in_process_communicator& inner) {
      auto& me = got[static_cast<std::size_t>(inner.rank())];
      recording_communicator comm(inner, me.log);
      mlp_replica<recording_communicator> r({.sharding = {.enabled = true}}, 1 << 20, comm);
      auto opt = mlp_adam();
      for (int step = 1; step <= steps; ++step) {
        me.log.push_back("iteration");
        r.forward_backward(step, comm.rank(), [] {});
        r.rt.for_each_grad_chunk([&](const step_chunk& c) { me.log.push_back("visit " + std::to_string(c.index)); });
        me.log.push_back("step");
        REQUIRE(opt.step(r.rt, 2e-2f, ranks).stepped);
      }
      me.params = owned_params(r);
      me.violations = r.rt.invariant_violations(true);
    });
    for (std::size_t k = 0; k < n; ++k) {
      CAPTURE(k);
      CHECK(got[k].violations.empty());
      std::size_t iterations = 0;
      for (std::size_t i = 0; i < got[k].log.size(); ++i) {
        if (got[k].log[i] != "iteration") continue;
        ++iterations;
        std::size_t end = i + 1;
        while (got[k].log[end] != "step") ++end;
        // Backward's last reduction starts (rs), is waited for (rw); the visits around them.
        std::size_t rs = i, rw = i;
        for (std::size_t e = i; e < end; ++e) {
          if (got[k].log[e] == "reduce-start") rs = e;
          if (got[k].log[e] == "reduce-wait") rw = e;
        }
        REQUIRE(rw > rs);
        std::vector<std::size_t> before, after;  // visited before and after that wait
        for (std::size_t e = i; e < end; ++e)
          if (got[k].log[e].rfind("visit ", 0) == 0) {
            CHECK(e > rs);  // after backward
            (e < rw ? before : after).push_back(std::stoul(got[k].log[e].substr(6)));
          }
        // The group reduced last (layer 0's, group 0, owned chunk k) is visited once it has landed;
        // every other owned chunk (k + g N of each later group; the chunk count is padded to whole
        // groups, and a padding chunk's reduced gradient is zeros) while it travels.
        std::vector<std::size_t> others;
        for (std::size_t c = k + n; c < (4 + n - 1) / n * n; c += n) others.push_back(c);
        CHECK(before == others);
        CHECK(after == std::vector<std::size_t>{k});
      }
      CHECK(iterations == static_cast<std::size_t>(steps));
    }
    const auto expected = reference(ranks);  // the step's own scan reads in the same order: same bits
    for (const auto& mine : got)
      for (const auto& [name, v] : mine.params) CHECK_MESSAGE(v == expected.params.at(name), name);
  }
}

TEST_CASE("gradient_final_untraced: final once backward has used a chunk as often as forward did") {
  CHECK_FALSE(gradient_final_untraced(1, 0));
  CHECK(gradient_final_untraced(1, 1));
  CHECK_FALSE(gradient_final_untraced(2, 1));  // a tied weight: its second backward use is still to come
  CHECK(gradient_final_untraced(2, 2));
  CHECK(gradient_final_untraced(0, 1));  // used in backward only: final after that use
  CHECK_FALSE(gradient_final_untraced(0, 0));
}

TEST_CASE(
    "ZeRO gathers ahead: once the trace exists, every gather starts ahead of its use: group 0 during the step before, "
    "the others a scope before their use, running while that scope computes") {
  // 4 layers of one chunk each: groups of N consecutive layers. Forward gathers group 0 when
  // layer 0 opens in the first iteration with a trace (nothing is open before it: synchronous),
  // and from then on during the step before (gathered ahead there, once this rank's chunk of it is
  // stepped); each later group while the layer before it computes; backward likewise, its first
  // group still gathered from forward.
  for (int ranks : {2, 3}) {
    CAPTURE(ranks);
    const std::size_t used = (4 + static_cast<std::size_t>(ranks) - 1) / static_cast<std::size_t>(ranks);
    const auto got = train_recorded(ranks, {.enabled = true}, /*log_forward=*/true);
    for (std::size_t k = 0; k < got.size(); ++k) {
      CAPTURE(k);
      CHECK(got[k].violations.empty());
      std::vector<std::size_t> sync, ahead, overlapped;
      std::size_t pending = 0, computed_since = 0;
      for (const auto& e : got[k].log) {
        if (e == "iteration") sync.push_back(0), ahead.push_back(0), overlapped.push_back(0);
        else if (sync.empty()) continue;  // finalize()'s agreement on the configuration
        else if (e == "allgather") ++sync.back();
        else if (e == "gather-start") ++ahead.back(), ++pending, computed_since = 0;
        else if (e == "computed") ++computed_since;
        else if (e == "gather-wait") {
          REQUIRE(pending > 0);
          --pending;
          if (computed_since > 0) ++overlapped.back();
        }
      }
      CHECK(pending == 0);  // the last step's too: invariant_violations() waited for it
      REQUIRE(sync.size() == static_cast<std::size_t>(steps));
      CHECK(sync[0] == 8);  // no trace yet: every scope gathers, and waits for it
      CHECK(ahead[0] == 0);
      // At 3 ranks group 0 (layers 0-2) is kept from forward's layer 2 to its backward, three
      // moments on, which gather_depth 2 reaches (gather_plan::keep): one gather fewer.
      const std::size_t kept = ranks == 3 ? 1 : 0;
      for (std::size_t it = 1; it < sync.size(); ++it) {
        CAPTURE(it);
        CHECK(sync[it] == (it == 1 ? 1 : 0));          // group 0 as layer 0 opens, until a step has gathered it
        CHECK(ahead[it] == 2 * used - 2 + 1 - kept);   // every other gather of the iteration (2U - 1 in all,
                                                       // less those kept), and the step's of group 0 for the next one
        CHECK(overlapped[it] == 2 * used - 2 - kept);  // those with a scope computed between their start and wait
      }
      CHECK(got[k].stats.gathers_ahead == (steps - 1) * (2 * used - 1 - kept));
      CHECK(got[k].stats.gathers_kept == (steps - 1) * kept);
      CHECK(got[k].stats.gathers_at_step == steps - 1);
    }
    const auto expected = reference(ranks);
    for (const auto& mine : got)
      for (const auto& [name, v] : mine.params) CHECK_MESSAGE(v == expected.params.at(name), name);
  }
}

namespace {
/** Forward over @p layers (each the chunks its scope uses) in order, backward in reverse (each
 *  scope's gradients its chunks), then the step. */
sharding_trace mirrored_trace(const std::vector<std::vector<std::uint32_t>>& layers) {
  sharding_trace t;
  const auto scope = [&](moment_kind k, const std::vector<std::uint32_t>& c) {
    t.kinds.push_back(k);
    t.params.push_back(c);
    t.grads.push_back(k == moment_kind::backward ? c : std::vector<std::uint32_t>{});
  };
  for (const auto& c : layers) scope(moment_kind::forward, c);
  for (auto c = layers.rbegin(); c != layers.rend(); ++c) scope(moment_kind::backward, *c);
  t.kinds.push_back(moment_kind::optimizer);
  t.params.emplace_back();
  t.grads.emplace_back();
  return t;
}
/** 4 layers of one chunk each, forward 0..3 then backward 3..0 and the step. */
sharding_trace four_layer_trace() { return mirrored_trace({{0}, {1}, {2}, {3}}); }
/** Rank @p rank of 2, 100-byte chunks, gathers up to @p depth moments ahead, 10 kB at every moment of @p t. */
gather_plan_inputs two_ranks(const sharding_trace& t, int rank = 0, std::size_t depth = 1) {
  return {.map = {.world = 2, .rank = rank},
          .param_chunk_bytes = 100,
          .grad_chunk_bytes = 100,
          .keep_gathered = false,
          .depth = depth,
          .budget = std::vector<std::size_t>(t.size(), 10'000)};
}
}  // namespace

TEST_CASE("plan_gathers: a gather starts ahead only where the moment's budget holds it beside what the moment needs") {
  // 2 ranks, 4 layers of one chunk each (groups {0, 1} and {2, 3}), chunks of 100 bytes, forward
  // 0..3 then backward 3..0 and the step. Rank 0.
  const sharding_trace t = four_layer_trace();
  gather_plan_inputs in{.map = {.world = 2, .rank = 0},
                        .param_chunk_bytes = 100,
                        .grad_chunk_bytes = 100,
                        .keep_gathered = false,
                        .budget = {}};

  // Without budgets: no gather ahead; 3 gathers (forward: both groups; backward: group 0 again,
  // group 1 stays from forward's layer 3), 2 reductions.
  const auto none = plan_gathers(t, in);
  CHECK(none.gathers == 3);
  CHECK(none.gathers_ahead == 0);
  CHECK(none.reductions == 2);
  for (std::size_t m = 0; m < t.size(); ++m) CHECK_FALSE(none.starts_ahead(m));
  // What each moment needs: at m = 1 (layer 1) group 0 (200 B; rank 0's chunk 0 is not in use):
  // 200; at m = 5 (layer 2's backward) group 1 and its gradient group (400) and rank 0's chunk 2
  // (100): 500; at m = 6 (layer 1's) group 0 and its gradients (400) beside group 1's reduction,
  // in flight while layer 1 computes (its gradient group and the owner's result: 300): 700.
  CHECK(none.need[1] == 200);
  CHECK(none.need[5] == 500);
  CHECK(none.need[6] == 700);

  in.budget.assign(t.size(), 10'000);      // room for everything: forward's m = 1 gathers group 1 for
  const auto loose = plan_gathers(t, in);  // m = 2, backward's m = 5 group 0 for m = 6, and the step
  CHECK(loose.gathers == 3);               // (m = 8) group 0 for the next iteration's m = 0
  CHECK(loose.gathers_ahead == 3);
  CHECK(loose.ahead[1] == std::vector<std::size_t>{1});
  CHECK(loose.ahead[5] == std::vector<std::size_t>{0});
  CHECK(loose.step == 8);
  CHECK(loose.ahead[8] == std::vector<std::size_t>{0});
  CHECK(loose.until[8] == std::vector<std::size_t>{0});
  CHECK(loose.need[8] == 200);  // rank 0's chunk 0 is in use at m = 0: no send buffer beyond it
  // The ahead gather at m = 1 costs the group (200) and rank 0's chunk 2, its send buffer (100).
  CHECK(loose.need[1] == 500);
  CHECK(loose.need[5] == 800);            // group 0 ahead, and rank 0's chunk 0, its send buffer
  CHECK(loose.peak_buffer_bytes == 700);  // m = 6, as without gathers ahead

  in.budget[1] = 499;  // one byte short at m = 1: only backward gathers ahead
  const auto tight = plan_gathers(t, in);
  CHECK_FALSE(tight.starts_ahead(1));
  CHECK(tight.starts_ahead(5));
  CHECK(tight.gathers == 3);

  // The ranks' agreement restricts the moments: an empty mask allows all, a false entry none.
  std::vector<bool> allowed(t.size(), true);
  allowed[5] = false;
  allowed[8] = false;
  const auto agreed = plan_gathers(t, in, allowed);
  CHECK_FALSE(agreed.starts_ahead(1));
  CHECK_FALSE(agreed.starts_ahead(5));
  CHECK_FALSE(agreed.starts_ahead(8));
  CHECK(agreed.step == gather_plan{}.step);
  CHECK(agreed.gathers_ahead == 0);

  in.keep_gathered = true;  // kept from forward: backward gathers nothing, forward and the step still ahead
  in.budget.assign(t.size(), 10'000);
  const auto kept = plan_gathers(t, in);
  CHECK(kept.gathers == 2);
  CHECK(kept.gathers_ahead == 2);
  CHECK(kept.starts_ahead(1));
  CHECK(kept.starts_ahead(8));
}

TEST_CASE("plan_gathers at the step: the next iteration's first groups, where the step and the first scope hold them") {
  // The trace above: forward 0..3, backward 3..0, the step (m = 8); 2 ranks, 100-byte chunks.
  const sharding_trace t = four_layer_trace();
  for (const int rank : {0, 1}) {
    CAPTURE(rank);
    gather_plan_inputs in = two_ranks(t, rank);
    // m = 0 uses chunk 0 of group 0: rank 0's own, so rank 0 pins nothing beyond it; rank 1's
    // chunk of the group (1) is not in use there, its send buffer pinned from the step until m = 0.
    const std::size_t pin = rank == 0 ? 0 : 100;
    const auto all = plan_gathers(t, in);
    CHECK(all.step == 8);
    CHECK(all.ahead[8] == std::vector<std::size_t>{0});
    CHECK(all.until[8] == std::vector<std::size_t>{0});
    CHECK(all.depth[8] == 1);
    CHECK(all.need[8] == 200 + pin);
    CHECK(all.gathers == 3);  // the same gathers: m = 0 finds group 0 gathered
    // The step's budget (what its own chunks on the compute tier leave) must hold the group.
    in.budget[8] = 200 + pin - 1;
    CHECK(plan_gathers(t, in).step == gather_plan{}.step);
    in.budget[8] = 200 + pin;
    CHECK(plan_gathers(t, in).step == 8);
    // And m = 0 its own demand beside the send buffer still pinned there.
    in.budget[0] = all.demand[0] + pin - 1;
    if (pin > 0) CHECK(plan_gathers(t, in).step == gather_plan{}.step);
    in.budget[0] = all.demand[0] + pin;
    CHECK(plan_gathers(t, in).step == 8);
    // Turned off (sharding_options::gather_at_step), or a budget shorter than the trace: nothing at the step.
    in.at_step = false;
    CHECK(plan_gathers(t, in).step == gather_plan{}.step);
    in.at_step = true;
    in.budget.resize(8);
    CHECK_FALSE(plan_gathers(t, in).starts_ahead(8));
  }
}

TEST_CASE(
    "plan_gathers at depth 2: a group gathered two moments ahead is held until its moment, where the budget of the "
    "moment between holds it too") {
  // The trace of the test above: forward 0..3, backward 3..0, the step; rank 0 of 2; 100-byte chunks.
  const sharding_trace t = four_layer_trace();
  gather_plan_inputs in = two_ranks(t, 0, 2);
  const auto deep = plan_gathers(t, in);
  // m = 0 (layer 0) gathers group 1 for m = 2, held through m = 1; m = 4 (layer 3's backward)
  // group 0 for m = 6 (released after forward's m = 1). The same 3 gathers as at depth 1, each
  // started a moment earlier; and the step group 0 for the next iteration, as at depth 1.
  CHECK(deep.gathers == 3);
  CHECK(deep.gathers_ahead == 3);
  CHECK(deep.ahead[8] == std::vector<std::size_t>{0});
  CHECK(deep.ahead[0] == std::vector<std::size_t>{1});
  CHECK(deep.until[0] == std::vector<std::size_t>{2});
  CHECK(deep.depth[0] == 2);
  CHECK(deep.ahead[4] == std::vector<std::size_t>{0});
  CHECK(deep.until[4] == std::vector<std::size_t>{6});
  CHECK_FALSE(deep.starts_ahead(1));  // group 1 is already on its way
  // m = 1 holds group 0 (in use), group 1 (held) and rank 0's chunk 2, group 1's send buffer.
  CHECK(deep.need[1] == 500);
  CHECK(deep.demand[1] == 500);

  in.budget[1] = 499;  // m = 1 cannot hold group 1 beside its own: m = 0 gathers nothing ahead
  const auto short_between = plan_gathers(t, in);
  CHECK(short_between.depth[0] == 0);
  CHECK(short_between.gathers == 3);
  in.budget[1] = 500;
  CHECK(plan_gathers(t, in).depth[0] == 2);

  // The agreed depths restrict each moment: 1 at m = 0 (nothing to gather a moment ahead there),
  // so group 1 is gathered at depth 1 from m = 1 as without depth.
  const auto agreed = plan_gathers(t, in, std::vector<std::size_t>{1, 2, 2, 2, 2, 2, 2, 2, 2});
  CHECK(agreed.depth[0] == 0);
  CHECK(agreed.ahead[1] == std::vector<std::size_t>{1});
  CHECK(agreed.until[1] == std::vector<std::size_t>{2});
  CHECK(agreed.depth[4] == 2);
}

TEST_CASE(
    "plan_gathers keeps a group from one use to the next the look-ahead reaches, instead of releasing and gathering it "
    "again, where the moments between hold it") {
  // A transformer's turn: forward emb {0}, block {2}, block {4, 5}, head {1} (in the embedding's
  // group, as a tied weight is), backward in reverse, the step. 2 ranks (groups {0, 1}, {2, 3},
  // {4, 5}), rank 0, 100-byte chunks. At depth 2, once a group is released the next moment's
  // look-ahead reaches its next use 3 moments on: the embedding's group after m = 0 (for the
  // head, m = 3) and after m = 4 (for backward's emb, m = 7), the last block's after m = 2 (for
  // its backward, m = 5).
  const sharding_trace t = mirrored_trace({{0}, {2}, {4, 5}, {1}});
  gather_plan_inputs in = two_ranks(t, 0, 2);
  const auto one = [&] {
    auto i = in;
    i.depth = 1;
    return plan_gathers(t, i);
  }();
  CHECK(one.kept == 0);  // depth 1 reaches no further than the very next moment, which is kept anyway
  // Per iteration (the step gathers the embedding's group for the next one's m = 0): the
  // embedding's group 3 times, each block's twice.
  CHECK(one.gathers == 7);
  const auto deep = plan_gathers(t, in);
  CHECK(deep.kept == 3);
  CHECK(deep.gathers == 4);  // the embedding's group at the step, block 1's twice, the last block's once
  CHECK(deep.gathers + deep.kept == one.gathers + one.kept);
  CHECK(deep.keep[0] == std::vector<std::size_t>{0});
  CHECK(deep.keep_until[0] == std::vector<std::size_t>{3});
  CHECK(deep.keep[2] == std::vector<std::size_t>{2});
  CHECK(deep.keep_until[2] == std::vector<std::size_t>{5});
  CHECK(deep.keep[4] == std::vector<std::size_t>{0});
  CHECK(deep.keep_until[4] == std::vector<std::size_t>{7});
  // Kept from m = 0 on, the group is counted where it is held, as a gather ahead would be: at
  // m = 1 beside what m = 1 holds (block 1's group, the last block's, gathered ahead at m = 0,
  // with its send buffer, rank 0's chunk 4, and rank 0's chunk 2 in use: 600), 200 more; no
  // gather starts for it.
  CHECK(deep.ahead[0] == std::vector<std::size_t>{1, 2});
  CHECK(deep.demand[1] == 600);
  CHECK(deep.need[1] == 800);
  CHECK(deep.depth[1] == 2);
  CHECK_FALSE(deep.starts_ahead(1));
  // One byte short at m = 1: m = 1 gathers nothing ahead (the last block's group is on its way)
  // and keeps nothing; the embedding's group goes after m = 0 and is gathered again (ahead, at
  // m = 2); the other two are still kept.
  in.budget[1] = 799;
  const auto short_at_1 = plan_gathers(t, in);
  CHECK(short_at_1.depth[1] == 0);
  CHECK(short_at_1.keep[0].empty());
  CHECK(short_at_1.kept == 2);
  CHECK(short_at_1.gathers == 5);
  CHECK(short_at_1.ahead[2] == std::vector<std::size_t>{0});
  // The ranks' agreement restricts keeps as it restricts gathers ahead (depth 1 at m = 3: the
  // last block's group is released after m = 2 and gathered again).
  in.budget[1] = 10'000;
  std::vector<std::size_t> agreed(t.size(), 2);
  agreed[3] = 1;
  const auto restricted = plan_gathers(t, in, agreed);
  CHECK(restricted.keep[2].empty());
  CHECK(restricted.kept == 2);
  // Kept from forward to the step (sharding_options::keep_gathered): nothing is released, nothing kept.
  in.keep_gathered = true;
  CHECK(plan_gathers(t, in).kept == 0);
}

TEST_CASE(
    "plan_gathers: deeper never needs more than the budget where depth 1 fits, and gathers as often or keeps instead") {
  // Random traces (forward and backward over random chunk sets, the step), random budgets, 2-4 ranks.
  std::uint64_t state = 12345;
  const auto next = [&](std::uint64_t mod) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (state >> 33) % mod;
  };
  int deeper = 0, kept = 0;
  for (int trial = 0; trial < 300; ++trial) {
    CAPTURE(trial);
    const int world = 2 + static_cast<int>(next(3));
    const std::size_t chunks = 2 + next(10), layers = 2 + next(6);
    sharding_trace t;
    std::vector<std::vector<std::uint32_t>> uses(layers);
    for (auto& u : uses) {
      for (std::size_t k = 0, n = 1 + next(3); k < n; ++k) u.push_back(static_cast<std::uint32_t>(next(chunks)));
      std::sort(u.begin(), u.end());
      u.erase(std::unique(u.begin(), u.end()), u.end());
    }
    for (std::size_t l = 0; l < layers; ++l) t.kinds.push_back(moment_kind::forward), t.params.push_back(uses[l]), t.grads.emplace_back();
    for (std::size_t l = layers; l-- > 0;) t.kinds.push_back(moment_kind::backward), t.params.push_back(uses[l]), t.grads.push_back(uses[l]);
    t.kinds.push_back(moment_kind::optimizer), t.params.emplace_back(), t.grads.emplace_back();
    gather_plan_inputs in{.map = {.world = world, .rank = static_cast<int>(next(static_cast<std::uint64_t>(world)))},
                          .param_chunk_bytes = 100,
                          .grad_chunk_bytes = 100,
                          .keep_gathered = next(4) == 0,
                          .depth = 1,
                          .budget = {}};
    for (std::size_t m = 0; m < t.size(); ++m) in.budget.push_back(300 + 100 * next(30));
    const auto one = plan_gathers(t, in);
    for (const std::size_t depth : {2, 3, 5}) {
      CAPTURE(depth);
      in.depth = depth;
      const auto d = plan_gathers(t, in);
      CHECK(d.gathers + d.kept == one.gathers + one.kept);  // a group kept is one not gathered again
      CHECK(d.reductions == one.reductions);
      for (std::size_t m = 0; m < t.size(); ++m) {
        CAPTURE(m);
        // Gathers ahead add only where the budget holds them: beyond it only where the moment's
        // own demand, as at depth 1, already is.
        CHECK(d.need[m] <= std::max(in.budget[m], one.demand[m]));
        // Each for a later moment; the step's for the next iteration's first scope.
        for (std::size_t i = 0; i < d.ahead[m].size(); ++i)
          CHECK((m == d.step ? d.until[m][i] < m : d.until[m][i] > m));
        for (const std::size_t until : d.keep_until[m]) CHECK(until > m + 1);  // else it was never released
      }
      deeper += d.gathers_ahead + d.kept > one.gathers_ahead + one.kept;
      kept += d.kept > one.kept;
    }
  }
  MESSAGE(deeper << " of 900 plans gather or keep more groups ahead than at depth 1, " << kept << " keep more");
  CHECK(deeper > 0);
  CHECK(kept > 0);
}

TEST_CASE("ZeRO memory-saving mode: chunk by chunk, the reference's bits at N = 1-4 where group buffers do not fit") {
  // One chunk per layer. A scope then holds one remote parameter chunk, its gradient chunk and the
  // previous layer's gradient still being reduced: at most 4 chunks of collective buffers at any N
  // (with keep_gathered, the forward's remote chunks stay for backward: at most 4 of them, and two
  // gradient chunks), where groups need 4N + 1. At 4 ranks the tight budget below holds the
  // former, not the latter.
  for (int ranks : {1, 2, 3, 4}) {
    CAPTURE(ranks);
    const auto expected = reference(ranks);
    const std::size_t tight = act_bytes + 6 * chunk_bytes;
    for (std::size_t capacity : {std::size_t{1} << 20, tight}) {
      for (bool keep : {false, true}) {
        CAPTURE(capacity);
        CAPTURE(keep);
        const auto got = train_zero(ranks, capacity, keep, 2, true, /*memory_saving=*/true);
        params_by_name all;
        for (std::size_t k = 0; k < got.size(); ++k) {
          for (const auto& v : got[k].violations) FAIL_CHECK(v);
          for (int step = 1; step <= steps; ++step)
            CHECK(got[k].losses[static_cast<std::size_t>(step - 1)] ==
                  expected.losses[static_cast<std::size_t>(step - 1)][k]);
          all.insert(got[k].params.begin(), got[k].params.end());
          CHECK(got[k].stats.peak_collective_bytes <= (keep ? 6 : 4) * chunk_bytes);
          CHECK(got[k].stats.peak_device_bytes <= capacity);
          CHECK(got[k].stats.peak_model_bytes <=
                got[k].model_bytes / static_cast<std::size_t>(ranks) + got[k].stats.peak_collective_bytes);
          CHECK(got[k].stats.gathers_ahead == 0);
          if (ranks > 1) CHECK(got[k].stats.gathers > 0);
        }
        REQUIRE(all.size() == expected.params.size());
        for (const auto& [name, values] : expected.params) CHECK_MESSAGE(all[name] == values, name);
      }
    }
  }
  // The same budget at 4 ranks is too small for group buffers: a typed error, not a hang.
  CHECK_THROWS_AS(train_zero(4, act_bytes + 6 * chunk_bytes, false), out_of_memory_error);
}

TEST_CASE("ZeRO out of memory names the user's scope, also where backward's gradient buffers do not fit") {
  // Budgets from too small for forward's gathers up to enough: each failure names a scope of the
  // model ('l0'..'l3'), never a pseudo-scope; at least one fails in backward.
  int in_backward = 0, failures = 0;
  for (std::size_t chunks = 4; chunks <= 12; ++chunks) {
    try {
      (void)train_zero(4, act_bytes + chunks * chunk_bytes, false);
    } catch (const out_of_memory_error& e) {
      ++failures;
      const std::string what = e.what();
      CAPTURE(what);
      CHECK(what.find("'gradients'") == std::string::npos);
      CHECK(what.find("scope 'l") != std::string::npos);
      in_backward += what.find("its gradient buffers") != std::string::npos;
    }
  }
  CHECK(failures > 0);
  CHECK(in_backward > 0);
  MESSAGE(failures << " budgets failed, " << in_backward << " of them for backward's gradient buffers");
}

TEST_CASE("ZeRO memory-saving mode: each chunk's reduction to its owner runs while the next backward scope computes") {
  // One chunk per layer, so in this mode one reduction per layer and iteration; all but layer 0's
  // (no scope after it) have a backward scope computed between their start and their wait.
  for (int ranks : {2, 3}) {
    CAPTURE(ranks);
    for (const auto& [log, params, stats, violations] :
         train_recorded(ranks, {.enabled = true, .memory_saving = true})) {
      std::vector<std::size_t> started, overlapped;
      std::size_t pending = 0, computed_since = 0;
      for (const auto& e : log) {
        if (e == "iteration") started.push_back(0), overlapped.push_back(0);
        else if (started.empty()) continue;
        else if (e == "reduce-start") ++started.back(), ++pending, computed_since = 0;
        else if (e == "computed") ++computed_since;
        else if (e == "reduce-wait") {
          REQUIRE(pending > 0);
          --pending;
          if (computed_since > 0) ++overlapped.back();
        }
        CHECK(e != "reduce");          // never a synchronous reduction
        CHECK(e != "reduce-scatter");  // nor a group's
      }
      REQUIRE(started.size() == static_cast<std::size_t>(steps));
      for (std::size_t it = 0; it < started.size(); ++it) {
        CAPTURE(it);
        CHECK(started[it] == 4);
        CHECK(overlapped[it] == 3);
      }
    }
  }
}

}  // namespace zero_test
