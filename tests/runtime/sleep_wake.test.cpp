// SPDX-License-Identifier: Apache-2.0
// Sleep and wake (chunk_runtime::sleep / wake): between two steps every chunk leaves the device and
// the device space holds nothing; after wake the run goes on with the bits of a run that never
// slept. One process and ZeRO (both modes) on 1-3 in-process ranks, with the model on the device or
// squeezed, and with a disk tier where the host cannot hold a rank's share.
#include "../support/disk_test_dir.hpp"
#include "../support/mlp_replica.hpp"

#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/disk/disk_copy_engine.hpp>
#include <chunkstar/disk/disk_space.hpp>
#include <chunkstar/eviction/lru.hpp>

#include <doctest/doctest.h>

#include <optional>
#include <set>
#include <string>
#include <vector>

using namespace chunkstar;
using chunkstar::testing::mlp_adam;
using chunkstar::testing::mlp_replica;

namespace sleep_wake_test {
namespace {

constexpr int steps = 6;
constexpr std::size_t act_bytes = chunkstar::testing::mlp_act_bytes, chunk_bytes = chunkstar::testing::mlp_chunk_bytes;
constexpr std::size_t block = 4096;  // a chunk's footprint on the host and the disk with a disk tier

struct run_spec {
  int ranks = 1;
  bool memory_saving = false;
  std::size_t device_chunks = 64;  // device capacity: the activations and this many chunks
  std::size_t host_blocks = 0;     // > 0: a host of that many 4 KiB blocks and a disk tier
  std::set<int> sleep_after;       // steps after which every rank sleeps and wakes
};

struct rank_result {
  std::vector<float> losses;
  std::vector<float> params, momentum;  // the rank's own tensors
  std::vector<std::size_t> asleep_device_chunks, asleep_device_used, asleep_disk_chunks;
  std::size_t device_chunks_before_sleep = 0;
  std::vector<std::string> violations;
};

template <class Eviction = belady_eviction>
std::vector<rank_result> train(const run_spec& spec, const std::string& dir) {
  std::vector<rank_result> out(static_cast<std::size_t>(spec.ranks));
  run_ranks(spec.ranks, [&](in_process_communicator& comm) {
    auto& me = out[static_cast<std::size_t>(comm.rank())];
    std::optional<disk_space> disk;
    std::optional<disk_copy_engine> disk_io;
    if (spec.host_blocks > 0) {
      disk.emplace(
          disk_space_options{.directory = dir, .capacity = 64 * block, .name = "rank" + std::to_string(comm.rank())});
      disk_io.emplace(*disk);
    }
    using replica = mlp_replica<in_process_communicator, auto_placement, Eviction>;
    replica r(
        {.sharding = {.enabled = true, .memory_saving = spec.memory_saving}},
        act_bytes + spec.device_chunks * chunk_bytes,
        host_space_options{.capacity = spec.host_blocks > 0 ? spec.host_blocks * block : host_space_options{}.capacity},
        [&](typename replica::runtime_type& rt) {
          if (disk) rt.attach_disk(disk_tier(*disk, *disk_io));
        },
        comm);
    auto opt = mlp_adam();
    for (int step = 1; step <= steps; ++step) {
      me.losses.push_back(r.forward_backward(step, comm.rank(), [] {}));
      REQUIRE(opt.step(r.rt, 2e-2f, spec.ranks).stepped);
      {  // an evaluation: under ZeRO it leaves other ranks' chunks gathered, which a sleep drops
        auto eval = r.rt.untraced();
        for (std::size_t l = 0; l < r.w.size(); ++l) auto s = r.rt.forward("eval", {r.w[l], r.b[l]});
      }
      if (spec.sleep_after.contains(step)) {
        me.device_chunks_before_sleep = std::max(me.device_chunks_before_sleep, r.rt.device_chunk_bytes());
        r.rt.sleep();
        CHECK(r.rt.asleep());
        me.asleep_device_chunks.push_back(r.rt.device_chunk_bytes());
        me.asleep_device_used.push_back(r.dev.used());
        me.asleep_disk_chunks.push_back(r.rt.disk_chunk_bytes());
        for (const auto& v : r.rt.invariant_violations(true)) me.violations.push_back("asleep: " + v);
        r.rt.wake();
      }
      for (const auto& v : r.rt.invariant_violations(true)) me.violations.push_back(v);
    }
    me.params = r.owned(chunk_kind::param);
    me.momentum = r.owned(chunk_kind::momentum);
  });
  return out;
}

void check_same_run(const std::vector<rank_result>& got, const std::vector<rank_result>& expected) {
  REQUIRE(got.size() == expected.size());
  for (std::size_t k = 0; k < got.size(); ++k) {
    CAPTURE(k);
    for (const auto& v : got[k].violations) FAIL_CHECK(v);
    CHECK(got[k].losses == expected[k].losses);
    CHECK(got[k].params == expected[k].params);
    CHECK(got[k].momentum == expected[k].momentum);
  }
}

}  // namespace

TEST_CASE(
    "sleep: no model data and no memory on the device while asleep; after wake the bits of a run that never slept") {
  chunkstar::test::scratch_dir dir;
  for (int ranks : {1, 2, 3}) {
    for (bool memory_saving : {false, true}) {
      if (ranks == 1 && memory_saving) continue;  // one rank does not shard
      // The whole model on the device, then a device that holds a few chunks (chunks move every step).
      for (std::size_t device_chunks : {std::size_t{64}, memory_saving ? std::size_t{6} : 4 * ranks + 2}) {
        CAPTURE(ranks);
        CAPTURE(memory_saving);
        CAPTURE(device_chunks);
        run_spec spec{
            .ranks = ranks, .memory_saving = memory_saving, .device_chunks = device_chunks, .sleep_after = {}};
        const auto expected = train(spec, dir.path());
        spec.sleep_after = {1, 3, 4};
        const auto got = train(spec, dir.path());
        check_same_run(got, expected);
        for (const auto& r : got) {
          CHECK(r.device_chunks_before_sleep > 0);
          CHECK(r.asleep_device_chunks == std::vector<std::size_t>(3, 0));
          CHECK(r.asleep_device_used == std::vector<std::size_t>(3, 0));
        }
      }
    }
  }
}

TEST_CASE("sleep with LRU eviction, and with a disk tier where the host cannot hold a rank's share: the same bits") {
  chunkstar::test::scratch_dir dir;
  for (int ranks : {1, 3}) {
    CAPTURE(ranks);
    run_spec spec{.ranks = ranks, .sleep_after = {}};
    const auto expected = train(spec, dir.path());
    spec.sleep_after = {2, 5};
    check_same_run(train<lru_eviction>(spec, dir.path()), expected);
    spec.host_blocks = ranks == 1 ? 12 : 6;  // a third of what the rank's share needs on the host: the rest on disk
    const auto got = train(spec, dir.path());
    check_same_run(got, expected);
    for (const auto& r : got) {
      CHECK(r.asleep_device_used == std::vector<std::size_t>(2, 0));
      CHECK(r.asleep_disk_chunks.front() > 0);  // the sleep spilled what the host could not hold
    }
  }
}

TEST_CASE("sleep: what is refused while asleep, and when sleeping is refused, each a state_error saying what to do") {
  mlp_replica<single_process_communicator> r({}, act_bytes + 64 * chunk_bytes);
  auto opt = mlp_adam();
  CHECK_THROWS_WITH_AS(r.rt.wake(), doctest::Contains("call sleep() first"), state_error);
  r.forward_backward(1, 0, [] {});
  REQUIRE(opt.step(r.rt, 2e-2f, 1).stepped);
  {
    auto s = r.rt.forward("l0", {r.w[0], r.b[0]});
    CHECK_THROWS_WITH_AS(r.rt.sleep(), doctest::Contains("scope 'l0' open"), state_error);
  }
  r.rt.end_iteration();
  {
    auto eval = r.rt.untraced();
    CHECK_THROWS_WITH_AS(r.rt.sleep(), doctest::Contains("untraced section"), state_error);
  }
  const auto before = r.all(chunk_kind::param);
  r.rt.sleep();
  CHECK_THROWS_WITH_AS(r.rt.sleep(), doctest::Contains("asleep: call wake() first"), state_error);
  CHECK_THROWS_WITH_AS((void)r.rt.forward("l0", {r.w[0], r.b[0]}), doctest::Contains("call wake() first"), state_error);
  CHECK_THROWS_WITH_AS((void)r.rt.backward("l0", {r.w[0], r.b[0]}), doctest::Contains("call wake() first"),
                       state_error);
  CHECK_THROWS_WITH_AS((void)r.rt.allocate_non_model(64), doctest::Contains("call wake() first"), state_error);
  CHECK_THROWS_WITH_AS((void)opt.step(r.rt, 2e-2f, 1), doctest::Contains("call wake() first"), state_error);
  CHECK(r.all(chunk_kind::param) == before);  // reading works while asleep
  CHECK(r.rt.device_chunk_bytes() == 0);
  CHECK(r.dev.used() == 0);
  r.rt.wake();
  CHECK_FALSE(r.rt.asleep());
  CHECK(r.rt.device_chunk_bytes() > 0);  // brought back ahead of the next step
  r.forward_backward(2, 0, [] {});
  CHECK(opt.step(r.rt, 2e-2f, 1).stepped);
  CHECK(r.rt.invariant_violations(true).empty());
}

TEST_CASE("sleep between micro-batches of a ZeRO step is refused: the gradient groups are open") {
  run_ranks(2, [](in_process_communicator& comm) {
    mlp_replica<in_process_communicator> r({.sharding = {.enabled = true}}, act_bytes + 64 * chunk_bytes, comm);
    auto opt = mlp_adam();
    r.forward_backward(1, comm.rank(), [] {});
    CHECK_THROWS_WITH_AS(r.rt.sleep(), doctest::Contains("between micro-batches"), state_error);
    REQUIRE(opt.step(r.rt, 2e-2f, 2).stepped);
    r.rt.sleep();
    r.rt.wake();
  });
}

}  // namespace sleep_wake_test
