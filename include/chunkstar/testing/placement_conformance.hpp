// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `check_placement_policy`: the laws of the `PlacementPolicy` concept
 *         (chunkstar/placement/placement_policy.hpp), checked on any model.
 *
 *  Laws checked, on random inputs (trace ready or not, every moment kind) and edge inputs (zero
 *  and maximal capacities, non-model data above capacity, no chunks, zero-byte chunks):
 *  - `name()` is not empty;
 *  - `chunk_budget(in)` is a pure function of `in`: the same answer on a repeat, for a copy of
 *    `in` at another address, after calls with other inputs (no hidden state), from a copy of the
 *    policy; it returns (does not throw) for every input;
 *  - `optimizer_tier(in, c)` is `tier::device` or `tier::host`, for every chunk index
 *    `c < in.num_chunks`, and a pure function of `(in, c)` in the same sense.
 *  How large a budget a policy gives is the policy's business (the runtime caps it by what the
 *  device has left and always admits the open scope): test that next to the policy.
 */
#pragma once

#include <chunkstar/placement/placement_policy.hpp>
#include <chunkstar/testing/conformance.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace chunkstar::testing {

/** @brief How much `check_placement_policy` tries. */
struct placement_conformance_options {
  std::size_t trials = 300;           ///< random inputs
  std::size_t max_chunks_asked = 64;  ///< optimizer_tier is asked for the first this many chunk indices (and the last)
  std::uint64_t seed = 5;             ///< the random inputs' seed (reports are reproducible)
};

namespace conformance_detail {

inline std::string describe_inputs(const placement_inputs& in) {
  auto v = [](std::size_t x) { return std::to_string(x); };
  return "{moment " + v(in.moment) + " (" + std::string(moment_kind_name(in.kind)) + "), device_capacity " +
         v(in.device_capacity) + ", non_model_now " + v(in.non_model_now) + ", trace_ready " +
         (in.trace_ready ? "true" : "false") + ", non_model_peak_here " + v(in.non_model_peak_here) +
         ", non_model_peak_next " + v(in.non_model_peak_next) + ", non_model_peak_max " + v(in.non_model_peak_max) +
         ", non_model_peak_step " + v(in.non_model_peak_step) + ", total_chunk_bytes " + v(in.total_chunk_bytes) +
         ", compute_chunk_bytes " + v(in.compute_chunk_bytes) + ", step_chunk_bytes " + v(in.step_chunk_bytes) +
         ", num_chunks " + v(in.num_chunks) + "}";
}

/** @brief Inputs as the runtime fills them (peaks within capacity or not, chunk bytes consistent). */
inline placement_inputs random_placement_inputs(conformance_rng& rng) {
  placement_inputs in;
  in.moment = rng.below(64);
  in.kind = static_cast<moment_kind>(rng.below(3));
  in.device_capacity = 1000 + rng.below(100000);
  in.non_model_now = rng.below(in.device_capacity + 500);
  in.trace_ready = rng.one_in(2);
  in.non_model_peak_here = in.non_model_now + rng.below(100);
  in.non_model_peak_next = rng.below(in.device_capacity);
  in.non_model_peak_max = std::max(in.non_model_peak_here, in.non_model_peak_next) + rng.below(50);
  in.non_model_peak_step = rng.below(in.non_model_peak_max + 1);
  in.num_chunks = 1 + rng.below(20);
  in.step_chunk_bytes = 16 + rng.below(1000);
  in.compute_chunk_bytes = in.num_chunks * in.step_chunk_bytes / (2 + rng.below(3));
  in.total_chunk_bytes = in.num_chunks * in.step_chunk_bytes;
  return in;
}

/** @brief Inputs at the edges: each field 0, tiny or maximal, independently. */
inline placement_inputs edge_placement_inputs(conformance_rng& rng) {
  constexpr std::size_t top = std::numeric_limits<std::size_t>::max();
  auto pick = [&] {
    static constexpr std::size_t values[] = {0, 1, 2, 1000, top / 2, top - 1, top};
    return values[rng.below(7)];
  };
  placement_inputs in;
  in.moment = rng.one_in(4) ? top : rng.below(4);
  in.kind = static_cast<moment_kind>(rng.below(3));
  in.device_capacity = pick();
  in.non_model_now = pick();
  in.trace_ready = rng.one_in(2);
  in.non_model_peak_here = pick();
  in.non_model_peak_next = pick();
  in.non_model_peak_max = pick();
  in.non_model_peak_step = pick();
  in.total_chunk_bytes = pick();
  in.compute_chunk_bytes = pick();
  in.step_chunk_bytes = pick();
  in.num_chunks = rng.below(4);  // chunk indices are asked for, so keep the count small
  return in;
}

}  // namespace conformance_detail

/** @brief Checks the `PlacementPolicy` laws (see the file comment) on @p p. */
template <PlacementPolicy P>
[[nodiscard]] conformance_report check_placement_policy(const P& p = {}, const placement_conformance_options& o = {}) {
  conformance_report r;
  std::string name;
  try {
    name = std::string(std::string_view(p.name()));
  } catch (...) {
    r.subject = "PlacementPolicy";
    r.fail("name() threw: " + current_exception_message());
    return r;
  }
  r.subject = "PlacementPolicy '" + name + "'";
  r.expect(!name.empty(), "name() is empty; it names the policy in reports");

  bool threw = false;
  auto budget = [&](const P& policy, const placement_inputs& in) -> std::optional<std::size_t> {
    if (threw) return std::nullopt;
    try {
      return policy.chunk_budget(in);
    } catch (...) {
      threw = true;
      r.fail("chunk_budget threw on " + conformance_detail::describe_inputs(in) + ": " + current_exception_message());
      return std::nullopt;
    }
  };
  auto tier_of = [&](const P& policy, const placement_inputs& in, std::size_t c) -> std::optional<tier> {
    if (threw) return std::nullopt;
    try {
      return policy.optimizer_tier(in, c);
    } catch (...) {
      threw = true;
      r.fail("optimizer_tier(in, " + std::to_string(c) + ") threw on " + conformance_detail::describe_inputs(in) +
             ": " + current_exception_message());
      return std::nullopt;
    }
  };
  // The chunk indices asked about: the first max_chunks_asked, and the last.
  auto indices = [&](const placement_inputs& in) {
    std::vector<std::size_t> cs;
    for (std::size_t c = 0; c < std::min(in.num_chunks, o.max_chunks_asked); ++c) cs.push_back(c);
    if (in.num_chunks > o.max_chunks_asked) cs.push_back(in.num_chunks - 1);
    return cs;
  };

  struct answers {
    placement_inputs in;
    std::optional<std::size_t> budget;
    std::vector<std::optional<tier>> tiers;
  };
  auto ask = [&](const P& policy, const placement_inputs& in) {
    answers a{in, budget(policy, in), {}};
    for (auto c : indices(in)) a.tiers.push_back(tier_of(policy, in, c));
    return a;
  };
  auto same_answers = [&](const answers& want, const answers& got, const char* how) {
    r.expect(!want.budget || !got.budget || *want.budget == *got.budget, [&] {
      return std::string("chunk_budget is not a pure function of its inputs (") + how +
             "): " + std::to_string(*want.budget) + " then " + std::to_string(*got.budget) + " for " +
             conformance_detail::describe_inputs(want.in);
    });
    const auto cs = indices(want.in);
    for (std::size_t k = 0; k < cs.size() && k < got.tiers.size(); ++k)
      r.expect(!want.tiers[k] || !got.tiers[k] || *want.tiers[k] == *got.tiers[k], [&] {
        return std::string("optimizer_tier(in, ") + std::to_string(cs[k]) + ") is not a pure function of (in, c) (" +
               how + "): " + std::string(tier_name(*want.tiers[k])) + " then " + std::string(tier_name(*got.tiers[k])) +
               " for " + conformance_detail::describe_inputs(want.in);
      });
  };

  conformance_detail::conformance_rng rng(o.seed);
  std::optional<answers> previous;
  for (std::size_t trial = 0; trial < o.trials + o.trials / 3 && !threw; ++trial) {
    const placement_inputs in = trial < o.trials ? conformance_detail::random_placement_inputs(rng)
                                                 : conformance_detail::edge_placement_inputs(rng);
    const answers first = ask(p, in);
    if (threw) break;
    const auto cs = indices(in);
    for (std::size_t k = 0; k < cs.size(); ++k)
      r.expect(!first.tiers[k] || *first.tiers[k] == tier::device || *first.tiers[k] == tier::host, [&] {
        return "optimizer_tier(in, " + std::to_string(cs[k]) +
               ") returned tier::" + std::string(tier_name(*first.tiers[k])) +
               "; an optimizer step runs on tier::device or tier::host only (" +
               conformance_detail::describe_inputs(in) + ")";
      });
    same_answers(first, ask(p, in), "a repeat");
    const std::vector<placement_inputs> elsewhere{in};  // same values, other address
    same_answers(first, ask(p, elsewhere.front()), "a copy of the inputs");
    if constexpr (std::copy_constructible<P>) {
      const P copy = p;
      same_answers(first, ask(copy, in), "a copy of the policy");
    }
    // Asked in the opposite chunk order: the answer for c does not depend on what was asked before.
    if (cs.size() > 1) {
      answers reversed{in, budget(p, in), std::vector<std::optional<tier>>(cs.size())};
      for (std::size_t k = cs.size(); k-- > 0;) reversed.tiers[k] = tier_of(p, in, cs[k]);
      same_answers(first, reversed, "chunk indices asked in reverse order");
    }
    if (previous) same_answers(*previous, ask(p, previous->in), "after calls with other inputs: hidden state");
    previous = first;
  }
  return r;
}

}  // namespace chunkstar::testing
