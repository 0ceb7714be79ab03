// SPDX-License-Identifier: Apache-2.0
// group_buffers on a chunk store of its own: a group's members become device payloads inside one
// buffer, counted as resident, its free positions as unslotted, the whole as collective memory;
// detach, ungroup and adopt give every byte back to the right count, and a group that does not
// fit changes nothing.
#include <chunkstar/memory/host_copy_engine.hpp>
#include <chunkstar/memory/host_space.hpp>
#include <chunkstar/memory/platform.hpp>
#include <chunkstar/memory/simulated_device_space.hpp>
#include <chunkstar/store/chunk_store.hpp>
#include <chunkstar/zero/group_buffers.hpp>

#include <doctest/doctest.h>

#include <cstddef>
#include <vector>

using namespace chunkstar;

namespace group_buffers_test {
namespace {

constexpr std::size_t chunk_bytes = 1024;
constexpr chunk_id grad(std::uint32_t i) { return {chunk_kind::grad, i}; }

struct fixture {
  simulated_device_space device;
  host_space host;
  host_copy_engine copier;
  runtime_stats stats;
  chunk_store<simulated_platform> store;
  explicit fixture(std::size_t capacity = 1 << 20)
      : device({.capacity = capacity}), store(device, host, copier, 64, stats) {
    const chunk_list_desc lists[] = {{chunk_kind::grad, dtype::f32, chunk_bytes, 4}};
    store.build(lists, 2);
    for (std::uint32_t c = 0; c < 4; ++c) store.at(grad(c)).where = tier::remote;  // as ZeRO leaves them
  }
  void check_books(bool pins_allowed) const {
    for (const auto& v : store.violations(pins_allowed, 0, true)) FAIL_CHECK(v);
  }
};

TEST_CASE("group_buffers: a group's members live in one buffer; detach gives every byte back") {
  fixture f;
  {
    group_buffers buffers(f.store);
    const std::vector<chunk_id> members{grad(1), grad(3)};
    const std::vector<std::size_t> at{1, 2};
    auto* base = static_cast<std::byte*>(buffers.attach(members, at, 3, /*zero=*/true));
    CHECK(f.store.at(grad(1)).data == base + chunk_bytes);
    CHECK(f.store.at(grad(3)).data == base + 2 * chunk_bytes);
    for (auto id : members) {
      CHECK(f.store.at(id).where == tier::device);
      CHECK(f.store.at(id).group == base);
      CHECK(f.store.at(id).pinned == 1);
    }
    CHECK(f.store.resident(tier::device) == 2 * chunk_bytes);
    CHECK(f.store.unslotted() == chunk_bytes);  // the free position
    CHECK(f.store.device_in_use() == 3 * chunk_bytes);
    CHECK(f.stats.peak_collective_bytes == 3 * chunk_bytes);
    CHECK(f.stats.peak_model_bytes == 3 * chunk_bytes);
    f.check_books(/*pins_allowed=*/false);  // a group's own pin is no scope's

    buffers.detach(base, tier::remote);
    for (auto id : members) {
      CHECK(f.store.at(id).where == tier::remote);
      CHECK(f.store.at(id).data == nullptr);
      CHECK(f.store.at(id).pinned == 0);
    }
    CHECK(f.store.resident(tier::device) == 0);
    CHECK(f.store.unslotted() == 0);
    CHECK(f.device.used() == 0);
    CHECK(f.stats.peak_collective_bytes == 3 * chunk_bytes);

    buffers.attach(members, at, 3, /*zero=*/false);  // left attached: the destructor detaches it
  }
  CHECK(f.device.used() == 0);
  CHECK(f.store.at(grad(1)).where == tier::free);
  f.check_books(false);
}

TEST_CASE("group_buffers: ungroup and adopt make a buffer a chunk's own payload, no longer collective") {
  fixture f;
  group_buffers buffers(f.store);
  const std::vector<chunk_id> one{grad(0)};
  const std::vector<std::size_t> at0{0};
  void* base = buffers.attach(one, at0, 1, /*zero=*/true);
  buffers.ungroup(base);
  CHECK(f.store.at(grad(0)).where == tier::device);
  CHECK(f.store.at(grad(0)).data == base);
  CHECK(f.store.at(grad(0)).group == nullptr);
  CHECK(f.store.at(grad(0)).pinned == 0);
  CHECK(f.store.unslotted() == 0);

  void* scratch = buffers.allocate_scratch(chunk_bytes);
  CHECK(f.store.unslotted() == chunk_bytes);
  f.store.restart_peaks();
  CHECK(f.stats.peak_collective_bytes == chunk_bytes);  // the scratch; grad(0) is its own now
  buffers.adopt(grad(2), scratch);
  CHECK(f.store.at(grad(2)).where == tier::device);
  CHECK(f.store.unslotted() == 0);
  CHECK(f.store.resident(tier::device) == 2 * chunk_bytes);
  f.check_books(false);

  f.store.release(grad(0));
  f.store.release(grad(2));
  CHECK(f.device.used() == 0);
  f.store.restart_peaks();
  CHECK(f.stats.peak_collective_bytes == 0);
}

TEST_CASE("group_buffers: a group that does not fit is a typed error and changes nothing") {
  fixture f(2 * chunk_bytes);
  group_buffers buffers(f.store);
  const std::vector<chunk_id> members{grad(0), grad(1)};
  const std::vector<std::size_t> at{0, 1};
  CHECK_THROWS_AS(buffers.attach(members, at, 3, /*zero=*/true), out_of_memory_error);
  for (auto id : members) {
    CHECK(f.store.at(id).where == tier::remote);
    CHECK(f.store.at(id).pinned == 0);
  }
  CHECK(f.store.unslotted() == 0);
  CHECK(f.device.used() == 0);
  CHECK_THROWS_AS((void)buffers.allocate_scratch(4 * chunk_bytes), out_of_memory_error);
  CHECK(f.store.unslotted() == 0);
  f.check_books(false);
}

}  // namespace
}  // namespace group_buffers_test
