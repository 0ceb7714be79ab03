// SPDX-License-Identifier: Apache-2.0
// plan_prefetch alone: a pure function of a hand-built snapshot, a hand-fed warmup_tracer, the
// eviction strategy and the budgets. Small cases are checked against op lists computed by hand
// (in the comments); a property test checks, for random small traces, states and budgets, that
// carrying out the plan is legal and never exceeds a budget before the chunk it loads is used.
#include <chunkstar/eviction/belady.hpp>
#include <chunkstar/eviction/lru.hpp>
#include <chunkstar/store/prefetch_planner.hpp>
#include <chunkstar/tracer/warmup_tracer.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <random>
#include <sstream>
#include <string>
#include <vector>

using namespace chunkstar;

namespace prefetch_planner_test {

namespace {

constexpr chunk_id P(std::uint32_t i) { return {chunk_kind::param, i}; }
constexpr chunk_id G(std::uint32_t i) { return {chunk_kind::grad, i}; }
constexpr std::size_t chunk = 100;  // bytes of every chunk in these cases

struct moment {
  moment_kind kind;
  std::vector<chunk_id> uses;
};

/** A warmup_tracer that has seen one iteration of @p ms, so it serves that trace. */
warmup_tracer traced(const std::vector<moment>& ms) {
  warmup_tracer t;
  t.begin_iteration();
  for (std::size_t m = 0; m < ms.size(); ++m) {
    (void)t.open_moment(ms[m].kind, "m" + std::to_string(m));
    for (auto id : ms[m].uses) t.record_access(id);
  }
  t.end_iteration();
  REQUIRE(t.ready());
  REQUIRE(t.num_moments() == ms.size());
  return t;
}

/** A snapshot of @p per_kind chunks per list, param and grad lists of `chunk` bytes. */
prefetch_snapshot snapshot(std::size_t moment, std::size_t per_kind, std::size_t fits, std::size_t depth) {
  prefetch_snapshot s;
  s.moment = moment;
  s.per_kind = per_kind;
  s.bytes[static_cast<std::size_t>(chunk_kind::param)] = chunk;
  s.bytes[static_cast<std::size_t>(chunk_kind::grad)] = chunk;
  s.chunks.resize(num_chunk_kinds * per_kind);
  s.fits = fits;
  s.depth = depth;
  return s;
}
void put(prefetch_snapshot& s, chunk_id id, tier where, std::size_t last_use = 0, bool pinned = false) {
  s.chunks[s.dense(id)] = {where, pinned, last_use, 0};
  if (where == tier::device) s.device_resident += s.bytes[static_cast<std::size_t>(id.kind)];
  s.tick = std::max(s.tick, last_use);
}

prefetch_budgets flat(std::size_t b) {
  return {[b](std::size_t) { return b; }, [b](std::size_t) { return b; }};
}

transfer_op evict(chunk_id id) { return {transfer_op::kind::evict, id}; }
transfer_op load(chunk_id id) { return {transfer_op::kind::load, id}; }
transfer_op zero(chunk_id id) { return {transfer_op::kind::zero, id}; }

std::string show(const std::vector<transfer_op>& ops) {
  std::string s = "[";
  for (const auto& o : ops)
    s += std::string(o.what == transfer_op::kind::evict  ? " evict "
                     : o.what == transfer_op::kind::load ? " load "
                                                         : " zero ") +
         to_string(o.id);
  return s + " ]";
}

template <class E, class Skip = bool (*)(chunk_id)>
std::vector<transfer_op> plan(
    const prefetch_snapshot& s, const warmup_tracer& t, const E& e, const prefetch_budgets& b,
    Skip skip = [](chunk_id) { return false; }) {
  trace_needs needs;
  needs.refresh(t);
  return plan_prefetch(s, t, needs, e, b, skip);
}

// The trace of the main cases: moments 0..5 use p0, p1, p2, p3, p2, p1 (a U-shaped reuse).
std::vector<moment> u_trace() {
  return {{moment_kind::forward, {P(0)}}, {moment_kind::forward, {P(1)}},  {moment_kind::forward, {P(2)}},
          {moment_kind::forward, {P(3)}}, {moment_kind::backward, {P(2)}}, {moment_kind::backward, {P(1)}}};
}
// Now: moment 2 (p2 in use, pinned); p0, p1, p2 on the device, p3 on the host; budget 3 chunks.
// p0 was used more recently than p1 (ticks 5 and 4), so LRU and Belady disagree.
prefetch_snapshot u_snapshot(std::size_t depth) {
  auto s = snapshot(2, 4, 3 * chunk, depth);
  put(s, P(0), tier::device, 5);
  put(s, P(1), tier::device, 4);
  put(s, P(2), tier::device, 6, /*pinned=*/true);
  put(s, P(3), tier::host, 0);
  return s;
}

}  // namespace

TEST_CASE("plan_prefetch: Belady evicts the chunk used furthest ahead and loads the next one") {
  // Moment 3 needs p3: the device is at its budget, so one of p0 (next use from 3: in 3 moments),
  // p1 (2) or p2 (1) goes: Belady picks p0; p0 is not used at moment 2 or before 3, so it leaves
  // now and p3 loads. Moments 4 and 5 use p2 and p1, both still there. Moment 0 (next iteration)
  // needs p0 back: the victim then would be p3 (used furthest from 0), but p3 is used at moment 3,
  // before: the plan stops there.
  const auto t = traced(u_trace());
  const auto ops = plan(u_snapshot(2), t, belady_eviction{}, flat(3 * chunk));
  CAPTURE(show(ops));
  CHECK(ops == std::vector<transfer_op>{evict(P(0)), load(P(3))});
}

TEST_CASE("plan_prefetch: LRU replays its own (worse) choices: evicts p1, then must fetch it back") {
  // LRU evicts p1 (tick 4) for p3; at moment 5 p1 is needed again: LRU evicts p0 (tick 5, older
  // than p2's 9 and p3's 7 in the simulation) and loads p1 back (in flight: 1 < depth 2). At moment
  // 0, p0 is needed; the victim p3 is used at moment 3: stop.
  const auto t = traced(u_trace());
  const auto ops = plan(u_snapshot(2), t, lru_eviction{}, flat(3 * chunk));
  CAPTURE(show(ops));
  CHECK(ops == std::vector<transfer_op>{evict(P(1)), load(P(3)), evict(P(0)), load(P(1))});
}

TEST_CASE("plan_prefetch: the depth limit stops loads beyond the next moment, never the next moment's") {
  const auto t = traced(u_trace());
  SUBCASE("LRU, depth 1: the load for moment 5 waits (its eviction, a move the demand path makes anyway, goes)") {
    const auto ops = plan(u_snapshot(1), t, lru_eviction{}, flat(3 * chunk));
    CAPTURE(show(ops));
    CHECK(ops == std::vector<transfer_op>{evict(P(1)), load(P(3)), evict(P(0))});
  }
  SUBCASE("depth 0 still loads for the next moment") {
    const auto ops = plan(u_snapshot(0), t, belady_eviction{}, flat(3 * chunk));
    CHECK(ops == std::vector<transfer_op>{evict(P(0)), load(P(3))});
  }
  SUBCASE("a forward chain with room for everything: depth bounds the loads in flight") {
    const auto chain = traced({{moment_kind::forward, {P(0)}},
                               {moment_kind::forward, {P(1)}},
                               {moment_kind::forward, {P(2)}},
                               {moment_kind::forward, {P(3)}}});
    auto s = snapshot(0, 4, 4 * chunk, 0);
    put(s, P(0), tier::device, 1, true);
    for (std::uint32_t c = 1; c < 4; ++c) put(s, P(c), tier::host);
    for (std::size_t depth : {0, 1, 2, 3}) {
      CAPTURE(depth);
      s.depth = depth;
      s.in_flight = 0;
      const auto ops = plan(s, chain, belady_eviction{}, flat(4 * chunk));
      std::vector<transfer_op> want{load(P(1))};
      for (std::uint32_t c = 2; c < 4 && c <= depth; ++c) want.push_back(load(P(c)));
      CHECK(ops == want);
      s.in_flight = 1;  // one prefetch already in flight counts against the depth
      const auto ops1 = plan(s, chain, belady_eviction{}, flat(4 * chunk));
      want = {load(P(1))};
      for (std::uint32_t c = 2; c < 4 && c < depth; ++c) want.push_back(load(P(c)));
      CHECK(ops1 == want);
    }
  }
}

TEST_CASE("plan_prefetch: a victim in use now stops the plan") {
  // Five moments p0, p1, p2, p3, p1, now at moment 2 (p2 pinned). For moment 3 Belady's victim is
  // p2 (next used a whole iteration later) — but p2 is in use now: nothing can be planned.
  const auto t = traced({{moment_kind::forward, {P(0)}},
                         {moment_kind::forward, {P(1)}},
                         {moment_kind::forward, {P(2)}},
                         {moment_kind::forward, {P(3)}},
                         {moment_kind::backward, {P(1)}}});
  const auto ops = plan(u_snapshot(2), t, belady_eviction{}, flat(3 * chunk));
  CAPTURE(show(ops));
  CHECK(ops.empty());
}

TEST_CASE("plan_prefetch: a FREE gradient gets a zero fill, within the budget of every moment before its use") {
  const auto t = traced({{moment_kind::forward, {P(0)}}, {moment_kind::backward, {P(0), G(0)}}});
  auto s = snapshot(0, 1, 2 * chunk, 2);
  put(s, P(0), tier::device, 1, true);
  CHECK(plan(s, t, belady_eviction{}, flat(2 * chunk)) == std::vector<transfer_op>{zero(G(0))});
  s.fits = chunk + chunk / 2;  // the current moment cannot hold it yet
  CHECK(plan(s, t, belady_eviction{}, flat(2 * chunk)).empty());
  // A gradient already on the host is loaded, not zeroed.
  s.fits = 2 * chunk;
  put(s, G(0), tier::host);
  CHECK(plan(s, t, belady_eviction{}, flat(2 * chunk)) == std::vector<transfer_op>{load(G(0))});
}

TEST_CASE("plan_prefetch: the skip predicate stops the plan at the chunk it rejects") {
  const auto t = traced(u_trace());
  const auto ops = plan(u_snapshot(2), t, belady_eviction{}, flat(3 * chunk), [](chunk_id id) { return id == P(3); });
  CHECK(ops == std::vector<transfer_op>{evict(P(0))});
}

TEST_CASE("plan_prefetch: a smaller budget at an intermediate moment bounds what loads early") {
  // p0 in use now; p1 at moment 1, p2 at moment 2. Moment 1's budget is 2 chunks: p2 cannot be on
  // the device during moment 1 beside p0 and p1, so only p1 is fetched now.
  const auto t =
      traced({{moment_kind::forward, {P(0)}}, {moment_kind::forward, {P(1)}}, {moment_kind::forward, {P(2)}}});
  auto s = snapshot(0, 3, 3 * chunk, 2);
  put(s, P(0), tier::device, 1, true);
  put(s, P(1), tier::host);
  put(s, P(2), tier::host);
  const prefetch_budgets tight{[](std::size_t k) { return k == 1 ? 2 * chunk : 3 * chunk; },
                               [](std::size_t k) { return k == 1 ? 2 * chunk : 3 * chunk; }};
  CHECK(plan(s, t, belady_eviction{}, tight) == std::vector<transfer_op>{load(P(1))});
  CHECK(plan(s, t, belady_eviction{}, flat(3 * chunk)) == std::vector<transfer_op>{load(P(1)), load(P(2))});
}

TEST_CASE("plan_prefetch: a host-side optimizer step (a moment with no device access) ends the plan") {
  const auto t = traced({{moment_kind::forward, {P(0)}}, {moment_kind::optimizer, {}}, {moment_kind::forward, {P(1)}}});
  auto s = snapshot(0, 2, 2 * chunk, 2);
  put(s, P(0), tier::device, 1, true);
  put(s, P(1), tier::host);
  CHECK(plan(s, t, belady_eviction{}, flat(2 * chunk)).empty());
  // Without a trace (or with a trace of another length) the planner plans nothing.
  trace_needs stale;
  CHECK(plan_prefetch(s, t, stale, belady_eviction{}, flat(2 * chunk), [](chunk_id) { return false; }).empty());
}

TEST_CASE_TEMPLATE("plan_prefetch property: carrying out the plan is legal and never exceeds a budget before the use",
                   E, lru_eviction, belady_eviction) {
  std::mt19937 gen(20240611);
  const E eviction{};
  std::size_t plans_with_ops = 0, loads = 0, evictions = 0, zeros = 0;
  for (int round = 0; round < 3000; ++round) {
    const std::size_t n = 2 + gen() % 5, per_kind = 2 + gen() % 4;
    std::vector<moment> ms(n);
    for (auto& m : ms) {
      m.kind = gen() % 2 ? moment_kind::forward : moment_kind::backward;
      const std::size_t k = 1 + gen() % 2;
      for (std::size_t i = 0; i < k; ++i) {
        const auto c = static_cast<std::uint32_t>(gen() % per_kind);
        if (std::find(m.uses.begin(), m.uses.end(), P(c)) == m.uses.end()) m.uses.push_back(P(c));
        if (m.kind == moment_kind::backward && std::find(m.uses.begin(), m.uses.end(), G(c)) == m.uses.end())
          m.uses.push_back(G(c));
      }
    }
    const auto t = traced(ms);
    std::vector<std::size_t> budget(n);
    for (auto& b : budget) b = (1 + gen() % (2 * per_kind)) * chunk;
    const std::size_t now = gen() % n;
    auto s = snapshot(now, per_kind, 0, gen() % 4);
    s.in_flight = gen() % 2;
    std::size_t tick = 0;
    for (std::uint32_t c = 0; c < per_kind; ++c) {
      for (auto id : {P(c), G(c)}) {
        const bool used_now = std::find(ms[now].uses.begin(), ms[now].uses.end(), id) != ms[now].uses.end();
        const auto r = gen() % 3;
        const tier where = used_now                      ? tier::device
                           : id.kind == chunk_kind::grad ? (r == 0   ? tier::free
                                                            : r == 1 ? tier::host
                                                                     : tier::device)
                                                         : (r == 0 ? tier::host : tier::device);
        put(s, id, where, ++tick + gen() % 5, used_now);
      }
    }
    s.tick += 5;
    s.fits = budget[now];
    const prefetch_budgets b{[&](std::size_t k) { return budget[k % n]; },
                             [&](std::size_t k) { return budget[k % n]; }};
    const auto ops = plan(s, t, eviction, b);
    if (!ops.empty()) ++plans_with_ops;

    // Carry the plan out on a model of the state.
    std::vector<tier> where(s.chunks.size());
    for (std::size_t x = 0; x < where.size(); ++x) where[x] = s.chunks[x].where;
    std::size_t resident = s.device_resident, loads_so_far = 0;
    std::ostringstream ctx;
    ctx << "round " << round << " now " << now << " fits " << s.fits << " depth " << s.depth << " in_flight "
        << s.in_flight << " ops " << show(ops);
    CAPTURE(ctx.str());
    for (const auto& op : ops) {
      const std::size_t x = s.dense(op.id);
      REQUIRE_FALSE(s.chunks[x].pinned);  // nothing in use now moves
      switch (op.what) {
        case transfer_op::kind::evict:
          ++evictions;
          REQUIRE(where[x] == tier::device);
          where[x] = tier::host;
          resident -= chunk;
          CHECK(t.next_use(op.id, now) >= 1);
          break;
        case transfer_op::kind::load:
        case transfer_op::kind::zero: {
          const bool is_load = op.what == transfer_op::kind::load;
          (is_load ? loads : zeros) += 1;
          REQUIRE(where[x] == (is_load ? tier::host : tier::free));
          where[x] = tier::device;
          resident += chunk;
          // Within the budget of now and of every moment before the chunk's next use.
          const std::size_t d = t.next_use(op.id, now);
          REQUIRE(d != never);
          CHECK(resident <= s.fits);
          for (std::size_t j = 1; j < d; ++j) CHECK(resident <= budget[(now + j) % n]);
          // Loads for a moment after the next one respect the depth (in flight before and in this plan).
          if (is_load) {
            if (d > 1) CHECK(s.in_flight + loads_so_far < s.depth);
            ++loads_so_far;
          }
          break;
        }
      }
    }
  }
  MESSAGE("plans with ops: " << plans_with_ops << ", loads " << loads << ", zero fills " << zeros << ", evictions "
                             << evictions);
  CHECK(plans_with_ops > 300);  // the generator exercises the planner, not only its early exits
  CHECK(loads > 0);
  CHECK(zeros > 0);
  CHECK(evictions > 0);
}

}  // namespace prefetch_planner_test
