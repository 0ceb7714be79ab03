// SPDX-License-Identifier: Apache-2.0
// RTP's partition of a dimension (rtp/partition.hpp) and its counter-based initialisation
// (rtp/counter_init.hpp): shards tile the dimension, a dimension the world size does not divide is
// a config_error naming it and the world sizes that work, every rank materialises exactly its
// slice of the tensor one rank would build, and the values are distributed as asked; and the
// weight pair's shard layout (rtp/weight_pair.hpp).
#include <chunkstar/rtp/counter_init.hpp>
#include <chunkstar/rtp/partition.hpp>
#include <chunkstar/rtp/weight_pair.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <set>
#include <string>
#include <vector>

namespace rtp_partition_test {

namespace {

using namespace chunkstar;
using namespace chunkstar::rtp;

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

}  // namespace

TEST_CASE("shard_range tiles a dimension into equal contiguous blocks in rank order") {
  for (std::size_t dim = 1; dim <= 48; ++dim)
    for (int world = 1; world <= 8; ++world) {
      if (dim % static_cast<std::size_t>(world) != 0) continue;
      CAPTURE(dim);
      CAPTURE(world);
      std::size_t next = 0;
      for (int r = 0; r < world; ++r) {
        const index_range got = shard_range(dim, world, r, "d");
        CHECK(got.begin == next);
        CHECK(got.size() == dim / static_cast<std::size_t>(world));
        next = got.end;
      }
      CHECK(next == dim);
    }
  CHECK(shard_range(12, 4, 2, "hidden") == index_range{6, 9});
  CHECK(shard_range(12, 1, 0, "hidden") == index_range{0, 12});
}

TEST_CASE("valid_world_sizes lists the divisors up to the bound") {
  CHECK(valid_world_sizes(12) == std::vector<int>{1, 2, 3, 4, 6, 12});
  CHECK(valid_world_sizes(128) == std::vector<int>{1, 2, 4, 8, 16, 32, 64});  // 128 is above the bound
  CHECK(valid_world_sizes(97) == std::vector<int>{1});                        // prime above the bound
  CHECK(valid_world_sizes(12, 4) == std::vector<int>{1, 2, 3, 4});
  CHECK(valid_world_sizes(0).empty());
}

TEST_CASE("a dimension the world size does not divide is a config_error naming it and the sizes that work") {
  CHECK_THROWS_AS((void)shard_range(10, 4, 0, "hidden"), config_error);
  try {
    (void)shard_range(10, 4, 0, "hidden");
  } catch (const config_error& e) {
    const std::string m = e.what();
    CHECK(m.find("'hidden'") != std::string::npos);
    CHECK(m.find("size 10") != std::string::npos);
    CHECK(m.find("4 ranks") != std::string::npos);
    CHECK(m.find(": 1, 2, 5, 10;") != std::string::npos);
  }
  CHECK_THROWS_WITH_AS(require_divisible("w2.cols", 7, 2), doctest::Contains("'w2.cols'"), config_error);
  CHECK_NOTHROW(require_divisible("w2.cols", 8, 2));
  CHECK_THROWS_AS((void)shard_range(12, 0, 0, "hidden"), config_error);  // no ranks
  CHECK_THROWS_AS((void)shard_range(0, 2, 0, "hidden"), config_error);   // nothing to shard
  CHECK_THROWS_AS((void)shard_range(12, 4, 4, "hidden"), config_error);  // rank outside the world
  CHECK_THROWS_AS((void)shard_range(12, 4, -1, "hidden"), config_error);
}

TEST_CASE("counter_init: splitmix64's mixer, and a pure function of (seed, key, index)") {
  // splitmix64 seeded with 0 outputs mix64(gamma) first: the published first value.
  CHECK(rtp::detail::mix64(rtp::detail::golden_gamma) == 0xE220A8397B1DCDAFULL);
  const counter_init a{.seed = 7, .key = tensor_key("w1")};
  const counter_init same{.seed = 7, .key = tensor_key("w1")};
  const counter_init other_key{.seed = 7, .key = tensor_key("w2")};
  const counter_init other_seed{.seed = 8, .key = tensor_key("w1")};
  CHECK(tensor_key("w1") != tensor_key("w2"));
  std::set<std::uint64_t> seen;
  for (std::uint64_t i = 0; i < 1000; ++i) {
    CHECK(a.bits(i) == same.bits(i));
    CHECK(a.bits(i) != other_key.bits(i));
    CHECK(a.bits(i) != other_seed.bits(i));
    CHECK(a.bits(i, 0) != a.bits(i, 1));
    seen.insert(a.bits(i, 0));
    seen.insert(a.bits(i, 1));
  }
  CHECK(seen.size() == 2000);  // distinct counters, distinct words
}

TEST_CASE("counter_init: the shard each rank materialises is its slice of the tensor one rank builds") {
  // A 12 x 8 weight split by rows (as W1 by hidden units) and an 8 x 12 one split by columns (as
  // W2 by the same units), at N = 1..4: each rank fills only its shard, by global index.
  constexpr std::size_t hidden = 12, d = 8;
  const counter_init w1{.seed = 11, .key = tensor_key("w1")};
  const counter_init w2{.seed = 11, .key = tensor_key("w2")};
  std::vector<float> full1(hidden * d), full2(d * hidden);
  w1.fill_normal<float>(full1, 0, 0.0f, 0.3f);
  w2.fill_uniform<float>(full2, 0, -0.5f, 0.5f);
  for (int world = 1; world <= 4; ++world)
    for (int r = 0; r < world; ++r) {
      CAPTURE(world);
      CAPTURE(r);
      const index_range rows = shard_range(hidden, world, r, "hidden");
      std::vector<float> shard1(rows.size() * d);
      w1.fill_normal<float>(shard1, rows.begin * d, 0.0f, 0.3f);  // the rows are contiguous
      CHECK(std::memcmp(shard1.data(), full1.data() + rows.begin * d, shard1.size() * sizeof(float)) == 0);
      bool columns_match = true;
      for (std::size_t o = 0; o < d; ++o)
        for (std::size_t k = rows.begin; k < rows.end; ++k)  // the columns are strided: element by element
          columns_match =
              columns_match && same_bits(w2.uniform<float>(o * hidden + k, -0.5f, 0.5f), full2[o * hidden + k]);
      CHECK(columns_match);
    }
}

TEST_CASE("counter_init: uniform and normal values have the asked mean and variance, and no correlation") {
  // n samples; each bound is 5 standard errors of the statistic for the exact distribution, so a
  // correct generator fails with probability below 1e-6 per check, and these seeds are fixed.
  constexpr std::size_t n = 1 << 17;
  const double sn = std::sqrt(static_cast<double>(n));
  const counter_init g{.seed = 2024, .key = tensor_key("stats")};

  std::vector<float> u(n);
  g.fill_uniform<float>(u, 0, -1.0f, 1.0f);
  double mean = 0, sq = 0, lag = 0;
  float lo = 2, hi = -2;
  for (std::size_t i = 0; i < n; ++i) {
    mean += u[i];
    sq += static_cast<double>(u[i]) * u[i];
    if (i > 0) lag += static_cast<double>(u[i]) * u[i - 1];
    lo = std::min(lo, u[i]);
    hi = std::max(hi, u[i]);
  }
  mean /= n;
  const double var = sq / n - mean * mean;
  CHECK(lo >= -1.0f);
  CHECK(hi <= 1.0f);
  CHECK(lo < -0.999f);  // the whole range is reached
  CHECK(hi > 0.999f);
  CHECK(std::abs(mean) < 5 * std::sqrt(1.0 / 3.0) / sn);                     // Var X = 1/3
  CHECK(std::abs(var - 1.0 / 3.0) < 5 * std::sqrt(1.0 / 5 - 1.0 / 9) / sn);  // Var X^2 = 1/5 - 1/9
  CHECK(std::abs(lag / (n - 1) / (1.0 / 3.0)) < 5 / sn);                     // neighbours uncorrelated

  std::vector<float> z(n);
  g.fill_normal<float>(z, 0, 0.5f, 2.0f);
  mean = 0, sq = 0, lag = 0;
  std::size_t within_1sd = 0;
  for (std::size_t i = 0; i < n; ++i) {
    mean += z[i];
    sq += (static_cast<double>(z[i]) - 0.5) * (static_cast<double>(z[i]) - 0.5);
    if (i > 0) lag += (static_cast<double>(z[i]) - 0.5) * (static_cast<double>(z[i - 1]) - 0.5);
    if (std::abs(z[i] - 0.5f) < 2.0f) ++within_1sd;
  }
  mean /= n;
  CHECK(std::abs(mean - 0.5) < 5 * 2.0 / sn);
  CHECK(std::abs(sq / n - 4.0) < 5 * std::sqrt(2.0) * 4.0 / sn);  // Var of (X - mu)^2 = 2 sigma^4
  CHECK(std::abs(lag / (n - 1) / 4.0) < 5 / sn);
  const double p = 0.682689492137;  // P(|X - mu| < sigma)
  CHECK(std::abs(static_cast<double>(within_1sd) / n - p) < 5 * std::sqrt(p * (1 - p)) / sn);

  // Two tensors (keys) at the same indices are uncorrelated too.
  const counter_init h{.seed = 2024, .key = tensor_key("stats2")};
  double cross = 0;
  for (std::size_t i = 0; i < n; ++i) cross += static_cast<double>(u[i]) * h.uniform<float>(i, -1.0f, 1.0f);
  CHECK(std::abs(cross / n / (1.0 / 3.0)) < 5 / sn);
}

TEST_CASE(
    "weight_pair: the shards hold every element of A, its bias and B exactly once, each shard a permutation of its "
    "buffer") {
  for (const std::size_t groups : {std::size_t{1}, std::size_t{3}})
    for (const bool bias : {true, false})
      for (int n = 1; n <= 4; ++n) {
        CAPTURE(groups);
        CAPTURE(bias);
        CAPTURE(n);
        const weight_pair p = make_weight_pair(5, 12, 7, n, "units", groups, bias);
        CHECK(p.shard_units() == 12 / static_cast<std::size_t>(n));
        CHECK(p.shard_elems() * static_cast<std::size_t>(n) ==
              p.a_weight_elems() + p.a_bias_elems() + p.b_weight_elems());
        std::vector<int> a(p.a_weight_elems()), ab(p.a_bias_elems()), b(p.b_weight_elems());
        for (std::size_t s = 0; s < static_cast<std::size_t>(n); ++s) {
          std::vector<int> at(p.shard_elems());
          p.for_each(s, [&](weight_pair::part part, std::size_t i, std::size_t off) {
            REQUIRE(off < at.size());
            ++at[off];
            auto& whole = part == weight_pair::part::a_weight ? a : part == weight_pair::part::a_bias ? ab : b;
            REQUIRE(i < whole.size());
            ++whole[i];
            // A's rows of this shard's units, B's columns of the same units.
            const std::size_t unit = part == weight_pair::part::b_weight
                                         ? i % p.units
                                         : (part == weight_pair::part::a_weight ? i / p.in : i) % p.units;
            CHECK(unit / p.shard_units() == s);
            // Offsets by part: A's rows, then the bias, then B's columns.
            if (part == weight_pair::part::a_weight) CHECK(off < p.a_bias_offset());
            if (part == weight_pair::part::a_bias) CHECK((off >= p.a_bias_offset() && off < p.b_weight_offset()));
            if (part == weight_pair::part::b_weight) CHECK(off >= p.b_weight_offset());
          });
          CHECK(std::all_of(at.begin(), at.end(), [](int c) { return c == 1; }));
        }
        for (const auto* v : {&a, &ab, &b}) CHECK(std::all_of(v->begin(), v->end(), [](int c) { return c == 1; }));
      }
  CHECK_THROWS_AS((void)make_weight_pair(5, 12, 7, 5, "units"), config_error);
  try {
    (void)make_weight_pair(5, 12, 7, 5, "hidden units");
  } catch (const config_error& e) {
    CHECK(std::string(e.what()).find("hidden units") != std::string::npos);
  }
}

}  // namespace rtp_partition_test
