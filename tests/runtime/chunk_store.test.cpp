// SPDX-License-Identifier: Apache-2.0
// chunk_store on its own, over the scripted copy engine: every copy completes only when the test
// releases it, so "the logical tier changes at once, the buffer retires when the copy lands", the
// buffer takeover of an in-flight eviction, the strong guarantee under faults and the stream
// contract are checked as exact sequences of engine operations and as bytes, not by timing.
#include <chunkstar/store/chunk_store.hpp>
#include <chunkstar/store/chunk_values.hpp>

#include <doctest/doctest.h>

#include "support/scripted_copy_engine.hpp"

#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <optional>
#include <vector>

using namespace chunkstar;
using namespace chunkstar::testing;

namespace chunk_store_test {

namespace {

constexpr std::size_t elems = 256;  // per chunk
constexpr std::size_t align = 64;
constexpr std::size_t unlimited = std::numeric_limits<std::size_t>::max();

constexpr chunk_id param(std::uint32_t i) { return {chunk_kind::param, i}; }
constexpr chunk_id grad(std::uint32_t i) { return {chunk_kind::grad, i}; }

std::vector<chunk_list_desc> lists(dtype t, std::size_t chunks) {
  return {{chunk_kind::param, t, elems * dtype_size(t), chunks},
          {chunk_kind::grad, t, elems * dtype_size(t), chunks},
          {chunk_kind::master, dtype::f32, elems * 4, chunks}};
}

/** A device space that can be told to fail its next allocations, by returning null (fragmented)
 *  or by throwing (an allocator that throws), to prove the store's strong guarantee. */
class flaky_device_space {
 public:
  static constexpr memory_kind kind = memory_kind::device;
  explicit flaky_device_space(std::size_t capacity) : inner_({.capacity = capacity, .name = "flaky device"}) {}
  enum class failure { none, null, throws };
  void fail_next(failure f, std::size_t count = 1) {
    mode_ = f;
    left_ = count;
  }
  void* allocate(std::size_t n, std::size_t a) {
    if (void* p = try_allocate(n, a)) return p;
    throw std::bad_alloc();
  }
  void* try_allocate(std::size_t n, std::size_t a) {
    if (left_ > 0) {
      --left_;
      if (mode_ == failure::throws) throw std::bad_alloc();
      if (mode_ == failure::null) return nullptr;
    }
    return inner_.try_allocate(n, a);
  }
  void deallocate(void* p, std::size_t n, std::size_t a) noexcept { inner_.deallocate(p, n, a); }
  [[nodiscard]] std::size_t capacity() const { return inner_.capacity(); }
  [[nodiscard]] std::size_t used() const { return inner_.used(); }
  [[nodiscard]] space_usage usage() const { return inner_.usage(); }
  [[nodiscard]] std::string_view name() const { return "flaky device"; }

 private:
  simulated_device_space inner_;
  failure mode_ = failure::none;
  std::size_t left_ = 0;
};
static_assert(MemorySpace<flaky_device_space>);

}  // namespace

}  // namespace chunk_store_test

template <>
inline constexpr bool chunkstar::can_access_v<chunkstar::host_exec, chunk_store_test::flaky_device_space> = true;

namespace chunk_store_test {

namespace {

using flaky_platform = platform<flaky_device_space, host_space, scripted_copy_engine, scripted_stream>;
static_assert(Platform<flaky_platform>);

/** A store over the scripted engine; every chunk starts FREE. */
template <class P = scripted_platform>
struct fixture {
  using device_type = typename P::device_space;
  device_type device;
  host_space host;
  scripted_copy_engine engine;
  runtime_stats stats;
  chunk_store<P> store;
  explicit fixture(std::size_t device_capacity, std::size_t host_capacity = unlimited, dtype t = dtype::f32,
                   std::size_t chunks = 4)
      : device(make_device(device_capacity)),
        host(host_space_options{.capacity = host_capacity}),
        store(device, host, engine, align, stats) {
    store.build(lists(t, chunks), 1);
  }
  ~fixture() {
    engine.on_stall = nullptr;  // the store's destructor synchronises; no test is watching then
  }
  static auto make_device(std::size_t c) {
    if constexpr (std::is_same_v<device_type, simulated_device_space>) return simulated_device_options{.capacity = c};
    else return c;
  }
  std::size_t bytes() const { return store.bytes_of(chunk_kind::param); }

  /** Values 1000*k + i (fp32-exact) written into chunk @p id. */
  void fill(chunk_id id, float k) {
    std::vector<float> v(elems);
    for (std::size_t i = 0; i < elems; ++i) v[i] = 1000.0f * k + static_cast<float>(i);
    chunk_values(store).write(id, 0, v);
  }
  std::vector<float> values(chunk_id id) {
    std::vector<float> v(elems);
    chunk_values(store).read(id, 0, v);
    return v;
  }
  static std::vector<float> expected(float k) {
    std::vector<float> v(elems);
    for (std::size_t i = 0; i < elems; ++i) v[i] = 1000.0f * k + static_cast<float>(i);
    return v;
  }
  /** Chunk @p id on the device with values(k), every copy landed and retired. */
  void on_device(chunk_id id, float k) {
    store.allocate_initial(id);
    fill(id, k);
    if (store.at(id).where != tier::device) store.move(id, tier::device, move_reason::load);
    engine.release_all();
    store.retire_completed();
  }
  /** Fails the test case whenever the store waits for an unfinished copy. */
  void strict() {
    engine.on_stall = [](std::uint64_t id) { FAIL_CHECK("the store waited for unfinished copy #" << id); };
  }
  void check_clean(std::size_t non_model = 0) {
    for (const auto& v : store.violations(false, non_model, true)) FAIL_CHECK(v);
  }
};

/** The residency counters and space levels, to compare before and after a failed operation. */
struct levels {
  std::size_t dev_resident, host_resident, dev_retiring, host_retiring, dev_used, host_used;
  std::uint64_t loads, evictions, to_device, to_host, materialised;
  friend bool operator==(const levels&, const levels&) = default;
};
template <class F>
levels levels_of(F& f) {
  return {f.store.resident(tier::device),
          f.store.resident(tier::host),
          f.store.retiring(tier::device),
          f.store.retiring(tier::host),
          f.device.used(),
          f.host.used(),
          f.stats.loads,
          f.stats.evictions,
          f.stats.bytes_to_device,
          f.stats.bytes_to_host,
          f.stats.materialised};
}

}  // namespace

TEST_CASE("chunk_store: allocate_initial fills the host, then spills to the device; no room is a typed error") {
  fixture f(/*device=*/2 * elems * 4, /*host=*/2 * elems * 4, dtype::f32, 5);
  f.strict();
  for (std::uint32_t c = 0; c < 4; ++c) f.store.allocate_initial(param(c));
  CHECK(f.store.at(param(0)).where == tier::host);
  CHECK(f.store.at(param(1)).where == tier::host);
  CHECK(f.store.at(param(2)).where == tier::device);
  CHECK(f.store.at(param(3)).where == tier::device);
  CHECK(f.store.resident(tier::host) == 2 * f.bytes());
  CHECK(f.store.resident(tier::device) == 2 * f.bytes());
  CHECK(f.device.used() == 2 * f.bytes());
  CHECK(f.values(param(3)) == std::vector<float>(elems, 0.0f));  // zeroed
  CHECK(f.engine.ops().empty());  // a host-accessible device is zeroed by memset, not the engine
  const auto before = levels_of(f);
  CHECK_THROWS_AS(f.store.allocate_initial(param(4)), out_of_memory_error);
  CHECK(f.store.at(param(4)).where == tier::free);
  CHECK(levels_of(f) == before);
  f.check_clean();
}

TEST_CASE("chunk_store: move changes the logical tier at once; the source buffer retires when the copy lands") {
  fixture f(1 << 20);
  f.strict();
  f.store.allocate_initial(param(0));
  f.fill(param(0), 1);
  void* const src = f.store.at(param(0)).data;
  const std::size_t host_used = f.host.used();

  f.store.move(param(0), tier::device, move_reason::load);
  const auto& s = f.store.at(param(0));
  CHECK(s.where == tier::device);
  CHECK(s.data != src);
  CHECK(f.store.resident(tier::device) == f.bytes());
  CHECK(f.store.resident(tier::host) == 0);
  CHECK(f.store.retiring(tier::host) == f.bytes());
  CHECK(f.host.used() == host_used);  // the copy still reads it
  CHECK(f.stats.loads == 1);
  CHECK(f.stats.bytes_to_device == f.bytes());
  REQUIRE(f.engine.ops().size() == 1);
  const auto op = f.engine.ops()[0];
  CHECK(op.kind == scripted_op_kind::copy_async);
  CHECK(op.lane == copy_direction::to_device);
  CHECK(op.src == src);
  CHECK(op.dst == s.data);
  CHECK(op.bytes == f.bytes());

  f.store.retire_completed();  // never waits: nothing landed yet
  CHECK(f.store.retiring(tier::host) == f.bytes());
  CHECK(s.pending.has_value());
  CHECK(f.engine.release_next(copy_direction::to_device));
  f.store.retire_completed();
  CHECK(f.store.retiring(tier::host) == 0);
  CHECK(f.host.used() == host_used - f.bytes());
  CHECK(!s.pending.has_value());
  CHECK(f.values(param(0)) == f.expected(1));
  CHECK(f.engine.stalls().empty());
  f.check_clean();
}

TEST_CASE("chunk_store: a pinned chunk never moves (state_error, nothing changes); pin_set unpins on every exit") {
  fixture f(1 << 20);
  f.store.allocate_initial(param(0));
  const auto before = levels_of(f);
  {
    chunk_store<scripted_platform>::pin_set pins(f.store, {param(0)});
    CHECK(f.store.at(param(0)).pinned == 1);
    CHECK_THROWS_AS(f.store.move(param(0), tier::device, move_reason::load), state_error);
    CHECK(f.store.at(param(0)).where == tier::host);
    CHECK(levels_of(f) == before);
    CHECK(f.engine.ops().empty());
    auto moved = std::move(pins);  // the pins travel; nothing is unpinned twice
    CHECK(f.store.at(param(0)).pinned == 1);
    chunk_store<scripted_platform>::pin_set other(f.store, {param(0)});
    CHECK(f.store.at(param(0)).pinned == 2);
    other = std::move(moved);  // drops other's pin, takes moved's
    CHECK(f.store.at(param(0)).pinned == 1);
  }
  CHECK(f.store.at(param(0)).pinned == 0);
  try {
    chunk_store<scripted_platform>::pin_set pins(f.store, {param(0), grad(0)});
    throw std::runtime_error("a scope's body throws");
  } catch (const std::runtime_error&) {
  }
  CHECK(f.store.at(param(0)).pinned == 0);
  CHECK(f.store.at(grad(0)).pinned == 0);
  CHECK_THROWS_AS(f.store.move(grad(0), tier::device, move_reason::load), state_error);  // no payload
  f.check_clean();
}

TEST_CASE("chunk_store: a load into a full device takes over the buffer of an in-flight eviction, ordered after it") {
  fixture f(2 * elems * 4);
  f.strict();
  f.on_device(param(0), 1);
  f.on_device(param(1), 2);
  f.store.allocate_initial(param(2));
  f.fill(param(2), 3);
  REQUIRE(f.store.at(param(2)).where == tier::host);
  f.engine.clear_ops();
  void* const p0_device = f.store.at(param(0)).data;

  f.store.move(param(0), tier::host, move_reason::evict);
  const auto evict = f.engine.ops().at(0);
  CHECK(evict.lane == copy_direction::to_host);
  CHECK(f.device.used() == 2 * f.bytes());  // the eviction still reads p0's device buffer
  void* const p2_host = f.store.at(param(2)).data;
  f.store.move(param(2), tier::device, move_reason::load);

  CHECK(f.stats.buffer_reuses == 1);
  CHECK(f.store.at(param(2)).data == p0_device);
  CHECK(f.device.used() == 2 * f.bytes());
  const auto ops = f.engine.ops();
  REQUIRE(ops.size() == 3);
  CHECK(ops[1].kind == scripted_op_kind::order_after);
  CHECK(ops[1].lane == copy_direction::to_device);
  CHECK(ops[1].handle == evict.handle);
  CHECK(ops[2].kind == scripted_op_kind::copy_async);
  CHECK(ops[2].lane == copy_direction::to_device);
  CHECK(ops[2].dst == p0_device);
  CHECK(ops[2].src == p2_host);

  // The load cannot overwrite the buffer before the eviction has read it.
  CHECK(f.engine.blocked(copy_direction::to_device));
  CHECK(!f.engine.release_next(copy_direction::to_device));
  CHECK(f.engine.release_next(copy_direction::to_host));
  CHECK(f.engine.release_next(copy_direction::to_device));
  f.store.retire_completed();
  CHECK(f.values(param(0)) == f.expected(1));  // on the host, intact
  CHECK(f.values(param(2)) == f.expected(3));  // in p0's old device buffer
  CHECK(f.values(param(1)) == f.expected(2));
  CHECK(f.device.used() == 2 * f.bytes());
  CHECK(f.store.retiring(tier::device) == 0);
  CHECK(f.engine.stalls().empty());
  f.check_clean();
}

TEST_CASE("chunk_store: strong guarantee when the engine throws (copy_async, order_after) or the space fails") {
  SUBCASE("copy_async throws on a load into free room") {
    fixture f(1 << 20);
    f.store.allocate_initial(param(0));
    f.fill(param(0), 4);
    void* const data = f.store.at(param(0)).data;
    const auto before = levels_of(f);
    f.engine.throw_on(scripted_op_kind::copy_async);
    CHECK_THROWS_AS(f.store.move(param(0), tier::device, move_reason::load), scripted_fault);
    CHECK(f.store.at(param(0)).where == tier::host);
    CHECK(f.store.at(param(0)).data == data);
    CHECK(!f.store.at(param(0)).pending.has_value());
    CHECK(levels_of(f) == before);
    CHECK(f.values(param(0)) == f.expected(4));
    f.check_clean();
    f.store.move(param(0), tier::device, move_reason::load);  // the retry works
    f.engine.release_all();
    CHECK(f.values(param(0)) == f.expected(4));
  }
  SUBCASE("copy_async throws on a load that took over an eviction's buffer") {
    fixture f(2 * elems * 4);
    f.on_device(param(0), 1);
    f.on_device(param(1), 2);
    f.store.allocate_initial(param(2));
    f.fill(param(2), 3);
    f.store.move(param(0), tier::host, move_reason::evict);
    const auto before = levels_of(f);
    f.engine.throw_on(scripted_op_kind::copy_async);
    CHECK_THROWS_AS(f.store.move(param(2), tier::device, move_reason::load), scripted_fault);
    CHECK(f.store.at(param(2)).where == tier::host);
    CHECK(levels_of(f) == before);  // the taken-over buffer went back to retire with its eviction
    f.check_clean();
    f.engine.release_all();
    f.store.retire_completed();
    CHECK(f.device.used() == f.bytes());  // ... and was freed when the eviction landed
    CHECK(f.values(param(0)) == f.expected(1));
    CHECK(f.values(param(2)) == f.expected(3));
    f.check_clean();
  }
  SUBCASE("order_after throws (the user's work or the previous copy is to be waited for)") {
    fixture f(1 << 20);
    f.on_device(param(0), 5);
    const auto user = f.engine.record(scripted_stream{1});
    f.store.order_after_user(param(0), user);
    const auto before = levels_of(f);
    f.engine.throw_on(scripted_op_kind::order_after);
    CHECK_THROWS_AS(f.store.move(param(0), tier::host, move_reason::evict), scripted_fault);
    CHECK(f.store.at(param(0)).where == tier::device);
    CHECK(levels_of(f) == before);
    f.check_clean();
    f.engine.clear_ops();
    f.store.move(param(0), tier::host, move_reason::evict);  // the retry still waits for the user
    REQUIRE(!f.engine.ops().empty());
    CHECK(f.engine.ops()[0].kind == scripted_op_kind::order_after);
    CHECK(f.engine.ops()[0].handle == user.id());
    f.engine.complete(user);
    f.engine.release_all();
    CHECK(f.values(param(0)) == f.expected(5));
  }
  SUBCASE("the observer's clock throws while a move records its copy: it reads as 0, the move goes on") {
    // store.clock is the observer's clock (chunk_runtime sets it); a user's observer may throw.
    fixture f(1 << 20);
    f.store.allocate_initial(param(0));
    f.fill(param(0), 7);
    f.store.clock = []() -> double { throw std::runtime_error("observer clock"); };
    f.store.move(param(0), tier::device, move_reason::load);
    f.store.clock = nullptr;
    CHECK(f.store.at(param(0)).where == tier::device);
    f.engine.release_all();
    f.store.retire_completed();
    f.check_clean();
    CHECK(f.values(param(0)) == f.expected(7));
  }
  SUBCASE("zero_async throws while materialising on the device") {
    fixture f(1 << 20);
    const auto before = levels_of(f);
    f.engine.throw_on(scripted_op_kind::zero_async);
    CHECK_THROWS_AS(f.store.materialise(grad(0), tier::device), scripted_fault);
    CHECK(f.store.at(grad(0)).where == tier::free);
    CHECK(f.store.at(grad(0)).data == nullptr);
    CHECK(levels_of(f) == before);
    f.check_clean();
  }
  SUBCASE("the device is full: out_of_memory_error, nothing changes") {
    fixture f(elems * 4);
    f.on_device(param(0), 1);
    f.store.allocate_initial(param(1));
    const auto before = levels_of(f);
    CHECK_THROWS_AS(f.store.move(param(1), tier::device, move_reason::load), out_of_memory_error);
    CHECK(f.store.at(param(1)).where == tier::host);
    CHECK(levels_of(f) == before);
    f.check_clean();
  }
  SUBCASE("the host is full on an eviction: out_of_memory_error naming the host, nothing changes") {
    fixture f(1 << 20, /*host=*/elems * 4);
    f.on_device(param(0), 1);            // its host buffer freed after the load
    f.store.allocate_initial(param(1));  // fills the host
    const auto before = levels_of(f);
    try {
      f.store.move(param(0), tier::host, move_reason::evict);
      FAIL("expected out_of_memory_error");
    } catch (const out_of_memory_error& e) {
      CHECK(std::string(e.what()).find("host") != std::string::npos);
    }
    CHECK(f.store.at(param(0)).where == tier::device);
    CHECK(levels_of(f) == before);
    f.check_clean();
  }
  for (auto mode : {flaky_device_space::failure::null, flaky_device_space::failure::throws}) {
    CAPTURE(static_cast<int>(mode));
    fixture<flaky_platform> f(1 << 20);
    f.store.allocate_initial(param(0));
    f.fill(param(0), 6);
    const auto before = levels_of(f);
    f.device.fail_next(mode, 8);
    CHECK_THROWS(f.store.move(param(0), tier::device, move_reason::load));
    CHECK(f.store.at(param(0)).where == tier::host);
    CHECK(levels_of(f) == before);
    f.check_clean();
    f.device.fail_next(mode, 8);
    CHECK_THROWS(f.store.materialise(grad(0), tier::device));
    CHECK(f.store.at(grad(0)).where == tier::free);
    CHECK(levels_of(f) == before);
    f.check_clean();
    f.device.fail_next(flaky_device_space::failure::none, 0);
    f.store.move(param(0), tier::device, move_reason::load);
    f.engine.release_all();
    CHECK(f.values(param(0)) == f.expected(6));
  }
}

TEST_CASE("chunk_store: release waits for a copy still in flight before freeing its buffers") {
  SUBCASE("a load in flight") {
    fixture f(1 << 20);
    f.store.allocate_initial(param(0));
    f.fill(param(0), 1);
    f.store.move(param(0), tier::device, move_reason::load);
    const auto load = f.engine.ops().back().handle;
    f.store.release(param(0));  // the scripted copy runs now, before the buffer goes (ASan would see it otherwise)
    CHECK(f.engine.stalls() == std::vector<std::uint64_t>{load});
    CHECK(f.store.at(param(0)).where == tier::free);
    CHECK(f.store.at(param(0)).data == nullptr);
    CHECK(f.store.resident(tier::device) == 0);
    CHECK(f.device.used() == 0);
    f.store.retire_completed();
    CHECK(f.host.used() == 0);
    CHECK(f.values(param(0)) == std::vector<float>(elems, 0.0f));  // FREE reads as zeros
    f.check_clean();
  }
  SUBCASE("an eviction in flight") {
    fixture f(1 << 20);
    f.on_device(grad(1), 2);
    f.store.move(grad(1), tier::host, move_reason::evict);
    f.store.release(grad(1));
    CHECK(f.engine.stalls().size() == 1);
    f.store.retire_completed();
    CHECK(f.host.used() == 0);
    CHECK(f.device.used() == 0);
    f.check_clean();
  }
  SUBCASE("a failed copy is dropped with the payload") {
    fixture f(1 << 20);
    f.store.allocate_initial(param(0));
    f.store.move(param(0), tier::device, move_reason::load);
    CHECK(f.engine.fail_next(copy_direction::to_device));
    CHECK_NOTHROW(f.store.release(param(0)));
    f.store.retire_completed();
    CHECK(f.device.used() == 0);
    CHECK(f.host.used() == 0);
    f.check_clean();
  }
}

TEST_CASE("chunk_store: wait rethrows a failed copy, the chunk keeps its logical tier") {
  fixture f(1 << 20);
  f.store.allocate_initial(param(0));
  f.store.move(param(0), tier::device, move_reason::load);
  CHECK(f.engine.fail_next(copy_direction::to_device, "bus error"));
  CHECK_THROWS_AS(f.store.wait(param(0)), chunkstar::error);
  CHECK(f.store.at(param(0)).where == tier::device);
  // The payload is not valid: the failure stays with the chunk (reported again by the sweep that
  // forgets finished copies) until the chunk is released.
  CHECK_THROWS_AS(f.store.retire_completed(), chunkstar::error);
  CHECK(f.store.retiring(tier::host) == 0);  // the source buffer was freed all the same
  f.store.release(param(0));
  CHECK_NOTHROW(f.store.retire_completed());
  f.check_clean();
}

TEST_CASE_TEMPLATE("chunk_store: read_values / write_values on both tiers, narrowed with round-to-nearest-even", T,
                   float, float16, bfloat16) {
  constexpr dtype t = dtype_of_v<T>;
  fixture f(1 << 20, unlimited, t);
  const std::vector<float> in = {1.0f,     -2.25f, 0.1f,    1.0f + 0x1p-8f, 1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f,
                                 65504.0f, 1e-3f,  3.0e38f, -0.0f};
  std::vector<float> expected;
  for (float x : in) expected.push_back(to_float(from_float<T>(x)));
  if constexpr (t == dtype::bf16) {
    CHECK(expected[3] == 1.0f);  // 1 + 2^-8 is a tie: to even
  } else if constexpr (t == dtype::f16) {
    CHECK(expected[4] == 1.0f);            // a tie: to even
    CHECK(expected[5] == 1.0f + 0x1p-9f);  // a tie: to even (up)
    CHECK(std::isinf(expected[8]));        // overflow
  }
  const auto read = [&](chunk_id id, std::size_t offset) {
    std::vector<float> out(in.size());
    chunk_values(f.store).read(id, offset, out);
    return out;
  };
  f.store.allocate_initial(param(0));
  chunk_values(f.store).write(param(0), 3, in);
  CHECK(read(param(0), 3) == expected);
  std::vector<float> head(3);
  chunk_values(f.store).read(param(0), 0, head);
  CHECK(head == std::vector<float>(3, 0.0f));  // neighbours untouched

  f.store.move(param(0), tier::device, move_reason::load);
  CHECK(read(param(0), 3) == expected);  // waits for the load (a stall the engine counts)
  CHECK(f.engine.stalls().size() == 1);
  chunk_values(f.store).write(param(0), 100, in);
  CHECK(read(param(0), 100) == expected);
  f.store.move(param(0), tier::host, move_reason::evict);
  f.engine.release_all();
  CHECK(read(param(0), 3) == expected);
  CHECK(read(param(0), 100) == expected);

  // The fp32 master list beside a 16-bit param list is exact.
  f.store.allocate_initial({chunk_kind::master, 0});
  chunk_values(f.store).write({chunk_kind::master, 0}, 0, in);
  CHECK(read({chunk_kind::master, 0}, 0) == in);

  // A FREE chunk reads as zeros; writing one gives it a payload on the host first.
  CHECK(read(grad(2), 0) == std::vector<float>(in.size(), 0.0f));
  chunk_values(f.store).write(grad(2), 0, in);
  CHECK(f.store.at(grad(2)).where == tier::host);
  CHECK(f.stats.materialised == 1);
  CHECK(read(grad(2), 0) == expected);
  f.check_clean();
}

TEST_CASE("chunk_store: the stream contract — the next move is ordered after the user's work, and only the next") {
  fixture f(1 << 20);
  f.strict();
  f.on_device(param(0), 1);
  const scripted_stream stream{7};
  const auto user = f.engine.record(stream);
  f.store.order_after_user(param(0), user);
  f.engine.clear_ops();

  f.store.move(param(0), tier::host, move_reason::evict);
  auto ops = f.engine.ops();
  REQUIRE(ops.size() == 2);
  CHECK(ops[0].kind == scripted_op_kind::order_after);
  CHECK(ops[0].handle == user.id());
  CHECK(ops[0].lane == copy_direction::to_host);
  CHECK(ops[1].kind == scripted_op_kind::copy_async);
  CHECK(ops[1].lane == copy_direction::to_host);
  // The copy does not start before the user's work is complete.
  CHECK(f.engine.blocked(copy_direction::to_host));
  CHECK(!f.engine.release_next(copy_direction::to_host));
  // The user's "kernel" finishes writing only now: the eviction must carry its bytes.
  std::vector<float> late(elems, 42.0f);
  std::memcpy(const_cast<void*>(ops[1].src), late.data(), late.size() * sizeof(float));
  f.engine.complete(user);
  CHECK(f.engine.release_next(copy_direction::to_host));
  f.store.retire_completed();
  CHECK(f.values(param(0)) == late);

  // The user's work is accounted for: moving again is ordered after nothing but its own last copy.
  f.engine.clear_ops();
  f.store.move(param(0), tier::device, move_reason::load);
  ops = f.engine.ops();
  REQUIRE(ops.size() == 1);
  CHECK(ops[0].kind == scripted_op_kind::copy_async);

  // With a copy still in flight, the next move is ordered after the user and after that copy.
  const auto load = ops[0].handle;
  const auto user2 = f.engine.record(stream);
  f.store.order_after_user(param(0), user2);
  f.engine.clear_ops();
  f.store.move(param(0), tier::host, move_reason::evict);
  ops = f.engine.ops();
  REQUIRE(ops.size() == 3);
  CHECK(ops[0].kind == scripted_op_kind::order_after);
  CHECK(ops[0].handle == user2.id());
  CHECK(ops[1].kind == scripted_op_kind::order_after);
  CHECK(ops[1].handle == load);
  CHECK(ops[2].kind == scripted_op_kind::copy_async);
  f.engine.complete(user2);
  f.engine.release_all();
  f.store.retire_completed();
  CHECK(f.values(param(0)) == late);
  f.check_clean();
}

TEST_CASE("chunk_store: reading a chunk the user's work still writes waits for that work (stream contract)") {
  // The user's work on a scope's memory is handed back with order_after_user (scope::close(stream)).
  // Reading the payload afterwards, without a move in between, must see what that work wrote: the
  // read has to wait for (or be ordered after) the user's handle, as a move is.
  fixture f(1 << 20);
  f.on_device(param(0), 1);
  const auto user = f.engine.record(scripted_stream{1});
  f.store.order_after_user(param(0), user);
  std::vector<float> out(elems);
  chunk_values(f.store).read(param(0), 0, out);
  CHECK_MESSAGE(user.ready(), "read_values read a payload while the user's work on it was still running");
  f.engine.complete(user);
}

}  // namespace chunk_store_test
