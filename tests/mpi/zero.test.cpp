// SPDX-License-Identifier: Apache-2.0
// ZeRO over MPI ranks (processes): each rank keeps its own chunks and trains the test MLP; its
// owned parameters must be bit-identical to the same rank of an in-process group (threads) run in
// this process — in-process and MPI ranks give the same bits — and to the rank-order reference.
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/mpi/mpi_communicator.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>

#include "support/mlp_replica.hpp"
#include "support/runtimes.hpp"

#include <doctest/doctest.h>

#include <map>
#include <string>
#include <vector>

using namespace chunkstar;

namespace zero_test {
using chunkstar::testing::mlp_replica;

namespace {

constexpr int steps = 10;
constexpr std::size_t tight =
    12 * chunkstar::testing::mlp_batch * chunkstar::testing::mlp_width * sizeof(float) + 10 * 1024;

chunk_adam<> make_adam() {
  return chunk_adam<>({.hyper = {.lr = 2e-2f, .weight_decay = 0.01f}, .max_grad_norm = 0.05f, .threads = 1});
}

template <class Comm>
std::map<std::string, std::vector<float>> train(Comm& comm, std::size_t capacity, bool memory_saving = false) {
  mlp_replica<Comm> r({.sharding = {.enabled = true, .memory_saving = memory_saving}}, capacity, comm);
  auto opt = make_adam();
  for (int step = 1; step <= steps; ++step) {
    r.forward_backward(step, comm.rank(), [] {});
    REQUIRE(opt.step(r.rt, 2e-2f, comm.size()).stepped);
  }
  std::map<std::string, std::vector<float>> out;
  for (std::size_t t = 0; t < r.rt.params().size(); ++t) {
    if (!r.rt.shards().owns(r.rt.plan().slots[t].chunk)) continue;
    std::vector<float> v(r.rt.params()[t].numel());
    r.rt.read_tensor(param_id{static_cast<std::uint32_t>(t)}, chunk_kind::param, v);
    out[r.rt.params()[t].name] = v;
  }
  return out;
}

}  // namespace

TEST_CASE(
    "ZeRO on MPI ranks gives the bits of the same ranks in-process, at a loose and a tight budget, in both modes") {
  mpi_communicator comm(MPI_COMM_WORLD, {.check_sequence = true});
  for (bool memory_saving : {false, true}) {
    for (std::size_t capacity : {std::size_t{1} << 20, tight}) {
      CAPTURE(memory_saving);
      CAPTURE(capacity);
      const auto mine = train(comm, capacity, memory_saving);
      std::map<std::string, std::vector<float>> threads;
      run_ranks(comm.size(), [&](in_process_communicator& c) {
        auto got = train(c, capacity, memory_saving);
        if (c.rank() == comm.rank()) threads = std::move(got);
      });
      CHECK(!mine.empty());
      CHECK(mine == threads);
    }
  }
}

}  // namespace zero_test
