// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief The LossScaler concept and its models: dynamic loss scaling for fp16 and a static
 *         (by default unit) scaler for bf16 and fp32.
 *
 *  Use per step: backward on `loss * scaler.scale()`; scan the gradient chunks (scan_gradients,
 *  or the device reduction); `if (scaler.update(!all_finite)) step with grad_scale = 1/scale`,
 *  where the scale used is the one read before update().
 */
#pragma once

#include <chunkstar/core/error.hpp>

#include <cmath>
#include <concepts>
#include <cstdint>
#include <string>

namespace chunkstar {

/** @brief A loss scaler. For `s` a `S&` and `cs` a `const S&`:
 *  - `cs.scale()` -> float: the factor the loss is multiplied by before backward (gradients come
 *    out multiplied by it; the optimizer divides it out through adam_step_args::grad_scale);
 *  - `s.update(found_overflow)` -> bool: called once per step after the gradients were checked;
 *    adjusts the scale and returns whether the optimizer step should run (false: skip it and
 *    zero the gradients). */
template <class S>
concept LossScaler = requires(S& s, const S& cs, bool overflow) {
  { cs.scale() } -> std::convertible_to<float>;
  { s.update(overflow) } -> std::same_as<bool>;
};

/** @brief Knobs of dynamic loss scaling (the defaults are those of common fp16 trainers). */
struct dynamic_loss_scaler_options {
  float init_scale = 65536.0f;
  float growth_factor = 2.0f;   ///< multiply the scale after growth_interval clean steps
  float backoff_factor = 0.5f;  ///< multiply the scale on overflow
  std::int64_t growth_interval = 2000;
  float min_scale = 1.0f;
  float max_scale = 16777216.0f;  ///< 2^24
};

/** @brief `init_scale` for gradients summed over @p micro_batches micro-batches per step
 *  (accumulation x data-parallel ranks, each its own mean loss's gradient): @p base divided by the
 *  largest power of two not above @p micro_batches, at least 1. The summed gradient then has the
 *  headroom in fp16 that one micro-batch has at @p base, so one process and N ranks splitting the
 *  same batch overflow alike (not N times sooner). Pure; @p micro_batches below 1 counts as 1. */
[[nodiscard]] constexpr float initial_scale_for(int micro_batches, float base = 65536.0f) noexcept {
  float scale = base;
  for (int n = micro_batches; n > 1 && scale > 1.0f; n /= 2) scale /= 2.0f;
  return scale;
}

/** @brief fp16 dynamic loss scaling: back off and skip the step on inf/NaN gradients; grow after
 *         growth_interval consecutive clean steps; stay within [min_scale, max_scale]. */
class dynamic_loss_scaler {
 public:
  /** @brief Throws config_error on inconsistent options. */
  explicit dynamic_loss_scaler(dynamic_loss_scaler_options o = {}) : o_(o), scale_(o.init_scale) {
    auto bad = [](const std::string& w) { throw config_error("dynamic_loss_scaler: " + w); };
    if (!(o.min_scale > 0.0f) || !(o.max_scale >= o.min_scale) || !std::isfinite(o.max_scale))
      bad("need 0 < min_scale <= max_scale < inf, got min_scale " + std::to_string(o.min_scale) + ", max_scale " +
          std::to_string(o.max_scale));
    if (!(o.init_scale >= o.min_scale && o.init_scale <= o.max_scale))
      bad("init_scale " + std::to_string(o.init_scale) + " must lie in [min_scale, max_scale]");
    if (!(o.growth_factor >= 1.0f) || !(o.backoff_factor > 0.0f && o.backoff_factor < 1.0f))
      bad("need growth_factor >= 1 and 0 < backoff_factor < 1, got " + std::to_string(o.growth_factor) + " and " +
          std::to_string(o.backoff_factor));
    if (o.growth_interval < 1) bad("growth_interval must be >= 1, got " + std::to_string(o.growth_interval));
  }

  /** @brief The current loss scale. */
  [[nodiscard]] float scale() const noexcept { return scale_; }
  /** @brief Clean steps since the last overflow or growth. */
  [[nodiscard]] std::int64_t clean_steps() const noexcept { return clean_; }
  /** @brief Steps skipped because of overflow, in total. */
  [[nodiscard]] std::int64_t skipped_steps() const noexcept { return skipped_; }
  /** @brief The options it was built with. */
  [[nodiscard]] const dynamic_loss_scaler_options& options() const noexcept { return o_; }

  /** @brief Records this step's check; returns whether the optimizer step should run. */
  bool update(bool found_overflow) noexcept {
    if (found_overflow) {
      scale_ = std::fmax(o_.min_scale, scale_ * o_.backoff_factor);
      clean_ = 0;
      ++skipped_;
      return false;
    }
    if (++clean_ >= o_.growth_interval) {
      scale_ = std::fmin(o_.max_scale, scale_ * o_.growth_factor);
      clean_ = 0;
    }
    return true;
  }

  /** @brief Restores the state saved in a checkpoint. */
  void restore(float scale, std::int64_t clean_steps) {
    if (!(scale >= o_.min_scale && scale <= o_.max_scale) || clean_steps < 0)
      throw config_error("dynamic_loss_scaler::restore: scale " + std::to_string(scale) + " outside [min_scale, " +
                         "max_scale] or negative clean_steps; was the checkpoint written with other options?");
    scale_ = scale;
    clean_ = clean_steps;
  }

 private:
  dynamic_loss_scaler_options o_;
  float scale_;
  std::int64_t clean_ = 0;
  std::int64_t skipped_ = 0;
};

/** @brief A fixed scale (1 by default: bf16 and fp32 train without loss scaling). It never skips
 *         a step: with no dynamic range problem an overflow is a real divergence, which clipping
 *         or the caller must handle. */
class static_loss_scaler {
 public:
  /** @brief Throws config_error unless @p scale is positive and finite. */
  explicit static_loss_scaler(float scale = 1.0f) : scale_(scale) {
    if (!(scale > 0.0f) || !std::isfinite(scale))
      throw config_error("static_loss_scaler: scale must be positive and finite, got " + std::to_string(scale));
  }
  /** @brief The fixed scale. */
  [[nodiscard]] float scale() const noexcept { return scale_; }
  /** @brief Always runs the step. */
  bool update(bool /*found_overflow*/) noexcept { return true; }

 private:
  float scale_;
};

static_assert(LossScaler<dynamic_loss_scaler>);
static_assert(LossScaler<static_loss_scaler>);

}  // namespace chunkstar
