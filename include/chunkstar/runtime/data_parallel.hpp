// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Forwarding header (kept for one release): moved to `chunkstar/zero/replicated_gradients.hpp`.
 */
#pragma once

#include <chunkstar/zero/replicated_gradients.hpp>
