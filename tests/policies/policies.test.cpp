// SPDX-License-Identifier: Apache-2.0
// The runtime's policy concepts: the installed conformance checks (chunkstar/testing/) run on every
// model, on a FIFO strategy written here as a user would, and on deliberately broken models (which
// they must reject); what is particular to each model; and types that must not satisfy a concept.
#include <chunkstar/eviction/belady.hpp>
#include <chunkstar/eviction/lru.hpp>
#include <chunkstar/layout/chunk_layout.hpp>
#include <chunkstar/placement/auto_placement.hpp>
#include <chunkstar/placement/static_placement.hpp>
#include <chunkstar/testing/eviction_conformance.hpp>
#include <chunkstar/testing/placement_conformance.hpp>
#include <chunkstar/testing/tracer_conformance.hpp>
#include <chunkstar/tracer/null_tracer.hpp>
#include <chunkstar/tracer/warmup_tracer.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

using namespace chunkstar;

namespace policies_test {
using chunkstar::testing::conformance_report;

namespace {

bool mentions(const conformance_report& r, const std::string& part) {
  return std::any_of(r.failures.begin(), r.failures.end(),
                     [&](const std::string& f) { return f.find(part) != std::string::npos; });
}

// A strategy outside the library, from docs/concepts.md alone: first in, first out.
struct fifo_eviction {
  static constexpr bool uses_trace = false;
  [[nodiscard]] std::size_t pick(std::span<const eviction_candidate> c) const noexcept {
    std::size_t best = 0;
    for (std::size_t i = 1; i < c.size(); ++i)
      if (c[i].loaded_at < c[best].loaded_at || (c[i].loaded_at == c[best].loaded_at && c[i].id < c[best].id)) best = i;
    return best;
  }
  [[nodiscard]] static constexpr std::string_view name() noexcept { return "fifo"; }
};
static_assert(EvictionStrategy<fifo_eviction>);

}  // namespace

// --- EvictionStrategy -------------------------------------------------------------------------
TEST_CASE_TEMPLATE("EvictionStrategy: the installed conformance check passes", E, lru_eviction, belady_eviction,
                   fifo_eviction) {
  const conformance_report r = chunkstar::testing::check_eviction_strategy(E{});
  CHECK_MESSAGE(r.ok(), r.to_string());
  CHECK(r.checks > 100000);  // the exhaustive domain was walked
  CHECK(r.subject == "EvictionStrategy '" + std::string(E::name()) + "'");
}

TEST_CASE("EvictionStrategy: each model prefers its own victim") {
  std::mt19937 gen(3);
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<eviction_candidate> c(1 + static_cast<std::size_t>(trial % 9));
    for (std::size_t i = 0; i < c.size(); ++i) {
      c[i].id = {static_cast<chunk_kind>(gen() % 2), static_cast<std::uint32_t>(i)};
      c[i].bytes = 64;
      c[i].last_use = gen() % 5;
      c[i].next_use = gen() % 3 == 0 ? never : gen() % 6;
      c[i].loaded_at = gen() % 5;
    }
    const auto& lru = c[lru_eviction{}.pick(c)];
    const auto& belady = c[belady_eviction{}.pick(c)];
    const auto& fifo = c[fifo_eviction{}.pick(c)];
    for (const auto& x : c) {
      // LRU: the oldest last use, ties to the lowest id.
      CHECK((lru.last_use < x.last_use || (lru.last_use == x.last_use && !(x.id < lru.id))));
      // Belady: the furthest next use, then LRU.
      CHECK(belady.next_use >= x.next_use);
      if (belady.next_use == x.next_use) CHECK(belady.last_use <= x.last_use);
      // FIFO: the earliest arrival, ties to the lowest id.
      CHECK((fifo.loaded_at < x.loaded_at || (fifo.loaded_at == x.loaded_at && !(x.id < fifo.id))));
    }
  }
}

TEST_CASE("Belady without a trace behaves as LRU") {
  std::vector<eviction_candidate> c{{{chunk_kind::param, 0}, 8, 5, never, 0},
                                    {{chunk_kind::param, 1}, 8, 2, never, 1},
                                    {{chunk_kind::grad, 0}, 8, 9, never, 2}};
  CHECK(belady_eviction{}.pick(c) == lru_eviction{}.pick(c));
}

namespace {
// Strategies that break one law each: the check must say which.
struct first_candidate {  // the victim depends on the order
  static constexpr bool uses_trace = false;
  std::size_t pick(std::span<const eviction_candidate>) const { return 0; }
  static std::string_view name() { return "first"; }
};
struct past_the_end {
  static constexpr bool uses_trace = false;
  std::size_t pick(std::span<const eviction_candidate> c) const { return c.size(); }
  static std::string_view name() { return "past-the-end"; }
};
struct lru_ties_by_position {  // LRU without the id tie-break
  static constexpr bool uses_trace = false;
  std::size_t pick(std::span<const eviction_candidate> c) const {
    std::size_t best = 0;
    for (std::size_t i = 1; i < c.size(); ++i)
      if (c[i].last_use < c[best].last_use) best = i;
    return best;
  }
  static std::string_view name() { return "lru-by-position"; }
};
struct alternating {  // hidden state
  static constexpr bool uses_trace = false;
  mutable std::size_t calls = 0;
  std::size_t pick(std::span<const eviction_candidate> c) const { return c.size() > 1 ? (calls++ % 2) : 0; }
  static std::string_view name() { return "alternating"; }
};
struct peeks_at_the_trace {  // reads next_use while saying it does not
  static constexpr bool uses_trace = false;
  std::size_t pick(std::span<const eviction_candidate> c) const { return belady_eviction{}.pick(c); }
  static std::string_view name() { return "peeks"; }
};
struct throws_on_many {
  static constexpr bool uses_trace = true;
  std::size_t pick(std::span<const eviction_candidate> c) const {
    if (c.size() > 5) throw std::length_error("too many candidates");
    return lru_eviction{}.pick(c);
  }
  static std::string_view name() { return "throws"; }
};
struct unnamed {
  static constexpr bool uses_trace = false;
  std::size_t pick(std::span<const eviction_candidate> c) const { return lru_eviction{}.pick(c); }
  static std::string_view name() { return ""; }
};
}  // namespace

TEST_CASE("EvictionStrategy: the conformance check rejects strategies that break a law") {
  using chunkstar::testing::check_eviction_strategy;
  const auto first = check_eviction_strategy(first_candidate{});
  CHECK(!first.ok());
  CHECK_MESSAGE(mentions(first, "depends on the candidates' order"), first.to_string());
  const auto past = check_eviction_strategy(past_the_end{});
  CHECK(!past.ok());
  CHECK_MESSAGE(mentions(past, "not an index into the"), past.to_string());
  const auto ties = check_eviction_strategy(lru_ties_by_position{});
  CHECK(!ties.ok());
  CHECK_MESSAGE(mentions(ties, "break ties by chunk id"), ties.to_string());
  const auto alt = check_eviction_strategy(alternating{});
  CHECK(!alt.ok());
  CHECK_MESSAGE((mentions(alt, "not deterministic") || mentions(alt, "hidden state")), alt.to_string());
  const auto peeks = check_eviction_strategy(peeks_at_the_trace{});
  CHECK(!peeks.ok());
  CHECK_MESSAGE(mentions(peeks, "uses_trace is false"), peeks.to_string());
  const auto thrower = check_eviction_strategy(throws_on_many{});
  CHECK(!thrower.ok());
  CHECK_MESSAGE(mentions(thrower, "too many candidates"), thrower.to_string());
  CHECK(thrower.failed == 1);  // stops at the first throw
  CHECK_MESSAGE(mentions(check_eviction_strategy(unnamed{}), "name() is empty"), "");
  // Failures are counted beyond the messages kept.
  CHECK(first.failed > first.failures.size());
  CHECK(first.failures.size() == first.max_recorded);
  CHECK(first.to_string().find("more") != std::string::npos);
}

// --- Tracer ---------------------------------------------------------------------------------------
TEST_CASE_TEMPLATE("Tracer: the installed conformance check passes", T, null_tracer, warmup_tracer) {
  const conformance_report r = chunkstar::testing::check_tracer<T>();
  CHECK_MESSAGE(r.ok(), r.to_string());
  CHECK(r.checks > 1000);
  // With a factory, as for a tracer that needs constructor arguments.
  const conformance_report f = chunkstar::testing::check_tracer([] { return T(); }, {.scripts = 5});
  CHECK_MESSAGE(f.ok(), f.to_string());
}

TEST_CASE("Tracer: a tracer without a trace is noted, not failed") {
  const auto r = chunkstar::testing::check_tracer<null_tracer>({.scripts = 3});
  CHECK(r.ok());
  REQUIRE(r.notes.size() == 1);
  CHECK(r.notes[0].find("never had a trace") != std::string::npos);
  CHECK(chunkstar::testing::check_tracer<warmup_tracer>({.scripts = 3}).notes.empty());
}

namespace {
// warmup_tracer with one bug each: the check must find it.
struct next_use_off_by_one : warmup_tracer {
  [[nodiscard]] std::size_t next_use(chunk_id c, std::size_t m) const noexcept {
    const auto v = warmup_tracer::next_use(c, m);
    return v == never ? v : v + 1;
  }
};
struct kind_of_without_wrap : warmup_tracer {
  [[nodiscard]] moment_kind kind_of(std::size_t m) const noexcept {
    return m < num_moments() ? warmup_tracer::kind_of(m) : moment_kind::forward;
  }
};
struct never_counts_divergences : warmup_tracer {
  [[nodiscard]] tracer_stats stats() const noexcept {
    auto s = warmup_tracer::stats();
    s.divergences = 0;
    return s;
  }
};
struct peak_from_ignores_e : warmup_tracer {
  [[nodiscard]] std::size_t non_model_peak_from(std::size_t m, std::size_t) const noexcept { return non_model_peak(m); }
};
struct counts_moments_from_one : warmup_tracer {
  std::size_t open_moment(moment_kind k, std::string_view name) { return warmup_tracer::open_moment(k, name) + 1; }
};
struct neutral_kind_is_backward : null_tracer {
  [[nodiscard]] moment_kind kind_of(std::size_t) const noexcept { return moment_kind::backward; }
};
static_assert(Tracer<next_use_off_by_one> && Tracer<counts_moments_from_one>);
}  // namespace

TEST_CASE("Tracer: the conformance check rejects tracers that break a requirement") {
  using chunkstar::testing::check_tracer;
  const auto off = check_tracer<next_use_off_by_one>({.scripts = 10});
  CHECK(!off.ok());
  CHECK_MESSAGE(mentions(off, "next_use("), off.to_string());
  const auto wrap = check_tracer<kind_of_without_wrap>({.scripts = 10});
  CHECK(!wrap.ok());
  CHECK_MESSAGE(mentions(wrap, "wrap into the next iteration"), wrap.to_string());
  const auto quiet = check_tracer<never_counts_divergences>({.scripts = 10});
  CHECK(!quiet.ok());
  CHECK_MESSAGE(mentions(quiet, "divergences, not 1"), quiet.to_string());
  const auto flat = check_tracer<peak_from_ignores_e>({.scripts = 20});
  CHECK(!flat.ok());
  CHECK_MESSAGE(mentions(flat, "non_model_peak_from("), flat.to_string());
  const auto one = check_tracer<counts_moments_from_one>({.scripts = 2});
  CHECK(!one.ok());
  CHECK_MESSAGE(mentions(one, "open_moment returned 1"), one.to_string());
  const auto neutral = check_tracer<neutral_kind_is_backward>({.scripts = 2});
  CHECK(!neutral.ok());
  CHECK_MESSAGE(mentions(neutral, "kind_of(m) (forward without a trace)"), neutral.to_string());
}

TEST_CASE("warmup tracer: a worked example of peaks, next uses and accesses") {
  warmup_tracer t;
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
  REQUIRE(t.ready());
  CHECK(t.num_moments() == 3);
  CHECK(t.non_model_peak(0) == 100);
  CHECK(t.non_model_peak(1) == 300);
  CHECK(t.non_model_peak(2) == 300);  // 300 was live when moment 2 opened
  CHECK(t.non_model_peak_from(2, 0) == 300);
  CHECK(t.non_model_peak_from(2, 1) == 50);   // after its first change the moment stays at 50
  CHECK(t.non_model_peak_from(2, 9) == 300);  // more changes than recorded: warmup_tracer answers the whole peak
  CHECK(t.non_model_peak_from(1, 1) == 300);
  CHECK(t.next_use(a, 0) == 3);  // wraps into the next iteration
  CHECK(t.next_use(b, 1) == 1);
  CHECK(t.next_use(b, 2) == 2);  // 3 - 2 + 1
  CHECK(t.next_use({chunk_kind::grad, 7}, 0) == never);
  CHECK(t.accesses().size() == 3);
  CHECK(t.first_access_after(0) == 1);
  CHECK(t.first_access_after(2) == 3);
  CHECK(t.kind_of(1) == moment_kind::forward);
  CHECK(t.kind_of(2) == moment_kind::backward);
  CHECK(t.kind_of(5) == moment_kind::backward);  // wraps
}

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
  iteration({"a"});  // fewer moments than the trace: warmup_tracer counts a divergence too
  CHECK(t.stats().divergences == 2);
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
TEST_CASE("PlacementPolicy: the installed conformance check passes") {
  using chunkstar::testing::check_placement_policy;
  for (const static_placement& p :
       {static_placement::all_device(), static_placement::all_host(), static_placement::fraction(0.3),
        static_placement::fraction(-1.0), static_placement::fraction(2.0)}) {
    CAPTURE(p.device_fraction);
    const auto r = check_placement_policy(p);
    CHECK_MESSAGE(r.ok(), r.to_string());
    CHECK(r.checks > 1000);
  }
  for (double use : {0.0, 0.5, 0.8, 1.0}) {
    CAPTURE(use);
    const auto r = check_placement_policy(auto_placement{use});
    CHECK_MESSAGE(r.ok(), r.to_string());
  }
  CHECK(check_placement_policy<auto_placement>().subject == "PlacementPolicy 'auto'");
}

TEST_CASE_TEMPLATE("PlacementPolicy: the library's models never budget more than the device has left", P,
                   static_placement, auto_placement) {
  // Not a law of the concept (the runtime caps any budget), but what these two promise.
  const P p{};
  std::mt19937 gen(5);
  for (int trial = 0; trial < 300; ++trial) {
    placement_inputs in;
    in.moment = gen() % 40;
    in.kind = static_cast<moment_kind>(gen() % 3);
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
    CHECK(p.chunk_budget(in) <= room_after(in.device_capacity, in.non_model_now));
  }
}

TEST_CASE("static placement fractions and auto placement margins") {
  placement_inputs in{.device_capacity = 1000,
                      .non_model_now = 100,
                      .trace_ready = true,
                      .non_model_peak_here = 100,
                      .non_model_peak_next = 300,
                      .non_model_peak_max = 400,
                      .total_chunk_bytes = 2000,
                      .compute_chunk_bytes = 200,
                      .step_chunk_bytes = 100,
                      .num_chunks = 10};
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

TEST_CASE("auto placement: the turn's first chunks step on the device where the room at the step holds their state") {
  // No margin (1000 - 800 peak activations - 200 param and grad chunks), but the activations are
  // gone at the step: 1000 - 0 - 200 = 800, 80% of it holds 640 / 80 = 8 chunks' state.
  placement_inputs in{.device_capacity = 1000,
                      .trace_ready = true,
                      .non_model_peak_max = 800,
                      .non_model_peak_step = 0,
                      .total_chunk_bytes = 1000,
                      .compute_chunk_bytes = 200,
                      .step_chunk_bytes = 100,
                      .num_chunks = 10};
  const auto tiers = [&](const auto_placement& a) {
    std::string t;
    for (std::size_t c = 0; c < in.num_chunks; ++c) t += a.optimizer_tier(in, c) == tier::device ? 'd' : 'h';
    return t;
  };
  CHECK(chunks_of_state_fitting(in, in.non_model_peak_max, 0.8) == 0);
  CHECK(chunks_of_state_fitting(in, in.non_model_peak_step, 0.8) == 8);
  CHECK(tiers(auto_placement{}) == "ddhhhhhhhh");  // turn_chunks = 2
  CHECK(tiers(auto_placement{.turn_chunks = 0}) == "hhhhhhhhhh");
  CHECK(tiers(auto_placement{.turn_chunks = 20}) == "ddddddddhh");  // no more than the room holds
  // 100 left at the step: its 80% holds one chunk's state.
  in.non_model_peak_step = 700;
  CHECK(tiers(auto_placement{}) == "dhhhhhhhhh");
  in.non_model_peak_step = 750;  // 50: none
  CHECK(tiers(auto_placement{}) == "hhhhhhhhhh");
  // A margin that already keeps more than turn_chunks decides alone; one that keeps fewer is topped up.
  in.non_model_peak_step = 0;
  in.non_model_peak_max = 300;  // margin 500 -> 400 / 80 = 5 kept
  CHECK(tiers(auto_placement{}) == "dddddhhhhh");
  in.non_model_peak_max = 700;  // margin 100 -> 80 / 80 = 1 kept, topped up to 2 by the turn
  CHECK(tiers(auto_placement{}) == "ddhhhhhhhh");
  // Without state to keep (plain SGD) any room holds every chunk; without a trace, all on the host.
  in.step_chunk_bytes = 20;
  in.non_model_peak_max = 800;
  CHECK(tiers(auto_placement{}) == "ddhhhhhhhh");
  in.non_model_peak_max = 300;
  CHECK(tiers(auto_placement{}) == "dddddddddd");
  in.trace_ready = false;
  CHECK(tiers(auto_placement{}) == "hhhhhhhhhh");
  // More chunks than a size_t counts: saturates (a double of 2^64 would not convert).
  in.device_capacity = std::numeric_limits<std::size_t>::max();
  in.compute_chunk_bytes = 0;
  in.step_chunk_bytes = 1;
  CHECK(chunks_of_state_fitting(in, 0, 1.0) == std::numeric_limits<std::size_t>::max());
  CHECK(chunks_of_state_fitting(in, 0, -1.0) == 0);
}

namespace {
struct steps_on_disk {  // a tier the optimizer cannot run on
  std::size_t chunk_budget(const placement_inputs& in) const { return in.device_capacity / 2; }
  tier optimizer_tier(const placement_inputs&, std::size_t c) const { return c % 2 ? tier::disk : tier::host; }
  static std::string_view name() { return "disk"; }
};
struct shrinking_budget {  // hidden state
  mutable std::size_t calls = 0;
  std::size_t chunk_budget(const placement_inputs& in) const { return in.device_capacity / (1 + calls++ % 3); }
  tier optimizer_tier(const placement_inputs&, std::size_t) const { return tier::host; }
  static std::string_view name() { return "shrinking"; }
};
struct remembers_last_chunk {  // the tier of c depends on what was asked before
  mutable std::size_t last = 0;
  std::size_t chunk_budget(const placement_inputs&) const { return 0; }
  tier optimizer_tier(const placement_inputs&, std::size_t c) const {
    const bool up = c > last;
    last = c;
    return up ? tier::device : tier::host;
  }
  static std::string_view name() { return "remembers"; }
};
struct divides_by_capacity {  // throws on an empty device
  std::size_t chunk_budget(const placement_inputs& in) const {
    if (in.device_capacity == 0) throw std::domain_error("no capacity");
    return in.device_capacity / 2;
  }
  tier optimizer_tier(const placement_inputs&, std::size_t) const { return tier::host; }
  static std::string_view name() { return "divides"; }
};
}  // namespace

TEST_CASE("PlacementPolicy: the conformance check rejects policies that break a law") {
  using chunkstar::testing::check_placement_policy;
  const auto disk = check_placement_policy(steps_on_disk{});
  CHECK(!disk.ok());
  CHECK_MESSAGE(mentions(disk, "returned tier::disk"), disk.to_string());
  const auto shrink = check_placement_policy(shrinking_budget{});
  CHECK(!shrink.ok());
  CHECK_MESSAGE(mentions(shrink, "chunk_budget is not a pure function"), shrink.to_string());
  const auto rem = check_placement_policy(remembers_last_chunk{});
  CHECK(!rem.ok());
  CHECK_MESSAGE(mentions(rem, "optimizer_tier(in, "), rem.to_string());
  const auto div = check_placement_policy(divides_by_capacity{});
  CHECK(!div.ok());
  CHECK_MESSAGE(mentions(div, "no capacity"), div.to_string());
}

// --- concepts both ways -----------------------------------------------------------------------------
namespace {
struct minimal_strategy {
  static constexpr bool uses_trace = false;
  std::size_t pick(std::span<const eviction_candidate>) const;
  const char* name() const;
};
struct not_a_strategy {
  std::size_t pick(std::span<const eviction_candidate>) const { return 0; }
};                           // no name(), no uses_trace
struct runtime_uses_trace {  // a static member, but not a constant expression
  static inline bool uses_trace = false;
  std::size_t pick(std::span<const eviction_candidate>) const;
  std::string_view name() const;
};
struct uses_trace_not_static {
  bool uses_trace = false;
  std::size_t pick(std::span<const eviction_candidate>) const;
  std::string_view name() const;
};
struct pick_returns_int {
  static constexpr bool uses_trace = false;
  int pick(std::span<const eviction_candidate>) const;
  std::string_view name() const;
};
struct pick_not_const {
  static constexpr bool uses_trace = false;
  std::size_t pick(std::span<const eviction_candidate>);
  std::string_view name() const;
};
struct pick_wants_a_vector {
  static constexpr bool uses_trace = false;
  std::size_t pick(std::vector<eviction_candidate>&) const;
  std::string_view name() const;
};
static_assert(EvictionStrategy<minimal_strategy>);
static_assert(EvictionStrategy<fifo_eviction>);
static_assert(!EvictionStrategy<not_a_strategy>);
static_assert(!EvictionStrategy<runtime_uses_trace>, "uses_trace must be a constant expression");
static_assert(!EvictionStrategy<uses_trace_not_static>);
static_assert(!EvictionStrategy<pick_returns_int>);
static_assert(!EvictionStrategy<pick_not_const>);
static_assert(!EvictionStrategy<pick_wants_a_vector>);
static_assert(!EvictionStrategy<int>);

struct minimal_placement {
  std::size_t chunk_budget(const placement_inputs&) const;
  tier optimizer_tier(const placement_inputs&, std::size_t) const;
  std::string_view name() const;
};
struct not_a_placement {
  std::size_t chunk_budget(const placement_inputs&) const { return 0; }
};
struct tier_as_int {
  std::size_t chunk_budget(const placement_inputs&) const;
  int optimizer_tier(const placement_inputs&, std::size_t) const;
  std::string_view name() const;
};
struct budget_as_double {
  double chunk_budget(const placement_inputs&) const;
  tier optimizer_tier(const placement_inputs&, std::size_t) const;
  std::string_view name() const;
};
struct budget_not_const {
  std::size_t chunk_budget(const placement_inputs&);
  tier optimizer_tier(const placement_inputs&, std::size_t) const;
  std::string_view name() const;
};
struct placement_without_name {
  std::size_t chunk_budget(const placement_inputs&) const;
  tier optimizer_tier(const placement_inputs&, std::size_t) const;
};
static_assert(PlacementPolicy<minimal_placement>);
static_assert(!PlacementPolicy<not_a_placement>);
static_assert(!PlacementPolicy<tier_as_int>, "optimizer_tier must return tier");
static_assert(!PlacementPolicy<budget_as_double>);
static_assert(!PlacementPolicy<budget_not_const>);
static_assert(!PlacementPolicy<placement_without_name>);
static_assert(!PlacementPolicy<lru_eviction>);

// Every required expression of Tracer, each switchable off (or to a wrong shape); all on = a model.
template <bool KindOf = true, bool ConstReady = true, bool SpanAccesses = true, bool OpenReturnsIndex = true,
          bool PeakFrom = true>
struct tracer_parts {
  void begin_iteration();
  std::size_t open_moment(moment_kind, std::string_view) requires OpenReturnsIndex;
  void open_moment(moment_kind, std::string_view) requires(!OpenReturnsIndex);
  void record_access(chunk_id);
  void record_non_model(std::size_t);
  void end_iteration();
  bool ready() const requires ConstReady;
  bool ready() requires(!ConstReady);
  std::size_t current_moment() const;
  std::size_t num_moments() const;
  std::size_t non_model_peak(std::size_t) const;
  std::size_t non_model_peak_from(std::size_t, std::size_t) const requires PeakFrom;
  std::size_t next_use(chunk_id, std::size_t) const;
  std::span<const trace_access> accesses() const requires SpanAccesses;
  std::vector<trace_access> accesses() const requires(!SpanAccesses);
  std::size_t first_access_after(std::size_t) const;
  moment_kind kind_of(std::size_t) const requires KindOf;
  tracer_stats stats() const;
};
static_assert(Tracer<tracer_parts<>>);
static_assert(!Tracer<tracer_parts<false>>, "kind_of is required");
static_assert(!Tracer<tracer_parts<true, false>>, "ready() must be callable on a const tracer");
static_assert(!Tracer<tracer_parts<true, true, false>>, "accesses() returns a span, not a vector");
static_assert(!Tracer<tracer_parts<true, true, true, false>>, "open_moment returns the moment's index");
static_assert(!Tracer<tracer_parts<true, true, true, true, false>>, "non_model_peak_from is required");
static_assert(!Tracer<lru_eviction>);
static_assert(!Tracer<int>);

struct layout_with_slots {  // plan returns the wrong type
  std::vector<tensor_slot> plan(std::span<const tensor_spec>) const;
  std::string_view name() const;
};
struct layout_plan_by_value_vector {
  chunk_plan plan(std::vector<tensor_spec>&) const;
  std::string_view name() const;
};
struct layout_ok {
  chunk_plan plan(std::span<const tensor_spec>) const;
  std::string_view name() const;
};
static_assert(ChunkLayout<layout_ok>);
static_assert(!ChunkLayout<layout_with_slots>, "plan must return chunk_plan");
static_assert(!ChunkLayout<layout_plan_by_value_vector>);
static_assert(!ChunkLayout<static_placement>);
}  // namespace

}  // namespace policies_test
