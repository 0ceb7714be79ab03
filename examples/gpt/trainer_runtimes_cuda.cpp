// SPDX-License-Identifier: Apache-2.0
#include "trainer_runtimes.hpp"

GPT_TRAINER_RUNTIMES(, gpt::cuda_runtimes, chunkstar::cuda::cuda_platform);
