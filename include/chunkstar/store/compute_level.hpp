// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `compute_level`: what the compute tier holds beside chunks and where the iteration is — the inputs of every
 *         budget.
 */
#pragma once

#include <chunkstar/core/moment_kind.hpp>

#include <cstddef>

namespace chunkstar {

/** @brief What the compute tier holds beside chunks, and where the iteration is: the inputs of
 *  every budget. Written by the non-model allocator (the first two) and the runtime. */
struct compute_level {
  std::size_t non_model = 0;                ///< non-model bytes live now
  std::size_t changes = 0;                  ///< non-model changes in the current moment
  bool untraced = false;                    ///< inside an untraced section: no trace answers
  moment_kind kind = moment_kind::forward;  ///< the current moment's kind
  std::size_t releasing = never;            ///< chunk index whose gradient the current moment (a step) frees at its end
  bool sharded = false;                     ///< ZeRO: gradients live in group buffers, never zero-filled chunk by chunk
};

}  // namespace chunkstar
