// SPDX-License-Identifier: Apache-2.0
// RTP over MPI ranks (processes): every rank trains the RTP test MLP (tests/support/rtp_mlp.hpp,
// the code tests/rtp/rtp_mlp.test.cpp runs on in-process ranks) with the world as its ring. Its
// owned shards, their gradients, the replicated parameters and their gradients, and the losses
// must be bit-identical, every iteration, to the same rank of an in-process group (threads) of the
// same N, and the run assembled from all ranks must be within the unit test's tolerance of the
// float64 serial reference. Registered at 2 and 4 ranks (tests/mpi/CMakeLists.txt).
//
// Where the in-process group runs: in every process, each keeping the record of its own rank (as
// zero.test.cpp does). Not on rank 0 with a broadcast, because (1) a broadcast of the expected
// bits would go through the communicator under test, (2) each process then checks itself with no
// further traffic, and (3) on an oversubscribed machine the other ranks would busy-wait in MPI
// while rank 0's threads compute, where here every process computes. The in-process run is a pure
// function of N (the schedule's sums have a fixed order), so every process gets the same bits.
#include <chunkstar/mpi/mpi_communicator.hpp>

#include "support/rtp_mlp.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

using namespace chunkstar;
using namespace chunkstar::testing::rtp_mlp;

namespace rtp_test {

namespace {

template <class T>
bool bits_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

/** Where @p got (this MPI rank) and @p want (the same rank in-process) differ in any bit: one line
 *  per differing field and iteration, naming the first differing element. */
std::vector<std::string> bit_differences(const rank_record& got, const rank_record& want) {
  std::vector<std::string> out;
  auto cmp = [&](const char* field, std::size_t it, const auto& x, const auto& y) {
    if (bits_equal(x, y)) return;
    std::ostringstream line;
    line << "iteration " << it << ": " << field;
    std::size_t i = 0;
    while (i < std::min(x.size(), y.size()) && std::memcmp(&x[i], &y[i], sizeof x[i]) == 0) ++i;
    if (i < std::min(x.size(), y.size()))
      line << "[" << i << "] is " << std::hexfloat << static_cast<double>(x[i]) << " over MPI, "
           << static_cast<double>(y[i]) << " in-process";
    else line << " has " << x.size() << " elements over MPI, " << y.size() << " in-process";
    out.push_back(line.str());
  };
  for (std::size_t it = 0; it < iterations; ++it) {
    cmp("owned shard before the step", it, got.shard_before[it], want.shard_before[it]);
    cmp("owned shard's gradient", it, got.shard_grad[it], want.shard_grad[it]);
    cmp("owned shard after the step", it, got.shard_after[it], want.shard_after[it]);
    cmp("replicated s | b2 | ds | db2 after the step", it, got.replicated[it], want.replicated[it]);
  }
  cmp("training losses", 0, got.train_loss, want.train_loss);
  cmp("evaluation losses", 0, got.eval_loss, want.eval_loss);
  if (got.eval_displaced != want.eval_displaced) out.push_back("evaluations that displaced the owned shard differ");
  return out;
}

/** A rank's record as floats, for an allgather: per iteration its shard before, gradient, after
 *  and replicated values, then eval_displaced. (The losses are global: rank 0's own are used.) */
std::vector<float> flatten(const rank_record& r) {
  std::vector<float> out;
  for (std::size_t it = 0; it < iterations; ++it)
    for (const auto* v : {&r.shard_before[it], &r.shard_grad[it], &r.shard_after[it], &r.replicated[it]})
      out.insert(out.end(), v->begin(), v->end());
  out.push_back(static_cast<float>(r.eval_displaced));
  return out;
}

rank_record unflatten(std::span<const float> flat, std::size_t shard_elems, const rank_record& losses) {
  rank_record r;
  std::size_t at = 0;
  auto take = [&](std::size_t n) {
    std::vector<float> v(flat.begin() + static_cast<std::ptrdiff_t>(at),
                         flat.begin() + static_cast<std::ptrdiff_t>(at + n));
    at += n;
    return v;
  };
  for (std::size_t it = 0; it < iterations; ++it) {
    r.shard_before.push_back(take(shard_elems));
    r.shard_grad.push_back(take(shard_elems));
    r.shard_after.push_back(take(shard_elems));
    r.replicated.push_back(take(4 * dout));
  }
  r.eval_displaced = static_cast<int>(flat[at]);
  r.train_loss = losses.train_loss, r.eval_loss = losses.eval_loss;
  return r;
}

struct injected_fault : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace

TEST_CASE(
    "RTP MLP on MPI ranks: the bits of the same rank in-process, every iteration, and the serial reference's "
    "tolerance") {
  mpi_communicator comm(MPI_COMM_WORLD, {.check_sequence = true});
  REQUIRE(comm.checks_sequence());
  const int n = comm.size(), me = comm.rank();
  REQUIRE_MESSAGE(hidden % static_cast<std::size_t>(n) == 0,
                  "the test MLP's " << hidden << " hidden units do not divide over " << n << " ranks");

  const rank_record mine = train_rank(comm);
  const std::vector<rank_record> threads = train_in_process(n);
  const rank_record& same_rank = threads[static_cast<std::size_t>(me)];
  const std::vector<std::string> diffs = bit_differences(mine, same_rank);
  for (const std::string& line : diffs) FAIL_CHECK("rank " << me << ", " << line);
  CHECK(diffs.empty());
  {  // the comparison sees one ulp of one gradient element at the last iteration
    rank_record nudged = same_rank;
    float& g = nudged.shard_grad[iterations - 1][0];
    g = std::nextafter(g, std::numeric_limits<float>::infinity());
    CHECK(bit_differences(mine, nudged).size() == 1);
  }
  CHECK(mine.eval_displaced == 0);

  // The whole MPI run, from every rank's shards, against the serial reference (rank 0 checks: it
  // is pure computation on the gathered record, and one report is enough).
  const std::vector<float> flat = flatten(mine);
  std::vector<float> all(flat.size() * static_cast<std::size_t>(n));
  comm.allgather(flat.data(), all.data(), flat.size() * sizeof(float));
  if (me != 0) return;
  const std::size_t shard_elems = mine.shard_grad[0].size();
  std::vector<rank_record> ranks;
  for (int r = 0; r < n; ++r)
    ranks.push_back(
        unflatten(std::span<const float>(all).subspan(static_cast<std::size_t>(r) * flat.size(), flat.size()),
                  shard_elems, mine));
  const run_record mpi_run = assemble(ranks);
  CHECK(same_bits(mpi_run, assemble(threads)));
  check_against_reference(mpi_run, n);
}

TEST_CASE(
    "RTP on MPI ranks: a kernel that throws on one rank gives every rank communication_error within seconds, not a "
    "hang") {
  // MPI cannot tell the peers that a rank left the schedule: they would wait in their next shift
  // for ever. With the collective-sequence check, the failing rank's next collective (here a
  // barrier, its "I failed" to the others) differs from the peers' (a shift or an all-reduce), so
  // every rank, the thrower included, gets communication_error naming both at that call. The
  // thrower's in-flight shifts were matched by its peers (a kernel runs after its step's shift
  // started on every rank), so its rotation unwinds without waiting on anyone.
  struct fault_case {
    int rank;
    int iteration;
    pass where;
    int step;
  };
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const fault_case cases[] = {
      {world - 1, 1, pass::train_forward, world / 2},  // a middle step: the next shard is arriving
      {0, 4, pass::backward, world - 1},               // the last step: the owner's partial sum is arriving
      {1, 10, pass::backward, 0},                      // the first step: the next weights are arriving
      {1, iterations - 1, pass::eval_forward, 0},      // the last evaluation
  };
  for (const fault_case& f : cases) {
    const int where = static_cast<int>(f.where);  // 0 training forward, 1 backward, 2 evaluation forward
    CAPTURE(f.rank);
    CAPTURE(f.iteration);
    CAPTURE(where);
    CAPTURE(f.step);
    mpi_communicator comm(MPI_COMM_WORLD, {.check_sequence = true});  // a fresh one: a mismatch poisons it for good
    const int me = comm.rank();
    const auto start = std::chrono::steady_clock::now();
    bool injected = false;
    std::string error;
    try {
      try {
        (void)train_rank(comm, [&](int it, pass p, int step) {
          if (me == f.rank && it == f.iteration && p == f.where && step == f.step)
            throw injected_fault("injected kernel failure");
        });
      } catch (const injected_fault&) {
        injected = true;
        comm.barrier();  // its report to the others; mismatches what they call next
      }
    } catch (const communication_error& e) {
      error = e.what();
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    CHECK(injected == (me == f.rank));
    CHECK_MESSAGE(error.find("collective mismatch") != std::string::npos, error);
    CHECK_MESSAGE(error.find("barrier") != std::string::npos, error);
    CHECK(seconds < 5.0);
    if (me == 0) MESSAGE("fault on rank " << f.rank << ": every rank stopped after " << seconds << " s: " << error);
  }
}

}  // namespace rtp_test
