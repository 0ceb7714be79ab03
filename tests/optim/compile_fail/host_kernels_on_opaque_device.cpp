// SPDX-License-Identifier: Apache-2.0
// Must not compile: chunk_adam with only the host kernels over a runtime whose device the host
// cannot address (a GPU's, here a simulated device typed without host access). The ctest
// `optim_compile_fail_host_kernels` builds it and passes when the compiler names the fix.
#include <chunkstar/runtime/chunk_adam.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>

using namespace chunkstar;

struct opaque_device_space : simulated_device_space {
  using simulated_device_space::simulated_device_space;
};
using rt_opaque =
    chunk_runtime<searched_chunk_layout, auto_placement, belady_eviction, warmup_tracer, single_process_communicator,
                  platform<opaque_device_space, host_space, host_copy_engine>>;

void step(rt_opaque& rt) {
  chunk_adam<> adam;
  (void)adam.step(rt, 1e-3f);
}
