// SPDX-License-Identifier: Apache-2.0
// The runtime with a third tier on disk: same bits at any device, host and disk budget and policy,
// the cascade (what is needed latest goes furthest down), disk prefetch, the disk planner alone,
// faults (a failed or corrupted read or write, a full disk, a file that has no name) and checkpoints.
#include <chunkstar/checkpoint/runtime_checkpoint.hpp>
#include <chunkstar/disk/disk_copy_engine.hpp>
#include <chunkstar/eviction/lru.hpp>
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/placement/static_placement.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>
#include <chunkstar/store/disk_planner.hpp>

#include <doctest/doctest.h>

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>
#include <vector>

#include "support/disk_test_dir.hpp"
#include "support/runtimes.hpp"
#include "support/toy_model.hpp"

using namespace chunkstar;

namespace disk_runtime_test {
using chunkstar::testing::toy_config;
using chunkstar::testing::toy_result;
using chunkstar::testing::train_toy;

namespace {

using belady_rt = chunk_runtime<fixed_chunk_layout>;
using lru_rt = chunk_runtime<fixed_chunk_layout, auto_placement, lru_eviction>;
using host_step_rt = chunk_runtime<fixed_chunk_layout, static_placement>;

toy_result reference_run() {
  static const toy_result r =
      train_toy<chunk_runtime<fixed_chunk_layout, static_placement>>(toy_config{}, 1.0, static_placement::all_device());
  return r;
}

}  // namespace

TEST_CASE(
    "disk tier: the same bits at any device and host budget, policy and disk prefetch; data beyond device + host") {
  const toy_result reference = reference_run();
  REQUIRE(reference.losses.back() < reference.losses.front());
  chunkstar::test::scratch_dir dir;
  for (double device : {0.5, 0.2}) {
    for (double host : {0.4, 0.2}) {
      for (std::size_t disk_prefetch : {std::size_t{0}, std::size_t{8}}) {
        CAPTURE(device);
        CAPTURE(host);
        CAPTURE(disk_prefetch);
        toy_config c;
        c.disk_dir = dir.path();
        c.host_fraction = host;
        c.disk_prefetch = disk_prefetch;
        const auto bel = train_toy<belady_rt>(c, device);
        const auto lru = train_toy<lru_rt>(c, device);
        // The model data does not fit in the device and the host together: the disk holds the rest.
        CHECK(bel.model_bytes > bel.capacity + bel.host_capacity - 11 * 8 * 32 * sizeof(float));
        for (const auto* r : {&bel, &lru}) {
          CHECK(r->params == reference.params);  // bitwise
          CHECK(r->losses == reference.losses);
          CHECK(r->stats.bytes_to_disk > 0);
          CHECK(r->stats.bytes_from_disk > 0);
          CHECK(r->stats.disk_reads == r->stats.disk_demand_reads + r->stats.disk_prefetches);
          CHECK(r->stats.peak_host_chunk_bytes <= r->host_capacity);
          CHECK(r->peak_device <= r->capacity);
          CHECK(r->stats.disk_failures == 0);
          // The engine's own count: the runtime's moves, plus the tensors read in place at the end.
          CHECK(r->disk_engine[copy_direction::to_host].bytes >= r->stats.bytes_to_disk);
          CHECK(r->disk_engine[copy_direction::to_device].bytes >= r->stats.bytes_from_disk);
          CHECK(r->disk_engine[copy_direction::to_device].bytes <= r->stats.bytes_from_disk + r->model_bytes / 4);
        }
        if (disk_prefetch > 0) CHECK(bel.stats.disk_prefetches > 0);
        else CHECK(bel.stats.disk_prefetches == 0);
      }
    }
  }
}

TEST_CASE("disk tier: host-side steps stream their state from the disk; pieces and short transfers change nothing") {
  const toy_result reference = reference_run();
  chunkstar::test::scratch_dir dir;
  toy_config c;
  c.disk_dir = dir.path();
  c.host_fraction = 0.2;
  const auto r = train_toy<host_step_rt>(c, 0.3, static_placement::all_host());
  CHECK(r.params == reference.params);
  CHECK(r.stats.host_steps == 4u * 8u);
  CHECK(r.stats.bytes_from_disk > 0);
  CHECK(r.stats.disk_prefetches > 0);  // the next chunks' state comes up while one steps
  // Syscalls of at most 512 bytes (the engine continues short transfers): the same bits.
  toy_config shorty = c;
  shorty.disk_engine = {.max_io_bytes = 512};
  const auto s = train_toy<host_step_rt>(shorty, 0.3, static_placement::all_host());
  CHECK(s.params == reference.params);
}

TEST_CASE("disk tier: the timeline has a track each way and a disk counter") {
  chunkstar::test::scratch_dir dir;
  toy_config c;
  c.disk_dir = dir.path();
  c.host_fraction = 0.25;
  c.timeline = true;
  const auto r = train_toy<belady_rt>(c, 0.2);
  REQUIRE(r.error.empty());
  for (const char* needle : {"\"copy to disk\"", "\"copy from disk\"", "\"name\":\"disk\""}) {
    CAPTURE(needle);
    CHECK(r.trace.find(needle) != std::string::npos);
  }
  // Spans on both disk tracks (tid 5: to disk, 6: from disk).
  CHECK(r.trace.find("\"tid\":5,\"ts\"") != std::string::npos);
  CHECK(r.trace.find("\"tid\":6,\"ts\"") != std::string::npos);
}

TEST_CASE("disk tier: what is needed latest goes furthest down") {
  // After a step the next use of every parameter is the coming forward pass and of the Adam
  // moments the next step: with room on the host for the parameters but not the moments, Belady
  // leaves only moments on the disk.
  chunkstar::test::scratch_dir dir;
  toy_config c;
  c.disk_dir = dir.path();
  c.host_fraction = 0.3;  // 9.6 of the 32 chunks
  const auto r = train_toy<belady_rt>(c, 0.2);
  REQUIRE(r.error.empty());
  std::size_t on_disk = 0;
  for (const auto& [id, where] : r.tiers) {
    if (where != tier::disk) continue;
    ++on_disk;
    CAPTURE(to_string(id));
    CHECK((id.kind == chunk_kind::momentum || id.kind == chunk_kind::variance));
  }
  CHECK(on_disk >= 8);
}

TEST_CASE("disk prefetch: reads start ahead of use and replace demand reads") {
  chunkstar::test::scratch_dir dir;
  toy_config c;
  c.disk_dir = dir.path();
  c.host_fraction = 0.3;
  c.disk_prefetch = 0;
  const auto demand = train_toy<belady_rt>(c, 0.2);
  c.disk_prefetch = 8;
  const auto ahead = train_toy<belady_rt>(c, 0.2);
  CHECK(demand.stats.disk_prefetches == 0);
  CHECK(ahead.stats.disk_prefetches > 0);
  CHECK(ahead.stats.disk_demand_reads < demand.stats.disk_demand_reads);
  CHECK(ahead.params == demand.params);
}

TEST_CASE(
    "disk planner: reads in order of need, exchanges only for chunks used later, in-use victims, horizon, depth") {
  // Four param chunks and no other list; moment k needs param k. Chunks 2 and 3 on disk.
  disk_snapshot s;
  s.moment = 0;
  s.moments = 4;
  s.per_kind = 4;
  s.bytes[static_cast<std::size_t>(chunk_kind::param)] = 100;
  s.chunks.resize(num_chunk_kinds * 4);
  for (std::uint32_t c = 0; c < 4; ++c)
    s.chunks[s.dense({chunk_kind::param, c})].where = c < 2 ? tier::host : tier::disk;
  s.host_resident = 200;
  s.host_budget = 400;
  s.depth = 8;
  const auto needs = [](std::size_t k) {
    static std::vector<chunk_id> v;
    v.assign(1, chunk_id{chunk_kind::param, static_cast<std::uint32_t>(k)});
    return std::span<const chunk_id>(v);
  };
  const auto next_use = [&](chunk_id id) {
    return id.index == 0 ? std::size_t{4} : std::size_t{id.index};
  };  // from moment 0
  const belady_eviction belady;
  using op = disk_op;
  // Room for both: read 2, then 3.
  CHECK(plan_disk_prefetch(s, needs, next_use, belady) ==
        std::vector<op>{{op::kind::read, {chunk_kind::param, 2}}, {op::kind::read, {chunk_kind::param, 3}}});
  // Room for one: read 2 into the room; for 3, chunk 0 (next used at 4, after 3) goes down.
  s.host_budget = 300;
  CHECK(plan_disk_prefetch(s, needs, next_use, belady) == std::vector<op>{{op::kind::read, {chunk_kind::param, 2}},
                                                                          {op::kind::write, {chunk_kind::param, 0}},
                                                                          {op::kind::read, {chunk_kind::param, 3}}});
  // No room: 2 needs a victim used after moment 2: chunk 0 (4), not chunk 1 (1). Then 3 has none left but 2 itself? No:
  // 2 is needed at 2 < 3.
  s.host_budget = 200;
  CHECK(plan_disk_prefetch(s, needs, next_use, belady) ==
        std::vector<op>{{op::kind::write, {chunk_kind::param, 0}}, {op::kind::read, {chunk_kind::param, 2}}});
  // Whatever the strategy: LRU would pick chunk 1 (older), which is used sooner; it is not a candidate.
  s.chunks[s.dense({chunk_kind::param, 1})].last_use = 0;
  s.chunks[s.dense({chunk_kind::param, 0})].last_use = 5;
  CHECK(plan_disk_prefetch(s, needs, next_use, lru_eviction{}) ==
        std::vector<op>{{op::kind::write, {chunk_kind::param, 0}}, {op::kind::read, {chunk_kind::param, 2}}});
  // A pinned victim cannot go; depth limits the reads in flight.
  s.chunks[s.dense({chunk_kind::param, 0})].pinned = true;
  CHECK(plan_disk_prefetch(s, needs, next_use, belady).empty());
  s.chunks[s.dense({chunk_kind::param, 0})].pinned = false;
  s.host_budget = 400;
  s.depth = 1;
  CHECK(plan_disk_prefetch(s, needs, next_use, belady) == std::vector<op>{{op::kind::read, {chunk_kind::param, 2}}});
  s.in_flight = 1;
  CHECK(plan_disk_prefetch(s, needs, next_use, belady).empty());
  // A chunk still arriving from the disk is never a victim.
  s.in_flight = 0;
  s.depth = 8;
  s.host_budget = 200;
  s.arriving.assign(s.chunks.size(), 0);
  s.arriving[s.dense({chunk_kind::param, 0})] = 1;
  CHECK(plan_disk_prefetch(s, needs, next_use, belady).empty());
  s.arriving.clear();
  // A chunk in use now that the demand path would send down first (used latest): the plan waits
  // for it instead of sending down the next best; when it is not the best, the best goes.
  const auto later = [](chunk_id id) {
    return id.index == 1 ? std::size_t{6} : id.index == 0 ? std::size_t{4} : std::size_t{id.index};
  };
  s.chunks[s.dense({chunk_kind::param, 1})].pinned = true;
  CHECK(plan_disk_prefetch(s, needs, later, belady).empty());
  const auto sooner = [](chunk_id id) {
    return id.index == 1 ? std::size_t{3} : id.index == 0 ? std::size_t{4} : std::size_t{id.index};
  };
  CHECK(plan_disk_prefetch(s, needs, sooner, belady) ==
        std::vector<op>{{op::kind::write, {chunk_kind::param, 0}}, {op::kind::read, {chunk_kind::param, 2}}});
  // The horizon: nothing needed beyond it is read.
  s.chunks[s.dense({chunk_kind::param, 1})].pinned = false;
  s.host_budget = 400;
  s.horizon = 2;
  CHECK(plan_disk_prefetch(s, needs, next_use, belady) == std::vector<op>{{op::kind::read, {chunk_kind::param, 2}}});
  s.horizon = 1;
  CHECK(plan_disk_prefetch(s, needs, next_use, belady).empty());
}

TEST_CASE(
    "disk faults: a failed read or write leaves the chunk where it was; retried, the run is bit for bit the same") {
  const toy_result reference = reference_run();
  chunkstar::test::scratch_dir dir;
  for (int which = 0; which < 2; ++which) {
    for (long n : {0L, 7L, 40L}) {
      CAPTURE(which);
      CAPTURE(n);
      toy_config c;
      c.disk_dir = dir.path();
      c.host_fraction = 0.25;
      c.retries = 2;
      (which == 0 ? c.disk_faults.fail_read : c.disk_faults.fail_write) = n;
      const auto r = train_toy<belady_rt>(c, 0.2);
      CHECK(r.error.empty());
      CHECK(r.stats.disk_failures == 1);
      CHECK(r.violations.empty());
      CHECK(r.params == reference.params);
      CHECK(r.losses == reference.losses);
    }
  }
}

TEST_CASE("disk faults: a chunk corrupted on disk is detected when read back, never trained on") {
  const toy_result reference = reference_run();
  chunkstar::test::scratch_dir dir;
  toy_config c;
  c.disk_dir = dir.path();
  c.host_fraction = 0.25;
  c.retries = 2;  // a corrupted chunk stays corrupted: retrying cannot help
  c.disk_engine.verify_checksums = true;
  c.disk_faults.corrupt_write = 3;
  const auto r = train_toy<belady_rt>(c, 0.2);
  REQUIRE_FALSE(r.error.empty());
  CHECK(r.error.find("checksum mismatch") != std::string::npos);
  CHECK(r.error.find("stays on the disk") != std::string::npos);
  CHECK(r.error.find("toy") != std::string::npos);  // the memory report names the disk space
  // Every step completed before the corrupt chunk was needed matches the reference.
  REQUIRE(r.losses.size() <= reference.losses.size());
  for (std::size_t i = 0; i < r.losses.size(); ++i) CHECK(r.losses[i] == reference.losses[i]);
}

TEST_CASE("disk faults: a full disk is a typed error with the memory report; the file has no name while training") {
  chunkstar::test::scratch_dir dir;
  {
    simulated_device_space dev({.capacity = 16 << 10});
    host_space host({.capacity = 32 << 10});
    host_copy_engine copier;
    disk_space disk({.directory = dir.path(), .capacity = 16 << 10, .name = "small-disk"});
    disk_copy_engine io(disk);
    belady_rt rt(dev, host, copier, {}, fixed_chunk_layout({.chunk_elems = 2048, .align_elems = 32}));
    rt.attach_disk({disk, io});
    for (int l = 0; l < 8; ++l)
      (void)rt.register_param({"w" + std::to_string(l), {32, 32}, dtype::f32, tensor_role::weight});
    try {
      rt.finalize();  // 4 chunks x 3 lists x 8 KiB = 96 KiB > 16 + 32 + 16 KiB
      FAIL("a model larger than device + host + disk was accepted");
    } catch (const out_of_memory_error& e) {
      const std::string what = e.what();
      CHECK(what.find("disk") != std::string::npos);
      CHECK(what.find("small-disk") != std::string::npos);  // the report
    }
  }
  // The backing file has no name in the directory while training: nothing to remove, clobber or leave behind.
  const toy_result reference = reference_run();
  toy_config c;
  c.disk_dir = dir.path();
  c.host_fraction = 0.25;
  std::size_t entries_while_training = 1;
  c.on_disk = [&](disk_space&) { entries_while_training = dir.entries(); };
  const auto r = train_toy<belady_rt>(c, 0.2);
  CHECK(r.error.empty());
  CHECK(r.params == reference.params);
  CHECK(entries_while_training == 0);
  CHECK(dir.entries() == 0);
}

TEST_CASE(
    "disk tier: a host too small to pass chunks through says so, naming the disk's room, not 'host and device are both "
    "full'") {
  chunkstar::test::scratch_dir dir;
  simulated_device_space dev({.capacity = 16 << 10});
  host_space host({.capacity = 8 << 10});  // one chunk: a host-side step needs several at once
  host_copy_engine copier;
  disk_space disk({.directory = dir.path(), .capacity = 1 << 20, .name = "roomy-disk"});
  disk_copy_engine io(disk);
  belady_rt rt(dev, host, copier, {}, fixed_chunk_layout({.chunk_elems = 2048, .align_elems = 32}));
  rt.attach_disk({disk, io});
  std::vector<param_id> ids;
  for (int l = 0; l < 8; ++l)
    ids.push_back(rt.register_param({"w" + std::to_string(l), {32, 32}, dtype::f32, tensor_role::weight}));
  std::string what;
  try {
    rt.finalize();
    chunk_adam<> adam;
    for (int step = 0; step < 2; ++step) {
      for (auto id : ids) (void)rt.forward("f" + std::to_string(id.value), {id});
      for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
        auto sc = rt.backward("b" + std::to_string(it->value), {*it});
        for (float& g : sc.grad<float>(*it)) g = 0.5f;
      }
      adam.step(rt, 1e-2f);
    }
    FAIL("a one-chunk host with a disk tier trained");
  } catch (const out_of_memory_error& e) {
    what = e.what();
  }
  INFO(what);
  CHECK(what.find("both full") == std::string::npos);
  CHECK(what.find("none of which can go to the disk now") != std::string::npos);
  CHECK(what.find("raise the host space's capacity") != std::string::npos);
  CHECK(what.find("roomy-disk") != std::string::npos);  // the memory report
}

TEST_CASE("disk tier: attach before finalize, once") {
  chunkstar::test::scratch_dir dir;
  simulated_device_space dev({.capacity = 1 << 20});
  host_space host;
  host_copy_engine copier;
  disk_space disk({.directory = dir.path(), .capacity = 1 << 20});
  disk_copy_engine io(disk);
  belady_rt rt(dev, host, copier, {}, fixed_chunk_layout({.chunk_elems = 2048, .align_elems = 32}));
  rt.attach_disk({disk, io});
  CHECK(rt.has_disk());
  CHECK_THROWS_AS(rt.attach_disk({disk, io}), state_error);
  (void)rt.register_param({"w", {32, 32}, dtype::f32, tensor_role::weight});
  rt.finalize();
  belady_rt late(dev, host, copier, {}, fixed_chunk_layout({.chunk_elems = 2048, .align_elems = 32}));
  (void)late.register_param({"w", {32, 32}, dtype::f32, tensor_role::weight});
  late.finalize();
  CHECK_THROWS_AS(late.attach_disk({disk, io}), state_error);
}

TEST_CASE("disk tier: checkpoints read and write through the tiers, the format unchanged") {
  chunkstar::test::scratch_dir dir;
  namespace fs = std::filesystem;
  const fs::path ckpt = fs::path(dir.path()) / "ckpt";
  const fixed_chunk_layout layout({.chunk_elems = 2048, .align_elems = 32});
  auto build = [&](belady_rt& rt) {
    for (int l = 0; l < 8; ++l)
      (void)rt.register_param({"w" + std::to_string(l), {32, 32}, dtype::f32, tensor_role::weight},
                              [l](std::span<float> v) {
                                for (std::size_t i = 0; i < v.size(); ++i)
                                  v[i] = static_cast<float>(l) + 0.001f * static_cast<float>(i);
                              });
    rt.finalize();
  };
  std::vector<float> expect(32 * 32), got(32 * 32);
  {  // on disk: 4 chunks x 3 lists x 8 KiB = 96 KiB over a 16 KiB device and a 32 KiB host
    simulated_device_space dev({.capacity = 16 << 10});
    host_space host({.capacity = 32 << 10});
    host_copy_engine copier;
    disk_space disk({.directory = dir.path(), .capacity = 1 << 20});
    disk_copy_engine io(disk);
    belady_rt rt(dev, host, copier, {}, layout);
    rt.attach_disk({disk, io});
    build(rt);
    CHECK(rt.disk_chunk_bytes() > 0);
    // Moments on disk get values a checkpoint must carry.
    for (int l = 0; l < 8; ++l) {
      for (std::size_t i = 0; i < expect.size(); ++i)
        expect[i] = 100.0f * static_cast<float>(l) + static_cast<float>(i);
      rt.write_tensor(param_id{static_cast<std::uint32_t>(l)}, chunk_kind::momentum, expect);
    }
    save_checkpoint(rt, ckpt);
  }
  {  // read back into a runtime without a disk
    simulated_device_space dev({.capacity = 1 << 20});
    host_space host;
    host_copy_engine copier;
    belady_rt rt(dev, host, copier, {}, layout);
    build(rt);
    (void)load_checkpoint(rt, ckpt);
    for (int l = 0; l < 8; ++l) {
      rt.read_tensor(param_id{static_cast<std::uint32_t>(l)}, chunk_kind::momentum, got);
      for (std::size_t i = 0; i < expect.size(); ++i)
        expect[i] = 100.0f * static_cast<float>(l) + static_cast<float>(i);
      CHECK(got == expect);
    }
  }
  {  // and into one whose chunks are on the disk
    simulated_device_space dev({.capacity = 16 << 10});
    host_space host({.capacity = 32 << 10});
    host_copy_engine copier;
    disk_space disk({.directory = dir.path(), .capacity = 1 << 20});
    disk_copy_engine io(disk);
    belady_rt rt(dev, host, copier, {}, layout);
    rt.attach_disk({disk, io});
    build(rt);
    (void)load_checkpoint(rt, ckpt);
    for (int l = 0; l < 8; ++l) {
      rt.read_tensor(param_id{static_cast<std::uint32_t>(l)}, chunk_kind::momentum, got);
      for (std::size_t i = 0; i < expect.size(); ++i)
        expect[i] = 100.0f * static_cast<float>(l) + static_cast<float>(i);
      CHECK(got == expect);
      rt.read_tensor(param_id{static_cast<std::uint32_t>(l)}, chunk_kind::param, got);
      CHECK(got[5] == static_cast<float>(l) + 0.001f * 5.0f);
    }
  }
}

}  // namespace disk_runtime_test
