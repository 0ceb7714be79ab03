// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief The LrSchedule concept and its models: constant, and linear warm-up then cosine decay.
 *
 *  Schedules are plain values evaluated per step, so the learning rate (like every other
 *  hyper-parameter) may change between steps: `hyper.lr = schedule(step)`.
 */
#pragma once

#include <chunkstar/core/error.hpp>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <numbers>
#include <string>

namespace chunkstar {

/** @brief A learning-rate schedule: for `cs` a `const S&` and `t` a `std::int64_t` (1-based step),
 *  `cs(t)` -> float is the learning rate of step t; `cs.validate()` throws config_error when the
 *  knobs make no sense. Pure: the same step always gives the same value. */
template <class S>
concept LrSchedule = requires(const S& cs, std::int64_t t) {
  { cs(t) } -> std::convertible_to<float>;
  cs.validate();
};

/** @brief The same learning rate at every step. */
struct constant_lr {
  float lr = 1e-3f;
  /** @brief Throws config_error unless lr >= 0 and finite. */
  void validate() const {
    if (!(lr >= 0.0f) || !std::isfinite(lr))
      throw config_error("constant_lr: lr must be >= 0 and finite, got " + std::to_string(lr));
  }
  /** @brief lr, whatever the step. */
  float operator()(std::int64_t /*step*/) const noexcept { return lr; }
};

/** @brief Linear warm-up from peak/warmup_steps to peak over steps 1..warmup_steps, then cosine
 *         decay from peak to min over the remaining steps up to total_steps; min afterwards. */
struct warmup_cosine {
  float peak = 1e-3f;
  float min = 0.0f;
  std::int64_t warmup_steps = 0;
  std::int64_t total_steps = 1;

  /** @brief Throws config_error on negative rates, min > peak, or warm-up longer than the run. */
  void validate() const {
    if (!(peak >= 0.0f) || !(min >= 0.0f) || !(min <= peak) || !std::isfinite(peak))
      throw config_error("warmup_cosine: need 0 <= min <= peak < inf, got min " + std::to_string(min) + ", peak " +
                         std::to_string(peak));
    if (warmup_steps < 0 || total_steps < 1 || warmup_steps > total_steps)
      throw config_error("warmup_cosine: need 0 <= warmup_steps <= total_steps and total_steps >= 1, got " +
                         std::to_string(warmup_steps) + " and " + std::to_string(total_steps));
  }

  /** @brief The learning rate of 1-based step @p step (computed in double, rounded once). */
  float operator()(std::int64_t step) const noexcept {
    step = std::max<std::int64_t>(step, 1);
    if (step <= warmup_steps)
      return static_cast<float>(static_cast<double>(peak) * static_cast<double>(step) /
                                static_cast<double>(warmup_steps));
    if (step >= total_steps) return min;
    const double progress = static_cast<double>(step - warmup_steps) / static_cast<double>(total_steps - warmup_steps);
    const double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
    return static_cast<float>(static_cast<double>(min) + (static_cast<double>(peak) - min) * cosine);
  }
};

static_assert(LrSchedule<constant_lr>);
static_assert(LrSchedule<warmup_cosine>);

}  // namespace chunkstar
