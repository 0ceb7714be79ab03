// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Forwarding header (kept for one release): split into `chunkstar/store/compute_level.hpp`,
 *         `chunkstar/store/non_model_allocator.hpp` and `chunkstar/runtime/non_model_buffer.hpp`.
 */
#pragma once

#include <chunkstar/runtime/non_model_buffer.hpp>
#include <chunkstar/store/compute_level.hpp>
#include <chunkstar/store/non_model_allocator.hpp>
