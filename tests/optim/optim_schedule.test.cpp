// SPDX-License-Identifier: Apache-2.0
// Learning-rate schedules and parameter groups.
#include <chunkstar/optim/lr_schedule.hpp>
#include <chunkstar/optim/param_groups.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <numbers>

using namespace chunkstar;

namespace optim_schedule_test {

TEST_CASE("constant_lr and warmup_cosine") {
  constant_lr c{.lr = 3e-4f};
  CHECK(c(1) == 3e-4f);
  CHECK(c(100000) == 3e-4f);
  const warmup_cosine s{.peak = 1e-3f, .min = 1e-4f, .warmup_steps = 10, .total_steps = 110};
  s.validate();
  CHECK(s(1) == doctest::Approx(1e-4));  // linear from peak/warmup
  CHECK(s(5) == doctest::Approx(5e-4));
  CHECK(s(10) == doctest::Approx(1e-3));                 // peak at the end of warm-up
  CHECK(s(60) == doctest::Approx(1e-4 + 0.9e-3 * 0.5));  // half-way through the cosine
  const double q = 0.5 * (1 + std::cos(std::numbers::pi * 0.25));
  CHECK(s(35) == doctest::Approx(1e-4 + 0.9e-3 * q));
  CHECK(s(110) == 1e-4f);
  CHECK(s(500) == 1e-4f);
  for (std::int64_t t = 11; t < 110; ++t) CHECK(s(t + 1) <= s(t));  // monotone decay
  const warmup_cosine no_warmup{.peak = 1.0f, .min = 0.0f, .warmup_steps = 0, .total_steps = 4};
  CHECK(no_warmup(1) == doctest::Approx(0.5 * (1 + std::cos(std::numbers::pi * 0.25))));
  CHECK_THROWS_AS((warmup_cosine{.peak = 1.0f, .min = 2.0f}.validate()), config_error);
  CHECK_THROWS_AS((warmup_cosine{.warmup_steps = 5, .total_steps = 4}.validate()), config_error);
  CHECK_THROWS_AS((constant_lr{.lr = -1.0f}.validate()), config_error);
}

TEST_CASE("param_groups: no decay on biases and norms by default") {
  const auto groups = param_groups::with_default_decay(0.1f);
  const adam_hyper base{.lr = 2e-3f, .weight_decay = 0.5f};
  CHECK(groups.hyper_for(tensor_role::weight, base).weight_decay == 0.1f);
  CHECK(groups.hyper_for(tensor_role::embedding, base).weight_decay == 0.1f);
  CHECK(groups.hyper_for(tensor_role::bias, base).weight_decay == 0.0f);
  CHECK(groups.hyper_for(tensor_role::norm, base).weight_decay == 0.0f);
  CHECK(groups.hyper_for(tensor_role::norm, base).lr == 2e-3f);
  const tensor_spec ln{.name = "ln_f.weight", .shape = {768}, .type = dtype::bf16, .role = tensor_role::norm};
  CHECK(groups.group_for(ln.role).name == "no_decay");
  CHECK(groups.hyper_for(ln, base).weight_decay == 0.0f);
}

TEST_CASE("param_groups: custom groups and errors") {
  param_groups g;
  CHECK_THROWS_AS((void)g.group_of(tensor_role::weight), state_error);
  const auto main = g.add({.name = "main", .weight_decay = 0.01f});
  const auto emb = g.add({.name = "embeddings", .weight_decay = 0.0f, .lr_multiplier = 0.1f});
  g.assign(tensor_role::embedding, emb);
  CHECK(g.group_of(tensor_role::bias) == main);  // unassigned roles fall to the first group
  CHECK(g.hyper_for(tensor_role::embedding, {.lr = 1.0f}).lr == doctest::Approx(0.1f));
  CHECK_THROWS_AS(g.add({.name = "main"}), config_error);
  CHECK_THROWS_AS(g.add({.name = "x", .weight_decay = -1.0f}), config_error);
  CHECK_THROWS_AS(g.assign(tensor_role::norm, 7), config_error);
}

}  // namespace optim_schedule_test
