// SPDX-License-Identifier: Apache-2.0
// libgpt_nccl.so: train_gpt's NCCL communicator, in a module of its own that the trainer loads
// (gpt_nccl.hpp) only when a run asks for NCCL; linking NCCL into the trainer would map its
// ~220 MB into every run, and a CPU run under `ulimit -v` would fail to start.
#include "gpt_nccl.hpp"

#include <chunkstar/nccl/nccl_communicator.hpp>

namespace {
struct owned {
  chunkstar::nccl::nccl_communicator comm;
};
}  // namespace

extern "C" void* gpt_nccl_create(chunkstar::communicator_ref* host, int device, chunkstar::communicator_ref* out) {
  auto* o = new owned{chunkstar::nccl::nccl_communicator::bootstrap(*host, device)};
  *out = chunkstar::communicator_ref(o->comm);
  return o;
}

extern "C" void gpt_nccl_destroy(void* comm) noexcept { delete static_cast<owned*>(comm); }
