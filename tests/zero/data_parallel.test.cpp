// SPDX-License-Identifier: Apache-2.0
// Replicated data parallelism: N in-process ranks, each its own runtime over a communicator held by
// reference, each computing its own micro-batch; gradient chunks all-reduced as soon as they are
// final (overlapped with the rest of backward). With clipping on, every rank's parameters are
// bit-identical to one process that computes the N micro-batches' gradients separately and sums
// them in rank order — the order the communicators reduce in — then steps.
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/disk/disk_copy_engine.hpp>
#include <chunkstar/disk/disk_space.hpp>
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/placement/static_placement.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>
#include <chunkstar/zero/replicated_gradients.hpp>

#include "support/device_memory_communicator.hpp"
#include "support/disk_test_dir.hpp"
#include "support/mlp_replica.hpp"
#include "support/runtimes.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

using namespace chunkstar;

namespace data_parallel_test {

namespace {

using chunkstar::testing::mlp_replica;
using chunkstar::testing::mlp_runtime;
constexpr int B = chunkstar::testing::mlp_batch, D = chunkstar::testing::mlp_width, steps = 4;
template <class Comm>
using runtime_t = mlp_runtime<Comm>;
template <class Comm>
using replica = mlp_replica<Comm>;

// A device for activations plus a third of the chunks: gradients move while being reduced.
constexpr std::size_t capacity = 12 * B * D * sizeof(float) + 7 * 256 * sizeof(float);

chunk_adam<> make_adam() {
  return chunk_adam<>({.hyper = {.lr = 2e-2f, .weight_decay = 0.01f}, .max_grad_norm = 0.05f});
}

/** One process: each micro-batch's gradient computed on its own, summed in rank order, then one step. */
std::vector<float> reference(int ranks, std::vector<double>& clip) {
  replica<single_process_communicator> r({.gradients = gradient_mode::local}, capacity);
  auto opt = make_adam();
  for (int step = 1; step <= steps; ++step) {
    std::vector<float> sum;
    for (int mb = 0; mb < ranks; ++mb) {
      r.rt.zero_grad();
      r.forward_backward(step, mb, [] {});
      const auto g = r.all(chunk_kind::grad);
      if (mb == 0) sum = g;
      else
        for (std::size_t i = 0; i < g.size(); ++i) sum[i] += g[i];  // rank order, in float
    }
    r.rt.zero_grad();
    r.write_all(chunk_kind::grad, sum);
    const auto res = opt.step(r.rt, 2e-2f, ranks);
    REQUIRE(res.stepped);
    clip.push_back(res.clip_coefficient);
  }
  return r.all(chunk_kind::param);
}

/** Every optimizer step on the host. */
struct all_host : static_placement {
  all_host() : static_placement{static_placement::all_host()} {}
};

}  // namespace

TEST_CASE(
    "replicated data parallelism over N in-process ranks equals one process summing the micro-batches in rank order") {
  for (int ranks : {2, 3, 4}) {
    CAPTURE(ranks);
    std::vector<double> clip_ref;
    const auto expected = reference(ranks, clip_ref);
    CHECK(clip_ref.back() < 1.0);  // clipping is active, so the norm must be the global one
    std::vector<std::vector<float>> params(static_cast<std::size_t>(ranks));
    std::vector<std::size_t> early(static_cast<std::size_t>(ranks), 0);
    std::vector<std::vector<double>> clips(static_cast<std::size_t>(ranks));
    run_ranks(ranks, [&](in_process_communicator& comm) {
      const auto me = static_cast<std::size_t>(comm.rank());
      replica<in_process_communicator> r({.gradients = gradient_mode::replicated}, capacity, comm);
      replicated_gradients dp(r.rt);
      auto opt = make_adam();
      for (int step = 1; step <= steps; ++step) {
        r.forward_backward(step, comm.rank(), [&] { dp.after_backward(); });
        if (step > 1) early[me] += dp.started();  // with a trace, reductions start during backward
        dp.synchronize();
        const auto res = opt.step(r.rt, 2e-2f, ranks);
        REQUIRE(res.stepped);
        clips[me].push_back(res.clip_coefficient);
        CHECK(r.rt.invariant_violations().empty());
      }
      params[me] = r.all(chunk_kind::param);
      CHECK(r.rt.stats().bytes_to_host > 0);  // chunks moved under the budget
    });
    for (int k = 0; k < ranks; ++k) {
      CAPTURE(k);
      CHECK(params[static_cast<std::size_t>(k)] == expected);
      CHECK(clips[static_cast<std::size_t>(k)] == clip_ref);
      CHECK(early[static_cast<std::size_t>(k)] > 0);
    }
  }
}

TEST_CASE(
    "replicated data parallelism with a disk tier per rank below a small host: gradients on the disk come up (room "
    "made) to be all-reduced, and the bits are those without a disk") {
  chunkstar::test::scratch_dir dir;
  constexpr std::size_t block = 4096;  // a chunk's footprint on the host and the disk with a disk tier
  for (int ranks : {2, 3})
    for (std::size_t host_blocks : {5, 9}) {
      CAPTURE(ranks);
      CAPTURE(host_blocks);
      std::vector<double> clip_ref;
      const auto expected = reference(ranks, clip_ref);
      std::vector<std::vector<float>> params(static_cast<std::size_t>(ranks));
      std::vector<std::uint64_t> from_disk(static_cast<std::size_t>(ranks));
      run_ranks(ranks, [&](in_process_communicator& comm) {
        disk_space disk(disk_space_options{
            .directory = dir.path(), .capacity = 64 * block, .name = "rank" + std::to_string(comm.rank())});
        disk_copy_engine disk_io(disk);
        // Every optimizer step on the host (train_gpt --policy offload), a host of 5 or 9 blocks for
        // the 24 chunks: most of them, gradients too, live on the disk.
        using host_replica = mlp_replica<in_process_communicator, all_host>;
        host_replica r(
            {.gradients = gradient_mode::replicated}, capacity, host_space_options{.capacity = host_blocks * block},
            [&](host_replica::runtime_type& rt) { rt.attach_disk(disk_tier(disk, disk_io)); }, comm);
        replicated_gradients dp(r.rt);
        auto opt = make_adam();
        for (int step = 1; step <= steps; ++step) {
          r.forward_backward(step, comm.rank(), [] {});
          dp.after_backward();  // after the whole backward, as train_gpt: gradients went down meanwhile
          dp.synchronize();
          REQUIRE(opt.step(r.rt, 2e-2f, ranks).stepped);
          CHECK(r.rt.invariant_violations().empty());
        }
        params[static_cast<std::size_t>(comm.rank())] = r.all(chunk_kind::param);
        from_disk[static_cast<std::size_t>(comm.rank())] = r.rt.stats().bytes_from_disk;
      });
      for (int k = 0; k < ranks; ++k) {
        CAPTURE(k);
        CHECK(params[static_cast<std::size_t>(k)] == expected);
        CHECK(from_disk[static_cast<std::size_t>(k)] > 0);
      }
    }
}

TEST_CASE("the gradient norm follows the gradient mode: sharded sums over ranks, replicated and local do not") {
  // Two ranks hold the same gradient; only `sharded` may add the squared norms of both.
  for (gradient_mode mode : {gradient_mode::local, gradient_mode::replicated, gradient_mode::sharded}) {
    std::vector<double> norms(2);
    run_ranks(2, [&](in_process_communicator& comm) {
      simulated_device_space dev({.capacity = 1 << 20});
      host_space host;
      host_copy_engine copier;
      runtime_t<in_process_communicator> rt(dev, host, copier, comm, {.gradients = mode},
                                            fixed_chunk_layout({.chunk_elems = 64}));
      const auto p = rt.register_param({"p", {4}, dtype::f32, tensor_role::weight});
      rt.finalize();
      {
        auto s = rt.backward("p", {p});
        for (float& g : s.grad<float>(p)) g = 1.0f;  // norm 2 on each rank
      }
      chunk_adam<> opt;
      if (mode == gradient_mode::replicated) rt.gradient_reduced(0);  // the same on both ranks already
      norms[static_cast<std::size_t>(comm.rank())] = opt.step(rt, 1e-3f).grad_norm;
    });
    CAPTURE(static_cast<int>(mode));
    CHECK(norms[0] == norms[1]);
    CHECK(norms[0] == doctest::Approx(mode == gradient_mode::sharded ? std::sqrt(8.0) : 2.0));
  }
  simulated_device_space dev({.capacity = 1 << 20});
  host_space host;
  host_copy_engine copier;
  runtime_t<single_process_communicator> rt(dev, host, copier);
  CHECK_THROWS_AS((replicated_gradients<runtime_t<single_process_communicator>>{rt}), config_error);
}

TEST_CASE(
    "replicated gradients never all-reduced: the step refuses on every rank instead of letting replicas diverge") {
  // A trainer that builds the runtime with gradient_mode::replicated and forgets replicated_gradients
  // (or one chunk of its own all-reduces): each rank would step its own gradients.
  for (const bool report_some : {false, true}) {
    std::vector<std::string> messages(2);
    run_ranks(2, [&](in_process_communicator& comm) {
      simulated_device_space dev({.capacity = 1 << 20});
      host_space host;
      host_copy_engine copier;
      runtime_t<in_process_communicator> rt(dev, host, copier, comm, {.gradients = gradient_mode::replicated},
                                            fixed_chunk_layout({.chunk_elems = 64}));
      const auto p = rt.register_param({"p", {48}, dtype::f32, tensor_role::weight});
      const auto q = rt.register_param({"q", {48}, dtype::f32, tensor_role::weight});
      rt.finalize();
      {
        auto s = rt.backward("pq", {p, q});
        for (float& g : s.grad<float>(p)) g = static_cast<float>(comm.rank() + 1);
        for (float& g : s.grad<float>(q)) g = 1.0f;
      }
      if (report_some) rt.gradient_reduced(0);  // chunk 1 (q) forgotten
      chunk_adam<> opt({.max_grad_norm = 1.0f});
      try {
        (void)opt.step(rt, 1e-3f);
      } catch (const state_error& e) {
        messages[static_cast<std::size_t>(comm.rank())] = e.what();
      }
    });
    for (const auto& m : messages) {
      CAPTURE(m);
      CHECK(m.find(report_some ? "chunk 1's gradient was not all-reduced" : "chunk 0's gradient was not all-reduced") !=
            std::string::npos);
      CHECK(m.find("replicated_gradients") != std::string::npos);
    }
  }
}

TEST_CASE(
    "replicated data parallelism over a communicator that takes device memory: gradients loaded to the device first, "
    "the same bits") {
  using chunkstar::testing::device_memory_communicator;
  using chunkstar::testing::tracked_platform;
  constexpr int ranks = 3;
  std::vector<double> clip_ref;
  const auto expected = reference(ranks, clip_ref);
  std::vector<std::vector<float>> params(ranks);
  std::vector<std::size_t> checked(ranks);
  std::vector<runtime_stats> stats(ranks);
  run_ranks(ranks, [&](in_process_communicator& inner) {
    const auto me = static_cast<std::size_t>(inner.rank());
    device_memory_communicator comm(inner);
    mlp_replica<device_memory_communicator, auto_placement, belady_eviction, tracked_platform> r(
        {.gradients = gradient_mode::replicated}, capacity, comm);
    replicated_gradients dp(r.rt, {.max_in_flight = 2});
    auto opt = make_adam();
    for (int step = 1; step <= steps; ++step) {
      r.forward_backward(step, comm.rank(), [&] { dp.after_backward(); });
      dp.synchronize();
      REQUIRE(opt.step(r.rt, 2e-2f, ranks).stepped);
      CHECK(r.rt.invariant_violations().empty());
    }
    params[me] = r.all(chunk_kind::param);
    checked[me] = comm.checked();
    stats[me] = r.rt.stats();
  });
  for (std::size_t k = 0; k < ranks; ++k) {
    CAPTURE(k);
    CHECK(params[k] == expected);
    CHECK(checked[k] > 0);              // every all-reduce was checked ...
    CHECK(stats[k].bytes_to_host > 0);  // ... while gradients were being evicted to the host
  }
}

}  // namespace data_parallel_test
