// SPDX-License-Identifier: Apache-2.0
#include "trainer_runtimes.hpp"

GPT_TRAINER_RUNTIMES(, gpt::sim_runtimes, chunkstar::simulated_platform);
CHUNKSTAR_INSTANTIATE_HOST_KERNELS;
