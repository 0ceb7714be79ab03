// SPDX-License-Identifier: Apache-2.0
// Gradient scans: inf/NaN detection anywhere, sum of squares against a long double reference,
// identical bits across ISAs and thread counts, and the fused scan.
#include <chunkstar/optim/grad_check.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

using namespace chunkstar;

namespace optim_grad_check_test {

namespace {
template <class G>
std::vector<G> grads(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 3.0f);
  std::vector<G> g(n);
  for (auto& x : g) x = from_float<G>(d(rng));
  return g;
}
}  // namespace

TEST_CASE_TEMPLATE("all_finite finds one inf or NaN at any position", G, float, float16, bfloat16) {
  const std::size_t n = 2 * grad_sum_block + 45;  // several blocks, ragged tail
  auto g = grads<G>(n, 1);
  CHECK(all_finite<G>(g));
  CHECK(all_finite_isa<cpu_isa::portable, G>(g));
  // The largest finite value is finite.
  if constexpr (std::is_same_v<G, float>) g[7] = std::numeric_limits<float>::max();
  else g[7] = G::from_bits(std::is_same_v<G, float16> ? 0x7bff : 0x7f7f);
  CHECK(all_finite<G>(g));
  for (std::size_t pos : {std::size_t{0}, std::size_t{31}, grad_sum_block - 1, grad_sum_block + 17, n - 1}) {
    for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                      std::numeric_limits<float>::quiet_NaN()}) {
      auto h = g;
      h[pos] = from_float<G>(bad);
      CAPTURE(pos);
      CHECK_FALSE(all_finite<G>(h));
      CHECK_FALSE(all_finite<G>(h, 1));
      CHECK_FALSE(all_finite_isa<cpu_isa::portable, G>(h));
    }
  }
  CHECK(all_finite<G>(std::span<const G>{}));
}

TEST_CASE_TEMPLATE("sum_of_squares matches a long double reference and is deterministic", G, float, float16, bfloat16) {
  const std::size_t n = 5 * grad_sum_block + 1001;
  const auto g = grads<G>(n, 2);
  const float scale = 1.0f / 1024.0f;
  long double ref = 0;
  for (const auto& x : g) {
    const long double y = static_cast<long double>(to_float(x)) * scale;
    ref += y * y;
  }
  const double s = sum_of_squares<G>(g, scale);
  // Every term is exact in double up to one rounding of x*scale and one of the fma; the sum of n
  // positive terms errs by at most ~n * 2^-53 relative (and the long double reference by less).
  CHECK(std::abs(s - static_cast<double>(ref)) <= static_cast<double>(ref) * double(n) * std::ldexp(1.0, -53));
  // Same bits for every thread count and for every path this CPU runs.
  for (int threads : {1, 2, 3, 5}) {
    CHECK(sum_of_squares<G>(g, scale, threads) == s);
    CHECK(sum_of_squares_isa<cpu_isa::portable, G>(g, scale, threads) == s);
  }
  for (cpu_isa isa : {cpu_isa::portable, cpu_isa::avx2, cpu_isa::avx512}) {
    if (!cpu_isa_supported(isa)) {
      MESSAGE(cpu_isa_name(isa) << ": not supported by this CPU, skipped");
      continue;
    }
    const scoped_cpu_isa forced(isa);
    CAPTURE(cpu_isa_name(isa));
    CHECK(sum_of_squares<G>(g, scale, 2) == s);
    CHECK(all_finite<G>(g));
    auto h = g;
    h[n - 3] = from_float<G>(std::numeric_limits<float>::infinity());
    CHECK_FALSE(all_finite<G>(h));
    CHECK_FALSE(scan_gradients<G>(h).all_finite);
  }
  const grad_stats st = scan_gradients<G>(g, scale);
  CHECK(st.sum_sq == s);
  CHECK(st.all_finite);
}

TEST_CASE_TEMPLATE("scan_gradients flags overflow in the same pass", G, float, float16, bfloat16) {
  auto g = grads<G>(1000, 3);
  g[999] = from_float<G>(std::numeric_limits<float>::quiet_NaN());
  CHECK_FALSE(scan_gradients<G>(g).all_finite);
  g[999] = from_float<G>(std::numeric_limits<float>::infinity());
  CHECK_FALSE(scan_gradients<G>(g, 1e-30f).all_finite);
  g[999] = from_float<G>(1.0f);
  CHECK(scan_gradients<G>(g, 1e30f).all_finite);  // large finite values cannot overflow the double sum
  grad_stats total;
  total += scan_gradients<G>(g);
  total += grad_stats{1.0, false};
  CHECK_FALSE(total.all_finite);
}

}  // namespace optim_grad_check_test
