// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Forwarding header (kept for one release): moved to `chunkstar/store/chunk_store.hpp`.
 */
#pragma once

#include <chunkstar/store/chunk_store.hpp>
