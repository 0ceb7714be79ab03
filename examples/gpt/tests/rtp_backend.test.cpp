// SPDX-License-Identifier: Apache-2.0
// RTP on a device-like backend, checked on the CPU: what a GPU run relies on (which buffer, which
// order, when to wait) without the GPU. `deferred_backend` (deferred_backend.hpp) runs the CPU
// kernels only when waited for, so a rotation that shifted a buffer before settling the stream
// would send it before the kernel wrote it (or overwrite it before the kernel read it), and a
// replicated all-reduce that did not wait would sum stale gradients: either changes the bits.
// Checked on 1-3 in-process ranks:
//  * the block (rtp_block_runs.hpp): the CPU backend's bits in every output, input gradient, shard
//    gradient, replica gradient and update; with the waits skipped (a faulty double) not, so the
//    comparison has teeth;
//  * the whole model (rtp_gpt, shards in host memory, its compute tier the backend's): the CPU
//    model's bits in every loss, gradient, parameter, Adam moment and next-token probability
//    over SGD and AdamW steps with evaluations (rtp_model_support.hpp's run).
#include "deferred_backend.hpp"
#include "rtp_block_runs.hpp"
#include "rtp_model_support.hpp"

#include <chunkstar/comm/in_process_group.hpp>

#include <doctest/doctest.h>

#include <vector>

namespace rtp_backend_test {

namespace {

using chunkstar::in_process_communicator;
using gpt::testing::deferred_backend;
using gpt::testing::rtp_block_record;
using gpt::testing::run_rtp_block;
namespace rtp_model = gpt::testing::rtp_model;

template <class Make>
std::vector<rtp_block_record> run(int n, Make make, int iters = 3) {
  std::vector<rtp_block_record> out(static_cast<std::size_t>(n));
  chunkstar::run_ranks(n, [&](in_process_communicator& comm) {
    auto b = make();
    out[static_cast<std::size_t>(comm.rank())] = run_rtp_block(comm, b, iters);
  });
  return out;
}

}  // namespace

TEST_CASE("rtp block on a backend whose kernels run only when waited for: the CPU backend's bits on 1-3 ranks") {
  for (int n = 1; n <= 3; ++n) {
    CAPTURE(n);
    const auto cpu = run(n, [] { return gpt::cpu_backend{}; });
    const auto deferred = run(n, [] { return deferred_backend{}; });
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      const auto& a = cpu[static_cast<std::size_t>(r)];
      const auto& d = deferred[static_cast<std::size_t>(r)];
      REQUIRE(a.y.size() == 3);
      CHECK(d.y == a.y);
      CHECK(d.dx == a.dx);
      CHECK(d.attn_grad == a.attn_grad);
      CHECK(d.mlp_grad == a.mlp_grad);
      CHECK(d.rep_grad == a.rep_grad);
      CHECK(d.rep == a.rep);
      // The replicas' gradient sums agree over the ranks, and something was learnt.
      CHECK(a.rep_grad == cpu[0].rep_grad);
      CHECK(a.y[0] != a.y[2]);
    }
  }
}

TEST_CASE(
    "rtp block on the deferred backend with its waits skipped: different bits, so the comparison sees a missing wait") {
  const auto cpu = run(
      2, [] { return gpt::cpu_backend{}; }, 2);
  const auto faulty = run(
      2, [] { return deferred_backend{true}; }, 2);
  bool differs = false;
  for (int r = 0; r < 2; ++r)
    differs = differs || faulty[static_cast<std::size_t>(r)] != cpu[static_cast<std::size_t>(r)];
  CHECK(differs);
}

TEST_CASE("rtp model on a backend whose kernels run only when waited for: the CPU model's bits on 1-3 ranks") {
  using tier = gpt::backend_tier<deferred_backend>;
  using store = chunkstar::rtp::basic_host_shard_store<tier>;
  for (int n = 1; n <= 3; ++n) {
    CAPTURE(n);
    const auto cpu = rtp_model::run_rtp(n, 3, 3);
    std::vector<rtp_model::rank_record> deferred(static_cast<std::size_t>(n));
    chunkstar::run_ranks(n, [&](in_process_communicator& comm) {
      deferred_backend b;
      store s{tier{&b}};
      gpt::rtp_gpt<in_process_communicator, store, deferred_backend> model(comm, s, rtp_model::config, rtp_model::B,
                                                                           rtp_model::Tn, &b);
      deferred[static_cast<std::size_t>(comm.rank())] = rtp_model::train_model(comm, model, 3, 3);
    });
    REQUIRE(cpu[0].adam_train_loss.size() == 3);
    CHECK(rtp_model::same_bits(deferred, cpu));
    CHECK(cpu[0].adam_params.back() != cpu[0].initial);  // the steps moved the weights
  }
}

}  // namespace rtp_backend_test
