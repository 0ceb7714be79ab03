// SPDX-License-Identifier: Apache-2.0
// The whole GPT under RTP (rtp_gpt.hpp) on 1-4 in-process ranks against the serial model
// (gpt_model.hpp on the full weights, fp32, the N micro-batches of a step one after another) and
// the same serial model in float64. Ten SGD iterations with an evaluation pass after each; the
// cases the reference implementation gets wrong are all here: later iterations (stale or
// displaced shards), evaluation in between, replicated LayerNorm and position parameters, and the
// tied embedding (both of its gradients). The tolerance is docs/rtp.md's "The whole model":
// RTP's distance from float64 is at most K times the serial fp32 model's own.
// The config, micro-batches, one rank's training, the serial runs and the checks against them are
// in rtp_model_support.hpp, shared with the MPI test (mpi/rtp_gpt.test.cpp).
#include "rtp_model_support.hpp"

#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/comm/single_process.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <mutex>
#include <string>
#include <vector>

namespace rtp_model_test {

namespace {

using chunkstar::in_process_communicator;
using namespace gpt::testing::rtp_model;

}  // namespace

TEST_CASE("rtp gpt: a world size that does not divide the heads is a config_error naming them") {
  chunkstar::in_process_group group(5);
  std::vector<std::string> errors(5);
  group.run([&](in_process_communicator& comm) {
    try {
      gpt::rtp_gpt<in_process_communicator> m(comm, config, B, Tn);
    } catch (const chunkstar::config_error& e) {
      errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  for (const auto& e : errors) {
    CHECK(e.find("heads") != std::string::npos);
    CHECK(e.find("1, 2, 3, 4, 6, 12") != std::string::npos);
  }
}

TEST_CASE(
    "rtp gpt: ranks given different shapes all get a config_error naming the field, before any other collective") {
  chunkstar::in_process_group group(2);
  std::vector<std::string> errors(2);
  group.run([&](in_process_communicator& comm) {
    gpt::gpt_config mine = config;
    if (comm.rank() == 1) mine.width = 24;  // 12 heads of 2: valid on its own
    try {
      gpt::rtp_gpt<in_process_communicator> m(comm, mine, B, Tn);
    } catch (const chunkstar::config_error& e) {
      errors[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  for (const auto& e : errors) {
    CHECK(e.find("width") != std::string::npos);
    CHECK(e.find("rtp_gpt") != std::string::npos);
  }
}

TEST_CASE("rtp gpt: the padded vocabulary, shard sizes and the partition of every tensor") {
  CHECK(gpt::rtp_padded_vocab(50, 1) == 50);
  CHECK(gpt::rtp_padded_vocab(50, 3) == 51);
  CHECK(gpt::rtp_padded_vocab(50, 4) == 52);
  CHECK(gpt::rtp_padded_vocab(256, 3) == 258);
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    // Every element of every tensor is held by exactly one rank's shard or by every rank (a replica).
    std::vector<int> count(param_elems, 0), replica(param_elems, 0);
    std::vector<std::size_t> base;
    std::size_t off = 0;
    for (const auto& s : gpt::param_specs(config)) base.push_back(off), off += s.numel();
    std::vector<std::size_t> bytes(static_cast<std::size_t>(n)), sent(static_cast<std::size_t>(n)),
        theory(static_cast<std::size_t>(n)), transit(static_cast<std::size_t>(n)), largest(static_cast<std::size_t>(n)),
        replica_elems(static_cast<std::size_t>(n));
    chunkstar::in_process_group group(n);
    std::mutex mu;
    group.run([&](in_process_communicator& comm) {
      gpt::rtp_gpt<in_process_communicator> m(comm, config, B, Tn);
      m.init(seed);
      const auto before = comm.stats();
      const micro_batch mb = make_batch(false, 0, comm.rank());
      m.forward(mb.tokens.data(), mb.targets.data());
      m.backward(mb.tokens.data(), mb.targets.data());
      const auto r = static_cast<std::size_t>(comm.rank());
      sent[r] = comm.stats().bytes_sent - before.bytes_sent;
      theory[r] = m.iteration_bytes_theory();
      bytes[r] = m.model_bytes();
      transit[r] = m.transient_bytes();
      largest[r] = m.largest_shard_bytes();
      std::lock_guard lock(mu);
      for (const auto& p : m.parts()) {
        if (p.replicated) replica_elems[r] += p.elems;
        p.for_each(
            [&](std::size_t t, std::size_t i, std::size_t) { (p.replicated ? replica : count)[base[t] + i] += 1; });
      }
    });
    for (std::size_t e = 0; e < param_elems; ++e) {
      const bool ok = (count[e] == 1 && replica[e] == 0) || (count[e] == 0 && replica[e] == n);
      if (!ok) {
        FAIL_CHECK("element " << e << " held " << count[e] << " times as a shard and " << replica[e]
                              << " times as a replica");
        break;
      }
    }
    // Memory per rank: its 1/N of the sharded elements (at most one padding row of wte less) and
    // the replicas, four lists of each (weights, gradient, two Adam moments); in transit one set of
    // five shards of the largest layer (two weight, two gradient, one scratch), shared by every
    // rotation — so at most total/N + the replicas + two shards of the largest layer and three
    // gradient-sized buffers for backward.
    const std::size_t sharded = param_elems - replica_elems[0], C = static_cast<std::size_t>(config.width);
    for (int r = 0; r < n; ++r) {
      const auto k = static_cast<std::size_t>(r);
      // Bytes per training iteration, counted by the communicator, against the model's theory.
      CHECK(sent[k] == theory[k]);
      CHECK(bytes[k] <= 16 * (sharded / static_cast<std::size_t>(n) + C + replica_elems[k]));
      CHECK(bytes[k] >= 16 * (sharded / static_cast<std::size_t>(n) - C + replica_elems[k]));
      CHECK(transit[k] == 5 * largest[k]);  // all five even at N = 1, where they hold the loaded shard
    }
  }
}

TEST_CASE("rtp gpt on 1-4 ranks: flyweight initialisation gives the serial model's initial bits") {
  gpt::gpt_reference<float> ref(config, B, Tn);
  gpt::init_params(config, ref.params, seed);
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    std::vector<rank_record> ranks(static_cast<std::size_t>(n));
    chunkstar::run_ranks(n, [&](in_process_communicator& comm) {
      gpt::rtp_gpt<in_process_communicator> m(comm, config, B, Tn);
      m.init(seed);
      ranks[static_cast<std::size_t>(comm.rank())].params.push_back(stored(m, false));
    });
    CHECK(assemble(ranks, &rank_record::params, 0) == ref.param_data);
  }
}

TEST_CASE(
    "rtp gpt on 1-4 ranks: 10 SGD steps with an evaluation after each follow the serial model; shards stay home; runs "
    "repeat bit for bit") {
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    const auto ranks = run_rtp(n);
    CHECK(same_bits(ranks, run_rtp(n)));
    check_against_serial(ranks, n);
  }
}

TEST_CASE("rtp gpt: one rank over the single-process communicator gives the one-rank in-process bits") {
  chunkstar::single_process_communicator comm;
  const rank_record solo = train_rank(comm, 2);
  CHECK(same_bits({solo}, run_rtp(1, 2)));
}

TEST_CASE(
    "rtp gpt: backward needs its forward and the same micro-batch; an evaluation in between is refused, not silently "
    "wrong") {
  chunkstar::single_process_communicator comm;
  gpt::rtp_gpt<chunkstar::single_process_communicator> m(comm, config, B, Tn);
  m.init(seed);
  const micro_batch mb = make_batch(false, 0, 0), other = make_batch(false, 1, 0);
  CHECK_THROWS_WITH_AS(m.backward(mb.tokens.data(), mb.targets.data()), doctest::Contains("call forward first"),
                       chunkstar::state_error);
  m.forward(mb.tokens.data(), mb.targets.data());
  CHECK_THROWS_WITH_AS(m.loss(mb.tokens.data(), mb.targets.data()), doctest::Contains("run backward"),
                       chunkstar::state_error);
  CHECK_THROWS_WITH_AS(m.next_token_probs(mb.tokens), doctest::Contains("run backward"), chunkstar::state_error);
  CHECK_THROWS_WITH_AS(m.backward(other.tokens.data(), mb.targets.data()), doctest::Contains("same micro-batch"),
                       chunkstar::config_error);
  // The refused backward used up the forward: a new one is needed.
  CHECK_THROWS_AS(m.backward(mb.tokens.data(), mb.targets.data()), chunkstar::state_error);
  m.forward(mb.tokens.data(), mb.targets.data());
  m.backward(mb.tokens.data(), mb.targets.data());
  CHECK(std::isfinite(m.loss(mb.tokens.data(), mb.targets.data())));
}

}  // namespace rtp_model_test
