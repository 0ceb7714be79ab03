// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief PatrickStar's warm-up tracer, made robust: it records one iteration (moments, chunk use
 *         order, non-model peak per moment), then serves that trace, detects when an iteration
 *         leaves it, and re-records instead of trusting a stale trace.
 */
#pragma once

#include <chunkstar/tracer/tracer.hpp>

#include <algorithm>
#include <string>
#include <unordered_map>
#include <vector>

namespace chunkstar {

/** @brief Records every iteration; adopts the recording as the trace when there was none or the
 *  iteration diverged from it. Between adoptions the recorded non-model peaks only grow (a moment
 *  that used more than recorded raises its peak), so budgets stay safe. */
class warmup_tracer {
 public:
  void begin_iteration() {
    rec_ = {};
    moment_ = 0;
    open_ = false;
    in_iteration_ = true;
    diverged_ = !has_trace_;
    ++stats_.iterations;
  }

  std::size_t open_moment(moment_kind k, std::string_view name) {
    if (open_) ++moment_;
    open_ = true;
    rec_.moments.push_back({k, std::string(name), carry_});
    rec_.levels.push_back({carry_});
    if (!diverged_ && (moment_ >= trace_.moments.size() || trace_.moments[moment_].kind != k ||
                       trace_.moments[moment_].name != name)) {
      diverged_ = true;
      ++stats_.divergences;
    }
    return moment_;
  }

  void record_access(chunk_id c) { rec_.accesses.push_back({open_ ? moment_ : 0, c}); }

  void record_non_model(std::size_t bytes) {
    carry_ = bytes;  // what is live when the next moment opens is part of that moment too
    // Between iterations (an input batch allocated before the first scope) the level only carries
    // into the next iteration's first moment: it is no moment's own, and no divergence.
    if (!in_iteration_ || rec_.moments.empty()) return;
    auto& peak = rec_.moments.back().non_model_peak;
    peak = std::max(peak, bytes);
    auto& levels = rec_.levels.back();
    levels.push_back(bytes);
    if (ready()) {
      if (bytes > trace_.moments[moment_].non_model_peak) {
        ++stats_.memory_divergences;
        trace_.moments[moment_].non_model_peak = bytes;  // budgets from now on include it
      }
      auto& tail = tails_[moment_];  // and so do the peaks of the rest of this moment
      for (std::size_t e = 0; e < std::min(levels.size(), tail.size()); ++e) tail[e] = std::max(tail[e], bytes);
    }
  }

  void end_iteration() {
    if (!diverged_ && rec_.moments.size() != trace_.moments.size()) {
      diverged_ = true;  // fewer moments than the trace: also a divergence
      ++stats_.divergences;
    }
    if (diverged_) adopt();
    open_ = false;
    in_iteration_ = false;
  }

  [[nodiscard]] bool ready() const noexcept { return has_trace_ && !diverged_; }
  [[nodiscard]] std::size_t current_moment() const noexcept { return moment_; }
  [[nodiscard]] std::size_t num_moments() const noexcept { return ready() ? trace_.moments.size() : 0; }

  [[nodiscard]] std::size_t non_model_peak(std::size_t m) const noexcept {
    if (!ready()) return 0;
    return trace_.moments[m % trace_.moments.size()].non_model_peak;
  }

  /** @brief Peak non-model bytes of moment @p m from its @p e-th non-model change on (e = 0: the
   *  whole moment); the whole moment's peak when the moment has fewer recorded changes. */
  [[nodiscard]] std::size_t non_model_peak_from(std::size_t m, std::size_t e) const noexcept {
    if (!ready()) return 0;
    const auto& tail = tails_[m % trace_.moments.size()];
    return e < tail.size() ? tail[e] : trace_.moments[m % trace_.moments.size()].non_model_peak;
  }

  [[nodiscard]] std::size_t next_use(chunk_id c, std::size_t m) const noexcept {
    if (!ready()) return never;
    const auto it = uses_.find(c);
    if (it == uses_.end()) return never;
    const auto& u = it->second;  // sorted moments
    const auto n = trace_.moments.size();
    const auto after = std::upper_bound(u.begin(), u.end(), m);
    return after != u.end() ? *after - m : n - m + u.front();
  }

  [[nodiscard]] std::span<const trace_access> accesses() const noexcept {
    return ready() ? std::span<const trace_access>(trace_.accesses) : std::span<const trace_access>();
  }

  [[nodiscard]] std::size_t first_access_after(std::size_t m) const noexcept {
    const auto a = accesses();
    return static_cast<std::size_t>(
        std::upper_bound(a.begin(), a.end(), m, [](std::size_t v, const trace_access& x) { return v < x.moment; }) -
        a.begin());
  }

  [[nodiscard]] moment_kind kind_of(std::size_t m) const noexcept {
    return ready() ? trace_.moments[m % trace_.moments.size()].kind : moment_kind::forward;
  }

  [[nodiscard]] tracer_stats stats() const noexcept { return stats_; }

  /** @brief The recorded moments, for reports: kind, scope name and non-model peak. */
  struct moment_record {
    moment_kind kind;
    std::string name;
    std::size_t non_model_peak = 0;
  };
  [[nodiscard]] std::span<const moment_record> moments() const noexcept { return trace_.moments; }

 private:
  struct recording {
    std::vector<moment_record> moments;
    std::vector<trace_access> accesses;
    std::vector<std::vector<std::size_t>> levels;  // per moment: non-model bytes at opening, after each change
  };

  void adopt() {
    trace_ = std::move(rec_);
    rec_ = {};
    tails_ = std::move(trace_.levels);  // suffix maxima: the peak from each change to the moment's end
    trace_.levels.clear();
    for (auto& t : tails_)
      for (std::size_t e = t.size(); e-- > 1;) t[e - 1] = std::max(t[e - 1], t[e]);
    uses_.clear();
    for (const auto& a : trace_.accesses) {
      auto& u = uses_[a.id];
      if (u.empty() || u.back() != a.moment) u.push_back(a.moment);
    }
    has_trace_ = !trace_.moments.empty();
    diverged_ = false;
    ++stats_.traces;
  }

  recording trace_;                                              // the adopted trace
  recording rec_;                                                // the iteration being recorded
  std::unordered_map<chunk_id, std::vector<std::size_t>> uses_;  // chunk -> moments using it
  std::vector<std::vector<std::size_t>> tails_;                  // per moment: peak from each non-model change on
  std::size_t moment_ = 0;
  std::size_t carry_ = 0;
  bool open_ = false;
  bool in_iteration_ = false;
  bool has_trace_ = false;
  bool diverged_ = true;
  tracer_stats stats_;
};

static_assert(Tracer<warmup_tracer>);

}  // namespace chunkstar
