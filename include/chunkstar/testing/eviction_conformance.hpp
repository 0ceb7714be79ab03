// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `check_eviction_strategy`: the laws of the `EvictionStrategy` concept
 *         (chunkstar/eviction/eviction_strategy.hpp), checked on any model.
 *
 *  Laws checked, on random candidate sets (many ties), an exhaustive small domain and extreme values:
 *  - `name()` is not empty (it names the strategy in reports);
 *  - `pick(c)` is an index into `c` (and 0 for a single candidate);
 *  - deterministic: the same candidates give the same victim on a repeat, from a copy of the
 *    candidates at another address, after picks on other sets (no hidden state), and from a copy of
 *    the strategy;
 *  - independent of the candidates' order: every permutation picks the same chunk; so ties are
 *    broken by something the candidates carry (their chunk id), never by position;
 *  - depends on nothing but the candidates: a strategy whose `uses_trace` is false is not given
 *    next uses by the runtime (it passes `never`), so its pick must not change with `next_use`.
 *  `E::uses_trace` being a constant expression is part of the concept, so it is checked at compile
 *  time. Which victim a policy prefers (LRU the oldest `last_use`, FIFO the oldest `loaded_at`) is
 *  the policy's own business: test that next to the policy.
 */
#pragma once

#include <chunkstar/eviction/eviction_strategy.hpp>
#include <chunkstar/testing/conformance.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace chunkstar::testing {

/** @brief How much `check_eviction_strategy` tries. */
struct eviction_conformance_options {
  std::size_t trials = 500;        ///< random candidate sets
  std::size_t max_candidates = 9;  ///< random sets hold 1..max_candidates candidates
  bool exhaustive = true;          ///< every set of 3 over a small value domain, in every order
  std::uint64_t seed = 3;          ///< the random sets' seed (reports are reproducible)
};

namespace conformance_detail {

inline std::string describe_candidates(std::span<const eviction_candidate> c) {
  std::string s = "[";
  const std::size_t shown = std::min<std::size_t>(c.size(), 12);
  for (std::size_t i = 0; i < shown; ++i) {
    auto size = [](std::size_t v) {
      return v == std::numeric_limits<std::size_t>::max() ? std::string("SIZE_MAX") : std::to_string(v);
    };
    s += (i ? ", " : "") + to_string(c[i].id) + "{bytes " + size(c[i].bytes) + ", last_use " + size(c[i].last_use) +
         ", next_use " + describe_value(c[i].next_use) + ", loaded_at " + size(c[i].loaded_at) + "}";
  }
  if (shown < c.size()) s += ", ... " + std::to_string(c.size() - shown) + " more";
  return s + "]";
}

/** @brief @p n distinct chunk ids of mixed kinds. */
inline std::vector<chunk_id> distinct_ids(conformance_rng& rng, std::size_t n) {
  std::vector<chunk_id> pool;
  const std::size_t per_kind = std::max<std::size_t>(4, (n + num_chunk_kinds - 1) / num_chunk_kinds);
  for (std::size_t k = 0; k < num_chunk_kinds; ++k)
    for (std::size_t i = 0; i < per_kind; ++i)
      pool.push_back({static_cast<chunk_kind>(k), static_cast<std::uint32_t>(i)});
  for (std::size_t i = 0; i < n; ++i) std::swap(pool[i], pool[i + rng.below(pool.size() - i)]);
  pool.resize(n);
  return pool;
}

inline std::vector<eviction_candidate> random_candidates(conformance_rng& rng, std::size_t n) {
  const auto ids = distinct_ids(rng, n);
  std::vector<eviction_candidate> c(n);
  // Small ranges make ties common: a tie broken by position shows up as order dependence.
  static constexpr std::size_t byte_sizes[] = {0, 64, 64, 128, 4096};
  for (std::size_t i = 0; i < n; ++i) {
    c[i].id = ids[i];
    c[i].bytes = byte_sizes[rng.below(5)];
    c[i].last_use = rng.below(5);
    c[i].next_use = rng.one_in(3) ? never : rng.below(6);
    c[i].loaded_at = rng.below(5);
    if (rng.one_in(50)) c[i].last_use = std::numeric_limits<std::size_t>::max() - rng.below(2);
    if (rng.one_in(50)) c[i].loaded_at = std::numeric_limits<std::size_t>::max() - rng.below(2);
  }
  return c;
}

}  // namespace conformance_detail

/** @brief Checks the `EvictionStrategy` laws (see the file comment) on @p e. */
template <EvictionStrategy E>
[[nodiscard]] conformance_report check_eviction_strategy(const E& e = {}, const eviction_conformance_options& o = {}) {
  constexpr bool uses_trace = std::bool_constant<E::uses_trace>::value;

  conformance_report r;
  std::string name;
  try {
    name = std::string(std::string_view(e.name()));
  } catch (...) {
    r.subject = "EvictionStrategy";
    r.fail("name() threw: " + current_exception_message());
    return r;
  }
  r.subject = "EvictionStrategy '" + name + "'";
  r.expect(!name.empty(), "name() is empty; it names the strategy in reports");

  bool threw = false;
  // The victim's index, or nullopt (recorded) when pick throws or answers out of range.
  auto pick = [&](const E& strategy, std::span<const eviction_candidate> c) -> std::optional<std::size_t> {
    if (threw) return std::nullopt;
    std::size_t v = 0;
    try {
      v = strategy.pick(c);
    } catch (...) {
      threw = true;
      r.fail("pick threw on " + conformance_detail::describe_candidates(c) + ": " + current_exception_message());
      return std::nullopt;
    }
    if (!r.expect(v < c.size(), [&] {
          return "pick returned " + std::to_string(v) + ", not an index into the " + std::to_string(c.size()) +
                 " candidates " + conformance_detail::describe_candidates(c);
        }))
      return std::nullopt;
    return v;
  };

  // The laws on one candidate set (distinct ids): determinism, order independence, trace independence.
  auto check_set = [&](const std::vector<eviction_candidate>& c, std::size_t shuffles,
                       conformance_detail::conformance_rng& rng) {
    const auto v = pick(e, c);
    if (!v) return;
    const chunk_id victim = c[*v].id;
    if (c.size() == 1) r.expect(*v == 0, "pick of a single candidate must be 0");
    const auto again = pick(e, c);
    r.expect(!again || *again == *v, [&] {
      return "not deterministic: a repeat pick differs on " + conformance_detail::describe_candidates(c);
    });
    const std::vector<eviction_candidate> moved(c.begin(), c.end());  // same values, other address
    const auto there = pick(e, moved);
    r.expect(!there || *there == *v, [&] {
      return "the pick depends on where the candidates are in memory, not only on their values: " +
             conformance_detail::describe_candidates(c);
    });
    if constexpr (std::copy_constructible<E>) {
      const E copy = e;
      const auto by_copy = pick(copy, c);
      r.expect(!by_copy || *by_copy == *v, [&] {
        return "a copy of the strategy picks differently on " + conformance_detail::describe_candidates(c);
      });
    }
    auto same_victim = [&](const std::vector<eviction_candidate>& perm, const char* how) {
      const auto p = pick(e, perm);
      r.expect(!p || perm[*p].id == victim, [&] {
        return std::string("depends on the candidates' order (") + how + "): picks " + to_string(victim) + " in " +
               conformance_detail::describe_candidates(c) + " but " +
               (p ? to_string(perm[*p].id) : std::string("nothing")) + " in " +
               conformance_detail::describe_candidates(perm) + "; break ties by chunk id";
      });
    };
    if (c.size() > 1) {
      auto perm = c;
      std::reverse(perm.begin(), perm.end());
      same_victim(perm, "reversed");
      perm = c;
      std::rotate(perm.begin(), perm.begin() + 1, perm.end());
      same_victim(perm, "rotated");
      for (std::size_t s = 0; s < shuffles; ++s) {
        perm = c;
        for (std::size_t i = 0; i + 1 < perm.size(); ++i) std::swap(perm[i], perm[i + rng.below(perm.size() - i)]);
        same_victim(perm, "shuffled");
      }
    }
    if constexpr (!uses_trace) {
      // The runtime passes `never` to a strategy that does not use the trace.
      for (int variant = 0; variant < 2; ++variant) {
        auto other = c;
        for (auto& x : other) x.next_use = variant == 0 ? never : rng.below(7);
        const auto p = pick(e, other);
        r.expect(!p || other[*p].id == victim, [&] {
          return "uses_trace is false, yet the pick changes with next_use (the runtime passes never): " +
                 conformance_detail::describe_candidates(c) + " vs " + conformance_detail::describe_candidates(other);
        });
      }
    }
  };

  conformance_detail::conformance_rng rng(o.seed);
  std::vector<eviction_candidate> previous;
  std::optional<std::size_t> previous_pick;
  const std::size_t max_n = std::max<std::size_t>(1, o.max_candidates);
  for (std::size_t trial = 0; trial < o.trials && !threw; ++trial) {
    auto c = conformance_detail::random_candidates(rng, 1 + trial % max_n);
    check_set(c, 2, rng);
    // No hidden state: the previous set, after picks on other sets, gets its old answer.
    if (!previous.empty() && previous_pick) {
      const auto p = pick(e, previous);
      r.expect(!p || *p == *previous_pick, [&] {
        return "the pick changed after picks on other candidate sets (hidden state): " +
               conformance_detail::describe_candidates(previous);
      });
    }
    previous = c;
    previous_pick = threw ? std::nullopt : pick(e, c);
  }

  // Ties on every field but the id, in every order of up to 5 candidates.
  for (std::size_t n = 2; n <= 5 && !threw; ++n) {
    auto c = conformance_detail::random_candidates(rng, n);
    for (std::size_t i = 1; i < n; ++i) {
      const chunk_id id = c[i].id;
      c[i] = c[0];
      c[i].id = id;
    }
    const auto v = pick(e, c);
    if (!v) break;
    auto perm = c;
    std::sort(perm.begin(), perm.end(), [](const auto& a, const auto& b) { return a.id < b.id; });
    do {
      const auto p = pick(e, perm);
      if (!r.expect(!p || perm[*p].id == c[*v].id, [&] {
            return "candidates equal but for their id: the victim depends on their order (" +
                   conformance_detail::describe_candidates(perm) + "); break ties by chunk id";
          }))
        break;
    } while (std::next_permutation(perm.begin(), perm.end(), [](const auto& a, const auto& b) { return a.id < b.id; }));
  }

  // Exhaustive: every set of three over a small domain, in every order.
  if (o.exhaustive && !threw) {
    static constexpr std::size_t last_uses[] = {0, 1};
    static constexpr std::size_t next_uses[] = {0, 1, never};
    static constexpr std::size_t loads[] = {0, 1};
    static constexpr std::size_t sizes[] = {64, 128};
    std::vector<eviction_candidate> values;
    for (auto lu : last_uses)
      for (auto nu : next_uses)
        for (auto la : loads)
          for (auto b : sizes) values.push_back({chunk_id{}, b, lu, nu, la});
    const chunk_id ids[3] = {{chunk_kind::param, 0}, {chunk_kind::param, 1}, {chunk_kind::grad, 0}};
    std::size_t failures_before = r.failed;
    for (std::size_t a = 0; a < values.size() && !threw && r.failed == failures_before; ++a)
      for (std::size_t b = 0; b < values.size() && !threw && r.failed == failures_before; ++b)
        for (std::size_t d = 0; d < values.size() && !threw && r.failed == failures_before; ++d) {
          std::vector<eviction_candidate> c{values[a], values[b], values[d]};
          for (std::size_t i = 0; i < 3; ++i) c[i].id = ids[i];
          const auto v = pick(e, c);
          if (!v) break;
          auto perm = c;
          static constexpr std::size_t orders[5][3] = {{0, 2, 1}, {1, 0, 2}, {1, 2, 0}, {2, 0, 1}, {2, 1, 0}};
          for (const auto& ord : orders) {
            for (std::size_t i = 0; i < 3; ++i) perm[i] = c[ord[i]];
            const auto p = pick(e, perm);
            r.expect(!p || perm[*p].id == c[*v].id, [&] {
              return "depends on the candidates' order: picks " + to_string(c[*v].id) + " in " +
                     conformance_detail::describe_candidates(c) + " but not in " +
                     conformance_detail::describe_candidates(perm);
            });
          }
          if constexpr (!uses_trace) {
            auto blind = c;
            for (auto& x : blind) x.next_use = never;
            const auto p = pick(e, blind);
            r.expect(!p || blind[*p].id == c[*v].id, [&] {
              return "uses_trace is false, yet the pick changes with next_use: " +
                     conformance_detail::describe_candidates(c);
            });
          }
        }
  }

  // Extremes: a large set, and every field at its limit.
  if (!threw) {
    auto big = conformance_detail::random_candidates(rng, 1000);
    check_set(big, 1, rng);
    std::vector<eviction_candidate> extreme(3);
    for (std::size_t i = 0; i < 3; ++i)
      extreme[i] = {{chunk_kind::variance, static_cast<std::uint32_t>(std::numeric_limits<std::uint32_t>::max() - i)},
                    std::numeric_limits<std::size_t>::max(),
                    std::numeric_limits<std::size_t>::max(),
                    never,
                    std::numeric_limits<std::size_t>::max()};
    check_set(extreme, 2, rng);
  }
  return r;
}

}  // namespace chunkstar::testing
