// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Forwarding header (kept for one release): moved to `chunkstar/memory/platform.hpp`.
 */
#pragma once

#include <chunkstar/memory/platform.hpp>
