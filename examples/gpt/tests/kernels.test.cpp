// SPDX-License-Identifier: Apache-2.0
// Tests of the GPT model math: every layer's backward against central finite differences of the
// float64 forward, the whole model likewise, float against double, the loss at initialisation,
// a few SGD steps, and bit-identical results whatever the OpenMP thread count.
#include "gpt_model.hpp"

#include <doctest/doctest.h>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace kernels_test {

namespace {

using gpt::gpt_config;
using rng = std::mt19937_64;

// Central differences in double, eps = 1e-5 on inputs of order 1: the truncation error is
// eps^2/6 |f'''| ~ 1e-11 and the rounding error ~ 1e-16 |f| / eps ~ 1e-10 for losses |f| ~ 10.
// A tolerance of 1e-6 (absolute, plus the same relative) keeps three orders of margin over both
// and is still orders below what a wrong sign, factor or index gives (errors of 1e-3 .. 1).
constexpr double fd_eps = 1e-5;
constexpr double fd_tol = 1e-6;

std::vector<double> randn(std::size_t n, rng& g, double sd = 1.0, double mean = 0.0) {
  std::normal_distribution<double> d(mean, sd);
  std::vector<double> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

std::vector<int> random_tokens(std::size_t n, int vocab, rng& g) {
  std::uniform_int_distribution<int> d(0, vocab - 1);
  std::vector<int> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

std::size_t pick(rng& g, std::size_t lo, std::size_t hi) {
  return std::uniform_int_distribution<std::size_t>(lo, hi)(g);
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

/** Checks, for every element i of x, that (grad_after - grad_before)[i] (what a backward kernel
 *  added) equals the central difference of loss() in x[i]. */
void check_grad(const std::string& what, double* x, std::size_t n, const double* grad_after, const double* grad_before,
                const std::function<double()>& loss) {
  double worst = 0;
  std::size_t worst_i = 0;
  double worst_a = 0, worst_n = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double x0 = x[i];
    x[i] = x0 + fd_eps;
    const double fp = loss();
    x[i] = x0 - fd_eps;
    const double fm = loss();
    x[i] = x0;
    const double numeric = (fp - fm) / (2 * fd_eps);
    const double analytic = grad_after[i] - grad_before[i];
    const double err = std::abs(analytic - numeric) / (1 + std::abs(numeric));
    if (err > worst) worst = err, worst_i = i, worst_a = analytic, worst_n = numeric;
  }
  INFO(what << ": worst at [" << worst_i << "]: analytic " << worst_a << ", numeric " << worst_n);
  CHECK(worst <= fd_tol);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Config and parameter list

TEST_CASE("presets: param_count agrees with the spec list and with the advertised sizes") {
  const std::vector<std::pair<std::string, std::pair<double, double>>> expect{
      {"tiny", {0.15e6, 0.3e6}}, {"mini", {4.5e6, 5.0e6}}, {"small", {8e6, 12e6}},  {"gpt2", {80e6, 90e6}},
      {"350m", {290e6, 310e6}},  {"760m", {690e6, 720e6}}, {"1.3b", {1.1e9, 1.3e9}}};
  for (const auto& [name, range] : expect) {
    const gpt_config c = gpt::parse_preset(name);
    std::size_t sum = 0;
    for (const auto& s : gpt::param_specs(c)) sum += s.numel();
    CHECK(sum == gpt::param_count(c));
    CHECK(static_cast<double>(sum) > range.first);
    CHECK(static_cast<double>(sum) < range.second);
  }
  CHECK(gpt::presets.size() == expect.size());
}

TEST_CASE("parse_preset and validate reject bad input with a message that says how to fix it") {
  try {
    gpt::parse_preset("gpt5");
    FAIL("expected config_error");
  } catch (const chunkstar::config_error& e) {
    const std::string msg = e.what();
    CHECK(msg.find("gpt5") != std::string::npos);
    for (const auto& p : gpt::presets) CHECK(msg.find(p.name) != std::string::npos);
  }
  CHECK_THROWS_AS(gpt::validate({.vocab = 256, .context = 8, .layers = 2, .heads = 3, .width = 16}),
                  chunkstar::config_error);
  CHECK_THROWS_AS(gpt::validate({.vocab = 256, .context = 0, .layers = 2, .heads = 2, .width = 16}),
                  chunkstar::config_error);
  CHECK_THROWS_AS(
      gpt::compute_activation_sizes({.vocab = 256, .context = 8, .layers = 1, .heads = 2, .width = 8}, 1, 9),
      chunkstar::config_error);
}

TEST_CASE("param_layers lists tensors in execution order with the documented shapes and roles") {
  const gpt_config c{.vocab = 256, .context = 32, .layers = 3, .heads = 2, .width = 8};
  const auto layers = gpt::param_layers(c);
  REQUIRE(layers.size() == 5);
  CHECK(layers[0].name == "embedding");
  CHECK(layers[0].tensors[0].name == "wte");
  CHECK(layers[0].tensors[0].shape == std::vector<std::int64_t>{256, 8});
  CHECK(layers[0].tensors[1].shape == std::vector<std::int64_t>{32, 8});
  const std::vector<std::string> block_order{"ln1.w", "ln1.b", "attn.qkv.w", "attn.qkv.b", "attn.proj.w", "attn.proj.b",
                                             "ln2.w", "ln2.b", "mlp.fc.w",   "mlp.fc.b",   "mlp.proj.w",  "mlp.proj.b"};
  for (int l = 0; l < 3; ++l) {
    const auto& b = layers[1 + l];
    CHECK(b.name == "h." + std::to_string(l));
    REQUIRE(b.tensors.size() == block_order.size());
    for (std::size_t i = 0; i < block_order.size(); ++i) CHECK(b.tensors[i].name == b.name + "." + block_order[i]);
    CHECK(b.tensors[2].shape == std::vector<std::int64_t>{24, 8});
    CHECK(b.tensors[4].shape == std::vector<std::int64_t>{8, 8});
    CHECK(b.tensors[8].shape == std::vector<std::int64_t>{32, 8});
    CHECK(b.tensors[10].shape == std::vector<std::int64_t>{8, 32});
    CHECK(b.tensors[2].role == chunkstar::tensor_role::weight);
    CHECK(b.tensors[3].role == chunkstar::tensor_role::bias);
    CHECK(b.tensors[0].role == chunkstar::tensor_role::norm);
  }
  CHECK(layers[4].tensors.size() == 2);
  CHECK(layers[4].tensors[1].name == "lnf.b");
  CHECK(gpt::param_specs(c, chunkstar::dtype::bf16)[0].type == chunkstar::dtype::bf16);
}

TEST_CASE("bound views: parameters round-trip, activation and workspace buffers tile their arenas") {
  const gpt_config c{.vocab = 40, .context = 9, .layers = 3, .heads = 3, .width = 12};
  std::vector<float> flat(gpt::param_count(c));
  const auto p = gpt::bind_params(c, flat.data());
  const auto list = gpt::param_list(p);
  const auto specs = gpt::param_specs(c);
  REQUIRE(list.size() == specs.size());
  std::size_t off = 0;
  for (std::size_t i = 0; i < list.size(); ++i) {
    CHECK(list[i] == flat.data() + off);
    off += specs[i].numel();
  }
  CHECK(gpt::param_list(gpt::params_from_list<float>(c, list)) == list);
  CHECK_THROWS_AS(gpt::params_from_list<float>(c, std::span<float* const>(list.data(), list.size() - 1)),
                  chunkstar::config_error);

  // Every buffer of the forward arena and of the workspace, as [begin, end) offsets: sorted, they
  // must touch end to end and cover the arena exactly (no overlap, no gap, nothing past the end).
  const std::size_t B = 2, Tn = 7, N = B * Tn, C = 12, V = 40, NH = 3;
  const auto s = gpt::compute_activation_sizes(c, B, Tn);
  std::vector<float> arena(s.forward_total()), work(s.workspace);
  const auto a = gpt::bind_activations(c, B, Tn, arena.data());
  std::vector<std::pair<std::size_t, std::size_t>> spans;
  const auto add = [&](const float* base, const float* p0, std::size_t n) {
    spans.emplace_back(static_cast<std::size_t>(p0 - base), static_cast<std::size_t>(p0 - base) + n);
  };
  add(arena.data(), a.encoded, N * C);
  for (const auto& b : a.blocks) {
    add(arena.data(), b.ln1, N * C), add(arena.data(), b.ln1_mean, N), add(arena.data(), b.ln1_rstd, N);
    add(arena.data(), b.qkv, 3 * N * C), add(arena.data(), b.atty, N * C), add(arena.data(), b.att, B * NH * Tn * Tn);
    add(arena.data(), b.res2, N * C), add(arena.data(), b.ln2, N * C), add(arena.data(), b.ln2_mean, N);
    add(arena.data(), b.ln2_rstd, N), add(arena.data(), b.fch, 4 * N * C), add(arena.data(), b.fch_gelu, 4 * N * C);
    add(arena.data(), b.res3, N * C);
  }
  add(arena.data(), a.head.lnf, N * C), add(arena.data(), a.head.lnf_mean, N), add(arena.data(), a.head.lnf_rstd, N);
  add(arena.data(), a.head.logits, N * V), add(arena.data(), a.head.probs, N * V), add(arena.data(), a.head.losses, N);
  add(arena.data(), a.proj, N * C);
  std::sort(spans.begin(), spans.end());
  std::size_t end = 0;
  for (const auto& [b, e] : spans) {
    CHECK(b == end);
    end = e;
  }
  CHECK(end == arena.size());

  const auto w = gpt::bind_backward_workspace(c, B, Tn, work.data());
  spans.clear();
  add(work.data(), w.dres, N * C), add(work.data(), w.dln, N * C), add(work.data(), w.datty, N * C);
  add(work.data(), w.dqkv, 3 * N * C), add(work.data(), w.dfch, 4 * N * C), add(work.data(), w.dfch_gelu, 4 * N * C);
  add(work.data(), w.att_scratch, B * NH * Tn), add(work.data(), w.dlogits, N * V);
  std::sort(spans.begin(), spans.end());
  end = 0;
  for (const auto& [b, e] : spans) {
    CHECK(b == end);
    end = e;
  }
  CHECK(end == work.size());
}

TEST_CASE("init: GPT-2 scheme, the same per tensor whatever the order, seed-dependent") {
  const gpt_config c{.vocab = 256, .context = 64, .layers = 8, .heads = 4, .width = 64};
  std::vector<double> a(gpt::param_count(c)), b(gpt::param_count(c));
  const auto pa = gpt::bind_params(c, a.data());
  gpt::init_params(c, pa, 7);
  // b: tensors one at a time in reverse order, as a runtime that owns them might
  const auto specs = gpt::param_specs(c);
  const auto lb = gpt::param_list(gpt::bind_params(c, b.data()));
  for (std::size_t i = specs.size(); i-- > 0;) gpt::init_tensor(c, specs[i], i, lb[i], 7);
  CHECK(a == b);
  gpt::init_params(c, gpt::bind_params(c, b.data()), 8);
  CHECK(a != b);

  const auto stats = [](const double* p, std::size_t n) {
    double m = 0, v = 0;
    for (std::size_t i = 0; i < n; ++i) m += p[i];
    m /= n;
    for (std::size_t i = 0; i < n; ++i) v += (p[i] - m) * (p[i] - m);
    return std::pair{m, std::sqrt(v / n)};
  };
  const auto [m_wte, s_wte] = stats(pa.wte, 256 * 64);  // 16k samples: the std is within 1% w.h.p.
  CHECK(std::abs(m_wte) < 1e-3);
  CHECK(s_wte == doctest::Approx(0.02).epsilon(0.03));
  const double s_p = stats(pa.blocks[0].fcproj_w, 64 * 256).second;
  CHECK(s_p == doctest::Approx(0.02 / std::sqrt(16.0)).epsilon(0.03));
  CHECK(pa.blocks[3].ln2_w[5] == 1.0);
  CHECK(pa.blocks[3].ln2_b[5] == 0.0);
  CHECK(pa.blocks[3].qkv_b[5] == 0.0);
}

// ---------------------------------------------------------------------------------------------
// Layers: forward against an independent formula, backward against finite differences. Each
// scalar loss is sum(out * R) for a random R, so dout = R. Gradient buffers start random, so the
// checks also prove that backward kernels add rather than overwrite.

TEST_CASE("encoder: forward gathers, backward matches finite differences (repeated tokens add)") {
  for (std::uint64_t seed : {1, 2, 3}) {
    rng g(seed);
    const std::size_t B = pick(g, 1, 3), Tn = pick(g, 1, 5), C = pick(g, 1, 20), V = 4, Tmax = Tn + 1;
    const auto tokens = random_tokens(B * Tn, V, g);
    auto wte = randn(V * C, g), wpe = randn(Tmax * C, g);
    const auto R = randn(B * Tn * C, g);
    std::vector<double> out(B * Tn * C);
    const auto loss = [&] {
      gpt::cpu::encoder_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, Tn, C);
      return dot(out, R);
    };
    loss();
    for (std::size_t bt = 0; bt < B * Tn; ++bt)
      for (std::size_t c = 0; c < C; ++c) CHECK(out[bt * C + c] == wte[tokens[bt] * C + c] + wpe[(bt % Tn) * C + c]);
    const auto dwte0 = randn(V * C, g), dwpe0 = randn(Tmax * C, g);
    auto dwte = dwte0, dwpe = dwpe0;
    gpt::cpu::encoder_backward(dwte.data(), dwpe.data(), R.data(), tokens.data(), B, Tn, C);
    check_grad("wte", wte.data(), wte.size(), dwte.data(), dwte0.data(), loss);
    check_grad("wpe", wpe.data(), wpe.size(), dwpe.data(), dwpe0.data(), loss);
  }
}

TEST_CASE("layernorm: forward normalises, backward matches finite differences") {
  for (std::uint64_t seed : {1, 2, 3}) {
    rng g(seed);
    const std::size_t N = pick(g, 1, 6), C = pick(g, 2, 40);
    auto x = randn(N * C, g, 2.0, 3.0), w = randn(C, g, 0.5, 1.0), b = randn(C, g);
    const auto R = randn(N * C, g);
    std::vector<double> out(N * C), mean(N), rstd(N);
    const auto loss = [&] {
      gpt::cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
      return dot(out, R);
    };
    loss();
    for (std::size_t n = 0; n < N; ++n) {  // undo the affine part: zero mean, unit variance (up to eps)
      double m = 0, v = 0, xm = 0, xv = 0;
      for (std::size_t c = 0; c < C; ++c) xm += x[n * C + c] / C;
      for (std::size_t c = 0; c < C; ++c) xv += (x[n * C + c] - xm) * (x[n * C + c] - xm) / C;
      for (std::size_t c = 0; c < C; ++c) m += (out[n * C + c] - b[c]) / w[c] / C;
      for (std::size_t c = 0; c < C; ++c) v += std::pow((out[n * C + c] - b[c]) / w[c] - m, 2) / C;
      CHECK(std::abs(m) < 1e-12);
      CHECK(v == doctest::Approx(xv / (xv + gpt::cpu::layernorm_eps)).epsilon(1e-12));
    }
    const auto dx0 = randn(N * C, g), dw0 = randn(C, g), db0 = randn(C, g);
    auto dx = dx0, dw = dw0, db = db0;
    gpt::cpu::layernorm_backward(dx.data(), dw.data(), db.data(), R.data(), x.data(), w.data(), mean.data(),
                                 rstd.data(), N, C);
    check_grad("x", x.data(), x.size(), dx.data(), dx0.data(), loss);
    check_grad("w", w.data(), w.size(), dw.data(), dw0.data(), loss);
    check_grad("b", b.data(), b.size(), db.data(), db0.data(), loss);
  }
}

TEST_CASE("matmul: forward is x W^T + b, backward matches finite differences, with and without bias") {
  for (std::uint64_t seed : {1, 2, 3, 4}) {
    rng g(seed);
    const bool with_bias = seed % 2 == 1;
    const std::size_t N = pick(g, 1, 7), C = pick(g, 1, 9), OC = pick(g, 1, 9);
    auto x = randn(N * C, g), W = randn(OC * C, g), bias = randn(OC, g);
    const auto R = randn(N * OC, g);
    std::vector<double> out(N * OC);
    const auto loss = [&] {
      gpt::cpu::matmul_forward(out.data(), x.data(), W.data(), with_bias ? bias.data() : nullptr, N, C, OC);
      return dot(out, R);
    };
    loss();
    for (std::size_t n = 0; n < N; ++n)
      for (std::size_t o = 0; o < OC; ++o) {
        long double s = with_bias ? bias[o] : 0;
        for (std::size_t c = 0; c < C; ++c) s += static_cast<long double>(x[n * C + c]) * W[o * C + c];
        CHECK(out[n * OC + o] == doctest::Approx(static_cast<double>(s)).epsilon(1e-13));
      }
    const auto dx0 = randn(N * C, g), dW0 = randn(OC * C, g), db0 = randn(OC, g);
    auto dx = dx0, dW = dW0, db = db0;
    gpt::cpu::matmul_backward(dx.data(), dW.data(), with_bias ? db.data() : nullptr, R.data(), x.data(), W.data(), N, C,
                              OC);
    check_grad("x", x.data(), x.size(), dx.data(), dx0.data(), loss);
    check_grad("W", W.data(), W.size(), dW.data(), dW0.data(), loss);
    if (with_bias) check_grad("bias", bias.data(), bias.size(), db.data(), db0.data(), loss);
    else CHECK(db == db0);
  }
}

TEST_CASE("attention: forward matches a masked-softmax reference and is causal; backward matches finite differences") {
  for (std::uint64_t seed : {1, 2, 3}) {
    rng g(seed);
    const std::size_t B = pick(g, 1, 2), Tn = pick(g, 1, 6), NH = pick(g, 1, 3), hs = pick(g, 1, 4), C = NH * hs;
    auto qkv = randn(B * Tn * 3 * C, g);
    const auto R = randn(B * Tn * C, g);
    std::vector<double> out(B * Tn * C), att(B * NH * Tn * Tn);
    const auto loss = [&] {
      gpt::cpu::attention_forward(out.data(), att.data(), qkv.data(), B, Tn, C, NH);
      return dot(out, R);
    };
    loss();
    // Reference: full score matrix, future masked to -inf, softmax via exp/sum in long double.
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t h = 0; h < NH; ++h)
        for (std::size_t t = 0; t < Tn; ++t) {
          std::vector<long double> s(Tn);
          for (std::size_t u = 0; u < Tn; ++u) {
            long double d = 0;
            for (std::size_t i = 0; i < hs; ++i)
              d += static_cast<long double>(qkv[(b * Tn + t) * 3 * C + h * hs + i]) *
                   qkv[(b * Tn + u) * 3 * C + C + h * hs + i];
            s[u] = u <= t ? d / std::sqrt(static_cast<long double>(hs)) : -INFINITY;
          }
          long double z = 0;
          for (auto v : s) z += std::exp(v);
          for (std::size_t i = 0; i < hs; ++i) {
            long double o = 0;
            for (std::size_t u = 0; u < Tn; ++u)
              o += std::exp(s[u]) / z * qkv[(b * Tn + u) * 3 * C + 2 * C + h * hs + i];
            CHECK(out[(b * Tn + t) * C + h * hs + i] == doctest::Approx(static_cast<double>(o)).epsilon(1e-12));
          }
          for (std::size_t u = 0; u < Tn; ++u)
            CHECK(att[((b * NH + h) * Tn + t) * Tn + u] ==
                  doctest::Approx(static_cast<double>(std::exp(s[u]) / z)).epsilon(1e-12));
        }
    // Causality: changing the last position's q, k, v leaves every earlier output bit-identical.
    const auto before = out;
    for (std::size_t j = 0; j < 3 * C; ++j) qkv[(B * Tn - 1) * 3 * C + j] += 1.0;
    loss();
    for (std::size_t t = 0; t + 1 < Tn; ++t)
      for (std::size_t c = 0; c < C; ++c) CHECK(out[((B - 1) * Tn + t) * C + c] == before[((B - 1) * Tn + t) * C + c]);
    loss();
    const auto dqkv0 = randn(qkv.size(), g);
    auto dqkv = dqkv0;
    std::vector<double> scratch(B * NH * Tn);
    gpt::cpu::attention_backward(dqkv.data(), scratch.data(), R.data(), qkv.data(), att.data(), B, Tn, C, NH);
    check_grad("qkv", qkv.data(), qkv.size(), dqkv.data(), dqkv0.data(), loss);
  }
}

TEST_CASE("gelu: forward within 1e-3 of the exact (erf) GELU, backward matches finite differences") {
  rng g(5);
  const std::size_t n = 200;
  auto x = randn(n, g, 2.5);
  const auto R = randn(n, g);
  std::vector<double> out(n);
  const auto loss = [&] {
    gpt::cpu::gelu_forward(out.data(), x.data(), n);
    return dot(out, R);
  };
  loss();
  // The tanh form differs from x Phi(x) by at most ~5e-4 (Hendrycks & Gimpel).
  for (std::size_t i = 0; i < n; ++i)
    CHECK(std::abs(out[i] - 0.5 * x[i] * (1 + std::erf(x[i] / std::sqrt(2.0)))) < 1e-3);
  const auto dx0 = randn(n, g);
  auto dx = dx0;
  gpt::cpu::gelu_backward(dx.data(), x.data(), R.data(), n);
  check_grad("x", x.data(), n, dx.data(), dx0.data(), loss);
}

TEST_CASE("residual: forward adds, backward matches finite differences for both inputs") {
  rng g(6);
  const std::size_t n = 37;
  auto a = randn(n, g), b = randn(n, g);
  const auto R = randn(n, g);
  std::vector<double> out(n);
  const auto loss = [&] {
    gpt::cpu::residual_forward(out.data(), a.data(), b.data(), n);
    return dot(out, R);
  };
  loss();
  for (std::size_t i = 0; i < n; ++i) CHECK(out[i] == a[i] + b[i]);
  const auto da0 = randn(n, g), db0 = randn(n, g);
  auto da = da0, db = db0;
  gpt::cpu::residual_backward(da.data(), db.data(), R.data(), n);
  check_grad("a", a.data(), n, da.data(), da0.data(), loss);
  check_grad("b", b.data(), n, db.data(), db0.data(), loss);
}

TEST_CASE(
    "softmax + cross-entropy: forward matches log-sum-exp, survives huge logits; backward matches finite differences") {
  for (std::uint64_t seed : {1, 2, 3}) {
    rng g(seed);
    const std::size_t N = pick(g, 1, 6), V = pick(g, 2, 30);
    auto z = randn(N * V, g, 3.0);
    const auto targets = random_tokens(N, static_cast<int>(V), g);
    const double dloss = 0.37;
    std::vector<double> probs(N * V), losses(N);
    const auto loss = [&] {
      gpt::cpu::softmax_crossentropy_forward(probs.data(), losses.data(), z.data(), targets.data(), N, V);
      return dloss * std::accumulate(losses.begin(), losses.end(), 0.0);
    };
    loss();
    for (std::size_t n = 0; n < N; ++n) {
      long double s = 0, ps = 0;
      for (std::size_t v = 0; v < V; ++v) s += std::exp(static_cast<long double>(z[n * V + v]));
      for (std::size_t v = 0; v < V; ++v) ps += probs[n * V + v];
      CHECK(losses[n] == doctest::Approx(static_cast<double>(std::log(s) - z[n * V + targets[n]])).epsilon(1e-13));
      CHECK(ps == doctest::Approx(1.0).epsilon(1e-14));
    }
    const auto dz0 = randn(N * V, g);
    auto dz = dz0;
    gpt::cpu::softmax_crossentropy_backward(dz.data(), probs.data(), targets.data(), dloss, N, V);
    check_grad("logits", z.data(), z.size(), dz.data(), dz0.data(), loss);
  }
  // exp(1000) overflows a double; with the max subtracted the result is exact
  const std::vector<float> z{1000.f, 1000.f, 990.f};
  const int target = 0;
  std::vector<float> p(3), l(1);
  gpt::cpu::softmax_crossentropy_forward(p.data(), l.data(), z.data(), &target, 1, 3);
  CHECK(std::isfinite(l[0]));
  CHECK(l[0] == doctest::Approx(std::log(2.0 + std::exp(-10.0))).epsilon(1e-6));
}

// ---------------------------------------------------------------------------------------------
// The whole model

namespace {
/** Fills every parameter with N(0, sd), LayerNorm gains around 1: biases and gains away from their
 *  init values so their gradients and the affine paths are exercised. */
template <class T>
void fill_random(const gpt_config& c, const gpt::gpt_params<T>& p, rng& g, double sd) {
  const auto specs = gpt::param_specs(c);
  const auto ptrs = gpt::param_list(p);
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const bool gain = specs[i].role == chunkstar::tensor_role::norm && specs[i].name.back() == 'w';
    const auto v = randn(specs[i].numel(), g, sd, gain ? 1.0 : 0.0);
    std::copy(v.begin(), v.end(), ptrs[i]);
  }
}

/** Inputs and next-byte targets from a text, sequence b starting at offset b * stride. */
std::pair<std::vector<int>, std::vector<int>> windows(const std::string& text, std::size_t B, std::size_t Tn,
                                                      std::size_t stride) {
  std::vector<int> x(B * Tn), y(B * Tn);
  for (std::size_t b = 0; b < B; ++b)
    for (std::size_t t = 0; t < Tn; ++t) {
      x[b * Tn + t] = static_cast<unsigned char>(text[(b * stride + t) % text.size()]);
      y[b * Tn + t] = static_cast<unsigned char>(text[(b * stride + t + 1) % text.size()]);
    }
  return {x, y};
}
}  // namespace

TEST_CASE("whole model: backward matches finite differences of the float64 forward") {
  for (std::uint64_t seed : {11, 12}) {
    rng g(seed);
    // T = 5 < context = 6: the unused row of wpe must get exactly zero gradient, and the small
    // vocabulary makes tokens repeat so the tied embedding collects from head and input alike.
    const gpt_config c{.vocab = 9, .context = 6, .layers = 2, .heads = 2, .width = 8};
    const std::size_t B = 2, Tn = 5;
    gpt::gpt_reference<double> m(c, B, Tn);
    fill_random(c, m.params, g, 0.4);
    const auto tokens = random_tokens(B * Tn, c.vocab, g), targets = random_tokens(B * Tn, c.vocab, g);
    m.forward(tokens.data(), targets.data());
    m.backward(tokens.data(), targets.data());
    const std::vector<double> grads = m.grad_data;
    const std::vector<double> zeros(grads.size(), 0.0);
    const auto loss = [&] { return m.forward(tokens.data(), targets.data()); };
    const auto specs = gpt::param_specs(c);
    const auto ptrs = gpt::param_list(m.params);
    std::size_t off = 0;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      // six random coordinates of each tensor (every coordinate of the small ones)
      const std::size_t n = specs[i].numel();
      for (int k = 0; k < std::min<int>(6, static_cast<int>(n)); ++k) {
        const std::size_t j = n <= 6 ? static_cast<std::size_t>(k) : pick(g, 0, n - 1);
        check_grad(specs[i].name + "[" + std::to_string(j) + "]", ptrs[i] + j, 1, grads.data() + off + j, zeros.data(),
                   loss);
      }
      off += n;
    }
    for (std::size_t c0 = 0; c0 < 8; ++c0) CHECK(m.grads.wpe[5 * 8 + c0] == 0.0);
  }
}

TEST_CASE("whole model: the float path matches the float64 path") {
  rng g(21);
  const gpt_config c{.vocab = 256, .context = 16, .layers = 3, .heads = 4, .width = 32};
  const std::size_t B = 3, Tn = 16;
  gpt::gpt_reference<double> d(c, B, Tn);
  gpt::gpt_reference<float> f(c, B, Tn);
  fill_random(c, d.params, g, 0.1);
  std::transform(d.param_data.begin(), d.param_data.end(), f.param_data.begin(),
                 [](double v) { return static_cast<float>(v); });
  std::copy(f.param_data.begin(), f.param_data.end(), d.param_data.begin());  // identical inputs
  const auto tokens = random_tokens(B * Tn, c.vocab, g), targets = random_tokens(B * Tn, c.vocab, g);
  const double ld = d.forward(tokens.data(), targets.data());
  const double lf = f.forward(tokens.data(), targets.data());
  d.backward(tokens.data(), targets.data());
  f.backward(tokens.data(), targets.data());
  // float rounds at u = 6e-8 per operation; the longest chains here are dot products of 4C = 128
  // terms, 3 layers deep, whose error is typically sqrt(K) u times a small growth per layer:
  // ~1e-6 of the values (1e-6 is also the worst seen). Tolerances 1e-5 (loss, relative) and 1e-4
  // (gradients, relative to each tensor's largest entry) leave a wide margin and still catch a
  // float-only bug (a wrong cast or a lost term changes results by far more than 1e-3).
  CHECK(lf == doctest::Approx(ld).epsilon(1e-5));
  const auto specs = gpt::param_specs(c);
  std::size_t off = 0;
  for (const auto& s : specs) {
    double scale = 0, err = 0;
    for (std::size_t j = off; j < off + s.numel(); ++j) {
      scale = std::max(scale, std::abs(d.grad_data[j]));
      err = std::max(err, std::abs(d.grad_data[j] - static_cast<double>(f.grad_data[j])));
    }
    INFO(s.name << ": max |grad| " << scale << ", max |float - double| " << err);
    CHECK(err <= 1e-4 * scale + 1e-12);
    off += s.numel();
  }
}

TEST_CASE("whole model: loss at a small init is ln(256)") {
  // With weights N(0, 0.02) the logits have std s ~ 0.02 sqrt(C) |lnf| ~ 0.16, so the expected
  // loss is ln 256 + s^2/2 ~ ln 256 + 0.013; 0.05 bounds that and the sampling noise.
  const gpt_config c = gpt::parse_preset("tiny");
  const std::size_t B = 2, Tn = 64;
  rng g(31);
  const auto tokens = random_tokens(B * Tn, c.vocab, g), targets = random_tokens(B * Tn, c.vocab, g);
  gpt::gpt_reference<float> f(c, B, Tn);
  gpt::init_params(c, f.params, 1234);
  const double lf = f.forward(tokens.data(), targets.data());
  gpt::gpt_reference<double> d(c, B, Tn);
  gpt::init_params(c, d.params, 1234);
  const double ld = d.forward(tokens.data(), targets.data());
  CHECK(std::abs(lf - std::log(256.0)) < 0.05);
  CHECK(std::abs(ld - std::log(256.0)) < 0.05);
}

TEST_CASE("whole model: a few SGD steps on a repeated string make the loss fall") {
  const gpt_config c{.vocab = 256, .context = 32, .layers = 2, .heads = 4, .width = 32};
  const std::size_t B = 4, Tn = 32;
  const std::string text = "hello, chunkstar! ";
  const auto [x, y] = windows(text, B, Tn, 5);
  gpt::gpt_reference<float> m(c, B, Tn);
  gpt::init_params(c, m.params, 99);
  const float lr = 0.1f;  // larger steps oscillate without clipping or warm-up
  std::vector<double> losses;
  for (int step = 0; step < 40; ++step) {
    losses.push_back(m.forward(x.data(), y.data()));
    m.backward(x.data(), y.data());
    for (std::size_t i = 0; i < m.param_data.size(); ++i) m.param_data[i] -= lr * m.grad_data[i];
  }
  losses.push_back(m.forward(x.data(), y.data()));
  std::string trace;
  for (double l : losses) trace += std::to_string(l).substr(0, 5) + " ";
  INFO("losses: " << trace);
  // The string has 13 distinct bytes: knowing only which bytes occur takes the loss from
  // ln 256 = 5.55 to ln 13 = 2.56. Going well below that means the model uses the context (the
  // next byte is a function of the previous ones), which is what attention and the MLP are for.
  CHECK(losses.back() < losses.front() - 2.5);
  CHECK(losses.back() < std::log(13.0) - 0.5);
}

TEST_CASE("whole model: results are bit-identical for 1, 2 and 3 OpenMP threads") {
#if defined(_OPENMP)
  const gpt_config c{.vocab = 256, .context = 32, .layers = 2, .heads = 4, .width = 64};
  const std::size_t B = 4, Tn = 32;
  // the smallest loop (one [N, C] pass) must be large enough to run in parallel at all
  REQUIRE(B * Tn * 64 >= gpt::cpu::parallel_threshold);
  rng g(41);
  const auto tokens = random_tokens(B * Tn, c.vocab, g), targets = random_tokens(B * Tn, c.vocab, g);
  const int saved = omp_get_max_threads();
  std::vector<float> ref_grads, ref_acts;
  double ref_loss = 0;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    gpt::gpt_reference<float> m(c, B, Tn);
    gpt::init_params(c, m.params, 5, 0.2);
    const double loss = m.forward(tokens.data(), targets.data());
    m.backward(tokens.data(), targets.data());
    m.backward(tokens.data(), targets.data());  // twice: the scratch zeroing must make it repeatable
    if (threads == 1) {
      ref_loss = loss, ref_grads = m.grad_data, ref_acts = m.act_data;
      continue;
    }
    INFO("threads = " << threads);
    CHECK(std::memcmp(&loss, &ref_loss, sizeof loss) == 0);
    CHECK(std::memcmp(m.grad_data.data(), ref_grads.data(), ref_grads.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(m.act_data.data(), ref_acts.data(), ref_acts.size() * sizeof(float)) == 0);
  }
  omp_set_num_threads(saved);
#else
  WARN_MESSAGE(false, "built without OpenMP: thread-count independence not tested");
#endif
}

// ---------------------------------------------------------------------------------------------
// The float path's vector kernels (kernels_cpu_simd.inc): against the float64 kernels on the same
// (float) inputs, and bit-identical on every ISA path of this build.

namespace {

std::vector<float> randf(std::size_t n, rng& g, double sd, double mean = 0.0) {
  std::normal_distribution<double> d(mean, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(d(g));
  return v;
}
std::vector<double> widen(const std::vector<float>& v) { return {v.begin(), v.end()}; }

/** Worst |f - d| / (|d| + floor) over the two outputs. */
double worst_rel(const std::vector<float>& f, const std::vector<double>& d, double floor) {
  double w = 0;
  for (std::size_t i = 0; i < f.size(); ++i)
    w = std::max(w, std::abs(static_cast<double>(f[i]) - d[i]) / (std::abs(d[i]) + floor));
  return w;
}

/** Runs @p fn once on every ISA path the CPU supports, and checks each result has the portable
 *  path's bits. @p fn returns the float outputs, concatenated. */
template <class Fn>
void check_same_bits_on_every_path(const char* what, Fn&& fn) {
  std::vector<float> reference;
  {
    const chunkstar::scoped_cpu_isa portable(chunkstar::cpu_isa::portable);
    reference = fn();
  }
  for (chunkstar::cpu_isa isa : {chunkstar::cpu_isa::avx2, chunkstar::cpu_isa::avx512}) {
    if (!chunkstar::cpu_isa_supported(isa)) {
      MESSAGE(what << ": " << chunkstar::cpu_isa_name(isa) << " not supported by this CPU, skipped");
      continue;
    }
    const chunkstar::scoped_cpu_isa forced(isa);
    const std::vector<float> got = fn();
    INFO(what << " on " << chunkstar::cpu_isa_name(isa));
    REQUIRE(got.size() == reference.size());
    std::size_t differ = 0;
    for (std::size_t i = 0; i < got.size(); ++i) differ += std::memcmp(&got[i], &reference[i], sizeof(float)) != 0;
    CHECK(differ == 0);
  }
}

// float rounds at u = 2^-24 = 6e-8 per operation. The bounds below are a few times the error
// analysis of each kernel, and far below what a wrong coefficient, sign or lane gives (>= 1e-4).
constexpr double u24 = 0x1p-24;

}  // namespace

TEST_CASE("vector GELU: forward and backward against float64, same bits on every ISA path") {
  rng g(51);
  // Lengths with and without a tail; inputs from the saturated tails (|x| up to 12) to tiny ones.
  for (std::size_t n :
       {std::size_t{1}, std::size_t{15}, std::size_t{16}, std::size_t{1000}, std::size_t{4096 * 3 + 5}}) {
    CAPTURE(n);
    auto x = randf(n, g, 3.0);
    if (n > 8) x[0] = 12.0f, x[1] = -12.0f, x[2] = 1e-30f, x[3] = -1e-20f, x[4] = 0.0f, x[5] = -40.0f, x[6] = 40.0f;
    const auto dout = randf(n, g, 1.0), dinp0 = randf(n, g, 1.0);
    std::vector<float> yf(n), df = dinp0;
    gpt::cpu::gelu_forward(yf.data(), x.data(), n);
    gpt::cpu::gelu_backward(df.data(), x.data(), dout.data(), n);
    // The reference, in long double and in the sigmoid form x / (1 + e^z), z = -2 sqrt(2/pi) (x +
    // 0.044715 x^3), which is the tanh form without its cancellation in the negative tail (the
    // double kernel's 0.5 x (1 + tanh) is only accurate to ~1e-16 absolute there).
    // Float error analysis, per element: the argument z carries ~3 roundings (x^3, the fma, the
    // scaling), i.e. an absolute error of 3 |z| u, which e^z turns into a relative one; exp itself
    // errs by ~2 ulp, the add and the division by one each: |y - ref| <= (4 + 3 |z|) u |ref|. The
    // float exp clamps z to 80, so for |z| > 80 the result is x / (1 + e^80) ~ 1e-33 |x| where the
    // true value is smaller still: an absolute floor of 1e-30 covers that.
    // Backward: slope = s (1 + t (1 - s)) with s = 1/(1 + e^z), t = 2 x u', accumulated with one
    // fma: the same exponential error plus ~8 roundings, relative to the magnitudes summed,
    // |dinp| + s (1 + |t| (1 - s)) |dout| (the slope itself crosses zero near x = -0.75).
    double worst_fwd = 0, worst_bwd = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const long double xi = x[i], z = -2 * 0.79788456080286535588L * (xi + 0.044715L * xi * xi * xi);
      const long double e = std::exp(z), sg = 1 / (1 + e), ref = xi * sg;
      const long double du = 0.79788456080286535588L * (1 + 3 * 0.044715L * xi * xi), t = 2 * xi * du;
      const long double slope = sg * (1 + t * (1 - sg)), dref = dinp0[i] + slope * dout[i];
      const double az = std::min(80.0, std::abs(static_cast<double>(z)));
      const double tol_f = (4 + 3 * az) * u24 * std::abs(static_cast<double>(ref)) + 1e-30;
      const double mag_b =
          std::abs(dinp0[i]) + static_cast<double>(sg * (1 + std::abs(t) * (1 - sg))) * std::abs(dout[i]);
      const double tol_b = (12 + 3 * az) * u24 * mag_b + 1e-30;
      worst_fwd = std::max(worst_fwd, std::abs(yf[i] - static_cast<double>(ref)) / tol_f);
      worst_bwd = std::max(worst_bwd, std::abs(df[i] - static_cast<double>(dref)) / tol_b);
    }
    MESSAGE("gelu n=" << n << ": worst error / bound: forward " << worst_fwd << ", backward " << worst_bwd);
    CHECK(worst_fwd <= 1.0);
    CHECK(worst_bwd <= 1.0);
    check_same_bits_on_every_path("gelu", [&] {
      std::vector<float> y(n), d = dinp0;
      gpt::cpu::gelu_forward(y.data(), x.data(), n);
      gpt::cpu::gelu_backward(d.data(), x.data(), dout.data(), n);
      y.insert(y.end(), d.begin(), d.end());
      return y;
    });
  }
}

TEST_CASE("vector softmax + cross-entropy: against float64, same bits on every ISA path") {
  rng g(52);
  for (std::size_t V : {std::size_t{1}, std::size_t{7}, std::size_t{16}, std::size_t{256}, std::size_t{1000}}) {
    CAPTURE(V);
    const std::size_t N = 9;
    auto z = randf(N * V, g, 4.0);
    if (V > 3) z[1] = 60.0f, z[2] = -200.0f;  // a dominant logit and one whose exp underflows
    std::vector<int> targets(N);
    for (std::size_t n = 0; n < N; ++n) targets[n] = static_cast<int>((n * 7) % V);
    std::vector<double> pd(N * V), ld(N), dd(N * V, 0.5);
    gpt::cpu::softmax_crossentropy_forward(pd.data(), ld.data(), widen(z).data(), targets.data(), N, V);
    gpt::cpu::softmax_crossentropy_backward(dd.data(), pd.data(), targets.data(), 0.37, N, V);
    std::vector<float> pf(N * V), lf(N), df(N * V, 0.5f);
    gpt::cpu::softmax_crossentropy_forward(pf.data(), lf.data(), z.data(), targets.data(), N, V);
    gpt::cpu::softmax_crossentropy_backward(df.data(), pf.data(), targets.data(), 0.37f, N, V);
    // Each probability: exp of (z - max), whose rounding (half an ulp of |z - max|) becomes a
    // relative error of |z - max| u, plus exp's ~2 ulp; then one division of a sum of V terms
    // (~V u relative at worst) and one multiply. Bound: (8 + V + |z - max|) u relative; an absolute
    // floor of 1e-37 covers probabilities the float exp flushes to its clamp value (e^-86 = 4.5e-38).
    // The loss log(sum) + (max - z_target): ~(8 + V) u times (1 + |loss|). The backward adds
    // dloss * (p - onehot) with one fma: the probability's error, relative to |d| + |dloss| p.
    double worst_p = 0, worst_d = 0;
    for (std::size_t n = 0; n < N; ++n) {
      const double mx = *std::max_element(z.begin() + static_cast<std::ptrdiff_t>(n * V),
                                          z.begin() + static_cast<std::ptrdiff_t>((n + 1) * V));
      for (std::size_t v = 0; v < V; ++v) {
        const std::size_t i = n * V + v;
        const double tol = (8.0 + static_cast<double>(V) + std::abs(z[i] - mx)) * u24;
        worst_p = std::max(worst_p, std::abs(pf[i] - pd[i]) / (tol * pd[i] + 1e-37));
        worst_d = std::max(worst_d, std::abs(df[i] - dd[i]) / (tol * (std::abs(dd[i]) + 0.37 * pd[i]) + 1e-37));
      }
      CHECK(std::abs(lf[n] - ld[n]) <= (8.0 + static_cast<double>(V)) * u24 * (1 + std::abs(ld[n])));
    }
    MESSAGE("softmax V=" << V << ": worst error / bound: probabilities " << worst_p << ", gradient " << worst_d);
    CHECK(worst_p <= 1.0);
    CHECK(worst_d <= 1.0);
    check_same_bits_on_every_path("softmax", [&] {
      std::vector<float> p(N * V), l(N), d(N * V, 0.5f);
      gpt::cpu::softmax_crossentropy_forward(p.data(), l.data(), z.data(), targets.data(), N, V);
      gpt::cpu::softmax_crossentropy_backward(d.data(), p.data(), targets.data(), 0.37f, N, V);
      p.insert(p.end(), l.begin(), l.end());
      p.insert(p.end(), d.begin(), d.end());
      return p;
    });
  }
}

TEST_CASE("vector LayerNorm: forward and backward against float64, same bits on every ISA path") {
  rng g(53);
  for (std::size_t C : {std::size_t{3}, std::size_t{16}, std::size_t{40}, std::size_t{256}, std::size_t{771}}) {
    CAPTURE(C);
    const std::size_t N = 37;
    const auto x = randf(N * C, g, 2.0, 3.0), w = randf(C, g, 0.5, 1.0), b = randf(C, g, 1.0);
    const auto dout = randf(N * C, g, 1.0), dx0 = randf(N * C, g, 1.0), dw0 = randf(C, g, 1.0), db0 = randf(C, g, 1.0);
    std::vector<double> yd(N * C), md(N), rd(N), dxd = widen(dx0), dwd = widen(dw0), dbd = widen(db0);
    gpt::cpu::layernorm_forward(yd.data(), md.data(), rd.data(), widen(x).data(), widen(w).data(), widen(b).data(), N,
                                C);
    gpt::cpu::layernorm_backward(dxd.data(), dwd.data(), dbd.data(), widen(dout).data(), widen(x).data(),
                                 widen(w).data(), md.data(), rd.data(), N, C);
    std::vector<float> yf(N * C), mf(N), rf(N), dxf = dx0, dwf = dw0, dbf = db0;
    gpt::cpu::layernorm_forward(yf.data(), mf.data(), rf.data(), x.data(), w.data(), b.data(), N, C);
    gpt::cpu::layernorm_backward(dxf.data(), dwf.data(), dbf.data(), dout.data(), x.data(), w.data(), mf.data(),
                                 rf.data(), N, C);
    // Row sums of C terms err by ~C u relative (typically sqrt(C) u); the mean's error enters
    // every xhat scaled by rstd (|x| ~ 3 + 2 sd, so |mean| rstd ~ 1.5: another C u), the outputs
    // are O(1) with O(1) weights: absolute bound (16 + 4 C) u, relative to |y| + 1.
    const double row = (16.0 + 4.0 * static_cast<double>(C)) * u24;
    CHECK(worst_rel(yf, yd, 1.0) <= row);
    CHECK(worst_rel(dxf, dxd, 1.0) <= 2 * row);
    // dw, db sum N = 37 rows in order: (N + C) terms' worth of error, relative to their size + 1.
    CHECK(worst_rel(dwf, dwd, 1.0) <= (2.0 * static_cast<double>(N)) * row);
    CHECK(worst_rel(dbf, dbd, 1.0) <= static_cast<double>(N) * 4 * u24);
    check_same_bits_on_every_path("layernorm", [&] {
      std::vector<float> y(N * C), m(N), r(N), dx = dx0, dw = dw0, db = db0;
      gpt::cpu::layernorm_forward(y.data(), m.data(), r.data(), x.data(), w.data(), b.data(), N, C);
      gpt::cpu::layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), m.data(), r.data(),
                                   N, C);
      for (const auto* v : {&m, &r, &dx, &dw, &db}) y.insert(y.end(), v->begin(), v->end());
      return y;
    });
  }
}

TEST_CASE("vector attention: forward and backward against float64, same bits on every ISA path") {
  rng g(54);
  struct shape {
    std::size_t B, Tn, NH, hs;
  };
  for (const shape s : {shape{1, 1, 1, 1}, shape{2, 5, 3, 7}, shape{2, 33, 2, 16}, shape{1, 40, 4, 64}}) {
    CAPTURE(s.Tn);
    CAPTURE(s.hs);
    const std::size_t C = s.NH * s.hs, N = s.B * s.Tn;
    const auto qkv = randf(N * 3 * C, g, 1.0), dout = randf(N * C, g, 1.0), dqkv0 = randf(N * 3 * C, g, 1.0);
    std::vector<double> od(N * C), ad(s.B * s.NH * s.Tn * s.Tn), dd = widen(dqkv0), sd(s.B * s.NH * s.Tn);
    gpt::cpu::attention_forward(od.data(), ad.data(), widen(qkv).data(), s.B, s.Tn, C, s.NH);
    gpt::cpu::attention_backward(dd.data(), sd.data(), widen(dout).data(), widen(qkv).data(), ad.data(), s.B, s.Tn, C,
                                 s.NH);
    std::vector<float> of(N * C), af(ad.size()), df = dqkv0, sf(sd.size());
    gpt::cpu::attention_forward(of.data(), af.data(), qkv.data(), s.B, s.Tn, C, s.NH);
    gpt::cpu::attention_backward(df.data(), sf.data(), dout.data(), qkv.data(), af.data(), s.B, s.Tn, C, s.NH);
    // Scores are dot products of hs terms of size ~1 (error ~hs u, |score| ~ sqrt(hs)), which the
    // exponential turns into relative errors of the probabilities; outputs and gradients sum T of
    // those. Bound: (16 + 4 (hs + T)) u relative to |value| + 1.
    const double tol = (16.0 + 4.0 * static_cast<double>(s.hs + s.Tn)) * u24;
    CHECK(worst_rel(af, ad, 1.0) <= tol);
    CHECK(worst_rel(of, od, 1.0) <= tol);
    CHECK(worst_rel(df, dd, 1.0) <= 4 * tol);
    check_same_bits_on_every_path("attention", [&] {
      std::vector<float> o(N * C), a(ad.size()), d = dqkv0, sc(sd.size());
      gpt::cpu::attention_forward(o.data(), a.data(), qkv.data(), s.B, s.Tn, C, s.NH);
      gpt::cpu::attention_backward(d.data(), sc.data(), dout.data(), qkv.data(), a.data(), s.B, s.Tn, C, s.NH);
      o.insert(o.end(), a.begin(), a.end());
      o.insert(o.end(), d.begin(), d.end());
      return o;
    });
  }
}

TEST_CASE("whole model: the float forward and backward give the same bits on every ISA path") {
  const gpt_config c{.vocab = 256, .context = 32, .layers = 2, .heads = 4, .width = 48};
  const std::size_t B = 2, Tn = 29;
  rng g(55);
  const auto tokens = random_tokens(B * Tn, c.vocab, g), targets = random_tokens(B * Tn, c.vocab, g);
  check_same_bits_on_every_path("model", [&] {
    gpt::gpt_reference<float> m(c, B, Tn);
    gpt::init_params(c, m.params, 9, 0.2);
    const double loss = m.forward(tokens.data(), targets.data());
    m.backward(tokens.data(), targets.data());
    std::vector<float> out = m.grad_data;
    out.insert(out.end(), m.act_data.begin(), m.act_data.end());
    out.push_back(static_cast<float>(loss));
    return out;
  });
}

}  // namespace kernels_test
