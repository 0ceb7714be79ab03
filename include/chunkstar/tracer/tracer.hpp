// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief The `Tracer` concept: observes moments, chunk accesses and non-model memory, and, once it
 *         has a trace, answers the questions placement, eviction and prefetch ask of the future.
 *
 *  Models: `null_tracer` (null_tracer.hpp), `warmup_tracer` (warmup_tracer.hpp).
 */
#pragma once

#include <chunkstar/core/chunk_id.hpp>
#include <chunkstar/core/moment_kind.hpp>
#include <chunkstar/core/tier.hpp>

#include <concepts>
#include <cstddef>
#include <span>
#include <string_view>

namespace chunkstar {

/** @brief One recorded access: chunk `id` was used at moment `moment` of the iteration. */
struct trace_access {
  std::size_t moment = 0;
  chunk_id id;
};

/** @brief What a tracer has seen. */
struct tracer_stats {
  std::size_t iterations = 0;          ///< iterations observed
  std::size_t traces = 0;              ///< times a trace was (re)adopted
  std::size_t divergences = 0;         ///< iterations that left the recorded trace
  std::size_t memory_divergences = 0;  ///< moments whose non-model memory exceeded the recorded peak
};

/** @brief The `Tracer` concept.
 *
 *  Required expressions, for `t` a `T&`, `ct` a `const T&`, `k` a `moment_kind`, `name` a
 *  `std::string_view`, `c` a `chunk_id`, `b`, `m` `std::size_t`:
 *  1. `t.begin_iteration()` — a new iteration starts; moments count from 0 again.
 *  2. `t.open_moment(k, name)` → `std::size_t`: a scope (or the optimizer step) opens; returns the
 *     moment's index. A tracer with a trace compares (k, name) with the recorded moment; a mismatch is
 *     a divergence: counted, `ready()` is false for the rest of the iteration, and the iteration is
 *     recorded afresh and adopted at its end.
 *  3. `t.record_access(c)` — chunk `c` is used at the current moment.
 *  4. `t.record_non_model(b)` — non-model (activation, workspace) bytes on the compute tier are `b`
 *     now; the tracer keeps the peak per moment. Exceeding a recorded peak counts a memory divergence.
 *  5. `t.end_iteration()` — closes the iteration (adopting the recording if there was no usable trace).
 *  6. `ct.ready()` → `bool`: a trace matching this iteration so far exists; the answers below are
 *     meaningful only then (otherwise they are neutral: 0 peaks, `never` next uses, no accesses).
 *  7. `ct.current_moment()`, `ct.num_moments()` → `std::size_t`.
 *  8. `ct.non_model_peak(m)` → `std::size_t`: recorded peak non-model bytes during moment `m`
 *     (`m` ≥ num_moments wraps into the next iteration).
 *  9. `ct.non_model_peak_from(m, e)` → `std::size_t`: the peak of moment `m` from its `e`-th
 *     non-model change (record_non_model call) on, to its end; `e` = 0 is the whole moment. Lets the
 *     budget rise within a moment once its activations are freed (the tide within a moment).
 *  10. `ct.next_use(c, m)` → `std::size_t`: moments from `m` to the next use of `c` strictly after `m`,
 *      wrapping into the next iteration; `never` when `c` is not in the trace.
 *  11. `ct.accesses()` → `std::span<const trace_access>` in moment order; `ct.first_access_after(m)`
 *      → `std::size_t`, index of the first access at a moment > `m` (== size when none).
 *  12. `ct.kind_of(m)` → `moment_kind`: the recorded kind of moment `m` (`m` ≥ num_moments wraps);
 *      `moment_kind::forward` without a trace.
 *  13. `ct.stats()` → `tracer_stats`.
 */
template <class T>
concept Tracer = requires(T& t, const T& ct, moment_kind k, std::string_view name, chunk_id c, std::size_t b) {
  t.begin_iteration();
  { t.open_moment(k, name) } -> std::same_as<std::size_t>;
  t.record_access(c);
  t.record_non_model(b);
  t.end_iteration();
  { ct.ready() } -> std::same_as<bool>;
  { ct.current_moment() } -> std::same_as<std::size_t>;
  { ct.num_moments() } -> std::same_as<std::size_t>;
  { ct.non_model_peak(b) } -> std::same_as<std::size_t>;
  { ct.non_model_peak_from(b, b) } -> std::same_as<std::size_t>;
  { ct.next_use(c, b) } -> std::same_as<std::size_t>;
  { ct.accesses() } -> std::same_as<std::span<const trace_access>>;
  { ct.first_access_after(b) } -> std::same_as<std::size_t>;
  { ct.kind_of(b) } -> std::same_as<moment_kind>;
  { ct.stats() } -> std::same_as<tracer_stats>;
};

}  // namespace chunkstar
