// SPDX-License-Identifier: Apache-2.0
// RTP on a GPU (label cuda; without a GPU it exits 77, skipped): 1-3 ranks (threads of this
// process) share GPU 0, each with its own cuda_backend (stream, cuBLAS) and a staged_communicator
// over the in-process group (cuda::host_stager: the shifts and the replicated all-reduces go
// through pinned host buffers); transit buffers, activations and the replicas' working copies in
// device memory.
//  * The block (shards in device memory): three SGD steps track the CPU backend's within fp32
//    tolerance (cuBLAS sums in another order), and a second run repeats the first bit for bit (no
//    atomics, a fixed cuBLAS configuration).
//  * The whole model (shards in host memory, loaded per pass): SGD and AdamW steps with
//    evaluations track the CPU model's losses, and repeat bit for bit.
// The waits these runs rely on (a shift only after the stream has finished with its buffers, the
// all-reduce after the kernels that wrote the gradients, a host read after the kernels) are checked
// on the CPU by rtp_backend.test.cpp.
#include "gpt_backend_cuda.hpp"
#include "rtp_block_runs.hpp"
#include "rtp_model_support.hpp"

#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/comm/staged_communicator.hpp>
#include <chunkstar/cuda/host_stager.hpp>

#include <cuda_runtime_api.h>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace rtp_cuda_test {

namespace {

using chunkstar::in_process_communicator;
using gpt::testing::rtp_block_record;
using gpt::testing::run_rtp_block;

constexpr int iters = 3;

std::vector<rtp_block_record> on_cpu(int n) {
  std::vector<rtp_block_record> out(static_cast<std::size_t>(n));
  chunkstar::run_ranks(n, [&](in_process_communicator& comm) {
    gpt::cpu_backend b;
    out[static_cast<std::size_t>(comm.rank())] = run_rtp_block(comm, b, iters);
  });
  return out;
}

std::vector<rtp_block_record> on_gpu(int n) {
  std::vector<rtp_block_record> out(static_cast<std::size_t>(n));
  chunkstar::run_ranks(n, [&](in_process_communicator& inner) {
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
    chunkstar::staged_communicator<in_process_communicator, chunkstar::cuda::host_stager> comm(inner);
    gpt::cuda_backend b(0);
    out[static_cast<std::size_t>(comm.rank())] = run_rtp_block(comm, b, iters);
  });
  return out;
}

/** Largest |a - b| over the largest |b|, over every array of a field. */
double relative_error(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  double diff = 0, scale = 1e-12;
  for (std::size_t k = 0; k < b.size(); ++k)
    for (std::size_t i = 0; i < b[k].size(); ++i) {
      diff = std::max(diff, std::abs(static_cast<double>(a[k][i]) - b[k][i]));
      scale = std::max(scale, std::abs(static_cast<double>(b[k][i])));
    }
  return diff / scale;
}

}  // namespace

TEST_CASE("rtp block on one GPU, 1-3 ranks through host staging: tracks the CPU backend, repeats bit for bit") {
  for (int n = 1; n <= 3; ++n) {
    CAPTURE(n);
    const auto cpu = on_cpu(n);
    const auto gpu = on_gpu(n);
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      const auto& g = gpu[static_cast<std::size_t>(r)];
      const auto& c = cpu[static_cast<std::size_t>(r)];
      REQUIRE(g.y.size() == c.y.size());
      // fp32 with sums of at most 4C = 192 terms in another order, over three steps: 1e-4 of the
      // largest value is ~1000 units in the last place, far above rounding and far below a wrong
      // shard or a lost contribution (which moves values by their own size).
      double worst = 0;
      for (const auto field : {&rtp_block_record::y, &rtp_block_record::dx, &rtp_block_record::attn_grad,
                               &rtp_block_record::mlp_grad, &rtp_block_record::rep_grad, &rtp_block_record::rep}) {
        const double e = relative_error(g.*field, c.*field);
        worst = std::max(worst, e);
        CHECK(e <= 1e-4);
      }
      MESSAGE("N = ", n, ", rank ", r, ": largest relative difference GPU vs CPU ", worst);
    }
    CHECK(on_gpu(n) == gpu);
  }
}

TEST_CASE("rtp model on one GPU, 1-3 ranks through host staging: tracks the CPU model's losses, repeats bit for bit") {
  namespace m = gpt::testing::rtp_model;
  using tier = gpt::backend_tier<gpt::cuda_backend>;
  using store = chunkstar::rtp::basic_host_shard_store<tier>;
  constexpr int sgd_steps = 4, adam_steps = 4;
  const auto gpu_run = [&](int n) {
    std::vector<m::rank_record> out(static_cast<std::size_t>(n));
    chunkstar::run_ranks(n, [&](in_process_communicator& inner) {
      REQUIRE(cudaSetDevice(0) == cudaSuccess);
      chunkstar::staged_communicator<in_process_communicator, chunkstar::cuda::host_stager> comm(inner);
      gpt::cuda_backend b(0);
      store s{tier{&b}};
      gpt::rtp_gpt<decltype(comm), store, gpt::cuda_backend> model(comm, s, m::config, m::B, m::Tn, &b);
      out[static_cast<std::size_t>(comm.rank())] = m::train_model(comm, model, sgd_steps, adam_steps);
    });
    return out;
  };
  for (int n = 1; n <= 3; ++n) {
    CAPTURE(n);
    const auto cpu = m::run_rtp(n, sgd_steps, adam_steps);
    const auto gpu = gpu_run(n);
    double worst = 0;
    for (const auto field : {&m::rank_record::train_loss, &m::rank_record::eval_loss, &m::rank_record::adam_train_loss,
                             &m::rank_record::adam_eval_loss}) {
      const auto& g = gpu[0].*field;
      const auto& c = cpu[0].*field;
      REQUIRE(g.size() == c.size());
      for (std::size_t i = 0; i < c.size(); ++i) {
        const double d = std::abs(g[i] - c[i]) / std::max(1.0, std::abs(c[i]));
        worst = std::max(worst, d);
        CHECK(d <= 1e-4);  // fp32 sums in another order over 8 steps: far below a lost shard's effect
      }
    }
    MESSAGE("N = ", n, ": largest relative loss difference GPU vs CPU ", worst);
    CHECK(m::same_bits(gpu_run(n), gpu));
  }
}

}  // namespace rtp_cuda_test
