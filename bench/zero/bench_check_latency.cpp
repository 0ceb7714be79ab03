// SPDX-License-Identifier: Apache-2.0
// bench_check_latency: what the collective-sequence check adds to one collective when the ranks
// arrive together (no skew to absorb): K back-to-back 8-byte allreduces through an
// mpi_communicator with the check on, then K with it off, in alternating rounds; the medians' difference
// is the check's own latency. bench_sequence_check.py runs it beside the trainer and turns it into a
// share of a step. Prints one JSON line: {"on_us": ..., "off_us": ..., "check_us": ...}.
//
//   mpirun -np 2 bench_check_latency [calls per round, default 4000] [rounds, default 7]
#include <chunkstar/mpi/mpi_communicator.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <vector>

namespace {

double per_call_us(chunkstar::mpi_communicator& comm, int calls) {
  double x = 1.0;
  comm.barrier();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) comm.allreduce(std::span<double>(&x, 1), chunkstar::reduce_op::max);
  double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / calls;
  comm.allreduce(std::span<double>(&us, 1), chunkstar::reduce_op::max);  // the slowest rank's figure
  return us;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  try {
    chunkstar::mpi_session session(&argc, &argv);
    const int calls = argc > 1 ? std::atoi(argv[1]) : 4000;
    const int rounds = argc > 2 ? std::atoi(argv[2]) : 7;
    if (calls < 1 || rounds < 1)
      throw chunkstar::config_error("bench_check_latency: calls and rounds must be positive");
    chunkstar::mpi_communicator on(MPI_COMM_WORLD, {.check_sequence = true});
    chunkstar::mpi_communicator off(MPI_COMM_WORLD, {.check_sequence = false});
    per_call_us(on, calls / 4 + 1);  // warm both paths up
    per_call_us(off, calls / 4 + 1);
    std::vector<double> t_on, t_off;
    for (int r = 0; r < rounds; ++r) {
      t_on.push_back(per_call_us(on, calls));
      t_off.push_back(per_call_us(off, calls));
    }
    if (on.rank() == 0)
      std::printf(
          "{\"on_us\": %.3f, \"off_us\": %.3f, \"check_us\": %.3f, \"calls\": %d, \"rounds\": %d, \"ranks\": %d}\n",
          median(t_on), median(t_off), median(t_on) - median(t_off), calls, rounds, on.size());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_check_latency: %s\n", e.what());
    return 1;
  }
}
