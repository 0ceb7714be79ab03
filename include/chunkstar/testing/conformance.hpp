// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief What every conformance check returns, `conformance_report`, and the small deterministic
 *         generator the checks draw their inputs from.
 *
 *  The conformance checks (`chunkstar/testing/<concept>_conformance.hpp`) test the laws every model of a
 *  concept must obey, as the concept's doc comment states them, on a model you pass in. They use no
 *  test framework: each returns a report, and you assert on `report.ok()` in yours, e.g.
 *  @code
 *    const auto r = chunkstar::testing::check_eviction_strategy(my_eviction{});
 *    if (!r.ok()) { std::fputs(r.to_string().c_str(), stderr); return 1; }
 *  @endcode
 *  (doctest: `CHECK_MESSAGE(r.ok(), r.to_string())`; GoogleTest: `EXPECT_TRUE(r.ok()) << r.to_string()`.)
 */
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace chunkstar::testing {

/** @brief The outcome of a conformance check: how many times a law was evaluated (once per input),
 *  and a message for each that failed, naming the law and the inputs that broke it.
 *
 *  Only the first `max_recorded` failures keep their message (a model that breaks a law usually
 *  breaks it on thousands of inputs); `failed` counts them all. */
struct conformance_report {
  std::string subject;                ///< what was checked, e.g. "EvictionStrategy 'fifo'"
  std::vector<std::string> failures;  ///< the first `max_recorded` broken laws, with their inputs
  std::vector<std::string> notes;     ///< what could not be exercised (e.g. a tracer that never had a trace)
  std::size_t checks = 0;             ///< laws evaluated, passed or not
  std::size_t failed = 0;             ///< laws broken, including those whose message was not kept
  std::size_t max_recorded = 32;      ///< messages kept

  /** @brief True when no law was broken. */
  [[nodiscard]] bool ok() const noexcept { return failed == 0; }

  /** @brief Records one evaluation of a law. @p message is a string, or a callable returning one
   *  (built only when the law is broken, so checks stay cheap). Returns @p holds. */
  template <class Message>
  bool expect(bool holds, Message&& message) {
    ++checks;
    if (!holds) {
      if constexpr (std::is_invocable_v<Message&>)
        record_failure(failures.size() < max_recorded ? std::string(message()) : std::string());
      else record_failure(failures.size() < max_recorded ? std::string(std::forward<Message>(message)) : std::string());
    }
    return holds;
  }

  /** @brief Records a broken law (counts as one check). */
  void fail(std::string message) {
    ++checks;
    record_failure(std::move(message));
  }

  /** @brief Records something the check could not exercise; not a failure. */
  void note(std::string message) { notes.push_back(std::move(message)); }

  /** @brief Adds @p other's counts, failures and notes to this report, each message prefixed with
   *  @p prefix (e.g. "rank 2: "). */
  void merge(const conformance_report& other, std::string_view prefix = {}) {
    checks += other.checks;
    failed += other.failed;
    for (const auto& f : other.failures)
      if (failures.size() < max_recorded) failures.push_back(std::string(prefix) + f);
    for (const auto& n : other.notes) notes.push_back(std::string(prefix) + n);
  }

  /** @brief "EvictionStrategy 'fifo': 2 of 81234 checks failed:" followed by one line per kept
   *  failure and note; "...: OK (81234 checks)" when none failed. */
  [[nodiscard]] std::string to_string() const {
    std::string s = subject.empty() ? std::string("conformance") : subject;
    if (ok()) {
      s += ": OK (" + std::to_string(checks) + " checks)";
    } else {
      s += ": " + std::to_string(failed) + " of " + std::to_string(checks) + " checks failed:";
      for (const auto& f : failures) s += "\n  - " + f;
      if (failed > failures.size()) s += "\n  ... and " + std::to_string(failed - failures.size()) + " more";
    }
    for (const auto& n : notes) s += "\n  note: " + n;
    return s;
  }

 private:
  void record_failure(std::string message) {
    ++failed;
    if (failures.size() < max_recorded) failures.push_back(std::move(message));
  }
};

/** @brief One report from the reports of every rank of a group (index = rank): counts added,
 *  every kept failure and note prefixed with "rank k: ". The subject is the first report's. */
[[nodiscard]] inline conformance_report combine_rank_reports(std::span<const conformance_report> per_rank) {
  conformance_report all;
  if (!per_rank.empty()) all.subject = per_rank.front().subject;
  std::size_t kept = 0;
  for (const auto& r : per_rank) kept += r.failures.size();
  all.max_recorded = std::max(all.max_recorded, kept);  // each rank's messages, not only the first's
  for (std::size_t k = 0; k < per_rank.size(); ++k) all.merge(per_rank[k], "rank " + std::to_string(k) + ": ");
  return all;
}

/** @brief The message of the exception in flight, for reports; call inside a `catch`. */
[[nodiscard]] inline std::string current_exception_message() {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "a non-standard exception";
  }
}

namespace conformance_detail {

/** @brief splitmix64: the same inputs on every platform (the standard distributions are not
 *  specified bit for bit), so a failure a report names can be reproduced anywhere. */
class conformance_rng {
 public:
  explicit conformance_rng(std::uint64_t seed) noexcept : state_(seed) {}
  std::uint64_t next() noexcept {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  /** @brief Uniform enough in [0, n) for test inputs; 0 when n is 0. */
  std::size_t below(std::size_t n) noexcept { return n == 0 ? 0 : static_cast<std::size_t>(next() % n); }
  /** @brief True with probability 1/n. */
  bool one_in(std::size_t n) noexcept { return below(n) == 0; }

 private:
  std::uint64_t state_;
};

/** @brief A size for messages: "never" for SIZE_MAX (the value of chunkstar::never). */
inline std::string describe_value(std::size_t v) {
  return v == static_cast<std::size_t>(-1) ? std::string("never") : std::to_string(v);
}

}  // namespace conformance_detail
}  // namespace chunkstar::testing
