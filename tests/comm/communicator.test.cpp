// SPDX-License-Identifier: Apache-2.0
// The Communicator concept (both ways), the installed conformance checks for single_process,
// in_process_group (1..4 ranks) and staged_communicator (1 and 3 ranks) as doctest cases, and
// framework-free (rank reports combined), a broken model they must reject, and in_process_group's
// failure handling.
#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/comm/communicator_ref.hpp>
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/comm/single_process.hpp>
#include <chunkstar/comm/staged_communicator.hpp>

#include "support/comm_conformance.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace communicator_test {

namespace {

using namespace chunkstar;

// ---- the concept, both ways --------------------------------------------------------------

// A type with every required expression, each switchable off (or to a wrong shape) to show that
// the concept notices. All switches on = a valid model (the positive control).
template <bool ConstRank = true, bool IntRank = true, bool DoubleAllreduce = true, bool Ring = true,
          bool AsyncHandle = true, bool Barrier = true, bool Reduce = true>
struct fake_comm {
  int rank() const noexcept requires(ConstRank&& IntRank) { return 0; }
  int rank() noexcept requires(!ConstRank) { return 0; }
  std::size_t rank() const noexcept requires(ConstRank && !IntRank) { return 0; }
  int size() const noexcept { return 1; }
  void allreduce(void*, std::size_t, dtype, reduce_op) {}
  void allreduce(std::span<double>, reduce_op) requires DoubleAllreduce {}
  void allgather(const void*, void*, std::size_t) {}
  void reduce_scatter(const void*, void*, std::size_t, dtype, reduce_op) {}
  void reduce(const void*, void*, std::size_t, dtype, reduce_op, int) requires Reduce {}
  void broadcast(void*, std::size_t, int) {}
  void ring_shift(const void*, void*, std::size_t) requires Ring {}
  void barrier() requires Barrier {}
  comm_handle allreduce_async(void*, std::size_t, dtype, reduce_op) requires AsyncHandle { return {}; }
  void allreduce_async(void*, std::size_t, dtype, reduce_op) requires(!AsyncHandle) {}
  comm_handle allreduce_async(std::span<double>, reduce_op) { return {}; }
  comm_handle allgather_async(const void*, void*, std::size_t) { return {}; }
  comm_handle reduce_scatter_async(const void*, void*, std::size_t, dtype, reduce_op) { return {}; }
  comm_handle reduce_async(const void*, void*, std::size_t, dtype, reduce_op, int) requires Reduce { return {}; }
  comm_handle broadcast_async(void*, std::size_t, int) { return {}; }
  comm_handle ring_shift_async(const void*, void*, std::size_t) { return {}; }
};

static_assert(Communicator<single_process_communicator>);
static_assert(Communicator<in_process_communicator>);
static_assert(Communicator<fake_comm<>>);
static_assert(!Communicator<fake_comm<false>>, "rank() must be callable on a const communicator");
static_assert(!Communicator<fake_comm<true, false>>, "rank() must return int");
static_assert(!Communicator<fake_comm<true, true, false>>, "allreduce(span<double>, op) is required");
static_assert(!Communicator<fake_comm<true, true, true, false>>, "ring_shift is required");
static_assert(!Communicator<fake_comm<true, true, true, true, false>>, "async forms must return comm_handle");
static_assert(!Communicator<fake_comm<true, true, true, true, true, false>>, "barrier is required");
static_assert(!Communicator<fake_comm<true, true, true, true, true, true, false>>, "reduce (rooted) is required");
static_assert(!Communicator<int>);
static_assert(!Communicator<in_process_group>, "the group is not a rank's communicator");

// ---- fixtures for the conformance suite ----------------------------------------------------

struct single_process_fixture {
  using buffer = comm_test::host_buffer;
  static constexpr bool exact = true;
  template <class Body>
  static void run(Body&& body) {
    single_process_communicator comm;
    body(comm);
  }
};

template <int N>
struct in_process_fixture {
  using buffer = comm_test::host_buffer;
  static constexpr bool exact = true;
  template <class Body>
  static void run(Body&& body) {
    run_ranks(N, [&](in_process_communicator& comm) { body(comm); });
  }
};

// staged_communicator over in-process ranks (memcpy staging): the concept's semantics, argument
// errors and bits survive the staging.
template <int N>
struct staged_fixture {
  using buffer = comm_test::host_buffer;
  static constexpr bool exact = true;
  template <class Body>
  static void run(Body&& body) {
    run_ranks(N, [&](in_process_communicator& inner) {
      staged_communicator<in_process_communicator> comm(inner);
      body(comm);
    });
  }
};

// Fails the test run (instead of hanging CI) when `fn` does not finish: the point of these tests
// is that failures never hang, so a hang is the failure being tested for.
template <class Fn>
void bounded(Fn fn) {
  auto done = std::async(std::launch::async, std::move(fn));
  if (done.wait_for(std::chrono::seconds(120)) != std::future_status::ready) {
    std::fprintf(stderr, "FATAL: in_process_group test hung for 120 s (a failure was not propagated)\n");
    std::fflush(stderr);
    std::_Exit(3);
  }
  done.get();
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

CHUNKSTAR_COMM_CONFORMANCE(single_process_fixture, in_process_fixture<1>, in_process_fixture<2>, in_process_fixture<3>,
                           in_process_fixture<4>, staged_fixture<1>, staged_fixture<3>);

TEST_CASE("communicator conformance without a test framework: every rank reports, the caller combines") {
  bounded([] {
    std::vector<chunkstar::testing::conformance_report> reports(3);
    run_ranks(3, [&](in_process_communicator& comm) {
      reports[static_cast<std::size_t>(comm.rank())] = chunkstar::testing::check_communicator(comm);
    });
    const auto all = chunkstar::testing::combine_rank_reports(reports);
    CHECK_MESSAGE(all.ok(), all.to_string());
    CHECK(all.checks == reports[0].checks + reports[1].checks + reports[2].checks);
    CHECK(all.checks > 3 * 400);
    single_process_communicator one;
    const auto r = chunkstar::testing::check_communicator(one);
    CHECK_MESSAGE(r.ok(), r.to_string());
    CHECK(r.subject == "Communicator (rank 0 of 1)");
  });
}

namespace {
// in_process_communicator with max and min swapped in every reduction: a model the checks must
// reject on every rank, without any rank left waiting (the same collectives are issued regardless).
class swapped_ops_communicator {
 public:
  explicit swapped_ops_communicator(in_process_communicator& c) : c_(&c) {}
  [[nodiscard]] int rank() const noexcept { return c_->rank(); }
  [[nodiscard]] int size() const noexcept { return c_->size(); }
  void allreduce(void* p, std::size_t n, dtype t, reduce_op op) { c_->allreduce(p, n, t, swap(op)); }
  void allreduce(std::span<double> d, reduce_op op) { c_->allreduce(d, swap(op)); }
  void allgather(const void* s, void* r, std::size_t n) { c_->allgather(s, r, n); }
  void reduce_scatter(const void* s, void* r, std::size_t n, dtype t, reduce_op op) {
    c_->reduce_scatter(s, r, n, t, swap(op));
  }
  void reduce(const void* s, void* r, std::size_t n, dtype t, reduce_op op, int root) {
    c_->reduce(s, r, n, t, swap(op), root);
  }
  void broadcast(void* p, std::size_t n, int root) { c_->broadcast(p, n, root); }
  void ring_shift(const void* s, void* r, std::size_t n) { c_->ring_shift(s, r, n); }
  void barrier() { c_->barrier(); }
  comm_handle allreduce_async(void* p, std::size_t n, dtype t, reduce_op op) {
    return c_->allreduce_async(p, n, t, swap(op));
  }
  comm_handle allreduce_async(std::span<double> d, reduce_op op) { return c_->allreduce_async(d, swap(op)); }
  comm_handle allgather_async(const void* s, void* r, std::size_t n) { return c_->allgather_async(s, r, n); }
  comm_handle reduce_scatter_async(const void* s, void* r, std::size_t n, dtype t, reduce_op op) {
    return c_->reduce_scatter_async(s, r, n, t, swap(op));
  }
  comm_handle reduce_async(const void* s, void* r, std::size_t n, dtype t, reduce_op op, int root) {
    return c_->reduce_async(s, r, n, t, swap(op), root);
  }
  comm_handle broadcast_async(void* p, std::size_t n, int root) { return c_->broadcast_async(p, n, root); }
  comm_handle ring_shift_async(const void* s, void* r, std::size_t n) { return c_->ring_shift_async(s, r, n); }

 private:
  static reduce_op swap(reduce_op op) {
    return op == reduce_op::max ? reduce_op::min : op == reduce_op::min ? reduce_op::max : op;
  }
  in_process_communicator* c_;
};
static_assert(Communicator<swapped_ops_communicator>);
}  // namespace

TEST_CASE("communicator conformance: a model with max and min swapped fails on every rank") {
  using chunkstar::testing::communicator_check;
  bounded([] {
    std::vector<chunkstar::testing::conformance_report> reports(2);
    run_ranks(2, [&](in_process_communicator& comm) {
      swapped_ops_communicator broken(comm);
      reports[static_cast<std::size_t>(comm.rank())] = chunkstar::testing::check_communicator(
          broken,
          {.only = {communicator_check::allreduce, communicator_check::reduce_scatter, communicator_check::allgather}});
    });
    for (const auto& r : reports) {
      CHECK(!r.ok());
      CHECK(std::any_of(r.failures.begin(), r.failures.end(), [](const std::string& f) {
        return contains(f, "allreduce f32 max") && contains(f, "differs from the rank-order reduction");
      }));
      CHECK(std::none_of(r.failures.begin(), r.failures.end(),
                         [](const std::string& f) { return contains(f, "allgather"); }));
    }
    const auto all = chunkstar::testing::combine_rank_reports(reports);
    CHECK(all.failed == reports[0].failed + reports[1].failed);
    CHECK(contains(all.to_string(), "rank 1: "));
  });
  bounded([] {  // the rooted reduce on its own (a report keeps only its first failures' messages)
    std::vector<chunkstar::testing::conformance_report> reports(2);
    run_ranks(2, [&](in_process_communicator& comm) {
      swapped_ops_communicator broken(comm);
      reports[static_cast<std::size_t>(comm.rank())] =
          chunkstar::testing::check_communicator(broken, {.only = {communicator_check::reduce}});
    });
    // The result is only at the root: each rank sees the failures of the reduces to itself.
    for (int rank = 0; rank < 2; ++rank) {
      const auto& r = reports[static_cast<std::size_t>(rank)];
      CHECK(!r.ok());
      CHECK_MESSAGE(std::any_of(r.failures.begin(), r.failures.end(),
                                [&](const std::string& f) {
                                  return contains(f, "reduce f32 max") &&
                                         contains(f, "to root " + std::to_string(rank)) &&
                                         contains(f, "at the root differs");
                                }),
                    r.to_string());
      CHECK(
          std::none_of(r.failures.begin(), r.failures.end(), [](const std::string& f) { return contains(f, "sum"); }));
    }
  });
}

// ---- in_process_group failure handling -------------------------------------------------------

TEST_CASE("in_process_group: a rank that throws makes every peer fail with communication_error") {
  bounded([] {
    std::vector<std::string> errors(4);
    std::atomic<int> peers_failed{0};
    CHECK_THROWS_WITH_AS(run_ranks(4,
                                   [&](in_process_communicator& comm) {
                                     float x = 1.0f;
                                     comm.allreduce(&x, 1, dtype::f32, reduce_op::sum);
                                     if (comm.rank() == 2) throw std::runtime_error("boom");
                                     try {
                                       comm.allreduce(&x, 1, dtype::f32, reduce_op::sum);  // rank 2 never joins
                                     } catch (const communication_error& e) {
                                       errors[static_cast<std::size_t>(comm.rank())] = e.what();
                                       ++peers_failed;
                                       throw;
                                     }
                                   }),
                         "boom", std::runtime_error);  // the root cause, not a peer's resulting error
    CHECK(peers_failed == 3);
    for (int r : {0, 1, 3})
      CHECK_MESSAGE(contains(errors[static_cast<std::size_t>(r)], "rank 2 failed: boom"),
                    errors[static_cast<std::size_t>(r)]);
  });
}

TEST_CASE("in_process_group: a failure reaches outstanding async handles, and later calls fail at once") {
  bounded([] {
    std::atomic<int> handle_errors{0}, later_errors{0};
    CHECK_THROWS_AS(run_ranks(3,
                              [&](in_process_communicator& comm) {
                                if (comm.rank() == 0) throw std::logic_error("rank zero gives up");
                                std::vector<float> v(100, 1.0f);
                                comm_handle h = comm.allreduce_async(v.data(), v.size(), dtype::f32, reduce_op::sum);
                                try {
                                  h.wait();
                                } catch (const communication_error& e) {
                                  if (contains(e.what(), "rank 0 failed: rank zero gives up")) ++handle_errors;
                                }
                                CHECK(h.ready());
                                try {
                                  comm.barrier();
                                } catch (const communication_error&) {
                                  ++later_errors;
                                }
                              }),
                    std::logic_error);
    CHECK(handle_errors == 2);
    CHECK(later_errors == 2);
  });
}

TEST_CASE("in_process_group: mismatched collective sequences are detected and both calls named") {
  bounded([] {
    std::vector<std::string> errors(2);
    CHECK_THROWS_AS(run_ranks(2,
                              [&](in_process_communicator& comm) {
                                comm.barrier();  // call #0 matches
                                std::vector<float> buf(32);
                                try {
                                  if (comm.rank() == 0) comm.allreduce(buf.data(), 10, dtype::f32, reduce_op::sum);
                                  else comm.allgather(buf.data(), buf.data() + 8, 8);
                                } catch (const communication_error& e) {
                                  errors[static_cast<std::size_t>(comm.rank())] = e.what();
                                  throw;
                                }
                              }),
                    communication_error);
    for (const auto& e : errors) {
      CHECK_MESSAGE(contains(e, "call #1"), e);
      CHECK_MESSAGE(contains(e, "rank 0 called allreduce(10 x f32, sum)"), e);
      CHECK_MESSAGE(contains(e, "rank 1 called allgather(8 bytes per rank)"), e);
    }
  });
}

TEST_CASE("in_process_group: same kind but different sizes, dtypes, ops or roots is a mismatch too") {
  struct variant {
    const char* name;
    void (*call)(in_process_communicator&, std::vector<float>&);
  };
  const variant variants[] = {
      {"count",
       [](in_process_communicator& c, std::vector<float>& b) {
         c.allreduce(b.data(), c.rank() == 0 ? 4 : 5, dtype::f32, reduce_op::sum);
       }},
      {"dtype",
       [](in_process_communicator& c, std::vector<float>& b) {
         c.allreduce(b.data(), 4, c.rank() == 0 ? dtype::f32 : dtype::bf16, reduce_op::sum);
       }},
      {"op",
       [](in_process_communicator& c, std::vector<float>& b) {
         c.allreduce(b.data(), 4, dtype::f32, c.rank() == 0 ? reduce_op::sum : reduce_op::max);
       }},
      {"root",
       [](in_process_communicator& c, std::vector<float>& b) { c.broadcast(b.data(), 16, c.rank() == 0 ? 0 : 1); }},
      {"reduce root",
       [](in_process_communicator& c, std::vector<float>& b) {
         c.reduce(b.data(), b.data(), 4, dtype::f32, reduce_op::sum, c.rank());
       }},
      {"reduce op",
       [](in_process_communicator& c, std::vector<float>& b) {
         c.reduce(b.data(), b.data(), 4, dtype::f32, c.rank() == 0 ? reduce_op::min : reduce_op::max, 0);
       }},
      {"reduce vs allreduce",
       [](in_process_communicator& c, std::vector<float>& b) {
         if (c.rank() == 0) c.reduce(b.data(), b.data(), 4, dtype::f32, reduce_op::sum, 0);
         else c.allreduce(b.data(), 4, dtype::f32, reduce_op::sum);
       }},
  };
  for (const auto& v : variants) {
    CAPTURE(v.name);
    bounded([&] {
      std::atomic<int> named{0};
      CHECK_THROWS_AS(run_ranks(2,
                                [&](in_process_communicator& comm) {
                                  std::vector<float> buf(16, 1.0f);
                                  try {
                                    v.call(comm, buf);
                                  } catch (const communication_error& e) {
                                    if (contains(e.what(), "collective mismatch at call #0")) ++named;
                                    throw;
                                  }
                                }),
                      communication_error);
      CHECK(named == 2);
    });
  }
}

TEST_CASE("in_process_group: a reduce to another root is a mismatch naming both calls and roots") {
  bounded([] {
    std::vector<std::string> errors(3);
    CHECK_THROWS_AS(run_ranks(3,
                              [&](in_process_communicator& comm) {
                                std::vector<float> buf(8, 1.0f), out(8);
                                comm.reduce(buf.data(), out.data(), 8, dtype::f32, reduce_op::sum,
                                            1);  // call #0 matches
                                try {
                                  // rank 2 thinks it owns the chunk; the others think rank 0 does
                                  comm.reduce_async(buf.data(), out.data(), 8, dtype::bf16, reduce_op::sum,
                                                    comm.rank() == 2 ? 2 : 0)
                                      .wait();
                                } catch (const communication_error& e) {
                                  errors[static_cast<std::size_t>(comm.rank())] = e.what();
                                  throw;
                                }
                              }),
                    communication_error);
    for (const auto& e : errors) {
      CHECK_MESSAGE(
          contains(e,
                   "collective mismatch at call #1: rank 0 called reduce(8 x bf16, sum, to root 0) but rank 2 "
                   "called reduce(8 x bf16, sum, to root 2)"),
          e);
    }
  });
}

TEST_CASE("reduce: the root gets the rank-order fold, the other ranks' buffers are left alone, volumes are counted") {
  bounded([] {
    run_ranks(4, [](in_process_communicator& comm) {
      const int r = comm.rank();
      // Rank k contributes 1 + k at every element; in place on the root (rank 2).
      std::vector<float> mine(6, 1.0f + static_cast<float>(r));
      const comm_stats before = comm.stats();
      comm.reduce(mine.data(), mine.data(), mine.size(), dtype::f32, reduce_op::sum, 2);
      const comm_stats after = comm.stats();
      for (float x : mine) CHECK(x == (r == 2 ? 10.0f : 1.0f + static_cast<float>(r)));
      CHECK(after.collectives - before.collectives == 1);
      CHECK(after.bytes_sent - before.bytes_sent == (r == 2 ? 0u : 24u));
      CHECK(after.bytes_received - before.bytes_received == (r == 2 ? 3u * 24u : 0u));
      // Not in place, null recv on the ranks other than the root.
      std::vector<float> out(6, -1.0f);
      comm.reduce(mine.data(), r == 0 ? out.data() : nullptr, mine.size(), dtype::f32, reduce_op::max, 0);
      if (r == 0)
        for (float x : out) CHECK(x == 10.0f);  // rank 2's 10 is the largest
      // Over communicator_ref, asynchronously.
      communicator_ref ref(comm);
      std::vector<float> x(3, static_cast<float>(r)), y(3, -1.0f);
      comm_handle h = ref.reduce_async(x.data(), y.data(), 3, dtype::f32, reduce_op::min, 3);
      h.wait();
      for (float v : y) CHECK(v == (r == 3 ? 0.0f : -1.0f));
      CHECK(ref.stats().collectives == comm.stats().collectives);
    });
  });
  single_process_communicator one;
  float a[3] = {1, 2, 3}, b[3] = {};
  one.reduce(a, b, 3, dtype::f32, reduce_op::sum, 0);
  CHECK(b[2] == 3.0f);
  one.reduce(a, a, 3, dtype::f32, reduce_op::sum, 0);  // in place: nothing to do
  CHECK(a[1] == 2.0f);
  CHECK_THROWS_AS(one.reduce(a, b, 3, dtype::f32, reduce_op::sum, 1), config_error);
  CHECK_THROWS_AS(one.reduce(a, a + 1, 2, dtype::f32, reduce_op::sum, 0), config_error);
}

TEST_CASE("communicator conformance over communicator_ref: the rooted reduce and the async mix") {
  using chunkstar::testing::communicator_check;
  bounded([] {
    std::vector<chunkstar::testing::conformance_report> reports(3);
    run_ranks(3, [&](in_process_communicator& comm) {
      communicator_ref ref(comm);
      reports[static_cast<std::size_t>(comm.rank())] = chunkstar::testing::check_communicator(
          ref, {.only = {communicator_check::reduce, communicator_check::async}});
    });
    const auto all = chunkstar::testing::combine_rank_reports(reports);
    CHECK_MESSAGE(all.ok(), all.to_string());
    CHECK(all.checks > 3 * 100);
  });
}

TEST_CASE("in_process_group: a rank that returns early fails its peers instead of hanging them") {
  bounded([] {
    std::string error;
    CHECK_THROWS_AS(run_ranks(2,
                              [&](in_process_communicator& comm) {
                                comm.barrier();
                                if (comm.rank() == 1) return;  // leaves after one call
                                try {
                                  comm.barrier();
                                } catch (const communication_error& e) {
                                  error = e.what();
                                  throw;
                                }
                              }),
                    communication_error);
    CHECK_MESSAGE(contains(error, "rank 1 left the collective sequence after 1 calls"), error);
    CHECK_MESSAGE(contains(error, "call #1: barrier()"), error);
  });
}

TEST_CASE("in_process_group: driven from the caller's own threads with fail() and leave()") {
  bounded([] {
    in_process_group group(2);
    std::string error;
    std::thread t0([&] {
      try {
        group.communicator(0).barrier();
      } catch (const communication_error& e) {
        error = e.what();
      }
    });
    group.fail(1, "out of device memory");
    t0.join();
    CHECK(group.poisoned());
    CHECK_MESSAGE(contains(error, "rank 1 failed: out of device memory"), error);
  });
  bounded([] {
    in_process_group group(2);
    double sums[2] = {0, 0};
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r)
      threads.emplace_back([&, r] {
        double x = r + 1.0;
        group.communicator(r).allreduce(std::span<double>(&x, 1), reduce_op::sum);
        sums[r] = x;
        group.leave(r);
      });
    for (auto& t : threads) t.join();
    CHECK(sums[0] == 3.0);
    CHECK(sums[1] == 3.0);
    CHECK_FALSE(group.poisoned());
  });
}

TEST_CASE("in_process_group: argument and state errors") {
  CHECK_THROWS_AS(in_process_group(0), config_error);
  in_process_group group(2);
  CHECK_THROWS_AS((void)group.communicator(2), config_error);
  CHECK_THROWS_AS((void)group.communicator(-1), config_error);
  CHECK_THROWS_AS(group.communicator(0).broadcast(nullptr, 0, 2), config_error);
  group.run([](in_process_communicator& comm) { comm.barrier(); });
  CHECK_THROWS_AS(group.run([](in_process_communicator&) {}), state_error);
}

TEST_CASE("in_process_group: a handle dropped without wait() still completes before its buffers go away") {
  bounded([] {
    run_ranks(3, [](in_process_communicator& comm) {
      std::vector<float> v(1000, 1.0f);
      { comm_handle h = comm.allreduce_async(v.data(), v.size(), dtype::f32, reduce_op::sum); }
      CHECK(v[999] == 3.0f);  // the destructor waited
    });
  });
}

TEST_CASE("comm_handle: wait() turns a model's failure into communication_error, once") {
  struct failing_state {
    void wait() { throw std::runtime_error("transport broke"); }
    bool ready() { return true; }
  };
  comm_handle h(std::make_shared<failing_state>());
  CHECK_FALSE(comm_handle().ready() == false);
  CHECK_THROWS_WITH_AS(h.wait(), "asynchronous collective failed: transport broke", communication_error);
  CHECK(h.ready());
  CHECK_NOTHROW(h.wait());
}

TEST_CASE("in_process_group: barrier() returns only after every rank entered it") {
  bounded([] {
    std::atomic<int> entered{0};
    std::atomic<int> early{0};
    run_ranks(4, [&](in_process_communicator& comm) {
      for (int round = 1; round <= 20; ++round) {
        ++entered;
        comm.barrier();
        if (entered.load() < 4 * round) ++early;
        comm.barrier();  // nobody starts the next round before all have checked this one
      }
    });
    CHECK(early == 0);
  });
}

}  // namespace communicator_test
