// SPDX-License-Identifier: Apache-2.0
// Checks bench/replay's offline references against an exhaustive search over every schedule
// (including ones that load early or evict voluntarily) on thousands of small random problems with
// varying capacities, droppable chunks and drops: `optimal_moves` must equal the true minimum on
// every problem, and `belady_min` must never beat it. How often MIN misses is printed, not asserted.
#include "belady_min.hpp"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

using namespace chunkstar::bench;

namespace {

// Exhaustive dynamic programme over states (each chunk absent / device / host), so 3^n states.
std::size_t exhaustive_min(const std::vector<min_step>& steps, const std::vector<bool>& droppable,
                           const std::vector<min_place>& initial) {
  const std::size_t n = droppable.size();
  std::size_t states = 1;
  for (std::size_t i = 0; i < n; ++i) states *= 3;
  constexpr std::size_t inf = std::numeric_limits<std::size_t>::max() / 4;
  auto decode = [&](std::size_t s) {
    std::vector<min_place> p(n);
    for (std::size_t i = 0; i < n; ++i, s /= 3) p[i] = static_cast<min_place>(s % 3);
    return p;
  };
  auto encode = [&](const std::vector<min_place>& p) {
    std::size_t s = 0;
    for (std::size_t i = n; i-- > 0;) s = s * 3 + static_cast<std::size_t>(p[i]);
    return s;
  };
  std::vector<std::size_t> cost(states, inf), next(states);
  cost[encode(initial)] = 0;
  for (const auto& st : steps) {
    std::fill(next.begin(), next.end(), inf);
    std::vector<bool> need(n, false);
    for (auto c : st.need) need[c] = true;
    std::size_t distinct = 0;
    for (std::size_t c = 0; c < n; ++c) distinct += need[c];
    const std::size_t cap = std::max(st.capacity, distinct);
    for (std::size_t s = 0; s < states; ++s) {
      if (cost[s] >= inf) continue;
      const auto from = decode(s);
      // Every choice of device set D (bitmask) that holds `need` and fits.
      for (std::size_t d = 0; d < (std::size_t{1} << n); ++d) {
        std::size_t count = 0, moves = 0;
        bool ok = true;
        std::vector<min_place> to(n);
        for (std::size_t c = 0; c < n && ok; ++c) {
          const bool on = (d >> c) & 1;
          if (need[c] && !on) ok = false;
          count += on;
          if (on) {
            if (from[c] == min_place::absent && !need[c]) ok = false;  // materialised only when used
            moves += from[c] == min_place::host;
            to[c] = min_place::device;
          } else {
            moves += from[c] == min_place::device;
            to[c] = from[c] == min_place::device ? min_place::host : from[c];
          }
        }
        if (!ok || count > cap) continue;
        if (st.drop_after)
          for (std::size_t c = 0; c < n; ++c)
            if (droppable[c]) to[c] = min_place::absent;
        auto& slot = next[encode(to)];
        slot = std::min(slot, cost[s] + moves);
      }
    }
    std::swap(cost, next);
  }
  return *std::min_element(cost.begin(), cost.end());
}

}  // namespace

int main() {
  std::mt19937 gen(12345);
  int failures = 0, checked = 0, min_above = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const std::size_t n = 2 + gen() % 5;  // 2..6 chunks
    std::vector<bool> droppable(n);
    std::vector<min_place> initial(n);
    for (std::size_t c = 0; c < n; ++c) {
      droppable[c] = gen() % 3 == 0;
      initial[c] = droppable[c] ? static_cast<min_place>(gen() % 3) : (gen() % 2 ? min_place::device : min_place::host);
    }
    // The initial state must fit the first step's capacity; MIN evicts down to it otherwise,
    // and so does the exhaustive search (it may choose any fitting set).
    const std::size_t steps_n = 3 + gen() % 12;
    std::vector<min_step> steps(steps_n);
    for (auto& s : steps) {
      const std::size_t k = 1 + gen() % 3;
      for (std::size_t i = 0; i < k; ++i) {
        const auto c = static_cast<std::uint32_t>(gen() % n);
        if (std::find(s.need.begin(), s.need.end(), c) == s.need.end()) s.need.push_back(c);
      }
      s.capacity = 1 + gen() % n;
      s.drop_after = gen() % 5 == 0;
    }
    const auto flow = optimal_moves(steps, droppable, initial);
    const auto min = belady_min(steps, droppable, initial).moves();
    const auto best = exhaustive_min(steps, droppable, initial);
    ++checked;
    min_above += min > best;
    if (flow != best || min < best) {
      if (++failures <= 5)
        std::printf("trial %d: optimal_moves %zu, belady_min %zu, exhaustive optimum %zu\n", trial, flow, min, best);
    }
  }
  std::printf("optimal_moves vs exhaustive search: %d of %d problems wrong; belady_min above the optimum on %d\n",
              failures, checked, min_above);
  return failures == 0 ? 0 : 1;
}
