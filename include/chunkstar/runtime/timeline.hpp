// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Forwarding header (kept for one release): moved to `chunkstar/observe/timeline.hpp`.
 */
#pragma once

#include <chunkstar/observe/timeline.hpp>
