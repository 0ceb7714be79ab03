// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Global-norm gradient clipping over all chunks of all ranks.
 *
 *  Each rank sums the squares of the gradients it owns (sum_of_squares / scan_gradients over its
 *  chunks, in chunk order), then global_norm_clip_coefficient adds the ranks' sums through the communicator
 *  (a deterministic allreduce in rank order), so every rank gets the same norm and coefficient.
 *  Fold the coefficient into adam_step_args::grad_scale: the gradients are never rewritten.
 */
#pragma once

#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/core/error.hpp>

#include <algorithm>
#include <cmath>
#include <span>
#include <string>

namespace chunkstar {

/** @brief The global gradient norm and the factor that clips it. */
struct clip_result {
  double norm = 0.0;         ///< sqrt of the sum of squares over all ranks (inf or NaN on overflow)
  float coefficient = 1.0f;  ///< min(1, max_norm / (norm + 1e-6)); 1 when the norm is not finite
};

/** @brief The coefficient for a global norm already summed over ranks. A norm that is not finite
 *         gives coefficient 1: that step must be skipped (loss scaler) rather than scaled by 0. */
inline clip_result clip_coefficient(double global_sum_sq, float max_norm) {
  if (!(max_norm > 0.0f))
    throw config_error("global-norm clipping: max_norm must be > 0, got " + std::to_string(max_norm) +
                       " (to disable clipping, do not call it, or pass infinity)");
  clip_result r;
  r.norm = std::sqrt(global_sum_sq);
  if (std::isfinite(r.norm))
    r.coefficient = static_cast<float>(std::min(1.0, static_cast<double>(max_norm) / (r.norm + 1e-6)));
  return r;
}

/** @brief Adds @p local_sum_sq (this rank's sum of squared gradients) over the ranks of @p comm and
 *         returns the global norm and the clipping coefficient; the same on every rank. A
 *         collective: every rank must call it. */
template <Communicator C>
clip_result global_norm_clip_coefficient(double local_sum_sq, float max_norm, C& comm) {
  double sum = local_sum_sq;
  comm.allreduce(std::span<double>(&sum, 1), reduce_op::sum);
  return clip_coefficient(sum, max_norm);
}

}  // namespace chunkstar
