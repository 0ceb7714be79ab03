// SPDX-License-Identifier: Apache-2.0
#include "support/runtimes.hpp"

CHUNKSTAR_INSTANTIATE_HOST_KERNELS;
