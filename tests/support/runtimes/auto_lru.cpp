// SPDX-License-Identifier: Apache-2.0
#include "support/runtimes.hpp"

CHUNKSTAR_TEST_RUNTIMES(, chunkstar::testing::fixed_lru_runtime, chunkstar::testing::fixed_lru_group_runtime,
                        chunkstar::testing::searched_lru_runtime);
