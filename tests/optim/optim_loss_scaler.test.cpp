// SPDX-License-Identifier: Apache-2.0
// Loss scaling: the dynamic scaler's schedule under injected overflows, and an fp16 training loop
// that skips exactly the overflowed steps.
#include <chunkstar/optim/adam.hpp>
#include <chunkstar/optim/grad_check.hpp>
#include <chunkstar/optim/loss_scaler.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <set>
#include <vector>

using namespace chunkstar;

namespace optim_loss_scaler_test {

TEST_CASE("dynamic_loss_scaler backs off on overflow and grows after the interval") {
  dynamic_loss_scaler s({.init_scale = 1024.0f, .growth_interval = 3, .min_scale = 64.0f, .max_scale = 4096.0f});
  CHECK(s.scale() == 1024.0f);
  CHECK(s.update(false));
  CHECK(s.update(false));
  CHECK(s.scale() == 1024.0f);
  CHECK(s.update(false));  // third clean step: grows
  CHECK(s.scale() == 2048.0f);
  CHECK_FALSE(s.update(true));  // overflow: skip and halve, counter restarts
  CHECK(s.scale() == 1024.0f);
  CHECK(s.clean_steps() == 0);
  CHECK(s.update(false));
  CHECK(s.update(false));
  CHECK_FALSE(s.update(true));  // an overflow before the interval ends resets the count
  CHECK(s.scale() == 512.0f);
  for (int i = 0; i < 10; ++i) CHECK_FALSE(s.update(true));
  CHECK(s.scale() == 64.0f);  // clamped at min_scale
  CHECK(s.skipped_steps() == 12);
  for (int i = 0; i < 30; ++i) CHECK(s.update(false));
  CHECK(s.scale() == 4096.0f);  // clamped at max_scale
}

TEST_CASE("initial_scale_for: the base over the largest power of two in the micro-batch count, at least 1") {
  CHECK(initial_scale_for(1) == 65536.0f);
  CHECK(initial_scale_for(0) == 65536.0f);
  CHECK(initial_scale_for(2) == 32768.0f);
  CHECK(initial_scale_for(3) == 32768.0f);
  CHECK(initial_scale_for(4) == 16384.0f);
  CHECK(initial_scale_for(6) == 16384.0f);
  CHECK(initial_scale_for(1 << 20) == 1.0f);
  CHECK(initial_scale_for(8, 1024.0f) == 128.0f);
  static_assert(initial_scale_for(2) == 32768.0f);
}

TEST_CASE("loss scaler options and the static scaler are checked") {
  CHECK_THROWS_AS(dynamic_loss_scaler({.init_scale = 0.5f}), config_error);
  CHECK_THROWS_AS(dynamic_loss_scaler({.backoff_factor = 1.0f}), config_error);
  CHECK_THROWS_AS(dynamic_loss_scaler({.growth_interval = 0}), config_error);
  CHECK_THROWS_AS(static_loss_scaler(0.0f), config_error);
  static_loss_scaler none;
  CHECK(none.scale() == 1.0f);
  CHECK(none.update(true));
  dynamic_loss_scaler s;
  s.restore(128.0f, 5);
  CHECK(s.scale() == 128.0f);
  CHECK(s.clean_steps() == 5);
  CHECK_THROWS_AS(s.restore(1e30f, 0), config_error);
}

TEST_CASE("fp16 training with injected overflows skips exactly those steps") {
  // The "true" gradient of step t is deterministic; backward produces loss_scale * g in fp16,
  // which overflows on the injected steps. The run must equal a run that never saw those steps.
  constexpr std::size_t n = 300;
  const std::set<int> injected = {3, 4, 10, 17};
  auto true_grad = [](int t, std::size_t i) { return 0.01f * std::sin(0.1f * float(i) + float(t)); };
  dynamic_loss_scaler scaler({.init_scale = 1024.0f, .growth_interval = 5});
  std::vector<float> master(n, 0.1f), m(n, 0.0f), v(n, 0.0f);
  std::vector<float16> param(n);
  std::vector<float> rmaster(n, 0.1f), rm(n, 0.0f), rv(n, 0.0f);
  std::int64_t step = 0, rstep = 0;
  std::vector<float> scales;
  const adam_hyper h{.lr = 1e-2f, .weight_decay = 0.01f};
  for (int t = 1; t <= 25; ++t) {
    const float ls = scaler.scale();
    scales.push_back(ls);
    std::vector<float16> g(n);
    for (std::size_t i = 0; i < n; ++i) g[i] = float16(ls * true_grad(t, i));
    if (injected.count(t)) g[t * 7 % n] = float16(std::numeric_limits<float>::infinity());
    const grad_stats st = scan_gradients<float16>(g, 1.0f / ls);
    CHECK(st.all_finite == !injected.count(t));
    if (scaler.update(!st.all_finite))
      adam_update<float16, float16>(master, m, v, std::span<const float16>(g), std::span<float16>(param), h,
                                    {.step = ++step, .grad_scale = 1.0f / ls});
    if (!injected.count(t)) {
      // Reference: fp32 gradients that went through the same fp16 rounding at the same scale.
      std::vector<float> rg(n);
      for (std::size_t i = 0; i < n; ++i) rg[i] = to_float(float16(ls * true_grad(t, i)));
      adam_update<float, float>(rmaster, rm, rv, std::span<const float>(rg), {}, h,
                                {.step = ++rstep, .grad_scale = 1.0f / ls});
    }
  }
  CHECK(step == 25 - static_cast<std::int64_t>(injected.size()));
  CHECK(scaler.skipped_steps() == 4);
  CHECK(scales[2] == 1024.0f);  // step 3 overflowed at 1024 ...
  CHECK(scales[3] == 512.0f);   // ... step 4 at 512 ...
  CHECK(scales[4] == 256.0f);   // ... then 5 clean steps (5..9) and growth
  CHECK(scales[9] == 512.0f);
  for (std::size_t i = 0; i < n; ++i) {
    REQUIRE(master[i] == rmaster[i]);  // same kernel, same inputs: same bits
    REQUIRE(param[i] == float16(master[i]));
  }
}

}  // namespace optim_loss_scaler_test
