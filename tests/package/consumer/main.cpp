// SPDX-License-Identifier: Apache-2.0
// A program as a user of chunkstar would write it, built by the package tests against an installed
// tree, the build tree and a FetchContent checkout. It checks a few results against values
// computed here by hand and prints which tiers the package brought along; the driver script
// (run_consumer.cmake) compares that line with what the main build found.
#include <chunkstar/chunkstar.hpp>
#include <chunkstar/layout/chunk_layout.hpp>

#if CHUNKSTAR_HAS_CUDA()
#include <cuda_runtime_api.h>
#endif
#if CHUNKSTAR_HAS_MPI()
#include <mpi.h>
#endif

#include <cstdio>
#include <vector>

int main() {
  int failures = 0;
  auto check = [&](bool ok, const char* what) {
    if (!ok) {
      std::printf("FAIL: %s\n", what);
      ++failures;
    }
  };

  // 1.0 + 2^-8 is halfway between two bf16 neighbours: round to even gives 1.0.
  check(chunkstar::to_float(chunkstar::from_float<chunkstar::bfloat16>(1.00390625f)) == 1.0f, "bf16 RNE");
  check(chunkstar::dtype_size(chunkstar::dtype::f16) == 2, "dtype_size(f16)");

  // Two chunks of 1024 elements holding three tensors; fp16 params get an fp32 master list.
  chunkstar::chunk_plan plan;
  plan.chunk_elems = 1024;
  plan.num_chunks = 2;
  plan.slots = {{0, 0, 600}, {0, 600, 400}, {1, 0, 1000}};
  plan.chunk_tensors = {{0, 1}, {2}};
  const auto lists = chunkstar::make_chunk_lists(plan, {.param_type = chunkstar::dtype::f16});
  check(lists.size() == 5, "param, grad, master, momentum, variance");
  check(lists.size() == 5 && lists[0].chunk_bytes == 2048 && lists[2].chunk_bytes == 4096, "list bytes");
  check(plan.waste_elems() == 48, "waste");

  // Built with the consumer's default flags (no -march): the SIMD kernels still run the widest path
  // this CPU has, chosen at run time.
  check(chunkstar::active_cpu_isa() == chunkstar::detected_cpu_isa(), "the kernels run the CPU's widest ISA");
  std::printf("cpu kernels: %s\n", chunkstar::cpu_isa_report().c_str());

  int cuda_runtime = 0;
#if CHUNKSTAR_HAS_CUDA()
  // Links against CUDA::cudart through the package; needs no GPU.
  check(cudaRuntimeGetVersion(&cuda_runtime) == cudaSuccess && cuda_runtime > 0, "cudaRuntimeGetVersion");
#endif
  int mpi_major = 0;
#if CHUNKSTAR_HAS_MPI()
  int mpi_minor = 0;
  check(MPI_Get_version(&mpi_major, &mpi_minor) == MPI_SUCCESS && mpi_major >= 3, "MPI_Get_version");
#endif

  std::printf("chunkstar %d.%d.%d tiers: cuda=%d nccl=%d mpi=%d (cudart %d, MPI %d)\n", CHUNKSTAR_VERSION_MAJOR,
              CHUNKSTAR_VERSION_MINOR, CHUNKSTAR_VERSION_PATCH, CHUNKSTAR_HAS_CUDA(), CHUNKSTAR_HAS_NCCL(),
              CHUNKSTAR_HAS_MPI(), cuda_runtime, mpi_major);
  if (failures == 0) std::printf("consumer OK\n");
  return failures == 0 ? 0 : 1;
}
