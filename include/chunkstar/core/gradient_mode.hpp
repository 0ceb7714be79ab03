// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `gradient_mode`: how the gradients of ranks relate (local, replicated, sharded), which decides how the global
 *         gradient norm is formed.
 */
#pragma once

#include <cstdint>

namespace chunkstar {

/** @brief How gradients relate across ranks, which decides how the global gradient norm is formed:
 *  `local` — each rank's gradients are its own (one rank, or independent ranks): norm of the local
 *  gradients; `replicated` — every rank holds the same, already summed gradients (data parallelism
 *  with all-reduced gradients, see data_parallel.hpp): the local norm is the global one;
 *  `sharded` — each rank holds a distinct part (ZeRO): the squared norms are summed over ranks. */
enum class gradient_mode : std::uint8_t { local, replicated, sharded };

}  // namespace chunkstar
