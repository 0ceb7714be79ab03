#include "support/runtimes.hpp"

CHUNKSTAR_RUNTIME_STORE(, chunkstar::simulated_platform);
