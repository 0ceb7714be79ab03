// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Forwarding header (kept for one release): moved to `chunkstar/runtime/tensor_state_table.hpp`.
 */
#pragma once

#include <chunkstar/runtime/tensor_state_table.hpp>
