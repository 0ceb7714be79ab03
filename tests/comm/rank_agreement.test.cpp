// SPDX-License-Identifier: Apache-2.0
// Ranks configured differently (another model, layout or option) are a config_error on every rank
// at finalize(), naming the first difference and both ranks' values — never a hang or a silently
// different model later.
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/comm/rank_agreement.hpp>
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>

#include "support/runtimes.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

using namespace chunkstar;

namespace rank_agreement_test {

TEST_CASE("first_differing_field: the first field whose hash differs from rank 0's, or the length when none does") {
  const std::vector<std::uint64_t> reference = {1, 2, 3};
  CHECK(first_differing_field(std::vector<std::uint64_t>{1, 2, 3}, reference) == 3);
  CHECK(first_differing_field(std::vector<std::uint64_t>{1, 2, 4}, reference) == 2);
  CHECK(first_differing_field(std::vector<std::uint64_t>{1, 9, 0}, reference) ==
        1);  // also lacks field 2: the first counts
  CHECK(first_differing_field(std::vector<std::uint64_t>{1, 2, 0}, reference) ==
        2);  // a field rank 0 has and this rank lacks
  CHECK(first_differing_field({}, {}) == 0);
}

namespace {

/** Runs @p build on 3 in-process ranks; returns each rank's config_error message ("" when none). */
std::vector<std::string> finalize_on_ranks(const std::function<void(int rank, in_process_communicator&)>& build) {
  std::vector<std::string> messages(3);
  run_ranks(3, [&](in_process_communicator& comm) {
    try {
      build(comm.rank(), comm);
    } catch (const config_error& e) {
      messages[static_cast<std::size_t>(comm.rank())] = e.what();
    }
  });
  return messages;
}

using runtime_t =
    chunk_runtime<fixed_chunk_layout, auto_placement, belady_eviction, warmup_tracer, in_process_communicator>;

struct model {
  simulated_device_space dev{{.capacity = 1 << 20}};
  host_space host;
  host_copy_engine copier;
  runtime_t rt;
  model(in_process_communicator& comm, runtime_options options, std::size_t chunk_elems)
      : rt(dev, host, copier, comm, options, fixed_chunk_layout({.chunk_elems = chunk_elems, .align_elems = 32})) {}
};

void build(int rank, in_process_communicator& comm, int odd_rank, const std::string& what) {
  const bool odd = rank == odd_rank;
  runtime_options options{.sharding = {.enabled = true}};
  if (odd && what == "keep") options.sharding.keep_gathered = true;
  if (odd && what == "memory-saving") options.sharding.memory_saving = true;
  if (odd && what == "gather-ahead") options.sharding.gather_ahead = false;
  if (odd && what == "prefetch") options.prefetch_depth = 0;  // this rank's own: may differ
  model m(comm, options, odd && what == "chunk" ? 512 : 256);
  m.rt.register_param({"w0", {12, 12}, dtype::f32, tensor_role::weight});
  m.rt.register_param({"w1", {12, odd && what == "shape" ? 13 : 12}, dtype::f32, tensor_role::weight});
  if (odd && what == "extra") m.rt.register_param({"w2", {12}, dtype::f32, tensor_role::bias});
  // A trainer's own fields, agreed in the same call.
  const std::vector<config_field> run = {{"seed", odd && what == "seed" ? "7" : "1337"}, {"steps", "5"}};
  m.rt.finalize(run);
}

}  // namespace

TEST_CASE("Ranks configured alike finalize; one that differs is a config_error on every rank naming the difference") {
  for (const std::string& m : finalize_on_ranks([](int r, in_process_communicator&c) { build(r, c, -1, ""); }))
    CHECK(m.empty());

  struct expectation {
    std::string what;
    int odd_rank;
    std::vector<std::string> says;
  };
  const std::vector<expectation> cases = {
      {"extra", 2, {"rank 0 has parameters = 2", "rank 2 has parameters = 3"}},
      {"shape",
       1,
       {"rank 0 has parameter 1 = 'w1' [12, 12] f32 weight", "rank 1 has parameter 1 = 'w1' [12, 13] f32 weight"}},
      {"keep", 1, {"sharding = on, keep_gathered off", "rank 1 has sharding = on, keep_gathered on"}},
      {"chunk", 2, {"chunks of 256 elements", "rank 2 has chunk layout = fixed", "chunks of 512 elements"}},
      {"memory-saving",
       1,
       {"rank 0 has sharding = on", "memory_saving off", "rank 1 has sharding = on", "memory_saving on"}},
      {"gather-ahead", 2, {"gather_ahead on", "rank 2 has sharding = on", "gather_ahead off"}},
      {"seed", 1, {"rank 0 has seed = 1337", "rank 1 has seed = 7"}},
  };
  for (const auto& m : finalize_on_ranks([](int r, in_process_communicator&c) { build(r, c, 1, "prefetch"); }))
    CHECK(m.empty());
  for (const auto& c : cases) {
    CAPTURE(c.what);
    const auto messages =
        finalize_on_ranks([&](int r, in_process_communicator& comm) { build(r, comm, c.odd_rank, c.what); });
    for (const auto& m : messages) {  // the same error on every rank, the odd one included
      CAPTURE(m);
      CHECK(m == messages[0]);
      CHECK(m.find("finalize(): the ranks are not configured alike") != std::string::npos);
      for (const auto& s : c.says) CHECK(m.find(s) != std::string::npos);
    }
  }
}

TEST_CASE("require_agreement: the first field that differs on any rank, then the first rank that differs there") {
  // fields[rank]: rank 1 differs at field 2, rank 2 at field 1 and 2, rank 3 has one field more.
  const std::vector<std::vector<config_field>> fields = {
      {{"a", "1"}, {"b", "2"}, {"c", "3"}},
      {{"a", "1"}, {"b", "2"}, {"c", "x"}},
      {{"a", "1"}, {"b", "y"}, {"c", "z"}},
      {{"a", "1"}, {"b", "2"}, {"c", "3"}, {"d", "4"}},
  };
  const auto messages_for = [&](int ranks) {
    std::vector<std::string> messages(static_cast<std::size_t>(ranks));
    run_ranks(ranks, [&](in_process_communicator& comm) {
      try {
        require_agreement(comm, fields[static_cast<std::size_t>(comm.rank())], "setup");
      } catch (const config_error& e) {
        messages[static_cast<std::size_t>(comm.rank())] = e.what();
      }
    });
    return messages;
  };
  for (const auto& m : messages_for(3)) CHECK(m.find("rank 0 has b = 2 but rank 2 has b = y") != std::string::npos);
  for (const auto& m : messages_for(2)) CHECK(m.find("rank 0 has c = 3 but rank 1 has c = x") != std::string::npos);
  run_ranks(2, [&](in_process_communicator& comm) {  // rank 3's list on rank 1: rank 0 lacks field 3
    const auto& mine = fields[comm.rank() == 0 ? 0 : 3];
    CHECK_THROWS_WITH_AS(require_agreement(comm, mine, "setup"),
                         doctest::Contains("rank 0 has (nothing: fewer fields) but rank 1 has d = 4"), config_error);
  });
}

}  // namespace rank_agreement_test

namespace rank_agreement_test {

TEST_CASE(
    "chunk_adam: ranks stepping with different optimizer options fail together at the first step, naming the option") {
  const auto step_on_ranks = [](const std::function<void(int rank, chunk_adam_options&, int& micro_batches)>& vary) {
    std::vector<std::string> messages(3);
    run_ranks(3, [&](in_process_communicator& comm) {
      model m(comm, {.sharding = {.enabled = true}}, 256);
      (void)m.rt.register_param({"w0", {12, 12}, dtype::f32, tensor_role::weight},
                                [](std::span<float> v) { std::fill(v.begin(), v.end(), 0.5f); });
      m.rt.finalize();
      chunk_adam_options o{.max_grad_norm = 1.0f};
      int micro_batches = 1;
      vary(comm.rank(), o, micro_batches);
      chunk_adam<> opt(o);
      try {
        {
          auto s = m.rt.backward("b", {param_id{0}});
          for (float& g : s.grad<float>(param_id{0})) g = 0.25f;
        }
        (void)opt.step(m.rt, 1e-3f, micro_batches);
      } catch (const config_error& e) {
        messages[static_cast<std::size_t>(comm.rank())] = e.what();
      }
    });
    return messages;
  };
  for (const auto& m : step_on_ranks([](int, chunk_adam_options&, int&) {})) CHECK(m.empty());
  const auto clip = step_on_ranks([](int r, chunk_adam_options& o, int&) {
    if (r == 2) o.max_grad_norm = 0.0f;
  });
  const auto micro = step_on_ranks([](int r, chunk_adam_options&, int& mb) {
    if (r == 1) mb = 2;
  });
  for (const auto& m : clip) {
    CAPTURE(m);
    CHECK(m == clip[0]);
    CHECK(m.find("chunk_adam::step: the ranks are not configured alike: rank 0 has max_grad_norm = 1 but rank 2 has "
                 "max_grad_norm = 0") != std::string::npos);
  }
  for (const auto& m : micro) {
    CAPTURE(m);
    CHECK(m.find("rank 0 has micro_batches = 1 but rank 1 has micro_batches = 2") != std::string::npos);
  }
}

}  // namespace rank_agreement_test
