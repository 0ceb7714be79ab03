// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `check_tracer`: the numbered requirements of the `Tracer` concept
 *         (chunkstar/tracer/tracer.hpp), checked on any model.
 *
 *  The check drives fresh tracers (from a factory, or default-constructed) through scripted
 *  iterations — random moments, kinds, chunk accesses and non-model levels — and compares every
 *  answer with a reference computed from the script:
 *  - (1) moments count from 0 in every iteration: `open_moment` returns 0, 1, ...; (7)
 *    `current_moment()` is the moment just opened;
 *  - (6) a tracer that has observed nothing has no trace (`ready()` false, also during its first
 *    iteration); without a trace every answer is neutral: 0 peaks, `never` next uses, no accesses,
 *    `first_access_after` 0, `kind_of` forward, no moments;
 *  - once ready, it stays ready while iterations repeat its trace, counts no divergence, and
 *    answers from the trace: (7) `num_moments()`; (12) `kind_of(m)`, wrapping for m >= num_moments;
 *    (8) `non_model_peak(m)`, the highest level during moment m (the level live when it opens
 *    included), wrapping; (9) `non_model_peak_from(m, e)`, the highest level from the moment's e-th
 *    `record_non_model` to its end, `non_model_peak_from(m, 0) == non_model_peak(m)`; (10)
 *    `next_use(c, m)`, moments to the next use of c strictly after m, wrapping into the next
 *    iteration, `never` for a chunk not in the trace; (11) `accesses()` in moment order, every moment
 *    in range, exactly the recorded (moment, chunk) pairs, and `first_access_after(m)` the index of
 *    the first access at a moment > m;
 *  - (2) an iteration that leaves the trace — another name or another kind at some moment, or a
 *    moment past the trace's end — is ready up to that moment, then counts one divergence and is not
 *    ready for the rest of the iteration; (5) at its end it is adopted (`stats().traces` grows) and
 *    the next identical iteration is served from it;
 *  - (4) a level above the recorded peak of the current moment counts one memory divergence;
 *  - (13) `stats().iterations` counts the iterations begun.
 *  A tracer that never gets a trace (`null_tracer`) passes the laws that apply to it; the report
 *  notes that the rest were not exercised.
 */
#pragma once

#include <chunkstar/testing/conformance.hpp>
#include <chunkstar/tracer/tracer.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace chunkstar::testing {

/** @brief How much `check_tracer` tries. */
struct tracer_conformance_options {
  std::size_t scripts = 40;     ///< random scripts, each run through every phase on a fresh tracer
  std::size_t max_moments = 6;  ///< moments per scripted iteration: 1..max_moments
  std::size_t warmup = 3;       ///< identical iterations before the divergence phases
  std::uint64_t seed = 7;       ///< the scripts' seed (reports are reproducible)
};

namespace conformance_detail {

/** @brief One call inside a moment: `record_access(id)` or `record_non_model(bytes)`. */
struct trace_event {
  bool access = true;
  chunk_id id;
  std::size_t bytes = 0;
};

struct trace_moment {
  moment_kind kind = moment_kind::forward;
  std::string name;
  std::vector<trace_event> events;
};

using trace_script = std::vector<trace_moment>;

/** @brief Every script opens its first moment above, and ends below, this level: so the level
 *  carried into moment 0 from the previous iteration (or 0 on a fresh tracer) never changes moment
 *  0's peak, and one reference serves every repetition. */
inline constexpr std::size_t carry_floor = 1000;

/** @brief What a tracer holding @p s as its trace must answer. */
struct trace_reference {
  std::vector<moment_kind> kinds;
  std::vector<std::string> names;
  std::vector<std::vector<std::size_t>> levels;  // per moment: the level at opening, then after each change
  std::vector<trace_access> accesses;
  std::vector<chunk_id> chunks;  // distinct, in first-use order
  const trace_script* script;    // for messages

  explicit trace_reference(const trace_script& s) : script(&s) {
    std::size_t level = 0;  // below carry_floor, like any carried level
    for (std::size_t m = 0; m < s.size(); ++m) {
      kinds.push_back(s[m].kind);
      names.push_back(s[m].name);
      levels.push_back({level});
      for (const auto& e : s[m].events) {
        if (e.access) {
          accesses.push_back({m, e.id});
          if (std::find(chunks.begin(), chunks.end(), e.id) == chunks.end()) chunks.push_back(e.id);
        } else {
          level = e.bytes;
          levels.back().push_back(level);
        }
      }
    }
  }
  [[nodiscard]] std::size_t size() const noexcept { return kinds.size(); }
  [[nodiscard]] std::size_t changes(std::size_t m) const noexcept { return levels[m].size() - 1; }
  [[nodiscard]] std::size_t peak_from(std::size_t m, std::size_t e) const {
    return *std::max_element(levels[m].begin() + static_cast<std::ptrdiff_t>(e), levels[m].end());
  }
  [[nodiscard]] std::size_t next_use(chunk_id c, std::size_t m) const {
    std::optional<std::size_t> first, after;
    for (const auto& a : accesses) {
      if (!(a.id == c)) continue;
      if (!first || a.moment < *first) first = a.moment;
      if (a.moment > m && (!after || a.moment < *after)) after = a.moment;
    }
    if (!first) return never;
    return after ? *after - m : size() - m + *first;
  }
};

inline std::string describe_script(const trace_script& s) {
  std::string out = "[";
  for (std::size_t m = 0; m < s.size(); ++m) {
    if (m) out += "; ";
    out += std::to_string(m) + ":" + std::string(moment_kind_name(s[m].kind)) + " '" + s[m].name + "'";
    for (const auto& e : s[m].events) out += e.access ? " use " + to_string(e.id) : " level " + std::to_string(e.bytes);
  }
  return out + "]";
}

inline trace_script random_script(conformance_rng& rng, std::size_t max_moments) {
  static constexpr std::string_view names[] = {"embed", "h.0", "h.1", "h.2", "head", "loss"};
  const chunk_id pool[] = {{chunk_kind::param, 0}, {chunk_kind::param, 1}, {chunk_kind::param, 2},
                           {chunk_kind::grad, 0},  {chunk_kind::grad, 1},  {chunk_kind::master, 0}};
  trace_script s(1 + rng.below(std::max<std::size_t>(1, max_moments)));
  for (auto& m : s) {
    m.kind = static_cast<moment_kind>(rng.below(3));
    m.name = std::string(names[rng.below(6)]);  // repeats, as forward and backward of one layer do
    const std::size_t events = rng.below(5);
    for (std::size_t e = 0; e < events; ++e) {
      if (rng.below(5) < 3) m.events.push_back({true, pool[rng.below(6)], 0});
      else m.events.push_back({false, {}, rng.below(2 * carry_floor)});
    }
  }
  auto& first = s.front().events;
  // One draw per statement: argument evaluation order is unspecified, and the scripts must be the
  // same whatever the compiler.
  const std::size_t at = rng.below(first.size() + 1);
  const std::size_t high = carry_floor + rng.below(carry_floor);
  first.insert(first.begin() + static_cast<std::ptrdiff_t>(at), trace_event{false, {}, high});
  for (auto m = s.rbegin(); m != s.rend(); ++m) {
    const auto last =
        std::find_if(m->events.rbegin(), m->events.rend(), [](const trace_event& e) { return !e.access; });
    if (last == m->events.rend()) continue;
    if (last->bytes >= carry_floor) s.back().events.push_back({false, {}, rng.below(carry_floor)});
    break;
  }
  return s;
}

}  // namespace conformance_detail

/** @brief Checks the `Tracer` laws (see the file comment) on tracers made by @p make, a callable
 *  returning a fresh tracer that has observed nothing (it is called once per script). */
template <class Make>
requires std::invocable<Make&> && Tracer<std::remove_cvref_t<std::invoke_result_t<Make&>>>
[[nodiscard]] conformance_report check_tracer(Make&& make, const tracer_conformance_options& o = {}) {
  using conformance_detail::trace_reference;
  using conformance_detail::trace_script;
  conformance_report r;
  r.subject = "Tracer";
  std::size_t scripts_with_trace = 0;
  conformance_detail::conformance_rng rng(o.seed);

  for (std::size_t script_no = 0; script_no < o.scripts; ++script_no) {
    const trace_script s = conformance_detail::random_script(rng, o.max_moments);
    try {
      auto t = make();
      const chunk_id unknown{chunk_kind::variance, 4000000000u};
      std::size_t iterations = 0;
      std::string ctx;  // where we are, for messages

      auto check_neutral = [&](const trace_reference& ref) {
        auto fail_if = [&](bool bad, const char* what) {
          r.expect(!bad, [&] { return ctx + ": not ready(), yet " + what + " is not neutral"; });
        };
        const std::size_t n = ref.size();
        for (std::size_t m : {std::size_t{0}, std::size_t{1}, n, n + 3}) {
          fail_if(t.non_model_peak(m) != 0, "non_model_peak(m) (0 without a trace)");
          fail_if(t.non_model_peak_from(m, 0) != 0 || t.non_model_peak_from(m, 1) != 0,
                  "non_model_peak_from(m, e) (0 without a trace)");
          fail_if(t.kind_of(m) != moment_kind::forward, "kind_of(m) (forward without a trace)");
          fail_if(t.first_access_after(m) != 0, "first_access_after(m) (0: there are no accesses)");
          for (const auto& c : ref.chunks) fail_if(t.next_use(c, m) != never, "next_use(c, m) (never without a trace)");
          fail_if(t.next_use(unknown, m) != never, "next_use(c, m) (never without a trace)");
        }
        fail_if(!t.accesses().empty(), "accesses() (empty without a trace)");
        fail_if(t.num_moments() != 0, "num_moments() (0 without a trace)");
      };

      auto check_answers = [&](const trace_reference& ref) {
        const std::size_t n = ref.size();
        auto trace = [&] { return " (trace " + conformance_detail::describe_script(*ref.script) + ")"; };
        // `what` is a callable: messages are built only for a broken law.
        auto eq = [&](std::size_t got, std::size_t want, auto&& what) {
          r.expect(got == want, [&] {
            return ctx + ": " + what() + " is " + conformance_detail::describe_value(got) + ", the trace says " +
                   conformance_detail::describe_value(want) + trace();
          });
        };
        auto num = [](std::size_t v) { return std::to_string(v); };
        eq(t.num_moments(), n, [] { return std::string("num_moments()"); });
        for (std::size_t m = 0; m < n; ++m) {
          for (std::size_t wrap : {std::size_t{0}, n, 3 * n})
            r.expect(t.kind_of(m + wrap) == ref.kinds[m], [&] {
              return ctx + ": kind_of(" + std::to_string(m + wrap) + ") is " +
                     std::string(moment_kind_name(t.kind_of(m + wrap))) + ", the trace's moment " + std::to_string(m) +
                     " is " + std::string(moment_kind_name(ref.kinds[m])) +
                     (wrap ? " (moments past the end wrap into the next iteration)" : "");
            });
          eq(t.non_model_peak(m), ref.peak_from(m, 0), [&] { return "non_model_peak(" + num(m) + ")"; });
          eq(t.non_model_peak(m + n), ref.peak_from(m, 0),
             [&] { return "non_model_peak(" + num(m + n) + ") (wraps to moment " + num(m) + ")"; });
          eq(t.non_model_peak_from(m, 0), t.non_model_peak(m), [&] {
            return "non_model_peak_from(" + num(m) + ", 0), which must equal non_model_peak(" + num(m) + "),";
          });
          for (std::size_t e = 1; e <= ref.changes(m); ++e)
            eq(t.non_model_peak_from(m, e), ref.peak_from(m, e),
               [&] { return "non_model_peak_from(" + num(m) + ", " + num(e) + ")"; });
          for (const auto& c : ref.chunks)
            eq(t.next_use(c, m), ref.next_use(c, m), [&] { return "next_use(" + to_string(c) + ", " + num(m) + ")"; });
          eq(t.next_use(unknown, m), never, [&] { return "next_use of a chunk not in the trace at moment " + num(m); });
        }
        const auto a = t.accesses();
        bool ordered = true, in_range = true, recorded = true;
        for (std::size_t i = 0; i < a.size(); ++i) {
          if (i > 0 && a[i].moment < a[i - 1].moment) ordered = false;
          if (a[i].moment >= n) in_range = false;
          if (std::none_of(ref.accesses.begin(), ref.accesses.end(),
                           [&](const trace_access& x) { return x.moment == a[i].moment && x.id == a[i].id; }))
            recorded = false;
        }
        bool complete = true;
        for (const auto& x : ref.accesses)
          if (std::none_of(a.begin(), a.end(),
                           [&](const trace_access& y) { return x.moment == y.moment && x.id == y.id; }))
            complete = false;
        r.expect(ordered, [&] { return ctx + ": accesses() is not in moment order" + trace(); });
        r.expect(in_range, [&] { return ctx + ": accesses() holds a moment >= num_moments()" + trace(); });
        r.expect(recorded,
                 [&] { return ctx + ": accesses() holds a (moment, chunk) that was never recorded" + trace(); });
        r.expect(complete, [&] { return ctx + ": accesses() misses a recorded (moment, chunk)" + trace(); });
        for (std::size_t m = 0; m <= n; ++m) {
          std::size_t first = 0;
          while (first < a.size() && a[first].moment <= m) ++first;
          eq(t.first_access_after(m), first, [&] { return "first_access_after(" + num(m) + ")"; });
        }
      };

      // Runs one iteration of `script`. `diverge_at`: the moment where it leaves the current trace
      // (`current`), if it does; nullopt: it repeats the current trace, if any. `must_be_ready`:
      // the tracer had a trace before, so it must be ready wherever the trace matches.
      // `inject_at`: the moment that records a level one above its recorded peak (then restores).
      auto run = [&](const trace_script& script, const trace_reference* current, std::optional<std::size_t> diverge_at,
                     bool must_be_ready, std::optional<std::size_t> inject_at, const char* phase) {
        const trace_reference ref(script);
        const auto before = t.stats();
        t.begin_iteration();
        ++iterations;
        std::size_t level = 0;
        bool injected = false;  // the trace's peaks may have grown since: answers are not compared after it
        for (std::size_t m = 0; m < script.size(); ++m) {
          ctx = std::string(phase) + ", iteration " + std::to_string(iterations) + ", moment " + std::to_string(m);
          const std::size_t got = t.open_moment(script[m].kind, script[m].name);
          r.expect(got == m, [&] {
            return ctx + ": open_moment returned " + std::to_string(got) + "; moments count from 0 in every iteration";
          });
          r.expect(t.current_moment() == m,
                   [&] { return ctx + ": current_moment() is " + std::to_string(t.current_moment()); });
          const bool left = diverge_at && m >= *diverge_at;
          if (left) {
            r.expect(!t.ready(), [&] {
              return ctx + ": ready() after the iteration left the trace at moment " + std::to_string(*diverge_at) +
                     " (it must stay false for the rest of the iteration)";
            });
            if (m == *diverge_at)
              r.expect(t.stats().divergences == before.divergences + 1, [&] {
                return ctx + ": leaving the trace counted " +
                       std::to_string(t.stats().divergences - before.divergences) + " divergences, not 1";
              });
          } else if (must_be_ready) {
            r.expect(t.ready(), [&] { return ctx + ": not ready() though the trace matches this iteration so far"; });
          }
          if (t.ready() && current && !injected) check_answers(*current);
          else if (!t.ready()) check_neutral(current ? *current : ref);
          if (inject_at && m == *inject_at && t.ready()) {
            t.record_non_model(t.non_model_peak(m) + 1);
            t.record_non_model(level);
            injected = true;
          }
          for (const auto& e : script[m].events) {
            if (e.access) {
              t.record_access(e.id);
            } else {
              t.record_non_model(e.bytes);
              level = e.bytes;
            }
          }
        }
        t.end_iteration();
        const auto after = t.stats();
        ctx = std::string(phase) + ", after iteration " + std::to_string(iterations);
        r.expect(after.iterations == before.iterations + 1, [&] {
          return ctx + ": stats().iterations went from " + std::to_string(before.iterations) + " to " +
                 std::to_string(after.iterations) + " over one iteration";
        });
        if (!diverge_at)
          r.expect(after.divergences == before.divergences,
                   [&] { return ctx + ": an iteration identical to the trace counted a divergence"; });
        if (diverge_at)
          r.expect(after.traces > before.traces, [&] {
            return ctx +
                   ": the iteration left the trace, but stats().traces did not grow: it must be adopted at its end";
          });
        if (inject_at)
          r.expect(after.memory_divergences == before.memory_divergences + 1, [&] {
            return ctx + ": a level above the moment's recorded peak counted " +
                   std::to_string(after.memory_divergences - before.memory_divergences) + " memory divergences, not 1";
          });
        else
          r.expect(after.memory_divergences == before.memory_divergences,
                   [&] { return ctx + ": no level exceeded a recorded peak, yet a memory divergence was counted"; });
      };

      ctx = "a fresh tracer";
      r.expect(!t.ready(), "a tracer that has observed nothing is ready(): it cannot have a trace");
      if (!t.ready()) check_neutral(trace_reference(s));

      // Phase 1: identical iterations. No trace during the first; once ready, ready for good.
      const trace_reference ref_s(s);
      bool ready_seen = false;
      for (std::size_t i = 0; i < std::max<std::size_t>(1, o.warmup); ++i) {
        const bool was_ready = ready_seen;
        if (i == 0) {
          // No trace can exist before an iteration was adopted at its end.
          const auto before = t.stats();
          t.begin_iteration();
          ++iterations;
          for (std::size_t m = 0; m < s.size(); ++m) {
            ctx = "first iteration, moment " + std::to_string(m);
            const std::size_t got = t.open_moment(s[m].kind, s[m].name);
            r.expect(got == m, [&] {
              return ctx + ": open_moment returned " + std::to_string(got) + ", not " + std::to_string(m);
            });
            r.expect(t.current_moment() == m,
                     [&] { return ctx + ": current_moment() is " + std::to_string(t.current_moment()); });
            r.expect(!t.ready(),
                     [&] { return ctx + ": ready() during the first iteration, before any trace was adopted"; });
            if (!t.ready()) check_neutral(ref_s);
            for (const auto& e : s[m].events) e.access ? t.record_access(e.id) : t.record_non_model(e.bytes);
          }
          t.end_iteration();
          r.expect(t.stats().iterations == before.iterations + 1,
                   "stats().iterations did not count the first iteration");
          r.expect(t.stats().divergences == 0,
                   "the first iteration counted a divergence, though there was no trace to leave");
        } else {
          run(s, &ref_s, std::nullopt, was_ready, std::nullopt, "repeating one iteration");
        }
        ctx = "after iteration " + std::to_string(iterations) + " (every one alike)";
        if (t.ready()) {
          ready_seen = true;
          check_answers(ref_s);
        } else {
          r.expect(!was_ready, [&] { return ctx + ": ready() turned false while iterations repeat the trace"; });
          check_neutral(ref_s);
        }
      }
      if (!ready_seen) continue;  // never has a trace: the remaining laws do not apply
      ++scripts_with_trace;
      r.expect(t.stats().traces >= 1, "ready(), yet stats().traces is 0");

      // Phase 2: leave the trace by name at moment j; the new iteration is adopted.
      const std::size_t j = rng.below(s.size());
      trace_script s2(s.begin(), s.begin() + static_cast<std::ptrdiff_t>(j));
      for (auto& m : conformance_detail::random_script(rng, o.max_moments)) s2.push_back(std::move(m));
      s2[j].name = s[j].name + ".other";
      const trace_reference ref_s2(s2);
      run(s2, &ref_s, j, true, std::nullopt, "leaving the trace by name");
      run(s2, &ref_s2, std::nullopt, true, std::nullopt, "repeating the adopted iteration");
      ctx = "after adopting a new trace";
      if (t.ready()) check_answers(ref_s2);

      // Phase 3: leave it by kind (same name) at moment k.
      const std::size_t k = rng.below(s2.size());
      trace_script s3 = s2;
      s3[k].kind = static_cast<moment_kind>((static_cast<int>(s3[k].kind) + 1 + static_cast<int>(rng.below(2))) % 3);
      const trace_reference ref_s3(s3);
      run(s3, &ref_s2, k, true, std::nullopt, "leaving the trace by kind");
      run(s3, &ref_s3, std::nullopt, true, std::nullopt, "repeating the adopted iteration");

      // Phase 4: one moment more than the trace has.
      trace_script s4 = s3;
      s4.push_back({moment_kind::optimizer, "step", {{true, {chunk_kind::momentum, 0}, 0}}});
      const trace_reference ref_s4(s4);
      run(s4, &ref_s3, s3.size(), true, std::nullopt, "running past the trace's last moment");
      run(s4, &ref_s4, std::nullopt, true, std::nullopt, "repeating the adopted iteration");

      // Phase 5: one level above a moment's recorded peak.
      run(s4, &ref_s4, std::nullopt, true, rng.below(s4.size()), "exceeding a recorded peak");
    } catch (...) {
      r.fail("the tracer threw on script " + conformance_detail::describe_script(s) + ": " +
             current_exception_message());
      break;
    }
  }
  if (scripts_with_trace == 0 && o.scripts > 0)
    r.note("the tracer never had a trace (ready() stayed false): only the laws without a trace were exercised");
  return r;
}

/** @brief `check_tracer` on default-constructed tracers. */
template <Tracer T>
requires std::default_initializable<T>
[[nodiscard]] conformance_report check_tracer(const tracer_conformance_options& o = {}) {
  return check_tracer([] { return T{}; }, o);
}

}  // namespace chunkstar::testing
