// SPDX-License-Identifier: Apache-2.0
// The Communicator conformance suite as doctest test cases: a thin adapter over the installed,
// framework-free checks (chunkstar/testing/communicator_conformance.hpp), one test case per group.
//
// A fixture F provides:
//   static void run(Body body)  — calls body(comm) once on every rank, comm being a Communicator;
//   using buffer = ...          — memory the model's collectives take (a communicator_buffer);
//   static constexpr bool exact — reductions are the bit-exact rank-order fold (false: NCCL with
//                                 several ranks, checked to reduction-order tolerance instead).
// Instantiate with CHUNKSTAR_COMM_CONFORMANCE(fixture types...).
//
// Each rank asserts on its own report (doctest assertions are thread-safe), so a failure names the
// rank that saw it; the checks issue the same collectives on every rank whatever they find.
#pragma once

#include <chunkstar/testing/communicator_conformance.hpp>

#include <doctest/doctest.h>

namespace chunkstar::comm_test {

using chunkstar::testing::host_buffer;

/** @brief Runs one group of the installed checks on every rank of fixture F. */
template <class F>
void run_conformance(chunkstar::testing::communicator_check group) {
  F::run([&](auto& comm) {
    const auto report =
        chunkstar::testing::check_communicator<typename F::buffer>(comm, {.exact = F::exact, .only = {group}});
    CHECK_MESSAGE(report.ok(), report.to_string());
    CHECK(report.checks > 0);
  });
}

}  // namespace chunkstar::comm_test

// clang-format off
#define CHUNKSTAR_COMM_CONFORMANCE_CASE(id, title, group)                                                   \
  TEST_CASE_TEMPLATE_DEFINE("communicator conformance: " title, F, id) {                                    \
    chunkstar::comm_test::run_conformance<F>(chunkstar::testing::communicator_check::group);                \
  }
CHUNKSTAR_COMM_CONFORMANCE_CASE(chunkstar_comm_rank_size, "rank, size, barrier, argument errors", rank_size)
CHUNKSTAR_COMM_CONFORMANCE_CASE(chunkstar_comm_allreduce, "allreduce matches the rank-order reference", allreduce)
CHUNKSTAR_COMM_CONFORMANCE_CASE(chunkstar_comm_allreduce_f64, "allreduce of doubles", allreduce_f64)
CHUNKSTAR_COMM_CONFORMANCE_CASE(chunkstar_comm_reduce_scatter, "reduce_scatter", reduce_scatter)
CHUNKSTAR_COMM_CONFORMANCE_CASE(chunkstar_comm_reduce, "reduce (rooted) matches the rank-order reference at the root", reduce)
CHUNKSTAR_COMM_CONFORMANCE_CASE(chunkstar_comm_allgather, "allgather", allgather)
CHUNKSTAR_COMM_CONFORMANCE_CASE(chunkstar_comm_broadcast, "broadcast", broadcast)
CHUNKSTAR_COMM_CONFORMANCE_CASE(chunkstar_comm_ring_shift, "ring_shift", ring_shift)
CHUNKSTAR_COMM_CONFORMANCE_CASE(chunkstar_comm_async, "several async handles outstanding", async)
CHUNKSTAR_COMM_CONFORMANCE_CASE(chunkstar_comm_determinism, "deterministic, bit-identical across ranks", determinism)
// clang-format on

/// Instantiates the whole suite for the given fixture types.
#define CHUNKSTAR_COMM_CONFORMANCE(...)                                  \
  TEST_CASE_TEMPLATE_INVOKE(chunkstar_comm_rank_size, __VA_ARGS__);      \
  TEST_CASE_TEMPLATE_INVOKE(chunkstar_comm_allreduce, __VA_ARGS__);      \
  TEST_CASE_TEMPLATE_INVOKE(chunkstar_comm_allreduce_f64, __VA_ARGS__);  \
  TEST_CASE_TEMPLATE_INVOKE(chunkstar_comm_reduce_scatter, __VA_ARGS__); \
  TEST_CASE_TEMPLATE_INVOKE(chunkstar_comm_reduce, __VA_ARGS__);         \
  TEST_CASE_TEMPLATE_INVOKE(chunkstar_comm_allgather, __VA_ARGS__);      \
  TEST_CASE_TEMPLATE_INVOKE(chunkstar_comm_broadcast, __VA_ARGS__);      \
  TEST_CASE_TEMPLATE_INVOKE(chunkstar_comm_ring_shift, __VA_ARGS__);     \
  TEST_CASE_TEMPLATE_INVOKE(chunkstar_comm_async, __VA_ARGS__);          \
  TEST_CASE_TEMPLATE_INVOKE(chunkstar_comm_determinism, __VA_ARGS__)
