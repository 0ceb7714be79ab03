// SPDX-License-Identifier: Apache-2.0
#include "support/runtimes.hpp"

CHUNKSTAR_TEST_RUNTIMES(, chunkstar::testing::fixed_runtime, chunkstar::testing::fixed_group_runtime,
                        chunkstar::testing::searched_runtime);
