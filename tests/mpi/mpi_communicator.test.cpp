// SPDX-License-Identifier: Apache-2.0
// mpi_communicator: the installed Communicator conformance checks on every MPI rank (as doctest
// cases, and framework-free with the ranks' verdicts allreduced), bit-identity with
// in_process_group, and MPI failures surfacing as communication_error.
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/mpi/mpi_communicator.hpp>

#include "support/comm_conformance.hpp"

#include <doctest/doctest.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <algorithm>
#include <vector>

namespace mpi_communicator_test {

namespace {

using namespace chunkstar;

static_assert(Communicator<mpi_communicator>);
static_assert(!std::copyable<mpi_communicator>, "it owns a duplicated MPI_Comm");

mpi_communicator& world() {
  static mpi_communicator comm(MPI_COMM_WORLD,
                               {.check_sequence = true});  // freed after MPI_Finalize is a no-op by design
  return comm;
}

struct mpi_fixture {
  using buffer = comm_test::host_buffer;
  static constexpr bool exact = true;
  template <class Body>
  static void run(Body&& body) {
    try {
      body(world());
    } catch (const std::exception& e) {
      // One rank leaving the suite would leave the others blocked in a collective.
      std::fprintf(stderr, "rank %d: unexpected exception, aborting all ranks: %s\n", world().rank(), e.what());
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
  }
};

}  // namespace

CHUNKSTAR_COMM_CONFORMANCE(mpi_fixture);

TEST_CASE("mpi_communicator conformance without a test framework: each rank reports, an allreduce combines") {
  mpi_communicator& comm = world();
  const auto report = chunkstar::testing::check_communicator(comm);
  CHECK_MESSAGE(report.ok(), report.to_string());
  // What a user's MPI program does with its ranks' reports: one verdict for the job.
  double failed = static_cast<double>(report.failed);
  comm.allreduce(std::span<double>(&failed, 1), reduce_op::sum);
  CHECK(failed == 0.0);
}

TEST_CASE("mpi_communicator gives the same bits as in_process_group for the same inputs") {
  mpi_communicator& comm = world();
  const int n = comm.size();
  const int r = comm.rank();
  const std::size_t count = 1001;
  for (dtype t : {dtype::f32, dtype::f16, dtype::bf16}) {
    CAPTURE(dtype_name(t));
    const std::uint64_t seed = 77 + static_cast<std::uint64_t>(t);
    auto input = [&](int rank) {
      std::vector<std::byte> bytes(count * dtype_size(t));
      for (std::size_t i = 0; i < count; ++i) {
        const float v = chunkstar::testing::communicator_test_value(seed, rank, i);
        const std::uint16_t half = t == dtype::f16 ? float16(v).bits : bfloat16(v).bits;
        if (t == dtype::f32) std::memcpy(bytes.data() + i * 4, &v, 4);
        else std::memcpy(bytes.data() + i * 2, &half, 2);
      }
      return bytes;
    };
    // Over MPI: sync allreduce, async allreduce (a different algorithm), reduce_scatter.
    auto sync = input(r);
    comm.allreduce(sync.data(), count, t, reduce_op::sum);
    auto async = input(r);
    comm.allreduce_async(async.data(), count, t, reduce_op::sum).wait();
    std::vector<std::byte> scattered_send;
    for (int k = 0; k < n; ++k) {
      const auto part = input(r + 10 * k);
      scattered_send.insert(scattered_send.end(), part.begin(), part.end());
    }
    std::vector<std::byte> scattered(count * dtype_size(t));
    comm.reduce_scatter(scattered_send.data(), scattered.data(), count, t, reduce_op::sum);
    // The rooted reduce to the last rank, sync out of place and async in place.
    const int root = n - 1;
    std::vector<std::byte> reduced(count * dtype_size(t), std::byte{0x5a});
    const std::vector<std::byte> untouched = reduced;
    const auto reduce_in = input(r);
    comm.reduce(reduce_in.data(), reduced.data(), count, t, reduce_op::sum, root);
    auto reduced_in_place = input(r);
    comm.reduce_async(reduced_in_place.data(), reduced_in_place.data(), count, t, reduce_op::sum, root).wait();
    CHECK(reduce_in == input(r));
    if (r != root) {
      CHECK(reduced == untouched);
      CHECK(reduced_in_place == input(r));
    }
    // The same on n threads in this process.
    std::vector<std::byte> local_sync, local_scattered;
    run_ranks(n, [&](in_process_communicator& c) {
      auto mine = input(c.rank());
      c.allreduce(mine.data(), count, t, reduce_op::sum);
      std::vector<std::byte> send;
      for (int k = 0; k < n; ++k) {
        const auto part = input(c.rank() + 10 * k);
        send.insert(send.end(), part.begin(), part.end());
      }
      std::vector<std::byte> out(count * dtype_size(t));
      c.reduce_scatter(send.data(), out.data(), count, t, reduce_op::sum);
      if (c.rank() == r) {
        local_sync = mine;
        local_scattered = out;
      }
    });
    CHECK(sync == local_sync);
    CHECK(async == local_sync);
    CHECK(scattered == local_scattered);
    if (r == root) {  // an allreduce's result, at the root, bit for bit
      CHECK(reduced == local_sync);
      CHECK(reduced_in_place == local_sync);
    }
  }
}

TEST_CASE("mpi_communicator: MPI failures become communication_error carrying MPI's error string") {
  mpi_communicator comm(MPI_COMM_WORLD, {.check_sequence = false});  // the check would catch the mismatch first
  if (comm.size() < 2) return;
  // Rank 0 receives 8 bytes from its predecessor, which sends 16: MPI reports truncation on rank 0
  // only; every other rank receives fewer bytes than it allows, which is legal.
  std::vector<std::byte> send(16, std::byte{1}), recv(16);
  const std::size_t bytes = comm.rank() == 0 ? 8 : 16;
  if (comm.rank() == 0) {
    try {
      comm.ring_shift(send.data(), recv.data(), bytes);
      FAIL_CHECK("a truncated receive did not throw");
    } catch (const communication_error& e) {
      const std::string what = e.what();
      CHECK_MESSAGE(what.find("MPI_Sendrecv failed: ") != std::string::npos, what);
      CHECK_MESSAGE(what.find("truncat") != std::string::npos, what);
    }
  } else {
    CHECK_NOTHROW(comm.ring_shift(send.data(), recv.data(), bytes));
  }
  comm.barrier();  // still usable afterwards
  double x = 1.0;
  comm.allreduce(std::span<double>(&x, 1), reduce_op::sum);
  CHECK(x == double(comm.size()));
}

TEST_CASE(
    "mpi_communicator's sequence check: a divergent call is the same communication_error on every rank, naming it") {
  if (world().size() < 2) return;
  CHECK(world().checks_sequence());
  mpi_communicator comm(MPI_COMM_WORLD, {.check_sequence = true});
  std::vector<std::byte> send(16, std::byte{1}), recv(16 * static_cast<std::size_t>(comm.size()));
  comm.allgather(send.data(), recv.data(), 16);  // call #0 agrees
  std::string what;
  try {
    if (comm.rank() == 1) comm.allgather(send.data(), recv.data(), 8);  // call #1: rank 1 asks for less
    else comm.allgather(send.data(), recv.data(), 16);
    FAIL_CHECK("a divergent collective did not throw");
  } catch (const communication_error& e) {
    what = e.what();
  }
  CHECK_MESSAGE(
      what.find("collective mismatch at call #1: rank 0 called allgather(16 bytes per rank) but rank 1 called "
                "allgather(8 bytes per rank)") != std::string::npos,
      what);
  // Every rank got the same message.
  std::vector<char> mine(256, '\0'), all(256 * static_cast<std::size_t>(comm.size()));
  what.copy(mine.data(), std::min<std::size_t>(what.size(), 255));
  MPI_Allgather(mine.data(), 256, MPI_CHAR, all.data(), 256, MPI_CHAR, MPI_COMM_WORLD);
  for (int q = 0; q < comm.size(); ++q) CHECK(std::string(all.data() + 256 * q) == std::string(mine.data()));
  // The communicator stays poisoned: its sequence no longer lines up.
  CHECK_THROWS_AS(comm.barrier(), communication_error);

  // Another kind at the same position, on the last rank only.
  mpi_communicator other(MPI_COMM_WORLD, {.check_sequence = true});
  try {
    float x = 1;
    if (other.rank() == other.size() - 1) other.barrier();
    else other.allreduce(&x, 1, dtype::f32, reduce_op::max);
    FAIL_CHECK("a divergent collective did not throw");
  } catch (const communication_error& e) {
    const std::string w = e.what();
    CHECK_MESSAGE(w.find("rank 0 called allreduce(1 x f32, max) but rank " + std::to_string(other.size() - 1) +
                         " called barrier()") != std::string::npos,
                  w);
  }
}

TEST_CASE("mpi_communicator's sequence check: a reduce to another root names both calls and roots") {
  if (world().size() < 2) return;
  mpi_communicator comm(MPI_COMM_WORLD, {.check_sequence = true});
  const int last = comm.size() - 1;
  std::vector<float> send(8, 1.0f), recv(8, 0.0f);
  comm.reduce(send.data(), recv.data(), 8, dtype::f32, reduce_op::sum, 0);  // call #0 agrees
  if (comm.rank() == 0) CHECK(recv[7] == float(comm.size()));
  std::string what;
  try {
    // The last rank thinks it owns the chunk; the others think rank 0 does.
    comm.reduce_async(send.data(), recv.data(), 8, dtype::f16, reduce_op::max, comm.rank() == last ? last : 0).wait();
    FAIL_CHECK("a reduce to another root did not throw");
  } catch (const communication_error& e) {
    what = e.what();
  }
  CHECK_MESSAGE(what.find("collective mismatch at call #1: rank 0 called reduce(8 x f16, max, to root 0) but rank " +
                          std::to_string(last) + " called reduce(8 x f16, max, to root " + std::to_string(last) +
                          ")") != std::string::npos,
                what);
  CHECK_THROWS_AS(comm.reduce(send.data(), recv.data(), 8, dtype::f32, reduce_op::sum, 0),
                  communication_error);  // poisoned
  // A bad root is an argument error at the call, before any communication (on every rank alike).
  mpi_communicator fresh(MPI_COMM_WORLD, {.check_sequence = true});
  CHECK_THROWS_AS(fresh.reduce(send.data(), recv.data(), 8, dtype::f32, reduce_op::sum, fresh.size()), config_error);
  fresh.reduce(send.data(), recv.data(), 8, dtype::f32, reduce_op::sum, last);  // still in step: call #0 on every rank
  if (fresh.rank() == last) CHECK(recv[0] == float(fresh.size()));
}

TEST_CASE(
    "mpi_communicator's sequence check on asynchronous calls: transfers start in issue order once agreed; a "
    "divergent one fails its handle and the rank's next call alike") {
  if (world().size() < 2) return;
  mpi_communicator comm(MPI_COMM_WORLD, {.check_sequence = true});
  const int n = comm.size();
  // Several handles outstanding, waited in reverse order: each transfer started after its check.
  std::vector<float> a(4, float(comm.rank() + 1));
  std::vector<std::byte> send(8, std::byte(comm.rank())), recv(8 * static_cast<std::size_t>(n));
  double x = comm.rank();
  comm_handle h1 = comm.allreduce_async(a.data(), a.size(), dtype::f32, reduce_op::sum);
  comm_handle h2 = comm.allgather_async(send.data(), recv.data(), 8);
  comm_handle h3 = comm.allreduce_async(std::span<double>(&x, 1), reduce_op::max);
  while (!h3.ready()) {  // polling alone starts and finishes it
  }
  h3.wait();
  h2.wait();
  h1.wait();
  CHECK(x == double(n - 1));
  CHECK(a[3] == float(n * (n + 1) / 2));
  for (int q = 0; q < n; ++q) CHECK(recv[8 * static_cast<std::size_t>(q) + 7] == std::byte(q));
  CHECK(comm.sequence_check().calls == 3);

  // Rank 1 gathers less. The mismatch is thrown by whichever call first sees the exchange done on
  // that rank (the issue itself when the peers are already there, else the rank's next call or the
  // handle's wait), with the same message on every rank, and no transfer ever starts.
  std::optional<comm_handle> bad;
  std::string what, at_wait;
  try {
    bad.emplace(comm.allgather_async(send.data(), recv.data(), comm.rank() == 1 ? 4 : 8));
    comm.barrier();
    FAIL_CHECK("a divergent asynchronous collective did not throw");
  } catch (const communication_error& e) {
    what = e.what();
  }
  CHECK_MESSAGE(what.find("collective mismatch at call #3: rank 0 called allgather(8 bytes per rank) but rank 1 called "
                          "allgather(4 bytes per rank)") != std::string::npos,
                what);
  if (bad) {  // the issue returned a handle: it reports the same failure
    try {
      bad->wait();
    } catch (const communication_error& e) {
      at_wait = e.what();
    }
    CHECK(at_wait == what);
  }
  CHECK_THROWS_AS(comm.barrier(), communication_error);  // poisoned for good
}

TEST_CASE("mpi_communicator: ranks given different check_sequence options refuse together, before any collective") {
  if (world().size() < 2) return;
  std::string what;
  try {
    mpi_communicator comm(MPI_COMM_WORLD, {.check_sequence = world().rank() != 1});  // rank 1 alone turns it off
    FAIL_CHECK("disagreeing options were accepted");
  } catch (const config_error& e) {
    what = e.what();
  }
  CHECK_MESSAGE(what.find("the ranks disagree on mpi_options::check_sequence") != std::string::npos, what);
  CHECK_MESSAGE(
      what.find(world().rank() == 1 ? "): off, another rank: on" : "): on, another rank: off") != std::string::npos,
      what);
  // Nothing was left half-made: the world still talks, and agreeing ranks construct as before.
  mpi_communicator off(MPI_COMM_WORLD, {.check_sequence = false});
  CHECK_FALSE(off.checks_sequence());
  CHECK(off.sequence_check().calls == 0);
  double x = 1.0;
  off.allreduce(std::span<double>(&x, 1), reduce_op::sum);
  CHECK(x == double(off.size()));
}

TEST_CASE("mpi_session and mpi_communicator lifetime") {
  mpi_session nested;  // MPI is already up: this one neither initialises nor finalises
  CHECK_FALSE(nested.owns_mpi());
  mpi_communicator a(MPI_COMM_WORLD);
  mpi_communicator b(std::move(a));
  CHECK(a.native() == MPI_COMM_NULL);  // NOLINT(bugprone-use-after-move)
  CHECK(b.size() == world().size());
  CHECK(b.rank() == world().rank());
  int value = b.rank() == 0 ? 42 : -1;
  b.broadcast(&value, sizeof value, 0);
  CHECK(value == 42);
}

}  // namespace mpi_communicator_test
