#include "support/runtimes.hpp"

CHUNKSTAR_INSTANTIATE_HOST_KERNELS;
