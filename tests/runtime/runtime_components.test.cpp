// SPDX-License-Identifier: Apache-2.0
// The runtime's components, each on its own: tensor_state_table, param_registry (with broken user
// layouts), the model-byte estimates, the non-model allocator and its RAII buffer, the
// optimizer-state lists a step sees, the Platform concept both ways, the observer, and the stats
// against the spaces' own accounting; plus the façade over the scripted platform, so the stream
// contract is checked through scopes as the user sees it.
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/placement/static_placement.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>

#include <doctest/doctest.h>

#include "support/runtimes.hpp"
#include "support/scripted_copy_engine.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <csignal>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

using namespace chunkstar;
using namespace chunkstar::testing;

namespace runtime_components_test {

namespace {

tensor_spec spec(std::string name, std::int64_t n, dtype t = dtype::f32) {
  return {std::move(name), {n}, t, tensor_role::weight};
}
fixed_chunk_layout layout(std::size_t chunk_elems = 256) {
  return fixed_chunk_layout({.chunk_elems = chunk_elems, .align_elems = 32});
}
std::string what_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(nothing thrown)";
}
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }
std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : " | ") + x;
  return s;
}

}  // namespace

// ---- tensor_state_table --------------------------------------------------------------------------

TEST_CASE("tensor_state_table: every change through transition(); nested opens counted; end_iteration all or nothing") {
  const std::vector<tensor_spec> specs = {spec("wte", 4), spec("w1", 4), spec("b1", 4)};
  tensor_state_table t;
  t.reset(specs);
  REQUIRE(t.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) CHECK(t[i] == tensor_state::hold);
  CHECK(!t.any_in_compute());

  t.open(0);
  CHECK(t[0] == tensor_state::compute);
  t.open(0);  // a nested use (a tied embedding): counted
  t.close(0, moment_kind::forward);
  CHECK(t[0] == tensor_state::compute);  // still used by the outer scope
  t.close(0, moment_kind::forward);
  CHECK(t[0] == tensor_state::hold_after_fwd);
  t.open(1);
  t.close(1, moment_kind::backward);
  CHECK(t[1] == tensor_state::hold_after_bwd);
  t.open(1);  // HOLD_AFTER_BWD -> COMPUTE (gradient accumulation: another backward)
  CHECK(t[1] == tensor_state::compute);
  CHECK(t.any_in_compute());
  CHECK(contains(what_of([&] { t.require_none_in_compute("step"); }), "'w1'"));
  CHECK_THROWS_AS(t.close(2, moment_kind::forward), state_error);  // never opened

  // end_iteration with w1 in COMPUTE: throws naming it, and changes nothing (wte stays HOLD_AFTER_FWD).
  CHECK(contains(what_of([&] { t.end_iteration(); }), "'w1'"));
  CHECK(t[0] == tensor_state::hold_after_fwd);
  CHECK(t[1] == tensor_state::compute);
  CHECK(t[2] == tensor_state::hold);
  t.close(1, moment_kind::backward);
  t.end_iteration();
  for (std::size_t i = 0; i < 3; ++i) CHECK(t[i] == tensor_state::hold);
  CHECK_THROWS_AS((void)t[3], std::out_of_range);
}

TEST_CASE("tensor_state_table: the transition table, exhaustively") {
  using S = tensor_state;
  using E = tensor_event;
  const S states[] = {S::free, S::compute, S::hold, S::hold_after_fwd, S::hold_after_bwd};
  const E events[] = {E::open_scope, E::close_forward, E::close_backward, E::end_iteration, E::release};
  for (auto s : states)
    for (auto e : events) {
      CAPTURE(tensor_state_name(s));
      CAPTURE(static_cast<int>(e));
      const bool legal = e == E::open_scope                                ? s != S::compute
                         : e == E::close_forward || e == E::close_backward ? s == S::compute
                                                                           : s != S::compute;
      if (!legal) {
        CHECK(contains(what_of([&] { (void)transition(s, e, "t.x"); }), "'t.x'"));
        continue;
      }
      const S got = transition(s, e, "t.x");
      const S want = e == E::open_scope       ? S::compute
                     : e == E::close_forward  ? S::hold_after_fwd
                     : e == E::close_backward ? S::hold_after_bwd
                     : e == E::release        ? S::free
                     : s == S::free           ? S::free
                                              : S::hold;
      CHECK(got == want);
    }
}

TEST_CASE("tensor_state_table: a chunk's state is derived from its tensors (COMPUTE wins, else the lowest HOLD*)") {
  const std::vector<tensor_spec> specs = {spec("a", 1), spec("b", 1), spec("c", 1)};
  tensor_state_table t;
  t.reset(specs);
  const std::vector<std::size_t> all = {0, 1, 2}, none;
  CHECK(t.chunk_state(all, true) == tensor_state::hold);
  CHECK(t.chunk_state(all, false) == tensor_state::free);  // no payload
  CHECK(t.chunk_state(none, true) == tensor_state::free);  // no tensors
  t.open(0);
  t.close(0, moment_kind::backward);
  t.open(1);
  t.close(1, moment_kind::forward);
  const std::vector<std::size_t> ab = {0, 1}, a = {0};
  CHECK(t.chunk_state(ab, true) == tensor_state::hold_after_fwd);  // lowest of HOLD_AFTER_BWD, HOLD_AFTER_FWD
  CHECK(t.chunk_state(a, true) == tensor_state::hold_after_bwd);
  CHECK(t.chunk_state(all, true) == tensor_state::hold);
  t.open(2);
  CHECK(t.chunk_state(all, true) == tensor_state::compute);
  t.close(2, moment_kind::forward);
}

// ---- param_registry ------------------------------------------------------------------------------

namespace {

/** A user's layout whose plan breaks one law of chunk_plan (see plan_validation.hpp). */
struct broken_layout {
  enum class fault { past_end, overlap, bad_chunk, bad_list_entry, missing_slot, unlisted, misaligned } f;
  [[nodiscard]] chunk_plan plan(std::span<const tensor_spec> specs) const {
    chunk_plan p;
    p.chunk_elems = 64;
    p.align_elems = 16;
    p.num_chunks = 1;
    for (const auto& s : specs) p.slots.push_back({0, 0, s.numel()});
    p.slots.at(1).offset = 32;
    p.chunk_tensors = {{0, 1}};
    switch (f) {
      case fault::past_end: p.slots[1].offset = 48; break;  // [48, 80) past 64
      case fault::overlap: p.slots[1].offset = 16; break;   // [16, 48) overlaps [0, 32)
      case fault::bad_chunk: p.slots[1].chunk = 7; break;   // no chunk 7
      case fault::bad_list_entry: p.chunk_tensors[0].push_back(99); break;
      case fault::missing_slot: p.slots.pop_back(); break;
      case fault::unlisted: p.chunk_tensors[0] = {0}; break;
      case fault::misaligned: p.slots[1].offset = 33; break;
    }
    return p;
  }
  [[nodiscard]] static constexpr std::string_view name() noexcept { return "broken"; }
};
static_assert(ChunkLayout<broken_layout>);

}  // namespace

TEST_CASE("param_registry: duplicate names and another dtype are config_errors naming the parameter") {
  param_registry r;
  const auto a = r.add(spec("h.0.w", 8), {}, dtype::f32);
  CHECK(a.value == 0);
  CHECK(contains(what_of([&] { (void)r.add(spec("h.0.w", 4), {}, dtype::f32); }), "'h.0.w' registered twice"));
  CHECK_THROWS_AS((void)r.add(spec("h.0.w", 4), {}, dtype::f32), config_error);
  const std::string msg = what_of([&] { (void)r.add(spec("h.1.w", 4, dtype::bf16), {}, dtype::f32); });
  CHECK(contains(msg, "'h.1.w'"));
  CHECK(contains(msg, "bf16"));
  CHECK_THROWS_AS((void)r.add(spec("h.1.w", 4, dtype::bf16), {}, dtype::f32), config_error);
  CHECK(r.size() == 1);  // failed registrations left nothing behind
  CHECK_THROWS_AS((void)r.spec(param_id{5}), config_error);
  const auto b = r.add(
      spec("h.1.w", 4), [](std::span<float> v) { v[0] = 1; }, dtype::f32);
  CHECK(b.value == 1);
  CHECK(static_cast<bool>(r.initializer(1)));
  CHECK(!static_cast<bool>(r.initializer(0)));
}

TEST_CASE("param_registry::plan validates a broken user layout: config_error naming the tensor and the chunk") {
  using F = broken_layout::fault;
  param_registry r;
  (void)r.add(spec("embed", 32), {}, dtype::f32);
  (void)r.add(spec("block.w", 32), {}, dtype::f32);
  CHECK_NOTHROW((void)r.plan(fixed_chunk_layout({.chunk_elems = 64, .align_elems = 16})));
  const struct {
    F f;
    std::vector<std::string> parts;
  } cases[] = {
      {F::past_end, {"'block.w'", "chunk 0", "past the chunk's end"}},
      {F::overlap, {"'block.w'", "chunk 0", "overlap", "'embed'"}},
      {F::bad_chunk, {"'block.w'", "chunk 7"}},
      {F::bad_list_entry, {"chunk_tensors[0]", "#99"}},
      {F::missing_slot, {"'block.w'", "has none"}},
      {F::unlisted, {"'block.w'", "chunk 0", "missing"}},
      {F::misaligned, {"'block.w'", "chunk 0", "offset 33"}},
  };
  for (const auto& c : cases) {
    CAPTURE(static_cast<int>(c.f));
    const broken_layout bad{c.f};
    CHECK_THROWS_AS((void)r.plan(bad), config_error);
    const std::string msg = what_of([&] { (void)r.plan(bad); });
    CAPTURE(msg);
    CHECK(contains(msg, "'broken'"));
    for (const auto& p : c.parts) CHECK(contains(msg, p));

    // Through a runtime: finalize() reports it and the runtime is destroyed cleanly.
    simulated_device_space dev({.capacity = 1 << 20});
    host_space host;
    host_copy_engine copier;
    chunk_runtime<broken_layout> rt(dev, host, copier, {}, bad);
    (void)rt.register_param(spec("embed", 32));
    (void)rt.register_param(spec("block.w", 32));
    CHECK_THROWS_AS(rt.finalize(), config_error);
    CHECK(dev.used() == 0);
  }
}

TEST_CASE("estimate_model_bytes equals a finalized runtime's model_bytes for every list description") {
  const std::vector<tensor_spec> base = {spec("a", 300), spec("b", 1000), spec("c", 17), spec("d", 512)};
  const struct {
    dtype t;
    optimizer_state_lists lists;
    std::size_t num_lists;
  } cases[] = {{dtype::f32, optimizer_state_lists::adam(), 4},
               {dtype::bf16, optimizer_state_lists::adam(), 5},
               {dtype::f16, optimizer_state_lists::sgd_momentum(), 4},
               {dtype::f32, optimizer_state_lists::sgd_momentum(), 3},
               {dtype::bf16, optimizer_state_lists::none(), 2}};
  for (const auto& c : cases) {
    CAPTURE(dtype_name(c.t));
    CAPTURE(static_cast<int>(c.lists.moments));
    std::vector<tensor_spec> specs = base;
    for (auto& s : specs) s.type = c.t;
    const auto lay = layout(1024);
    const std::size_t estimate = estimate_model_bytes(specs, lay, {.param_type = c.t, .optimizer_state = c.lists});
    simulated_device_space dev({.capacity = 1 << 20});
    host_space host;
    host_copy_engine copier;
    chunk_runtime<fixed_chunk_layout> rt(dev, host, copier, {.param_type = c.t, .optimizer_state = c.lists}, lay);
    for (const auto& s : specs) (void)rt.register_param(s);
    rt.finalize();
    CHECK(estimate == rt.model_bytes());
    CHECK(rt.host_chunk_bytes() + rt.device_chunk_bytes() + rt.plan().num_chunks * 1024 * dtype_size(c.t) ==
          rt.model_bytes());
    std::size_t lists = 0;
    for (auto k : {chunk_kind::param, chunk_kind::grad, chunk_kind::master, chunk_kind::momentum, chunk_kind::variance})
      lists += rt.has_list(k);
    CHECK(lists == c.num_lists);
  }
}

TEST_CASE("default_layout_options: chunk bounds from the largest tensor (a 150k-parameter model gets small chunks)") {
  const std::vector<tensor_spec> specs = {{"wte", {200, 250}, dtype::f32, tensor_role::embedding},
                                          {"w1", {250, 200}, dtype::f32, tensor_role::weight},
                                          {"w2", {200, 250}, dtype::f32, tensor_role::weight},
                                          {"b", {250}, dtype::f32, tensor_role::bias}};
  const auto o = default_layout_options(specs);
  CHECK(o.min_chunk_elems == 50016);  // 50000 rounded up to 32
  CHECK(o.max_chunk_elems == 4 * 50016);
  CHECK(o.step_elems == 32);
  CHECK(o.align_elems == 32);
  const auto plan = searched_chunk_layout(o).plan(specs);
  CHECK(plan.chunk_elems >= 50000);
  CHECK(plan.chunk_elems <= 4 * 50016);
  CHECK(plan.chunk_elems < (std::size_t{1} << 20));
  CHECK(plan.num_chunks >= 1);
  CHECK(!plan_violation(specs, plan));
  const auto o8 = default_layout_options(specs, 64, 2);
  CHECK(o8.min_chunk_elems == 50048);
  CHECK(o8.max_chunk_elems == 2 * 50048);
  CHECK(default_layout_options({}).min_chunk_elems == 32);  // no tensors: one alignment unit
}

// ---- non-model memory ----------------------------------------------------------------------------

TEST_CASE("non_model_allocator: asks make_room until the block fits; names the scope when nothing can be freed") {
  simulated_device_space dev({.capacity = 1000});
  compute_level level;
  non_model_allocator<simulated_device_space> alloc(dev, level);
  std::vector<void*> evictable = {dev.allocate(300, 64), dev.allocate(300, 64), dev.allocate(300, 64)};
  int calls = 0;
  auto make_room = [&] {
    ++calls;
    if (evictable.empty()) return false;
    dev.deallocate(evictable.back(), 300, 64);
    evictable.pop_back();
    return true;
  };
  auto report = [&] { return memory_report{{dev.usage()}}; };
  void* a = alloc.allocate(250, 64, make_room, report, "blocks.0");
  CHECK(calls == 1);
  CHECK(level.non_model == 250);
  void* b = alloc.allocate(500, 64, make_room, report, "blocks.0");  // 850 used -> two evictions
  CHECK(calls == 3);
  CHECK(level.non_model == 750);
  try {
    (void)alloc.allocate(400, 64, make_room, report, "blocks.3");
    FAIL("expected out_of_memory_error");
  } catch (const out_of_memory_error& e) {
    CHECK(contains(e.what(), "'blocks.3'"));
    CHECK(e.requested_bytes() == 400);
    CHECK(e.report().spaces.size() == 1);
  }
  CHECK(level.non_model == 750);  // a failed allocation counts nothing
  CHECK(contains(what_of([&] { (void)alloc.allocate(400, 64, make_room, report, ""); }), "outside any scope"));
  alloc.deallocate(b, 500, 64);
  alloc.deallocate(a, 250, 64);
  CHECK(level.non_model == 0);
  CHECK(dev.used() == 0);
}

namespace {
/** A runtime stand-in that counts what non_model_buffer asks of it. */
struct counting_runtime {
  simulated_device_space& space;
  int allocations = 0, frees = 0;
  std::size_t live = 0;
  void* allocate_non_model(std::size_t bytes, std::size_t a) {
    void* p = space.allocate(bytes, a);
    ++allocations;
    live += bytes;
    return p;
  }
  void deallocate_non_model(void* p, std::size_t bytes, std::size_t a) noexcept {
    ++frees;
    live -= bytes;
    space.deallocate(p, bytes, a);
  }
};
}  // namespace

TEST_CASE("non_model_buffer: RAII frees exactly once, across moves, resets and failed allocations") {
  simulated_device_space dev({.capacity = 4096});
  counting_runtime rt{dev};
  using buf = non_model_buffer<float, counting_runtime>;
  {
    buf a(rt, 100);
    CHECK(a);
    CHECK(a.size() == 100);
    CHECK(a.span().size() == 100);
    CHECK(rt.live == 400);
    buf b(std::move(a));
    CHECK(!a);  // NOLINT(bugprone-use-after-move): the moved-from buffer is empty by contract
    CHECK(a.data() == nullptr);
    CHECK(b.size() == 100);
    buf c(rt, 10);
    c = std::move(b);  // c's old block is freed, b's taken
    CHECK(rt.frees == 1);
    CHECK(c.size() == 100);
    CHECK(rt.live == 400);
    auto& self = c;
    c = std::move(self);  // self-move: nothing happens
    CHECK(c.size() == 100);
    c.reset();
    c.reset();
    CHECK(rt.frees == 2);
    CHECK(rt.live == 0);
    buf d;  // default: empty, frees nothing
    CHECK(!d);
    CHECK_THROWS_AS(buf(rt, 2000), out_of_memory_error);  // 8000 bytes: nothing to free
    buf e(rt, 8);
  }
  CHECK(rt.allocations == 3);
  CHECK(rt.frees == 3);
  CHECK(dev.used() == 0);
}

TEST_CASE(
    "non-model memory through the runtime: allocate_buffer is counted, evicts idle chunks, names the scope when it "
    "cannot") {
  // Four 1 KiB chunks (param + grad lists of two chunks); the device holds 3 KiB.
  simulated_device_space dev({.capacity = 3 * 1024});
  host_space host;
  host_copy_engine copier;
  chunk_runtime<fixed_chunk_layout> rt(dev, host, copier, {.optimizer_state = optimizer_state_lists::none()}, layout());
  const auto a = rt.register_param(spec("a", 256));
  const auto b = rt.register_param(spec("b", 256));
  rt.finalize();
  {
    auto s = rt.forward("fa", {a});
    auto buf = rt.allocate_buffer<float>(256);
    CHECK(rt.non_model_bytes() == 1024);
    { auto t = rt.forward("fb", {b}); }
    CHECK(rt.device_chunk_bytes() == 2048);
    // 1 KiB more: param b (idle) is evicted to make room.
    auto more = rt.allocate_buffer<float>(256);
    CHECK(rt.where({chunk_kind::param, 1}) == tier::host);
    CHECK(rt.non_model_bytes() == 2048);
    // Nothing idle is left: the error names the open scope.
    const std::string msg = what_of([&] { (void)rt.allocate_buffer<float>(512); });
    CAPTURE(msg);
    CHECK(contains(msg, "'fa'"));  // the scope open now, not the latest one opened
    CHECK(contains(msg, "non-model"));
  }
  CHECK(rt.non_model_bytes() == 0);
  rt.end_iteration();
  CHECK(rt.invariant_violations(true).empty());
}

// ---- optimizer-state lists a step sees -----------------------------------------------------------

TEST_CASE("step_chunk: pointers are null exactly for the lists the optimizer_state description leaves out") {
  const struct {
    dtype t;
    optimizer_state_lists lists;
    bool master, momentum, variance;
  } cases[] = {{dtype::f32, optimizer_state_lists::sgd_momentum(), false, true, false},
               {dtype::bf16, optimizer_state_lists::sgd_momentum(), true, true, false},
               {dtype::f32, optimizer_state_lists::none(), false, false, false},
               {dtype::bf16, optimizer_state_lists::none(), false, false, false},
               {dtype::bf16, optimizer_state_lists::adam(), true, true, true},
               {dtype::f16, optimizer_state_lists{false, 2}, false, true, true}};
  for (const auto& c : cases) {
    CAPTURE(dtype_name(c.t));
    CAPTURE(c.lists.master);
    CAPTURE(static_cast<int>(c.lists.moments));
    simulated_device_space dev({.capacity = 1 << 20});
    host_space host;
    host_copy_engine copier;
    chunk_runtime<fixed_chunk_layout, static_placement> rt(
        dev, host, copier, {.param_type = c.t, .optimizer_state = c.lists}, layout(), static_placement::fraction(0.5));
    std::vector<param_id> ids;
    for (int i = 0; i < 4; ++i) ids.push_back(rt.register_param(spec("w" + std::to_string(i), 200, c.t)));
    rt.finalize();
    for (auto id : ids) auto s = rt.backward("b", {id});
    std::vector<tier> where;
    rt.step([&](const step_chunk& sc) {
      where.push_back(sc.where);
      CHECK(sc.param != nullptr);
      CHECK(sc.grad != nullptr);
      CHECK((sc.master != nullptr) == c.master);
      CHECK((sc.momentum != nullptr) == c.momentum);
      CHECK((sc.variance != nullptr) == c.variance);
      CHECK(sc.param_type == c.t);
      CHECK(sc.elems == 256);
      CHECK(sc.tensors.size() == 1);
    });
    CHECK(where.size() == 4);
    CHECK(rt.has_list(chunk_kind::master) == c.master);
    CHECK(rt.has_list(chunk_kind::momentum) == c.momentum);
    CHECK(rt.has_list(chunk_kind::variance) == c.variance);
    CHECK(rt.invariant_violations(true).empty());
  }
}

// ---- the Platform concept, both ways ---------------------------------------------------------------

namespace {
/** A CopyEngine with no record(stream): not a platform's engine. */
class engine_without_record {
 public:
  void copy(void* d, const void* s, std::size_t n, copy_direction dir) { inner_.copy(d, s, n, dir); }
  host_copy_handle copy_async(void* d, const void* s, std::size_t n, copy_direction dir) {
    return inner_.copy_async(d, s, n, dir);
  }
  host_copy_handle zero_async(void* d, std::size_t n) { return inner_.zero_async(d, n); }
  void order_after(const host_copy_handle& h, copy_direction d) { inner_.order_after(h, d); }
  void synchronize() { inner_.synchronize(); }
  [[nodiscard]] copy_stats stats() const { return inner_.stats(); }

 private:
  host_copy_engine inner_;
};
static_assert(CopyEngine<engine_without_record>);

struct move_only_stream {
  move_only_stream() = default;
  move_only_stream(move_only_stream&&) = default;
  move_only_stream& operator=(move_only_stream&&) = default;
};
/** An engine that records any stream, so only the stream type decides. */
class recording_engine : public engine_without_record {
 public:
  [[nodiscard]] host_copy_handle record(const move_only_stream&) const noexcept { return {}; }
  [[nodiscard]] host_copy_handle record(const host_stream&) const noexcept { return {}; }
  [[nodiscard]] host_copy_handle record(const scripted_stream&) const noexcept { return {}; }
};
static_assert(CopyEngine<recording_engine>);
/** An engine whose record returns another handle type than its copies. */
class mismatched_engine : public engine_without_record {
 public:
  [[nodiscard]] scripted_copy_handle record(const host_stream&) const noexcept { return {}; }
};
struct not_a_space {};
struct hand_platform {  // the four names, but a device that is not a MemorySpace
  using device_space = not_a_space;
  using host_space = chunkstar::host_space;
  using copy_engine = host_copy_engine;
  using stream_type = host_stream;
};
struct no_stream_platform {
  using device_space = simulated_device_space;
  using host_space = chunkstar::host_space;
  using copy_engine = host_copy_engine;
};
}  // namespace

static_assert(Platform<simulated_platform>);
static_assert(Platform<scripted_platform>);
static_assert(Platform<platform<simulated_device_space, host_space, recording_engine>>);
static_assert(Platform<platform<simulated_device_space, host_space, recording_engine, scripted_stream>>);
static_assert(!Platform<platform<simulated_device_space, host_space, engine_without_record>>, "no record(stream)");
static_assert(!Platform<platform<simulated_device_space, host_space, recording_engine, move_only_stream>>,
              "stream not copyable");
static_assert(!Platform<platform<simulated_device_space, host_space, host_copy_engine, scripted_stream>>,
              "no record for this stream");
static_assert(!Platform<platform<simulated_device_space, host_space, mismatched_engine>>,
              "record's handle is not the copy handle");
static_assert(!Platform<hand_platform>, "device is not a MemorySpace");
static_assert(!Platform<no_stream_platform>, "no stream_type");

TEST_CASE("Platform concept: positive and negative cases (static_asserts above)") { CHECK(true); }

// ---- the observer --------------------------------------------------------------------------------

namespace {

/** A user's observer: a logical clock, and every event as a line. */
struct recording_observer {
  double t = 0;
  std::vector<std::string> events;  // scope open/close and step, in order
  std::map<tier, int> copies;
  std::vector<memory_levels> levels;
  int bad_spans = 0;
  double now_us() { return t += 1; }
  void on_scope_open(moment_kind k, std::string_view n, double b, double e) {
    bad_spans += b > e;
    events.push_back("open " + std::string(moment_kind_name(k)) + " " + std::string(n));
  }
  void on_scope_close(moment_kind k, std::string_view n, double b, double e) {
    bad_spans += b > e;
    events.push_back("close " + std::string(moment_kind_name(k)) + " " + std::string(n));
  }
  void on_copy(tier from, double b, double e) {
    bad_spans += b > e;
    ++copies[from];
  }
  void on_step(double b, double e) {
    bad_spans += b > e;
    events.push_back("step");
  }
  void on_memory(const memory_levels& l) { levels.push_back(l); }
};
static_assert(RuntimeObserver<recording_observer>);

/** An observer that throws from every event (its clock works). */
struct throwing_observer {
  double now_us() const { return 0; }
  void on_scope_open(moment_kind, std::string_view, double, double) { throw std::runtime_error("observer"); }
  void on_scope_close(moment_kind, std::string_view, double, double) { throw std::runtime_error("observer"); }
  void on_copy(tier, double, double) { throw std::runtime_error("observer"); }
  void on_step(double, double) { throw std::runtime_error("observer"); }
  void on_memory(const memory_levels&) { throw std::runtime_error("observer"); }
};
static_assert(RuntimeObserver<throwing_observer>);

/** An observer whose clock throws once armed. */
struct throwing_clock_observer : null_observer {
  bool armed = true;
  double now_us() const {
    if (armed) throw std::runtime_error("clock");
    return 0;
  }
};
static_assert(RuntimeObserver<throwing_clock_observer>);

struct no_memory_observer {  // lacks on_memory
  double now_us();
  void on_scope_open(moment_kind, std::string_view, double, double);
  void on_scope_close(moment_kind, std::string_view, double, double);
  void on_copy(tier, double, double);
  void on_step(double, double);
};
static_assert(!RuntimeObserver<no_memory_observer>);

using small_rt = chunk_runtime<fixed_chunk_layout>;

/** Three layers (one 1 KiB chunk each, Adam state), a device for about half the model data, two
 *  iterations with activations; returns the final parameters. */
std::vector<float> train_small(small_rt& rt, int iterations = 2) {
  std::vector<param_id> w;
  for (int l = 0; l < 3; ++l)
    w.push_back(rt.register_param(spec("l" + std::to_string(l), 200), [l](std::span<float> v) {
      for (std::size_t i = 0; i < v.size(); ++i)
        v[i] = 0.01f * static_cast<float>(i % 7) - 0.02f * static_cast<float>(l);
    }));
  rt.finalize();
  for (int it = 0; it < iterations; ++it) {
    std::vector<non_model_buffer<float, small_rt>> acts;
    for (int l = 0; l < 3; ++l) {
      auto s = rt.forward("l" + std::to_string(l), {w[l]});
      acts.push_back(rt.allocate_buffer<float>(64));
      for (float& x : acts.back().span()) x = s.param<float>(w[l])[3];
    }
    for (int l = 2; l >= 0; --l) {
      auto s = rt.backward("l" + std::to_string(l), {w[l]});
      auto g = s.grad<float>(w[l]);
      for (std::size_t i = 0; i < g.size(); ++i) g[i] += acts.back().span()[i % 64] + 0.001f * static_cast<float>(i);
      acts.pop_back();
    }
    rt.step([](const step_chunk& c) {
      auto* p = static_cast<float*>(c.param);
      const auto* g = static_cast<const float*>(c.grad);
      for (auto t : c.tensors)
        for (std::size_t i = c.slots[t].offset; i < c.slots[t].offset + c.slots[t].numel; ++i) {
          c.momentum[i] = 0.9f * c.momentum[i] + g[i];
          p[i] -= 0.01f * c.momentum[i];
        }
    });
  }
  std::vector<float> all, v(200);
  for (auto id : w) {
    rt.read_tensor(id, chunk_kind::param, v);
    all.insert(all.end(), v.begin(), v.end());
  }
  return all;
}

constexpr std::size_t small_device = 3 * 64 * 4 + 6 * 1024;  // activations + 6 of the 12 chunks

}  // namespace

TEST_CASE("observer: a user's observer sees scopes in order, copies, the step and memory levels") {
  simulated_device_space dev({.capacity = small_device});
  host_space host;
  host_copy_engine copier;
  small_rt rt(dev, host, copier, {}, layout());
  recording_observer obs;
  rt.set_observer(obs);
  (void)train_small(rt, 1);
  const std::vector<std::string> want = {"open forward l0",
                                         "close forward l0",
                                         "open forward l1",
                                         "close forward l1",
                                         "open forward l2",
                                         "close forward l2",
                                         "open backward l2",
                                         "close backward l2",
                                         "open backward l1",
                                         "close backward l1",
                                         "open backward l0",
                                         "close backward l0",
                                         "step"};
  CHECK(join(obs.events) == join(want));
  CHECK(obs.bad_spans == 0);
  CHECK(obs.copies[tier::host] > 0);    // loads retired (their source was on the host)
  CHECK(obs.copies[tier::device] > 0);  // evictions or offloads retired
  REQUIRE(!obs.levels.empty());
  std::size_t max_non_model = 0;
  for (const auto& l : obs.levels) max_non_model = std::max(max_non_model, l.non_model);
  CHECK(max_non_model == 3 * 64 * 4);
  CHECK(obs.levels.back().device_chunks + obs.levels.back().host_chunks <= rt.model_bytes());
  // Detached: nothing more is reported.
  rt.set_observer({});
  const auto n = obs.events.size();
  { auto s = rt.forward("l0", {param_id{0}}); }
  CHECK(obs.events.size() == n);
}

TEST_CASE("observer: a nested scope's close is reported with its own name") {
  simulated_device_space dev({.capacity = 1 << 20});
  host_space host;
  host_copy_engine copier;
  small_rt rt(dev, host, copier, {}, layout());
  const auto emb = rt.register_param(spec("wte", 64));
  const auto head = rt.register_param(spec("head", 64));
  rt.finalize();
  recording_observer obs;
  rt.set_observer(obs);
  {
    auto outer = rt.forward("embed", {emb});
    { auto inner = rt.forward("lm_head", {emb, head}); }
  }
  const std::vector<std::string> want = {"open forward embed", "open forward lm_head", "close forward lm_head",
                                         "close forward embed"};
  CHECK(join(obs.events) == join(want));
  rt.end_iteration();
}

TEST_CASE("observer: exceptions from an observer's events are swallowed; training is unchanged") {
  std::vector<float> reference, observed;
  {
    simulated_device_space dev({.capacity = small_device});
    host_space host;
    host_copy_engine copier;
    small_rt rt(dev, host, copier, {}, layout());
    reference = train_small(rt);
  }
  {
    simulated_device_space dev({.capacity = small_device});
    host_space host;
    host_copy_engine copier;
    small_rt rt(dev, host, copier, {}, layout());
    throwing_observer obs;
    rt.set_observer(obs);
    CHECK_NOTHROW(observed = train_small(rt));
    CHECK(rt.invariant_violations(true).empty());
  }
  CHECK(observed == reference);
}

namespace {
bool lifetime_observer_alive = false;
int calls_after_destruction = 0;
/** Counts the calls it gets after its destructor ran (touching only globals, never itself). */
struct short_lived_observer : null_observer {
  short_lived_observer() { lifetime_observer_alive = true; }
  ~short_lived_observer() { lifetime_observer_alive = false; }
  short_lived_observer(const short_lived_observer&) = delete;
  short_lived_observer& operator=(const short_lived_observer&) = delete;
  void on_copy(tier, double, double) const noexcept { calls_after_destruction += !lifetime_observer_alive; }
  void on_memory(const memory_levels&) const noexcept { calls_after_destruction += !lifetime_observer_alive; }
};
}  // namespace

TEST_CASE(
    "observer: an observer attached after the runtime was built (so destroyed before it) gets no call from its "
    "destructor") {
  calls_after_destruction = 0;
  {
    simulated_device_space dev({.capacity = 2048});
    host_space host;
    host_copy_engine copier;
    small_rt rt(dev, host, copier, {.optimizer_state = optimizer_state_lists::none()}, layout());
    const auto a = rt.register_param(spec("a", 256));
    const auto b = rt.register_param(spec("b", 256));
    rt.finalize();
    short_lived_observer obs;  // declared after the runtime, as one attaches an observer to a runtime
    rt.set_observer(obs);
    { auto s = rt.forward("a", {a}); }
    { auto s = rt.forward("b", {b}); }  // the loads' host buffers retire later: at the next scope, or in the destructor
    rt.end_iteration();
  }
  CHECK_MESSAGE(calls_after_destruction == 0, "the runtime's destructor reported "
                                                  << calls_after_destruction
                                                  << " event(s) to an observer already destroyed");
}

namespace {
/** Runs @p f in a child process (so a std::terminate is observed, not suffered); its exit status. */
int in_child(const std::function<int()>& f) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    for (int sig : {SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTERM})
      std::signal(sig, SIG_DFL);  // not doctest's handlers
    int code = 99;
    try {
      code = f();
    } catch (...) {
      code = 98;
    }
    ::_exit(code);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}
}  // namespace

TEST_CASE("observer: a throwing clock (now_us) is ignored like a throwing event") {
  // Exit codes of the child: 0 fine; 1 a scope or the step threw the observer's exception;
  // 2 the bookkeeping is broken afterwards; 128+6: std::terminate (a throw through a noexcept close).
  const int open_and_step = in_child([] {
    simulated_device_space dev({.capacity = small_device});
    host_space host;
    host_copy_engine copier;
    small_rt rt(dev, host, copier, {}, layout());
    throwing_clock_observer obs;
    rt.set_observer(obs);
    try {
      (void)train_small(rt, 1);
    } catch (const std::runtime_error&) {
      return 1;
    }
    return rt.invariant_violations(true).empty() ? 0 : 2;
  });
  CHECK_MESSAGE(open_and_step == 0,
                "a scope or step with a throwing observer clock: child exit status " << open_and_step);
  const int close_only = in_child([] {
    simulated_device_space dev({.capacity = small_device});
    host_space host;
    host_copy_engine copier;
    small_rt rt(dev, host, copier, {}, layout());
    const auto w = rt.register_param(spec("w", 64));
    rt.finalize();
    throwing_clock_observer obs;
    obs.armed = false;
    rt.set_observer(obs);
    {
      auto s = rt.forward("f", {w});
      obs.armed = true;  // the clock fails while the scope is open: its close must survive it
    }
    obs.armed = false;
    rt.end_iteration();
    return rt.invariant_violations(true).empty() ? 0 : 2;
  });
  CHECK_MESSAGE(close_only == 0, "closing a scope with a throwing observer clock: child exit status " << close_only);
}

namespace {
/** A strict JSON validator (RFC 8259 grammar, no extensions): true when @p s is one JSON value. */
class json_checker {
 public:
  explicit json_checker(std::string_view s) : s_(s) {}
  bool valid() {
    ws();
    if (!value()) return false;
    ws();
    return i_ == s_.size();
  }

 private:
  bool value() {
    if (i_ >= s_.size()) return false;
    switch (s_[i_]) {
      case '{': return object();
      case '[': return array();
      case '"': return string();
      case 't': return lit("true");
      case 'f': return lit("false");
      case 'n': return lit("null");
      default: return number();
    }
  }
  bool object() {
    ++i_;
    ws();
    if (peek('}')) return ++i_, true;
    for (;;) {
      ws();
      if (!string()) return false;
      ws();
      if (!peek(':')) return false;
      ++i_;
      ws();
      if (!value()) return false;
      ws();
      if (peek(',')) {
        ++i_;
        continue;
      }
      if (peek('}')) return ++i_, true;
      return false;
    }
  }
  bool array() {
    ++i_;
    ws();
    if (peek(']')) return ++i_, true;
    for (;;) {
      ws();
      if (!value()) return false;
      ws();
      if (peek(',')) {
        ++i_;
        continue;
      }
      if (peek(']')) return ++i_, true;
      return false;
    }
  }
  bool string() {
    if (!peek('"')) return false;
    for (++i_; i_ < s_.size(); ++i_) {
      const auto c = static_cast<unsigned char>(s_[i_]);
      if (c == '"') return ++i_, true;
      if (c < 0x20) return false;
      if (c == '\\') {
        if (++i_ >= s_.size()) return false;
        const char e = s_[i_];
        if (e == 'u') {
          for (int k = 0; k < 4; ++k)
            if (++i_ >= s_.size() || !std::isxdigit(static_cast<unsigned char>(s_[i_]))) return false;
        } else if (std::string_view("\"\\/bfnrt").find(e) == std::string_view::npos) {
          return false;
        }
      }
    }
    return false;
  }
  bool number() {
    const std::size_t start = i_;
    if (peek('-')) ++i_;
    if (peek('0')) ++i_;
    else if (!digits()) return false;
    if (peek('.')) {
      ++i_;
      if (!digits()) return false;
    }
    if (peek('e') || peek('E')) {
      ++i_;
      if (peek('+') || peek('-')) ++i_;
      if (!digits()) return false;
    }
    return i_ > start;
  }
  bool digits() {
    const std::size_t start = i_;
    while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) ++i_;
    return i_ > start;
  }
  bool lit(std::string_view w) {
    if (s_.substr(i_, w.size()) != w) return false;
    i_ += w.size();
    return true;
  }
  bool peek(char c) const { return i_ < s_.size() && s_[i_] == c; }
  void ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t')) ++i_;
  }
  std::string_view s_;
  std::size_t i_ = 0;
};
}  // namespace

TEST_CASE("timeline_observer: attached by the user, it writes valid Chrome-trace JSON with every kind of event") {
  CHECK(json_checker(R"({"a":[1,-2.5e3,"x\"y",true,null],"b":{}})").valid());
  CHECK(!json_checker(R"({"a":[1,],})").valid());
  CHECK(!json_checker("{\"a\":\"tab\there\"}").valid());

  simulated_device_space dev({.capacity = small_device});
  host_space host;
  host_copy_engine copier;
  small_rt rt(dev, host, copier, {}, layout());
  timeline_observer tl;
  rt.set_observer(tl);
  (void)train_small(rt, 2);
  {
    auto s = rt.forward("quote \" back\\slash \t tab", {param_id{0}});  // names are escaped
  }
  rt.end_iteration();
  const std::string json = tl.recorded().to_chrome_trace();
  CHECK(json_checker(json).valid());
  CHECK(contains(json, "\"traceEvents\""));
  CHECK(contains(json, "\"name\":\"forward load l0\""));
  CHECK(contains(json, "\"name\":\"backward\""));
  CHECK(contains(json, "\"name\":\"chunk\""));
  CHECK(contains(json, "\"name\":\"optimizer step\""));
  CHECK(contains(json, "\"ph\":\"C\",\"name\":\"device\""));
  CHECK(contains(json, R"(quote \" back\\slash  tab)"));
  CHECK(!contains(json, "\"dur\":-"));  // spans never run backwards
  CHECK(tl.recorded().size() > 20);
}

// ---- stats against the spaces --------------------------------------------------------------------

TEST_CASE("runtime_stats agree with the device space: peaks, their parts, loads, and reset_stats") {
  for (std::size_t prefetch : {std::size_t{0}, std::size_t{2}}) {
    CAPTURE(prefetch);
    simulated_device_space dev({.capacity = small_device});
    host_space host;
    host_copy_engine copier;
    small_rt rt(dev, host, copier, {.prefetch_depth = prefetch}, layout());
    (void)train_small(rt, 3);
    const auto& s = rt.stats();
    CHECK(s.peak_device_bytes == dev.usage().peak);  // only the runtime allocates from the device
    CHECK(s.peak_device_bytes <= dev.capacity());
    CHECK(s.peak_device_chunk_bytes <= s.peak_device_bytes);
    CHECK(s.peak_non_model_bytes <= s.peak_device_bytes);
    CHECK(s.peak_non_model_bytes == 3 * 64 * 4);
    CHECK(s.loads == s.demand_loads + s.prefetches);
    CHECK(s.loads > 0);
    CHECK(s.evictions + s.offloads > 0);
    if (prefetch > 0) CHECK(s.prefetches > 0);
    CHECK(s.bytes_to_device == s.loads * 1024);
    CHECK(s.bytes_to_host == (s.evictions + s.offloads) * 1024);
    CHECK(s.prefetch_hits <= s.prefetches);
    CHECK(s.steps == 3);
    CHECK(s.device_steps + s.host_steps == 9);

    rt.reset_stats();
    CHECK(rt.stats().loads == 0);
    CHECK(rt.stats().steps == 0);
    CHECK(rt.stats().peak_device_bytes == dev.used());
    CHECK(rt.stats().peak_device_chunk_bytes == rt.device_chunk_bytes());
    CHECK(rt.stats().peak_host_chunk_bytes == rt.host_chunk_bytes());
    CHECK(rt.stats().peak_non_model_bytes == rt.non_model_bytes());
    dev.reset_peak();
    {
      auto s0 = rt.forward("l0", {param_id{0}});
      auto act = rt.allocate_buffer<float>(32);
      auto s1 = rt.forward("l1", {param_id{1}});
    }
    rt.end_iteration();
    CHECK(rt.stats().peak_device_bytes == dev.usage().peak);
    CHECK(rt.stats().peak_non_model_bytes == 32 * 4);
    CHECK(rt.stats().loads == rt.stats().demand_loads + rt.stats().prefetches);
    CHECK(rt.invariant_violations(true).empty());
  }
}

// ---- the façade over the scripted platform: the stream contract through scopes --------------------

namespace {
using scripted_rt = chunk_runtime<fixed_chunk_layout, static_placement, belady_eviction, warmup_tracer,
                                  single_process_communicator, scripted_platform>;
}  // namespace

TEST_CASE("scripted platform: a scope closed on a stream holds its chunk's eviction until the user's work completes") {
  simulated_device_space dev({.capacity = 1 << 20});
  host_space host;
  scripted_copy_engine engine;
  // Two params, param + grad lists: 4 KiB of chunks; a quarter of it may be on the device.
  scripted_rt rt(dev, host, engine, {.optimizer_state = optimizer_state_lists::none(), .prefetch_depth = 0}, layout(),
                 static_placement::fraction(0.25));
  const auto a = rt.register_param(spec("a", 256));
  const auto b = rt.register_param(spec("b", 256));
  rt.finalize();
  const scripted_stream stream{5};
  float* kernel_out = nullptr;
  {
    auto s = rt.forward("fa", {a});
    kernel_out = s.param<float>(a).data();
    s.close(stream);  // the user's kernel is still running on `stream`
  }
  const auto users = engine.user_handles(stream);
  REQUIRE(users.size() == 1);
  CHECK(!users[0].ready());
  const auto stalls_before = engine.stalls().size();
  { auto s = rt.forward("fb", {b}); }  // evicts a's chunk to stay within the budget
  CHECK(rt.where({chunk_kind::param, 0}) == tier::host);
  CHECK(!users[0].ready());                            // opening fb did not wait for the user's work...
  CHECK(engine.blocked(copy_direction::to_host));      // ... and the eviction waits for it
  CHECK(engine.stalls().size() == stalls_before + 1);  // fb waited for its own load only
  bool ordered = false;
  for (const auto& op : engine.ops())
    if (op.kind == scripted_op_kind::order_after && op.handle == users[0].id() && op.lane == copy_direction::to_host)
      ordered = true;
  CHECK(ordered);
  // The kernel's writes land now, after the scope closed: the eviction must carry them.
  for (std::size_t i = 0; i < 256; ++i) kernel_out[i] = 7.0f + static_cast<float>(i);
  engine.complete(users[0]);
  engine.release_all();
  std::vector<float> got(256);
  rt.read_tensor(a, chunk_kind::param, got);
  for (std::size_t i = 0; i < 256; ++i) CHECK(got[i] == 7.0f + static_cast<float>(i));
  rt.end_iteration();
  CHECK(rt.invariant_violations(true).empty());
}

TEST_CASE("scripted platform: a scope opens at most scopes_ahead scopes ahead of the user's work on a stream") {
  // A trainer on CUDA closes its scopes on its stream and goes on: without a bound the host would
  // queue a whole iteration ahead of the device, deciding moves and early steps an iteration early.
  for (const std::size_t ahead : {std::size_t{0}, std::size_t{1}, std::size_t{2}, unbounded_scopes_ahead}) {
    CAPTURE(ahead);
    simulated_device_space dev({.capacity = 1 << 20});
    host_space host;
    scripted_copy_engine engine;
    scripted_rt rt(dev, host, engine, {.optimizer_state = optimizer_state_lists::none(), .scopes_ahead = ahead},
                   layout(), static_placement::all_device());
    std::vector<param_id> ps;
    for (int i = 0; i < 5; ++i) ps.push_back(rt.register_param(spec("p" + std::to_string(i), 256)));
    rt.finalize();
    const scripted_stream stream{3};
    for (std::size_t k = 0; k < ps.size(); ++k) {
      auto s = rt.forward("f" + std::to_string(k), {ps[k]});
      // Opening scope k waited for the work of every scope before it but the last `ahead`.
      const auto users = engine.user_handles(stream);
      REQUIRE(users.size() == k);
      for (std::size_t i = 0; i < k; ++i) {
        CAPTURE(k);
        CAPTURE(i);
        CHECK(users[i].ready() == (ahead != unbounded_scopes_ahead && i + ahead < k));
      }
      s.close(stream);
    }
    for (const auto& u : engine.user_handles(stream)) engine.complete(u);
    engine.release_all();
    rt.end_iteration();
    CHECK(rt.invariant_violations(true).empty());
  }
}

TEST_CASE("scripted platform: the optimizer step runs after the user's backward work on its chunks (stream contract)") {
  // Backward scopes closed on a stream hand their gradients back with the user's work still
  // running; a step on the device tier (nothing moves) must still not read them before it is done.
  simulated_device_space dev({.capacity = 1 << 20});
  host_space host;
  scripted_copy_engine engine;
  scripted_rt rt(dev, host, engine, {.optimizer_state = optimizer_state_lists::none()}, layout(),
                 static_placement::all_device());
  const auto a = rt.register_param(spec("a", 256));
  rt.finalize();
  const scripted_stream stream{9};
  {
    auto s = rt.backward("ba", {a});
    s.close(stream);
  }
  const auto users = engine.user_handles(stream);
  REQUIRE(users.size() == 1);
  bool user_done_at_step = false;
  rt.step([&](const step_chunk&) { user_done_at_step = users[0].ready(); });
  CHECK_MESSAGE(user_done_at_step, "the step's update ran on gradients the user's work was still writing");
  engine.complete(users[0]);
}

TEST_CASE(
    "scripted platform: with the trace, prefetch has every forward scope's chunks in place when copies finish during "
    "compute") {
  // Six layers, one param chunk each (param + grad lists: 12 chunks of 1 KiB), a device budget of
  // 5 chunks. The engine finishes every queued copy while a scope "computes" (release_all inside
  // the scope); from the second iteration on, no forward scope may wait for a copy: the prefetcher
  // started its loads while the previous scope ran.
  //
  // Backward scopes do wait today, for a zero fill or a load: the planner's first victim for the
  // next backward scope is the gradient in use now (Belady: a host-stepped gradient is next used
  // a whole iteration later), which cannot leave before the scope closes, so the plan stops there
  // (documented: "a victim still in use now") and nothing re-plans between the close and the next
  // open. They are reported, not failed (see the report: re-planning when a scope closes).
  simulated_device_space dev({.capacity = 1 << 20});
  host_space host;
  scripted_copy_engine engine;
  scripted_rt rt(dev, host, engine, {.optimizer_state = optimizer_state_lists::none(), .prefetch_depth = 2}, layout(),
                 static_placement::fraction(5.0 / 12.0));
  std::vector<param_id> w;
  for (int l = 0; l < 6; ++l) w.push_back(rt.register_param(spec("l" + std::to_string(l), 256)));
  rt.finalize();
  std::vector<std::string> forward_stalls, backward_stalls;
  const auto open = [&](bool backward, int l, int it) {
    const std::size_t before = engine.stalls().size();
    auto s = backward ? rt.backward("b" + std::to_string(l), {w[l]}) : rt.forward("f" + std::to_string(l), {w[l]});
    for (std::size_t k = before; it > 0 && k < engine.stalls().size(); ++k)
      for (const auto& op : engine.ops())
        if (op.handle == engine.stalls()[k] && op.kind != scripted_op_kind::order_after)
          (backward ? backward_stalls : forward_stalls)
              .push_back(std::string(backward ? "b" : "f") + std::to_string(l) + " waited for " + to_string(op.kind));
    engine.release_all();  // the copies run while this scope computes
  };
  for (int it = 0; it < 3; ++it) {
    for (int l = 0; l < 6; ++l) open(false, l, it);
    for (int l = 5; l >= 0; --l) open(true, l, it);
    rt.step([](const step_chunk&) {});
    engine.release_all();
  }
  CHECK_MESSAGE(forward_stalls.empty(),
                "forward scopes that waited for a copy after warm-up: " << join(forward_stalls));
  MESSAGE(
      "backward scopes that waited after warm-up (planner stops at the gradient in use): " << join(backward_stalls));
  CHECK(rt.stats().prefetches > 0);
  CHECK(rt.stats().prefetch_hits > 0);
  CHECK(rt.stats().peak_device_chunk_bytes <= 5 * 1024);
  CHECK(rt.invariant_violations(true).empty());
}

TEST_CASE(
    "scripted platform: holding a gradient for a collective waits for the user's backward work on it (stream "
    "contract)") {
  // replicated_gradients all-reduces a gradient chunk as soon as its backward scope closed; with
  // close(stream) the user's work may still be writing it.
  simulated_device_space dev({.capacity = 1 << 20});
  host_space host;
  scripted_copy_engine engine;
  scripted_rt rt(dev, host, engine, {.optimizer_state = optimizer_state_lists::none()}, layout(),
                 static_placement::all_device());
  const auto a = rt.register_param(spec("a", 256));
  rt.finalize();
  const scripted_stream stream{4};
  {
    auto s = rt.backward("ba", {a});
    s.close(stream);
  }
  const auto users = engine.user_handles(stream);
  REQUIRE(users.size() == 1);
  {
    auto held = rt.hold_gradient(0);
    CHECK(held.data != nullptr);
    CHECK_MESSAGE(users[0].ready(), "hold_gradient handed out a gradient the user's work was still writing");
  }
  engine.complete(users[0]);
  rt.end_iteration();
}

}  // namespace runtime_components_test
