// SPDX-License-Identifier: Apache-2.0
// Adam/AdamW kernels: against a float64 reference over many steps, SIMD against portable bit for
// bit, thread counts bit for bit, the run-time-typed entry point, and argument checking.
#include <chunkstar/optim/adam.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <vector>

using namespace chunkstar;

namespace optim_adam_test {

namespace {

template <class T>
std::uint32_t bits_of(T x) {
  if constexpr (sizeof(T) == 4) return std::bit_cast<std::uint32_t>(x);
  else return x.bits;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// The float64 reference: textbook Adam/AdamW on the gradients as the kernel sees them
// (decoded from G, times grad_scale), with bias correction, nothing fused and nothing rounded.
struct ref_adam {
  std::vector<double> p, m, v;
  void step(const std::vector<double>& g_in, const adam_hyper& h, std::int64_t t, double gscale) {
    const double b1 = h.beta1, b2 = h.beta2, lr = h.lr, wd = h.weight_decay;
    const double bc1 = 1 - std::pow(b1, double(t)), bc2 = 1 - std::pow(b2, double(t));
    for (std::size_t i = 0; i < p.size(); ++i) {
      double g = g_in[i] * gscale;
      if (h.mode == adam_mode::adam) g += wd * p[i];
      m[i] = b1 * m[i] + (1 - b1) * g;
      v[i] = b2 * v[i] + (1 - b2) * g * g;
      const double upd = (m[i] / bc1) / (std::sqrt(v[i] / bc2) + h.eps);
      if (h.mode == adam_mode::adamw) p[i] -= lr * wd * p[i];
      p[i] -= lr * upd;
    }
  }
};

template <class G>
std::vector<G> random_grads(std::size_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<G> g(n);
  for (auto& x : g) x = from_float<G>(d(rng));
  return g;
}

template <class G, class P>
void check_against_reference(adam_mode mode) {
  constexpr std::size_t n = 1037;  // not a multiple of any vector width: exercises the tails
  constexpr int steps = 300;
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> master(n), m(n, 0.0f), v(n, 0.0f);
  for (auto& x : master) x = u(rng);
  std::vector<P> param(std::is_same_v<P, float> ? 0 : n);
  ref_adam ref{{master.begin(), master.end()}, std::vector<double>(n, 0.0), std::vector<double>(n, 0.0)};
  const adam_hyper h{.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.1f, .mode = mode};
  // The loss scale of fp16 training: gradients arrive multiplied by 1024 and grad_scale undoes it.
  const float loss_scale = std::is_same_v<G, float16> ? 1024.0f : 1.0f;
  for (int t = 1; t <= steps; ++t) {
    const auto g = random_grads<G>(n, rng, 0.05f * loss_scale);
    std::vector<double> gd(n);
    for (std::size_t i = 0; i < n; ++i) gd[i] = to_float(g[i]);
    adam_update<G, P>(master, m, v, std::span<const G>(g), std::span<P>(param), h,
                      {.step = t, .grad_scale = 1.0f / loss_scale});
    ref.step(gd, h, t, 1.0 / loss_scale);
  }
  // Tolerance, from a worst-case rounding analysis with eps32 = 2^-24 (unit roundoff):
  //  - each step rounds m and v a few times; the moving averages damp old errors by beta, so the
  //    relative error of m stays below ~3 eps32 / (1 - beta1) and that of v below ~4 eps32 / (1 - beta2);
  //  - the update m_hat / (sqrt(v_hat) + eps) thus errs by at most ~(3/(1-b1) + 2/(1-b2) + 4) eps32
  //    times its magnitude, and that magnitude is at most (1-b1)/sqrt(1-b2) ~ 3.2 (Kingma & Ba,
  //    section 2.1); 10 is used;
  //  - p accumulates lr * that per step plus one rounding of p (eps32 (|p| + 10 lr)) per step.
  // Summed over the steps this bounds |p - p_ref|; the test uses this bound, not a tuned constant.
  const double eps32 = std::ldexp(1.0, -24);
  const double upd_rel = (3.0 / (1 - 0.9) + 2.0 / (1 - 0.999) + 4.0) * eps32;
  double max_p = 0;
  for (double x : ref.p) max_p = std::max(max_p, std::abs(x));
  const double tol_p = steps * (eps32 * (max_p + h.lr * 10.0) + h.lr * 10.0 * upd_rel);
  double max_m = 0, max_v = 0;
  for (std::size_t i = 0; i < n; ++i) max_m = std::max(max_m, std::abs(ref.m[i])), max_v = std::max(max_v, ref.v[i]);
  // m and v: relative to the largest element (elements near zero have no meaningful relative error);
  // adam mode feeds wd * p into the gradient, whose own error (tol_p) adds to m's.
  const double tol_m = 3.0 / (1 - 0.9) * eps32 * max_m + h.weight_decay * tol_p;
  const double tol_v = 4.0 / (1 - 0.999) * eps32 * max_v + 2 * 0.05 * h.weight_decay * tol_p;
  double err_p = 0, err_m = 0, err_v = 0;
  for (std::size_t i = 0; i < n; ++i) {
    err_p = std::max(err_p, std::abs(master[i] - ref.p[i]));
    err_m = std::max(err_m, std::abs(m[i] - ref.m[i]));
    err_v = std::max(err_v, std::abs(v[i] - ref.v[i]));
  }
  INFO("err_p " << err_p << " tol " << tol_p << "; err_m " << err_m << " tol " << tol_m << "; err_v " << err_v
                << " tol " << tol_v);
  CHECK(err_p <= tol_p);
  CHECK(err_m <= tol_m);
  CHECK(err_v <= tol_v);
  // The tolerance is far below what the parameters moved (~lr per step), so the test has teeth.
  CHECK(tol_p < 0.05 * steps * h.lr);
  // The low-precision copy is the master rounded to nearest even, exactly.
  for (std::size_t i = 0; i < param.size(); ++i) REQUIRE(bits_of(param[i]) == bits_of(from_float<P>(master[i])));
}

template <cpu_isa Isa, class G, class P>
void check_bit_identical_to_portable() {
  // Odd length and an odd offset into the buffers: unaligned vectors and a scalar tail.
  constexpr std::size_t n = 100003, off = 3;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::vector<float> master(n + off), m(n + off, 0.0f), v(n + off, 0.0f);
  for (auto& x : master) x = u(rng);
  // Include tiny values (subnormal halves after the update) and values that round to f16 infinity.
  master[off + 5] = 1e-6f;
  master[off + 6] = 70000.0f;
  std::vector<P> param(n + off);
  auto master2 = master, m2 = m, v2 = v;
  auto param2 = param;
  const bool write_param = !std::is_same_v<P, float>;
  for (adam_mode mode : {adam_mode::adamw, adam_mode::adam}) {
    const adam_hyper h{.lr = 3e-3f, .weight_decay = 0.05f, .mode = mode};
    for (std::int64_t t = 1; t <= 5; ++t) {
      auto g = random_grads<G>(n + off, rng, 0.3f);
      g[off + 9] = from_float<G>(1e-30f);  // underflows in f16/bf16 conversions of the grad
      auto span_of = [&](auto& vec) { return std::span(vec.data() + off, n); };
      const std::span<const G> gs(g.data() + off, n);
      adam_update_isa<Isa, G, P>(span_of(master), span_of(m), span_of(v), gs,
                                 write_param ? span_of(param) : std::span<P>{}, h, {.step = t, .grad_scale = 0.5f});
      adam_update_isa<cpu_isa::portable, G, P>(span_of(master2), span_of(m2), span_of(v2), gs,
                                               write_param ? span_of(param2) : std::span<P>{}, h,
                                               {.step = t, .grad_scale = 0.5f});
    }
  }
  CHECK(same_bits(master, master2));
  CHECK(same_bits(m, m2));
  CHECK(same_bits(v, v2));
  CHECK(same_bits(param, param2));
}

}  // namespace

TEST_CASE_TEMPLATE("adam_update matches a float64 reference over 300 steps", G, float, float16, bfloat16) {
  for (adam_mode mode : {adam_mode::adamw, adam_mode::adam}) {
    CAPTURE(static_cast<int>(mode));
    check_against_reference<G, float>(mode);
    check_against_reference<G, float16>(mode);
    check_against_reference<G, bfloat16>(mode);
  }
}

// Every path is compiled into this (default-flags) build; each one the CPU can run must give the
// portable path's bits. A path the CPU lacks is reported and skipped (CI machines may lack AVX-512).
TEST_CASE_TEMPLATE("every SIMD path of this build is bit-identical to the portable path", G, float, float16, bfloat16) {
  MESSAGE("detected ISA: " << cpu_isa_name(detected_cpu_isa()) << "; running: " << cpu_isa_report());
  with_cpu_isa(cpu_isa::avx2, [](auto isa) {
    if constexpr (isa() != cpu_isa::portable) {
      if (!cpu_isa_supported(isa())) {
        MESSAGE("avx2: not supported by this CPU, skipped");
        return;
      }
      check_bit_identical_to_portable<isa(), G, float>();
      check_bit_identical_to_portable<isa(), G, float16>();
      check_bit_identical_to_portable<isa(), G, bfloat16>();
    }
  });
  with_cpu_isa(cpu_isa::avx512, [](auto isa) {
    if constexpr (isa() != cpu_isa::portable) {
      if (!cpu_isa_supported(isa())) {
        MESSAGE("avx512: not supported by this CPU, skipped");
        return;
      }
      check_bit_identical_to_portable<isa(), G, float>();
      check_bit_identical_to_portable<isa(), G, float16>();
      check_bit_identical_to_portable<isa(), G, bfloat16>();
    }
  });
}

TEST_CASE("adam_update runs the active ISA, and a forced path gives the same bits") {
  constexpr std::size_t n = 70001;
  std::mt19937 rng(11);
  const auto g = random_grads<float16>(n, rng, 0.2f);
  std::vector<std::vector<float>> masters;
  std::vector<std::vector<float16>> params;
  for (cpu_isa isa : {cpu_isa::portable, cpu_isa::avx2, cpu_isa::avx512}) {
    if (!cpu_isa_supported(isa)) continue;
    const scoped_cpu_isa forced(isa);
    CHECK(active_cpu_isa() == isa);
    std::vector<float> master(n, 0.5f), m(n, 0.0f), v(n, 0.0f);
    std::vector<float16> p(n);
    for (std::int64_t t = 1; t <= 3; ++t)
      adam_update<float16, float16>(master, m, v, std::span<const float16>(g), std::span<float16>(p),
                                    {.lr = 1e-2f, .weight_decay = 0.1f}, {.step = t});
    masters.push_back(master);
    params.push_back(p);
  }
  for (std::size_t k = 1; k < masters.size(); ++k) {
    CHECK(same_bits(masters[0], masters[k]));
    CHECK(same_bits(params[0], params[k]));
  }
}

TEST_CASE("the result does not depend on the thread count") {
  constexpr std::size_t n = 3 * 65536 + 77;  // above the parallel threshold, ragged last block
  std::mt19937 rng(3);
  const auto g = random_grads<bfloat16>(n, rng, 0.1f);
  std::vector<std::vector<float>> results;
  std::vector<std::vector<bfloat16>> params;
  for (int threads : {1, 2, 3, 4}) {
    std::vector<float> master(n, 0.25f), m(n, 0.0f), v(n, 0.0f);
    std::vector<bfloat16> p(n);
    for (std::int64_t t = 1; t <= 3; ++t)
      adam_update<bfloat16, bfloat16>(master, m, v, std::span<const bfloat16>(g), std::span<bfloat16>(p),
                                      {.lr = 1e-2f, .weight_decay = 0.01f}, {.step = t, .threads = threads});
    results.push_back(master);
    params.push_back(p);
  }
  for (std::size_t k = 1; k < results.size(); ++k) {
    CHECK(same_bits(results[0], results[k]));
    CHECK(same_bits(params[0], params[k]));
  }
}

TEST_CASE("non-finite gradients propagate the same way on every path") {
  constexpr std::size_t n = 67;
  std::vector<float> g(n, 0.5f);
  g[3] = std::numeric_limits<float>::infinity();
  g[40] = std::numeric_limits<float>::quiet_NaN();
  g[66] = -std::numeric_limits<float>::infinity();
  for (cpu_isa isa : {cpu_isa::avx2, cpu_isa::avx512}) {
    if (!cpu_isa_supported(isa)) continue;
    CAPTURE(cpu_isa_name(isa));
    std::vector<float> a(n, 1.0f), ma(n, 0.0f), va(n, 0.0f), b = a, mb = ma, vb = va;
    {
      const scoped_cpu_isa forced(isa);
      adam_update<float, float>(a, ma, va, std::span<const float>(g), {}, {}, {});
    }
    adam_update_isa<cpu_isa::portable, float, float>(b, mb, vb, std::span<const float>(g), {}, {}, {});
    for (std::size_t i = 0; i < n; ++i) {
      CHECK(std::isnan(a[i]) == std::isnan(b[i]));
      if (!std::isnan(a[i])) CHECK(bits_of(a[i]) == bits_of(b[i]));
    }
    CHECK(std::isnan(a[3]));  // inf/inf in the update
    CHECK(std::isnan(a[40]));
    CHECK(a[0] != 1.0f);
  }
}

TEST_CASE("adam_step_host dispatches on run-time dtypes to the typed kernel") {
  constexpr std::size_t n = 513;
  std::mt19937 rng(5);
  const auto g = random_grads<float16>(n, rng, 1.0f);
  std::vector<float> master(n, 0.5f), m(n, 0.0f), v(n, 0.0f);
  auto master2 = master, m2 = m, v2 = v;
  std::vector<bfloat16> p(n), p2(n);
  const adam_hyper h{.lr = 1e-2f, .weight_decay = 0.1f, .mode = adam_mode::adam};
  adam_step_host({.master = master.data(),
                  .m = m.data(),
                  .v = v.data(),
                  .count = n,
                  .grad = g.data(),
                  .grad_type = dtype::f16,
                  .param = p.data(),
                  .param_type = dtype::bf16},
                 h, {.step = 2, .grad_scale = 0.25f});
  adam_update<float16, bfloat16>(master2, m2, v2, std::span<const float16>(g), std::span<bfloat16>(p2), h,
                                 {.step = 2, .grad_scale = 0.25f});
  CHECK(same_bits(master, master2));
  CHECK(same_bits(m, m2));
  CHECK(same_bits(v, v2));
  CHECK(same_bits(p, p2));
  // Without a parameter copy, master is the parameter.
  adam_step_host(
      {.master = master.data(), .m = m.data(), .v = v.data(), .count = n, .grad = g.data(), .grad_type = dtype::f16}, h,
      {.step = 3});
  adam_update<float16, float>(master2, m2, v2, std::span<const float16>(g), std::span<float>{}, h, {.step = 3});
  CHECK(same_bits(master, master2));
}

TEST_CASE("bad arguments throw config_error") {
  std::vector<float> a(8), b(8), c(8), g(8), shorter(7);
  std::vector<float16> p(5);
  const std::span<const float> gs(g);
  CHECK_THROWS_AS((adam_update<float, float>(a, b, shorter, gs, {}, {}, {})), config_error);
  CHECK_THROWS_AS((adam_update<float, float16>(a, b, c, gs, std::span<float16>(p), {}, {})), config_error);
  CHECK_THROWS_AS((adam_update<float, float>(a, b, c, gs, {}, {}, {.step = 0})), config_error);
  CHECK_THROWS_AS((adam_update<float, float>(a, b, c, gs, {}, {.beta1 = 1.0f}, {})), config_error);
  CHECK_THROWS_AS((adam_update<float, float>(a, b, c, gs, {}, {.eps = 0.0f}, {})), config_error);
  CHECK_THROWS_AS((adam_update<float, float>(a, b, c, gs, {}, {.weight_decay = -1.0f}, {})), config_error);
  CHECK_THROWS_AS(
      (adam_update<float, float>(a, b, c, gs, {}, {}, {.grad_scale = std::numeric_limits<float>::infinity()})),
      config_error);
  CHECK_NOTHROW((adam_update<float, float>({}, {}, {}, {}, {}, {}, {})));  // empty range: nothing to do
}

TEST_CASE("hyper-parameters may change between steps") {
  // Two steps with different lr and weight decay equal the reference doing the same.
  std::vector<float> p(16, 1.0f), m(16, 0.0f), v(16, 0.0f), g(16, 0.5f);
  ref_adam ref{std::vector<double>(16, 1.0), std::vector<double>(16, 0.0), std::vector<double>(16, 0.0)};
  const std::vector<double> gd(16, 0.5);
  const adam_hyper h1{.lr = 0.1f, .weight_decay = 0.0f}, h2{.lr = 0.01f, .weight_decay = 0.5f};
  adam_update<float, float>(p, m, v, std::span<const float>(g), {}, h1, {.step = 1});
  adam_update<float, float>(p, m, v, std::span<const float>(g), {}, h2, {.step = 2});
  ref.step(gd, h1, 1, 1.0);
  ref.step(gd, h2, 2, 1.0);
  for (std::size_t i = 0; i < 16; ++i) CHECK(p[i] == doctest::Approx(ref.p[i]).epsilon(1e-6));
  CHECK(p[0] < 0.9f);  // it moved by ~lr per step
}

}  // namespace optim_adam_test
