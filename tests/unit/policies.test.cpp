// Conformance suites for the runtime's policy concepts, instantiated for every model, and checks
// that types which must not satisfy a concept do not.
#include <chunkstar/eviction/belady.hpp>
#include <chunkstar/eviction/lru.hpp>
#include <chunkstar/placement/auto_placement.hpp>
#include <chunkstar/placement/static_placement.hpp>
#include <chunkstar/tracer/null_tracer.hpp>
#include <chunkstar/tracer/warmup_tracer.hpp>

#include <doctest/doctest.h>

#include <random>
#include <vector>

using namespace chunkstar;

// --- EvictionStrategy -------------------------------------------------------------------------
TEST_CASE_TEMPLATE_DEFINE("EvictionStrategy conformance", E, eviction_conformance) {
  static_assert(EvictionStrategy<E>);
  const E e;
  CHECK(!std::string_view(e.name()).empty());
  std::mt19937 gen(3);
  for (int trial = 0; trial < 500; ++trial) {
    std::vector<eviction_candidate> c(1 + static_cast<std::size_t>(trial % 9));
    for (std::size_t i = 0; i < c.size(); ++i) {
      c[i].id = {chunk_kind::param, static_cast<std::uint32_t>(i)};
      c[i].bytes = 64;
      c[i].last_use = gen() % 5;
      c[i].next_use = gen() % 3 == 0 ? never : gen() % 6;
    }
    const auto v = e.pick(c);
    REQUIRE(v < c.size());
    CHECK(e.pick(c) == v);  // deterministic
    auto reversed = c;
    std::reverse(reversed.begin(), reversed.end());
    CHECK(reversed[e.pick(reversed)].id == c[v].id);  // independent of candidate order
    if (!E::uses_trace) {
      for (const auto& x : c) CHECK(c[v].last_use <= x.last_use);
    } else {
      for (const auto& x : c) CHECK(c[v].next_use >= x.next_use);
    }
  }
}
TEST_CASE_TEMPLATE_INVOKE(eviction_conformance, lru_eviction, belady_eviction);

TEST_CASE("Belady without a trace behaves as LRU") {
  std::vector<eviction_candidate> c{{{chunk_kind::param, 0}, 8, 5, never},
                                    {{chunk_kind::param, 1}, 8, 2, never},
                                    {{chunk_kind::grad, 0}, 8, 9, never}};
  CHECK(belady_eviction{}.pick(c) == lru_eviction{}.pick(c));
}

// --- Tracer ---------------------------------------------------------------------------------------
TEST_CASE_TEMPLATE_DEFINE("Tracer conformance", T, tracer_conformance) {
  static_assert(Tracer<T>);
  T t;
  const chunk_id a{chunk_kind::param, 0}, b{chunk_kind::param, 1};
  for (int it = 0; it < 3; ++it) {
    t.begin_iteration();
    CHECK(t.open_moment(moment_kind::forward, "l0") == 0);
    t.record_access(a);
    t.record_non_model(100);
    CHECK(t.open_moment(moment_kind::forward, "l1") == 1);
    t.record_access(b);
    t.record_non_model(300);
    CHECK(t.open_moment(moment_kind::backward, "l1") == 2);
    t.record_access(b);
    t.record_non_model(50);
    CHECK(t.current_moment() == 2);
    t.end_iteration();
  }
  CHECK(t.stats().iterations == 3);
  if (t.ready()) {
    CHECK(t.num_moments() == 3);
    CHECK(t.non_model_peak(0) == 100);
    CHECK(t.non_model_peak(1) == 300);
    CHECK(t.non_model_peak(2) == 300);  // 300 was live when moment 2 opened
    CHECK(t.non_model_peak_from(2, 0) == 300);
    CHECK(t.non_model_peak_from(2, 1) == 50);   // after its first change the moment stays at 50
    CHECK(t.non_model_peak_from(2, 9) == 300);  // more changes than recorded: the whole peak
    CHECK(t.non_model_peak_from(1, 1) == 300);
    CHECK(t.next_use(a, 0) == 3);        // wraps into the next iteration
    CHECK(t.next_use(b, 1) == 1);
    CHECK(t.next_use(b, 2) == 2);        // 3 - 2 + 1
    CHECK(t.next_use({chunk_kind::grad, 7}, 0) == never);
    CHECK(t.accesses().size() == 3);
    CHECK(t.first_access_after(0) == 1);
    CHECK(t.first_access_after(2) == 3);
    CHECK(t.kind_of(1) == moment_kind::forward);
    CHECK(t.kind_of(2) == moment_kind::backward);
    CHECK(t.kind_of(5) == moment_kind::backward);  // wraps
  } else {
    CHECK(t.kind_of(2) == moment_kind::forward);
    CHECK(t.num_moments() == 0);
    CHECK(t.next_use(a, 0) == never);
    CHECK(t.accesses().empty());
    CHECK(t.non_model_peak(0) == 0);
    CHECK(t.non_model_peak_from(2, 1) == 0);
  }
}
TEST_CASE_TEMPLATE_INVOKE(tracer_conformance, null_tracer, warmup_tracer);

TEST_CASE("warmup tracer: ready after one iteration, divergence re-traces") {
  warmup_tracer t;
  CHECK(!t.ready());
  auto iteration = [&](std::vector<std::string> names) {
    t.begin_iteration();
    for (const auto& n : names) t.open_moment(moment_kind::forward, n);
    t.end_iteration();
  };
  iteration({"a", "b"});
  CHECK(t.ready());
  iteration({"a", "b"});
  CHECK(t.stats().divergences == 0);
  t.begin_iteration();
  t.open_moment(moment_kind::forward, "a");
  CHECK(t.ready());
  t.open_moment(moment_kind::forward, "c");
  CHECK(!t.ready());  // left the trace: neutral answers for the rest of the iteration
  t.end_iteration();
  CHECK(t.stats().divergences == 1);
  CHECK(t.ready());
  CHECK(t.moments()[1].name == "c");
}

TEST_CASE("warmup tracer: a moment that allocates more than recorded raises its remaining peaks") {
  warmup_tracer t;
  auto iteration = [&](std::size_t second) {
    t.begin_iteration();
    t.open_moment(moment_kind::backward, "a");
    t.record_non_model(400);
    t.record_non_model(100);
    t.record_non_model(second);
    t.end_iteration();
  };
  iteration(50);
  REQUIRE(t.ready());
  CHECK(t.non_model_peak_from(0, 2) == 100);
  CHECK(t.non_model_peak_from(0, 3) == 50);
  iteration(700);  // the last change exceeds every recorded peak
  CHECK(t.stats().memory_divergences == 1);
  CHECK(t.non_model_peak(0) == 700);
  CHECK(t.non_model_peak_from(0, 2) == 700);
  CHECK(t.non_model_peak_from(0, 3) == 700);
}

// --- PlacementPolicy ------------------------------------------------------------------------------
TEST_CASE_TEMPLATE_DEFINE("PlacementPolicy conformance", P, placement_conformance) {
  static_assert(PlacementPolicy<P>);
  const P p{};
  std::mt19937 gen(5);
  for (int trial = 0; trial < 300; ++trial) {
    placement_inputs in;
    in.device_capacity = 1000 + gen() % 100000;
    in.non_model_now = gen() % (in.device_capacity + 500);
    in.trace_ready = trial % 2 == 0;
    in.non_model_peak_here = in.non_model_now + gen() % 100;
    in.non_model_peak_next = gen() % in.device_capacity;
    in.non_model_peak_max = std::max(in.non_model_peak_here, in.non_model_peak_next);
    in.num_chunks = 1 + gen() % 20;
    in.step_chunk_bytes = 16 + gen() % 1000;
    in.compute_chunk_bytes = in.num_chunks * in.step_chunk_bytes / 3;
    in.total_chunk_bytes = in.num_chunks * in.step_chunk_bytes;
    // Never more than the device has left after non-model data now.
    CHECK(p.chunk_budget(in) <= room_after(in.device_capacity, in.non_model_now));
    CHECK(p.chunk_budget(in) == p.chunk_budget(in));
    for (std::size_t c = 0; c < in.num_chunks; ++c) {
      const auto t = p.optimizer_tier(in, c);
      CHECK((t == tier::device || t == tier::host));
      CHECK(p.optimizer_tier(in, c) == t);
    }
  }
}
TEST_CASE_TEMPLATE_INVOKE(placement_conformance, static_placement, auto_placement);

TEST_CASE("static placement fractions and auto placement margins") {
  placement_inputs in{.device_capacity = 1000, .non_model_now = 100, .trace_ready = true, .non_model_peak_here = 100,
                      .non_model_peak_next = 300, .non_model_peak_max = 400, .total_chunk_bytes = 2000,
                      .compute_chunk_bytes = 200, .step_chunk_bytes = 100, .num_chunks = 10};
  CHECK(static_placement::all_device().chunk_budget(in) == 900);
  CHECK(static_placement::all_host().chunk_budget(in) == 0);
  CHECK(static_placement::fraction(0.25).chunk_budget(in) == 500);
  CHECK(static_placement::fraction(0.5).optimizer_tier(in, 4) == tier::device);
  CHECK(static_placement::fraction(0.5).optimizer_tier(in, 5) == tier::host);
  // auto: budget = capacity - max(peak here, peak next) = 700; margin = 1000 - 400 - 200 = 400,
  // 80% of it = 320; each chunk's state costs 100 - 200/10 = 80 bytes -> four chunks on the device.
  const auto_placement a;
  CHECK(a.chunk_budget(in) == 700);
  CHECK(a.optimizer_tier(in, 3) == tier::device);
  CHECK(a.optimizer_tier(in, 4) == tier::host);
  in.trace_ready = false;
  CHECK(a.chunk_budget(in) == 900);
  CHECK(a.optimizer_tier(in, 0) == tier::host);
}

// --- concepts both ways -----------------------------------------------------------------------------
struct not_a_strategy {
  std::size_t pick(std::span<const eviction_candidate>) const { return 0; }
};  // no name(), no uses_trace
struct not_a_placement {
  std::size_t chunk_budget(const placement_inputs&) const { return 0; }
};
static_assert(!EvictionStrategy<not_a_strategy>);
static_assert(!EvictionStrategy<int>);
static_assert(!PlacementPolicy<not_a_placement>);
static_assert(!PlacementPolicy<lru_eviction>);
static_assert(!Tracer<lru_eviction>);
static_assert(!Tracer<int>);
