// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Forwarding header (kept for one release): moved to `chunkstar/store/prefetch_planner.hpp`.
 */
#pragma once

#include <chunkstar/store/prefetch_planner.hpp>
