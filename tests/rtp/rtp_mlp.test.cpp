// SPDX-License-Identifier: Apache-2.0
// RTP trains a 2-layer MLP exactly as one process would: y = s * (W2 gelu(W1 x + b1)) + b2 on
// 1-4 in-process ranks, each with its own micro-batch, SGD for 12 iterations with an evaluation
// pass after every one, against an independent serial float64 reference (plain loops over the full
// weights, N micro-batches per step). The model, the reference and the derived tolerances are in
// tests/support/rtp_mlp.hpp, shared with the MPI test (tests/mpi/rtp.test.cpp), which checks that
// MPI ranks give these runs' bits.
#include "support/rtp_mlp.hpp"

#include <doctest/doctest.h>

using namespace chunkstar::testing::rtp_mlp;

namespace rtp_mlp_test {

TEST_CASE("RTP MLP on 1-4 ranks = the serial float64 reference, iteration by iteration, with evaluation in between") {
  for (int n = 1; n <= 4; ++n) check_against_reference(run_rtp(n), n);
}

TEST_CASE("RTP MLP: two runs at the same N give bit-identical losses, gradients and parameters") {
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    CHECK(same_bits(run_rtp(n), run_rtp(n)));
  }
}

}  // namespace rtp_mlp_test
