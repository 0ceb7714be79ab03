// SPDX-License-Identifier: Apache-2.0
// ZeRO with a disk tier (ZeRO-Infinity's combination): each rank's own share of the model data
// spills to its own disk when device and host cannot hold it, and N ranks still give the bits of
// N ranks without a disk (which tests/mpi/zero.test.cpp ties to the one-process reference).
#include <chunkstar/checkpoint/runtime_checkpoint.hpp>
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/disk/disk_copy_engine.hpp>
#include <chunkstar/disk/disk_space.hpp>
#include <chunkstar/disk/disk_tier.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>

#include <doctest/doctest.h>

#include <optional>
#include <string>
#include <vector>

#include "support/disk_test_dir.hpp"
#include "support/mlp_replica.hpp"
#include "support/runtimes.hpp"

using namespace chunkstar;

namespace zero_disk_test {
using chunkstar::testing::mlp_adam;
using chunkstar::testing::mlp_replica;

namespace {

constexpr int steps = 6;
constexpr std::size_t act_bytes = chunkstar::testing::mlp_act_bytes, chunk_bytes = chunkstar::testing::mlp_chunk_bytes;
constexpr std::size_t block = 4096;  // a chunk's footprint on the host and the disk with a disk tier

struct rank_result {
  std::vector<float> losses;
  std::vector<float> params;  // the rank's own parameter tensors
  runtime_stats stats;
  std::vector<std::string> violations;
};

/** @p ranks ZeRO ranks, @p steps steps; with @p host_blocks > 0 each rank has a host of that many
 *  4 KiB blocks and a disk tier of its own under @p dir. */
std::vector<rank_result> train(int ranks, bool memory_saving, std::size_t host_blocks, const std::string& dir) {
  std::vector<rank_result> out(static_cast<std::size_t>(ranks));
  run_ranks(ranks, [&](in_process_communicator& comm) {
    auto& me = out[static_cast<std::size_t>(comm.rank())];
    std::optional<disk_space> disk;
    std::optional<disk_copy_engine> disk_io;
    if (host_blocks > 0) {
      disk.emplace(
          disk_space_options{.directory = dir, .capacity = 64 * block, .name = "rank" + std::to_string(comm.rank())});
      disk_io.emplace(*disk);
    }
    using replica = mlp_replica<in_process_communicator>;
    // A device too small for the model data: group buffers (4N + 1 chunks) or the memory-saving mode's 4.
    const std::size_t device = act_bytes + (memory_saving ? 6 : 4 * static_cast<std::size_t>(ranks) + 2) * chunk_bytes;
    replica r(
        {.sharding = {.enabled = true, .memory_saving = memory_saving}}, device,
        host_space_options{.capacity = host_blocks > 0 ? host_blocks * block : host_space_options{}.capacity},
        [&](replica::runtime_type& rt) {
          if (disk) rt.attach_disk(disk_tier(*disk, *disk_io));
        },
        comm);
    auto opt = mlp_adam();
    for (int step = 1; step <= steps; ++step) {
      me.losses.push_back(r.forward_backward(step, comm.rank(), [] {}));
      REQUIRE(opt.step(r.rt, 2e-2f, ranks).stepped);
      const auto v = r.rt.invariant_violations(true);
      me.violations.insert(me.violations.end(), v.begin(), v.end());
    }
    me.params = r.owned(chunk_kind::param);
    me.stats = r.rt.stats();
  });
  return out;
}

}  // namespace

TEST_CASE(
    "ZeRO with a disk tier per rank: the bits of the same ranks without a disk, each rank's share moving through its "
    "disk") {
  chunkstar::test::scratch_dir dir;
  for (int ranks : {2, 3}) {
    for (bool memory_saving : {false, true}) {
      const auto expected = train(ranks, memory_saving, 0, dir.path());
      for (std::size_t host_blocks : {6, 5}) {  // a host that cannot hold the rank's share (8 blocks can)
        CAPTURE(ranks);
        CAPTURE(memory_saving);
        CAPTURE(host_blocks);
        const auto got = train(ranks, memory_saving, host_blocks, dir.path());
        for (std::size_t k = 0; k < got.size(); ++k) {
          CAPTURE(k);
          for (const auto& v : got[k].violations) FAIL_CHECK(v);
          CHECK(got[k].losses == expected[k].losses);
          CHECK(got[k].params == expected[k].params);
          CHECK(got[k].stats.bytes_to_disk > 0);
          CHECK(got[k].stats.bytes_from_disk > 0);
        }
      }
    }
  }
}

}  // namespace zero_disk_test
