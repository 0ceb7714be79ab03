// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief A tracer that records nothing: the runtime then budgets from current use and evicts LRU.
 */
#pragma once

#include <chunkstar/tracer/tracer.hpp>

namespace chunkstar {

/** @brief Never has a trace. Counts moments and iterations only. */
class null_tracer {
 public:
  void begin_iteration() noexcept {
    moment_ = 0;
    ++stats_.iterations;
  }
  std::size_t open_moment(moment_kind, std::string_view) noexcept { return moment_++; }
  void record_access(chunk_id) noexcept {}
  void record_non_model(std::size_t) noexcept {}
  void end_iteration() noexcept {}
  [[nodiscard]] bool ready() const noexcept { return false; }
  [[nodiscard]] std::size_t current_moment() const noexcept { return moment_ == 0 ? 0 : moment_ - 1; }
  [[nodiscard]] std::size_t num_moments() const noexcept { return 0; }
  [[nodiscard]] std::size_t non_model_peak(std::size_t) const noexcept { return 0; }
  [[nodiscard]] std::size_t non_model_peak_from(std::size_t, std::size_t) const noexcept { return 0; }
  [[nodiscard]] std::size_t next_use(chunk_id, std::size_t) const noexcept { return never; }
  [[nodiscard]] std::span<const trace_access> accesses() const noexcept { return {}; }
  [[nodiscard]] std::size_t first_access_after(std::size_t) const noexcept { return 0; }
  [[nodiscard]] moment_kind kind_of(std::size_t) const noexcept { return moment_kind::forward; }
  [[nodiscard]] tracer_stats stats() const noexcept { return stats_; }

 private:
  std::size_t moment_ = 0;
  tracer_stats stats_;
};

static_assert(Tracer<null_tracer>);

}  // namespace chunkstar
