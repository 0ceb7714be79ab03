// SPDX-License-Identifier: Apache-2.0
// doctest main for MPI tests: every rank runs the same suite (so collectives line up); rank 0
// reports in full, the others only their failures; the exit code fails if any rank failed.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <chunkstar/mpi/mpi_communicator.hpp>

#include <cstdio>

int main(int argc, char** argv) {
  chunkstar::mpi_session session(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  doctest::Context ctx(argc, argv);
  if (rank != 0) ctx.setOption("minimal", true);
  const int failed = ctx.run();
  if (ctx.shouldExit()) return failed;
  int any_failed = failed != 0 ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && any_failed && failed == 0) std::printf("FAILED: another rank reported failures (see above)\n");
  return any_failed ? 1 : 0;
}
