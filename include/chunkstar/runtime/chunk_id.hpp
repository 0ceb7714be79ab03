// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Forwarding header (kept for one release): the vocabulary moved to `core/` —
 *         chunk_kind.hpp, chunk_id.hpp, tier.hpp, moment_kind.hpp, tensor_state.hpp.
 */
#pragma once

#include <chunkstar/core/chunk_id.hpp>
#include <chunkstar/core/chunk_kind.hpp>
#include <chunkstar/core/moment_kind.hpp>
#include <chunkstar/core/tensor_state.hpp>
#include <chunkstar/core/tier.hpp>
