// SPDX-License-Identifier: Apache-2.0
#include "support/runtimes.hpp"

CHUNKSTAR_RUNTIME_STORE(, chunkstar::simulated_platform);
