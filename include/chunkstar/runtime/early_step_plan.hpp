// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `plan_early_steps`: which chunks' optimizer steps may start inside backward, and after
 *         which moment — a pure function of one traced iteration —, `speculation_advised`,
 *         whether this iteration should speculate at all (a pure function of the last step),
 *         `early_update_threads`, the host threads of one early update (of the worker's load,
 *         `early_load_of`, and backlog), and `order_due_updates`, which of the updates due
 *         starts first.
 *
 *  A chunk's step may start once nothing in the iteration reads or adds to it before the
 *  optimizer: after the last moment that uses its gradient (all micro-batches' contributions are
 *  in) and its parameters (no later scope reads the weights the step rewrites — a tied weight's
 *  first use in forward is its last in backward). Where that moment is, is in the trace. The step
 *  is speculative (chunk_adam::prepare): it runs with clip coefficient 1 and no overflow, keeping
 *  what it needs to undo where the global norm or an fp16 overflow could still change it; the
 *  plan caps the chunks so that state kept for them stays within a budget. Under ZeRO a rank plans
 *  the chunks it owns (the others step elsewhere: not `tier::host` here), a group's chunks count
 *  as used together, and the step waits, besides, for the chunk's reduction to its owner.
 */
#pragma once

#include <chunkstar/core/moment_kind.hpp>
#include <chunkstar/core/tier.hpp>
#include <chunkstar/zero/gather_plan.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

namespace chunkstar {

/** @brief What plan_early_steps needs besides the trace. */
struct early_step_inputs {
  /// Per chunk index: the tier its step runs on (residency_manager::optimizer_tier). Only host
  /// steps start early: they are the ones that cost the iteration their whole time.
  std::vector<tier> step_tier;
  /// Bytes kept to undo one chunk's speculative step (0: nothing is kept, the step always commits).
  std::size_t kept_bytes_per_chunk = 0;
  /// Most bytes kept at once (speculated chunks keep theirs until the step decides).
  std::size_t kept_budget = std::numeric_limits<std::size_t>::max();
  /// Chunks used as one: under ZeRO's group mode each group of this many consecutive chunks is
  /// gathered (this rank's chunk sent to every rank) and reduced together, so a use of one chunk
  /// of a group is a use of each. 1: every chunk on its own.
  std::size_t together = 1;
};

/** @brief Per moment of the traced iteration: the chunk indices whose step may start once that
 *  moment's scope has closed, in the order they become ready (then by index). */
struct early_step_plan {
  std::vector<std::vector<std::uint32_t>> after;
  [[nodiscard]] std::span<const std::uint32_t> at(std::size_t m) const noexcept {
    return m < after.size() ? std::span<const std::uint32_t>(after[m]) : std::span<const std::uint32_t>{};
  }
  /** @brief Chunks planned in all. */
  [[nodiscard]] std::size_t size() const noexcept {
    std::size_t n = 0;
    for (const auto& v : after) n += v.size();
    return n;
  }
};

/** @brief The early steps of one traced iteration @p t (its forward and backward moments up to the
 *  first optimizer moment): each host-stepped chunk whose gradient the iteration writes, after the
 *  last moment that uses its gradient or its parameters, while the kept state fits the budget
 *  (earliest-ready first: those overlap the most). A chunk used at the last moment before the
 *  optimizer is planned there too: it starts when the step does (or when the norm's scan reads the
 *  gradients), on the worker, so the step returns at once and the next forward waits for that
 *  chunk's update alone, not for it to run on the calling thread first. */
[[nodiscard]] inline early_step_plan plan_early_steps(const sharding_trace& t, const early_step_inputs& in) {
  early_step_plan plan;
  std::size_t end = 0;  // moments before the first optimizer moment
  while (end < t.size() && t.kinds[end] != moment_kind::optimizer) ++end;
  plan.after.resize(end);
  constexpr std::size_t none = std::numeric_limits<std::size_t>::max();
  const std::size_t chunks = in.step_tier.size();
  const std::size_t n = in.together > 0 ? in.together : 1;
  std::vector<std::size_t> last_grad(chunks, none), last_use(chunks, none);
  const auto used = [&](std::uint32_t c, auto&& mark) {  // c, with the chunks used as one with it
    for (std::size_t k = c / n * n; k < std::min(chunks, c / n * n + n); ++k) mark(k);
  };
  for (std::size_t m = 0; m < end; ++m) {
    for (const std::uint32_t c : t.grads[m])
      if (c < chunks) {
        last_grad[c] = m;
        used(c, [&](std::size_t k) { last_use[k] = m; });
      }
    for (const std::uint32_t c : t.params[m])
      if (c < chunks) used(c, [&](std::size_t k) { last_use[k] = m; });
  }
  std::size_t kept = 0;
  for (std::size_t m = 0; m < end; ++m)
    for (std::uint32_t c = 0; c < chunks; ++c) {
      if (last_grad[c] == none || last_use[c] != m || in.step_tier[c] != tier::host) continue;
      if (in.kept_bytes_per_chunk > in.kept_budget - kept) return plan;  // the budget is spent
      kept += in.kept_bytes_per_chunk;
      plan.after[m].push_back(c);
    }
  return plan;
}

/** @brief What the last iteration's early updates asked of the worker's threads (early_load_of). */
enum class early_load {
  unknown,  ///< no iteration measured yet
  fits,     ///< all threads but one carried them
  exceeds   ///< they need every thread
};

/** @brief The load of an iteration's early updates: @p update_thread_seconds, its updates as
 *  thread-seconds (each one's duration times its threads, about its time on one thread), against
 *  @p busy_seconds on all @p hardware threads but one, where busy_seconds is the iteration's time
 *  less what it waited for the updates (an iteration stretched by a worker too slow for it must
 *  not pass for one with room to spare). @p hardware 0 (not known) counts as one. */
[[nodiscard]] constexpr early_load early_load_of(double update_thread_seconds, double busy_seconds,
                                                 unsigned hardware) noexcept {
  const double threads = hardware > 1 ? hardware - 1 : 1;
  return update_thread_seconds <= std::max(busy_seconds, 0.0) * threads ? early_load::fits : early_load::exceeds;
}

/** @brief Host threads for an early update about to start on the worker: every one of @p hardware
 *  threads once the step has begun (@p stepping: the next forward waits for what is left; the
 *  thread that queues the device's work mostly waits), where the iteration's updates need them
 *  (@p load `exceeds`: the worker falls behind whatever it does, so from the start), or while
 *  @p blocked chunks are due that cannot start yet (below a disk tier, the room this update
 *  holds is what they wait for; under ZeRO, their reduction); all but one where the load fits,
 *  even with @p queued updates behind this one (a backlog all but one thread clear before the
 *  next forward needs it costs nothing, and the queuing thread keeps a core, so its scopes open
 *  on time). Before the load is known, every thread while any update is queued behind this one,
 *  else all but one. At least one; @p hardware 0 (not known) counts as one. Measured in
 *  docs/performance.md, "The step inside backward". */
[[nodiscard]] constexpr int early_update_threads(unsigned hardware, std::size_t queued, std::size_t blocked,
                                                 bool stepping, early_load load) noexcept {
  if (hardware <= 1) return 1;
  const bool all =
      stepping || load == early_load::exceeds || blocked > 0 || (load == early_load::unknown && queued > 0);
  return static_cast<int>(all ? hardware : hardware - 1);
}

/** @brief Orders @p due (chunk indices whose early update is due, in the order they became due),
 *  in place, as they should start: the one the next forward reads first (@p next_use: its moment
 *  there) before the others, so that where the host has room for few at once (below a disk tier)
 *  those left waiting are the ones it reads last. Inside backward (@p at_step false), before that,
 *  those whose gradient the user's work has finished (@p computed): their lists come down at once,
 *  whereas one the device still computes holds the copy lane behind that work (its copies are
 *  ordered after it), and the room it takes stays idle meanwhile. At the step, next use alone: the
 *  next forward's first chunks must not be the ones left without room. Stable. */
template <class NextUse, class Computed>
void order_due_updates(std::span<std::uint32_t> due, NextUse&& next_use, Computed&& computed, bool at_step) {
  std::stable_sort(due.begin(), due.end(), [&](std::uint32_t a, std::uint32_t b) { return next_use(a) < next_use(b); });
  if (!at_step) std::stable_partition(due.begin(), due.end(), [&](std::uint32_t c) { return computed(c); });
}

/** @brief Whether to speculate this iteration: always where nothing can undo a step (no clipping,
 *  a static loss scale); else only after a step that neither clipped nor overflowed (@p
 *  last_clipped, @p last_skipped), since a norm above the threshold tends to stay above it and
 *  every speculation would be redone. */
[[nodiscard]] constexpr bool speculation_advised(bool can_undo, bool last_clipped, bool last_skipped) noexcept {
  return !can_undo || (!last_clipped && !last_skipped);
}

}  // namespace chunkstar
