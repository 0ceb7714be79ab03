// SPDX-License-Identifier: Apache-2.0
// The store's extension point for a tier below the host, with a tier that is not the disk: a
// "shelf" of host memory whose copies finish at once. The store hands it every move to or from
// tier::disk and every wait on such a copy; a copy that failed puts the chunk back on the payload
// it was copied from, bytes intact, and leaks nothing.
#include <chunkstar/core/error.hpp>
#include <chunkstar/memory/host_copy_engine.hpp>
#include <chunkstar/memory/host_space.hpp>
#include <chunkstar/memory/platform.hpp>
#include <chunkstar/memory/simulated_device_space.hpp>
#include <chunkstar/store/chunk_store.hpp>
#include <chunkstar/store/chunk_values.hpp>
#include <chunkstar/store/lower_tier.hpp>

#include <doctest/doctest.h>

#include <cstring>
#include <exception>
#include <future>
#include <memory>
#include <string>
#include <utility>
#include <vector>

using namespace chunkstar;

namespace lower_tier_test {
namespace {

using store_type = chunk_store<simulated_platform>;
constexpr chunk_id param{chunk_kind::param, 0};
constexpr std::size_t elems = 256;

/** A lower tier in host memory; `fail_next` makes its next copy fail (as a disk read can). */
struct shelf final : lower_tier {
  explicit shelf(store_type& s) : store(s) {}
  store_type& store;
  mutable host_space room;
  bool fail_next = false;
  int moves = 0;

  [[nodiscard]] memory_space_ref space() const noexcept override { return room; }
  void move(chunk_id id, tier to) override {
    auto& s = store.at(id);
    const std::size_t bytes = store.bytes_of(id.kind);
    void* dst = store.allocate(to, bytes);
    if (dst == nullptr) throw out_of_memory_error("shelf: no room", bytes, store.report());
    std::memcpy(dst, s.data, bytes);
    disk_copy_handle h;
    if (std::exchange(fail_next, false)) {
      std::promise<void> p;
      p.set_exception(std::make_exception_ptr(io_error("shelf copy failed")));
      h = disk_copy_handle(p.get_future().share());
    }
    s.disk_pending = lower_move{h, s.data, s.where, 0.0};
    store.relocate(id, dst, to, true);
    ++moves;
  }
  void resolve(chunk_id id) override {
    auto& s = store.at(id);
    if (!s.disk_pending) return;
    const lower_move m = *s.disk_pending;
    const tier to = s.where;
    void* landed = s.data;
    s.disk_pending.reset();
    try {
      m.done.wait();
    } catch (...) {  // back to the payload the copy read
      store.relocate(id, m.source, m.from, false);
      store.deallocate(to, landed, store.bytes_of(id.kind));
      throw;
    }
    store.deallocate(m.from, m.source, store.bytes_of(id.kind));
  }
  bool resolve_one(tier t) override {
    bool found = false;
    store.for_each([&](chunk_id id, auto& s) {
      if (!found && s.disk_pending && s.disk_pending->from == t) {
        found = true;
        resolve(id);
      }
    });
    return found;
  }
  [[nodiscard]] std::size_t retiring(tier t) const noexcept override {
    std::size_t b = 0;
    std::as_const(store).for_each([&](chunk_id id, const auto& s) {
      if (s.disk_pending && s.disk_pending->from == t) b += store.footprint(t, store.bytes_of(id.kind));
    });
    return b;
  }
  void discard(chunk_id id) noexcept override {
    auto& s = store.at(id);
    store.deallocate(s.disk_pending->from, s.disk_pending->source, store.bytes_of(id.kind));
    s.disk_pending.reset();
  }
  void drain() noexcept override {
    store.for_each([&](chunk_id id, auto& s) {
      if (s.disk_pending) discard(id);
    });
  }
  void zero(void* p, std::size_t n) override { std::memset(p, 0, n); }
  void copy(void* dst, const void* src, std::size_t n, copy_direction) override { std::memcpy(dst, src, n); }
  [[nodiscard]] std::string why_host_full() const override { return ": the shelf's chunks pass through the host"; }
};

struct fixture {
  simulated_device_space device{{.capacity = 1 << 20}};
  host_space host;
  host_copy_engine copier;
  runtime_stats stats;
  store_type store{device, host, copier, 64, stats};
  shelf* lower = nullptr;
  fixture() {
    const chunk_list_desc lists[] = {{chunk_kind::param, dtype::f32, elems * 4, 2}};
    store.build(lists, 1);
    auto t = std::make_unique<shelf>(store);
    lower = t.get();
    store.attach_lower(std::move(t));
    store.allocate_initial(param);
  }
  std::vector<float> values() {
    std::vector<float> v(elems);
    chunk_values(store).read(param, 0, v);
    return v;
  }
  void check_books() const {
    for (const auto& v : store.violations(false, 0, true)) FAIL_CHECK(v);
  }
};

std::vector<float> ramp() {
  std::vector<float> v(elems);
  for (std::size_t i = 0; i < elems; ++i) v[i] = static_cast<float>(i) + 0.5f;
  return v;
}

TEST_CASE("lower_tier: moves to and from tier::disk are the lower tier's; the store counts them") {
  fixture f;
  chunk_values(f.store).write(param, 0, ramp());
  f.store.move(param, tier::disk, move_reason::offload);
  CHECK(f.lower->moves == 1);
  CHECK(f.store.at(param).where == tier::disk);
  CHECK(f.store.resident(tier::disk) == f.store.footprint(tier::disk, elems * 4));
  CHECK(f.store.retiring(tier::host) == f.store.footprint(tier::host, elems * 4));  // until resolved
  f.store.retire_completed();
  CHECK(f.store.retiring(tier::host) == 0);
  CHECK(f.values() == ramp());  // read where it lives, through the tier's copy
  f.store.move(param, tier::host, move_reason::load);
  CHECK(f.lower->moves == 2);
  CHECK(f.store.at(param).where == tier::host);
  CHECK(f.values() == ramp());
  f.store.move(param, tier::device, move_reason::load);  // between device and host: the store's own copy
  f.store.wait(param);
  CHECK(f.lower->moves == 2);
  CHECK(f.values() == ramp());
  f.check_books();
}

TEST_CASE("lower_tier: a failed copy puts the chunk back where it was, bytes intact, nothing leaked") {
  fixture f;
  chunk_values(f.store).write(param, 0, ramp());
  const std::size_t host_used = f.host.used();
  f.lower->fail_next = true;
  f.store.move(param, tier::disk, move_reason::offload);
  CHECK(f.store.at(param).where == tier::disk);  // logically moved at once
  CHECK_THROWS_AS(f.store.wait(param), io_error);
  CHECK(f.store.at(param).where == tier::host);
  CHECK(f.store.resident(tier::disk) == 0);
  CHECK(f.lower->room.used() == 0);
  CHECK(f.host.used() == host_used);
  CHECK(f.values() == ramp());
  f.check_books();
}

}  // namespace
}  // namespace lower_tier_test
