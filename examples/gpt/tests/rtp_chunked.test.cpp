// SPDX-License-Identifier: Apache-2.0
// RTP composed with chunk offload: each rank's shards (weights, gradients, Adam moments) live in
// that rank's chunk runtime (rtp::chunk_shard_store) under a device budget, the transit buffers
// and activations are non-model memory the runtime accounts for, and the optimizer step is local,
// run where the placement put each chunk. The invariants: the same bits whatever the budget,
// placement and eviction policy; the bits of the host store (rtp::host_shard_store) without
// clipping; the device never above its budget, and chunks really moving at a tight one; and, on the
// scripted platform, every stage closing its scope on the store ops' stream (the GPU's contract).
#include "rtp_model_support.hpp"
#include "support/runtimes.hpp"
#include "support/scripted_copy_engine.hpp"

#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/eviction/lru.hpp>
#include <chunkstar/placement/static_placement.hpp>
#include <chunkstar/rtp/chunk_shard_store.hpp>
#include <chunkstar/runtime/assemblies.hpp>

#include <doctest/doctest.h>

#include <cstring>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace rtp_chunked_test {

namespace {

using chunkstar::in_process_communicator;
using namespace gpt::testing::rtp_model;

/** One rank's view after each AdamW step, and what its memory did. */
struct chunked_record {
  std::vector<flat> params;
  std::vector<double> losses, eval;
  std::size_t device_peak = 0, device_capacity = 0, moved = 0, evictions = 0 /* and offloads */, host_steps = 0,
              device_steps = 0;
  std::size_t non_model_peak = 0, transit_and_activations = 0;
  bool operator==(const chunked_record& o) const {
    if (params.size() != o.params.size()) return false;
    for (std::size_t i = 0; i < params.size(); ++i)
      if (std::memcmp(params[i].data(), o.params[i].data(), params[i].size() * sizeof(float)) != 0) return false;
    return std::memcmp(losses.data(), o.losses.data(), losses.size() * sizeof(double)) == 0 &&
           std::memcmp(eval.data(), o.eval.data(), eval.size() * sizeof(double)) == 0;
  }
};

constexpr int steps = 4;

/** Iterations after whose evaluation the model sleeps and wakes; `asleep` runs while it sleeps. */
struct sleeps {
  std::set<int> after;
  std::function<void()> asleep = [] {};
};

/** Trains `steps` AdamW steps (clipping at @p clip, 0 off) on this rank, an evaluation after each. */
template <class Model>
void train(Model& model, in_process_communicator& comm, float clip, chunked_record& rec, const sleeps& sl = {}) {
  model.init(seed);
  for (int it = 0; it < steps; ++it) {
    const micro_batch mb = make_batch(false, it, comm.rank());
    rec.losses.push_back(model.forward(mb.tokens.data(), mb.targets.data()));
    model.backward(mb.tokens.data(), mb.targets.data());
    model.step(adamw, adam_groups, comm.size(), clip);
    rec.params.push_back(stored(model, false));
    const micro_batch ev = make_batch(true, 0, comm.rank());
    rec.eval.push_back(model.loss(ev.tokens.data(), ev.targets.data()));
    if (sl.after.contains(it)) {
      model.sleep();
      sl.asleep();
      model.wake();
    }
  }
}

/** The chunked run on @p n ranks with a device of @p device_share of the model data beside the
 *  non-model memory (activations, transit buffers), runtime assembly @p Runtime. */
template <class Runtime>
std::vector<chunked_record> run_chunked(int n, double device_share, float clip,
                                        typename Runtime::placement_type placement = {}, std::set<int> sleep_after = {},
                                        std::vector<std::size_t>* asleep_device_used = nullptr) {
  std::vector<chunked_record> out(static_cast<std::size_t>(n));
  chunkstar::run_ranks(n, [&](in_process_communicator& comm) {
    auto& rec = out[static_cast<std::size_t>(comm.rank())];
    // Size the device from a host-store model of the same shape (the same shards and non-model memory).
    std::size_t model_data = 0, non_model = 0;
    {
      gpt::rtp_gpt<in_process_communicator> probe(comm, config, B, Tn);
      model_data = probe.store().bytes();
      non_model = probe.activation_bytes() + probe.transient_bytes();
    }
    const std::size_t capacity =
        non_model + static_cast<std::size_t>(device_share * static_cast<double>(model_data)) + (256 << 10);
    chunkstar::simulated_device_space device({.capacity = capacity});
    chunkstar::host_space host;
    chunkstar::host_copy_engine copier;
    chunkstar::single_process_communicator one;
    Runtime rt(device, host, copier, one, {}, chunkstar::searched_chunk_layout(), placement);
    chunkstar::rtp::chunk_shard_store<Runtime> store(rt);
    gpt::rtp_gpt<in_process_communicator, chunkstar::rtp::chunk_shard_store<Runtime>> model(comm, store, config, B, Tn);
    train(model, comm, clip, rec, {sleep_after, [&] {
                                     if (comm.rank() == 0 && asleep_device_used)
                                       asleep_device_used->push_back(device.used() + rt.device_chunk_bytes());
                                   }});
    const auto& s = rt.stats();
    rec.device_peak = device.usage().peak;
    rec.device_capacity = capacity;
    rec.moved = s.bytes_moved();
    rec.evictions = s.evictions + s.offloads;  // chunks sent down: by Belady when room ran out, or by the plan
    rec.host_steps = s.host_steps;
    rec.device_steps = s.device_steps;
    rec.non_model_peak = s.peak_non_model_bytes;
    rec.transit_and_activations = model.transient_bytes() + model.activation_bytes();
  });
  return out;
}

std::vector<chunked_record> run_host(int n, float clip, std::set<int> sleep_after = {}) {
  std::vector<chunked_record> out(static_cast<std::size_t>(n));
  chunkstar::run_ranks(n, [&](in_process_communicator& comm) {
    gpt::rtp_gpt<in_process_communicator> model(comm, config, B, Tn);
    train(model, comm, clip, out[static_cast<std::size_t>(comm.rank())], {sleep_after});
  });
  return out;
}

using belady_rt = chunkstar::patrickstar_runtime;
using lru_rt = chunkstar::lru_runtime;
using static_rt = chunkstar::static_runtime;

}  // namespace

TEST_CASE("rtp with chunk offload: the same bits at every budget, placement and policy, and the host store's") {
  for (const int n : {1, 2, 3}) {
    CAPTURE(n);
    const auto roomy = run_chunked<belady_rt>(n, 1.5, max_norm);
    for (const double share : {0.6, 0.3}) {
      CAPTURE(share);
      const auto tight = run_chunked<belady_rt>(n, share, max_norm);
      CHECK(tight == roomy);
      for (const auto& r : tight) {
        CHECK(r.device_peak <= r.device_capacity);
        CHECK(r.moved > 0);  // the shards really travel between the tiers
        CHECK(r.evictions > 0);
        // The transit buffers and activations are non-model memory the runtime accounts for.
        CHECK(r.non_model_peak >= r.transit_and_activations);
      }
    }
    CHECK(run_chunked<lru_rt>(n, 0.3, max_norm) == roomy);
    const auto offload = run_chunked<static_rt>(n, 0.3, max_norm, chunkstar::static_placement::all_host());
    CHECK(offload == roomy);
    for (const auto& r : offload) CHECK(r.host_steps > 0);  // the step ran where the chunks were: on the host
    for (const auto& r : roomy) CHECK(r.device_steps > 0);
    // Without clipping nothing depends on how the norm's sum is grouped: the host store's bits.
    CHECK(run_chunked<belady_rt>(n, 0.3, 0.0f) == run_host(n, 0.0f));
    MESSAGE("N = " << n << ": at 0.3 of the model data on the device, "
                   << run_chunked<belady_rt>(n, 0.3, max_norm)[0].moved << " bytes moved on rank 0 over " << steps
                   << " steps");
  }
}

TEST_CASE(
    "rtp with chunk offload: a device too small for a stage beside the non-model memory is a typed out-of-memory "
    "error") {
  chunkstar::run_ranks(1, [&](in_process_communicator& comm) {
    chunkstar::simulated_device_space device({.capacity = 64 << 10});
    chunkstar::host_space host;
    chunkstar::host_copy_engine copier;
    chunkstar::single_process_communicator one;
    belady_rt rt(device, host, copier, one, {}, chunkstar::searched_chunk_layout());
    chunkstar::rtp::chunk_shard_store<belady_rt> store(rt);
    CHECK_THROWS_AS((gpt::rtp_gpt<in_process_communicator, chunkstar::rtp::chunk_shard_store<belady_rt>>(
                        comm, store, config, B, Tn)),
                    chunkstar::out_of_memory_error);
  });
}

TEST_CASE("rtp chunk store: fp16 or bf16 runtimes are refused with the fix named") {
  chunkstar::simulated_device_space device({.capacity = 1 << 20});
  chunkstar::host_space host;
  chunkstar::host_copy_engine copier;
  chunkstar::single_process_communicator one;
  belady_rt rt(device, host, copier, one, {.param_type = chunkstar::dtype::bf16}, chunkstar::searched_chunk_layout());
  const auto make = [&] { chunkstar::rtp::chunk_shard_store<belady_rt> store(rt); };
  CHECK_THROWS_WITH_AS(make(), doctest::Contains("param_type f32"), chunkstar::config_error);
}

namespace {

/** A chunk shard store's ops on the scripted platform: the host loops, and the stream the model's
 *  kernels "run" on, which the stages must close their scopes with. */
struct scripted_shard_ops {
  static constexpr int stream_id = 9;
  int* copies = nullptr;
  void copy(float* dst, const float* src, std::size_t n) const {
    ++*copies;
    std::copy(src, src + n, dst);
  }
  void add(float* acc, const float* x, std::size_t n) const {
    for (std::size_t i = 0; i < n; ++i) acc[i] += x[i];
  }
  [[nodiscard]] chunkstar::testing::scripted_stream stream() const noexcept { return {stream_id}; }
};

}  // namespace

TEST_CASE("rtp chunk store: every stage closes its scope on the ops' stream, and the shards move through the ops") {
  using namespace chunkstar;
  using Runtime = chunk_runtime<searched_chunk_layout, static_placement, belady_eviction, warmup_tracer,
                                single_process_communicator, testing::scripted_platform>;
  simulated_device_space device({.capacity = 64u << 20});
  host_space host;
  testing::scripted_copy_engine engine;
  single_process_communicator one, comm;
  Runtime rt(device, host, engine, one, {}, searched_chunk_layout(), static_placement::all_device());
  int copies = 0;
  rtp::chunk_shard_store<Runtime, scripted_shard_ops> store(rt, scripted_shard_ops{&copies});
  gpt::rtp_gpt<single_process_communicator, rtp::chunk_shard_store<Runtime, scripted_shard_ops>> model(comm, store,
                                                                                                       config, B, Tn);
  model.init(seed);  // each replica's working copy loaded in a stage of its own
  const std::size_t L = static_cast<std::size_t>(config.layers);
  const std::size_t at_init = engine.ops_of(testing::scripted_op_kind::record).size();
  CHECK(at_init == L + 1);
  const micro_batch mb = make_batch(false, 0, 0);
  (void)model.forward(mb.tokens.data(), mb.targets.data());
  model.backward(mb.tokens.data(), mb.targets.data());
  // Forward: embedding, L blocks, head; backward: head, L blocks, embedding, then each replica's
  // gradients (wpe | lnf, each block's). One record each, on the ops' stream.
  const auto records = engine.ops_of(testing::scripted_op_kind::record);
  CHECK(records.size() - at_init == 2 * (L + 2) + L + 1);
  for (const auto& op : records) CHECK(op.stream == scripted_shard_ops::stream_id);
  CHECK(copies > 0);  // the shards were loaded through the ops (on a GPU: device copies on the stream)
}

TEST_CASE(
    "rtp sleep and wake between steps: nothing on the device while asleep (chunks, transit buffers, replicas, "
    "activations), then the bits of a run that never slept") {
  for (const int n : {1, 3}) {
    CAPTURE(n);
    for (const double share : {1.5, 0.3}) {
      CAPTURE(share);
      const auto awake = run_chunked<belady_rt>(n, share, max_norm);
      std::vector<std::size_t> asleep_used;
      CHECK(run_chunked<belady_rt>(n, share, max_norm, {}, {0, 2}, &asleep_used) == awake);
      CHECK(asleep_used == std::vector<std::size_t>(2, 0));
    }
    CHECK(run_host(n, max_norm, {1}) == run_host(n, max_norm));
  }
  // Refused where it would lose work: between a forward and its backward, and twice.
  chunkstar::single_process_communicator comm;
  gpt::rtp_gpt<chunkstar::single_process_communicator> m(comm, config, B, Tn);
  m.init(seed);
  const micro_batch mb = make_batch(false, 0, 0);
  m.forward(mb.tokens.data(), mb.targets.data());
  CHECK_THROWS_WITH_AS(m.sleep(), doctest::Contains("a forward is waiting for its backward"), chunkstar::state_error);
  m.backward(mb.tokens.data(), mb.targets.data());
  m.sleep();
  CHECK_THROWS_WITH_AS(m.sleep(), doctest::Contains("call wake() first"), chunkstar::state_error);
  CHECK_THROWS_WITH_AS(m.forward(mb.tokens.data(), mb.targets.data()), doctest::Contains("call wake() first"),
                       chunkstar::state_error);
  m.wake();
  CHECK_THROWS_WITH_AS(m.wake(), doctest::Contains("call sleep() first"), chunkstar::state_error);
  CHECK(std::isfinite(m.forward(mb.tokens.data(), mb.targets.data())));
}

}  // namespace rtp_chunked_test
