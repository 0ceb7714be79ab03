// SPDX-License-Identifier: Apache-2.0
// Global-norm clipping: N ranks of an in-process group, each owning some of the gradient chunks,
// get the same norm and coefficient as one rank owning all of them.
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/comm/single_process.hpp>
#include <chunkstar/optim/clip.hpp>
#include <chunkstar/optim/grad_check.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

using namespace chunkstar;

namespace optim_clip_test {

namespace {
// Chunks of different sizes (some not multiples of the vector width), like a chunk list's tail.
std::vector<std::vector<bfloat16>> make_chunks() {
  std::mt19937 rng(11);
  std::normal_distribution<float> d(0.0f, 0.02f);
  std::vector<std::vector<bfloat16>> chunks;
  for (std::size_t size : {70000u, 65536u, 1000u, 33333u, 70000u, 7u, 100001u, 4096u}) {
    chunks.emplace_back(size);
    for (auto& x : chunks.back()) x = bfloat16(d(rng));
  }
  return chunks;
}
}  // namespace

TEST_CASE("clip_coefficient") {
  CHECK(clip_coefficient(0.25, 1.0f).coefficient == 1.0f);  // norm 0.5 below max: unchanged
  const clip_result r = clip_coefficient(16.0, 1.0f);
  CHECK(r.norm == 4.0);
  CHECK(r.coefficient == doctest::Approx(0.25).epsilon(1e-6));
  CHECK(clip_coefficient(std::numeric_limits<double>::infinity(), 1.0f).coefficient == 1.0f);
  CHECK(std::isnan(clip_coefficient(std::numeric_limits<double>::quiet_NaN(), 1.0f).norm));
  CHECK_THROWS_AS(clip_coefficient(1.0, 0.0f), config_error);
}

TEST_CASE("clipping across an in-process rank group equals single-rank clipping") {
  const auto chunks = make_chunks();
  const float max_norm = 1.0f;
  // Single rank owns every chunk and sums them in chunk order.
  double local = 0;
  for (const auto& c : chunks) local += sum_of_squares<bfloat16>(c);
  single_process_communicator solo;
  const clip_result one = global_norm_clip_coefficient(local, max_norm, solo);
  long double ref = 0;
  for (const auto& c : chunks)
    for (auto x : c) ref += static_cast<long double>(to_float(x)) * to_float(x);
  CHECK(one.norm == doctest::Approx(std::sqrt(static_cast<double>(ref))).epsilon(1e-12));
  REQUIRE(one.coefficient < 1.0f);  // the norm (~4.6) exceeds max_norm: clipping is active
  // Clipped gradients have norm max_norm.
  double clipped = 0;
  for (const auto& c : chunks) clipped += sum_of_squares<bfloat16>(c, one.coefficient);
  CHECK(std::sqrt(clipped) == doctest::Approx(max_norm).epsilon(1e-6));

  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    std::vector<clip_result> results(static_cast<std::size_t>(n));
    run_ranks(n, [&](in_process_communicator& comm) {
      // Rank r owns chunks r, r + n, ... (ZeRO-style round robin).
      double mine = 0;
      for (std::size_t k = static_cast<std::size_t>(comm.rank()); k < chunks.size(); k += static_cast<std::size_t>(n))
        mine += sum_of_squares<bfloat16>(chunks[k]);
      results[static_cast<std::size_t>(comm.rank())] = global_norm_clip_coefficient(mine, max_norm, comm);
    });
    for (const auto& r : results) {
      // Bit-identical on every rank (the allreduce adds in rank order everywhere) ...
      CHECK(r.norm == results[0].norm);
      CHECK(r.coefficient == results[0].coefficient);
    }
    // ... and equal to one rank up to the association of a handful of double additions (each
    // rank's partial sums its own chunks first): a few units of 2^-53 relative. The coefficient
    // is that norm rounded to float, so at most one float ulp apart.
    CHECK(results[0].norm == doctest::Approx(one.norm).epsilon(1e-14));
    CHECK(std::abs(results[0].coefficient - one.coefficient) <=
          std::nextafter(one.coefficient, 2.0f) - one.coefficient);
  }
}

}  // namespace optim_clip_test
