/** @file
 *  @brief `searched_chunk_layout`: tries every chunk size on a grid within bounds, packs next-fit
 *         at each, and keeps the size that wastes the fewest elements (as Gemini's chunk search).
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/tensor_spec.hpp>
#include <chunkstar/layout/chunk_layout.hpp>
#include <chunkstar/layout/detail/next_fit.hpp>

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>

namespace chunkstar {

/** @brief Knobs of `searched_chunk_layout`. Sizes are elements and must be positive multiples of
 *  `align_elems`. The defaults suit GPT-like models, whose largest tensor (the embedding) is a few
 *  to a few tens of Mi elements. */
struct searched_layout_options {
  std::size_t min_chunk_elems = std::size_t{1} << 20;   ///< smallest chunk considered (1 Mi elements)
  std::size_t max_chunk_elems = std::size_t{64} << 20;  ///< largest chunk considered (64 Mi elements)
  std::size_t step_elems = std::size_t{128} << 10;      ///< grid spacing (128 Ki elements)
  std::size_t align_elems = 32;                         ///< every offset is a multiple of this
  /** At most this many sizes are packed; a finer grid is widened (step rounded up to alignment)
   *  so planning stays fast for any bounds. At least 1. */
  std::size_t max_candidates = 1024;
};

/** @brief How the search went: the grid it walked and the best and worst sizes on it. */
struct search_report {
  std::size_t candidates_tried = 0;
  std::size_t first_candidate_elems = 0;  ///< max(min_chunk_elems, largest tensor rounded up to alignment)
  std::size_t last_candidate_elems = 0;
  std::size_t step_elems = 0;             ///< the step walked: options.step_elems, or wider when capped
  std::size_t best_chunk_elems = 0;       ///< the chosen size (the smallest one on ties)
  std::size_t best_waste_elems = 0;
  std::size_t worst_chunk_elems = 0;      ///< the smallest size with the most waste
  std::size_t worst_waste_elems = 0;
};

/** @brief The chosen plan and how it was found. */
struct searched_layout_result {
  chunk_plan plan;
  search_report report;
};

/** @brief Picks the chunk size with the least waste (allocated minus used elements) among
 *  `first, first + step, ... <= max_chunk_elems`, where `first` is the larger of `min_chunk_elems`
 *  and the largest tensor rounded up to alignment; ties go to the smaller chunk (finer movement).
 *  Packs with the same next-fit rule as `fixed_chunk_layout`. A tensor larger than
 *  `max_chunk_elems` throws `config_error` naming it. */
class searched_chunk_layout {
 public:
  /** @brief The default options. Not explicit, so that a defaulted `Layout layout = {}` parameter
   *  (chunk_runtime's) is valid copy-list-initialization: with only the explicit constructor below
   *  taking a defaulted argument, clang rejects `patrickstar_runtime rt(device, host, copier);`
   *  ("chosen constructor is explicit in copy-initialization"; GCC accepts it). */
  searched_chunk_layout() : searched_chunk_layout(searched_layout_options{}) {}

  /** @brief Validates @p options (alignment >= 1; min, max and step positive multiples of the
   *  alignment; min <= max; max_candidates >= 1), throwing `config_error` otherwise. */
  explicit searched_chunk_layout(searched_layout_options options) : options_(options) {
    detail::require_alignment("searched_layout_options::align_elems", options_.align_elems);
    detail::require_positive_multiple("searched_layout_options::min_chunk_elems", options_.min_chunk_elems,
                                      options_.align_elems);
    detail::require_positive_multiple("searched_layout_options::max_chunk_elems", options_.max_chunk_elems,
                                      options_.align_elems);
    detail::require_positive_multiple("searched_layout_options::step_elems", options_.step_elems,
                                      options_.align_elems);
    if (options_.min_chunk_elems > options_.max_chunk_elems)
      throw config_error("searched_layout_options: min_chunk_elems (" + std::to_string(options_.min_chunk_elems) +
                         ") is larger than max_chunk_elems (" + std::to_string(options_.max_chunk_elems) +
                         "); swap them or raise max_chunk_elems");
    if (options_.max_candidates == 0)
      throw config_error("searched_layout_options::max_candidates is 0; it must be at least 1 (default 1024)");
  }

  /** @brief The plan at the chosen size, with the search's report. */
  [[nodiscard]] searched_layout_result search(std::span<const tensor_spec> specs) const {
    const auto numels = detail::layout_numels(specs, "searched_chunk_layout");
    const std::size_t align = options_.align_elems;
    std::size_t first = options_.min_chunk_elems;
    if (!numels.empty()) {
      const std::size_t big = detail::largest_tensor(numels);
      if (numels[big] > options_.max_chunk_elems)
        throw config_error("searched_chunk_layout: " + detail::describe_tensor(specs[big], numels[big]) +
                           " is larger than max_chunk_elems (" + std::to_string(options_.max_chunk_elems) +
                           "), and a tensor never straddles chunks; raise max_chunk_elems to at least " +
                           std::to_string(detail::layout_round_up(numels[big], align)) +
                           " or split the tensor");
      first = std::max(first, detail::layout_round_up(numels[big], align));
    }
    // max is aligned and >= the largest tensor, so first <= max.
    const std::size_t span = options_.max_chunk_elems - first;
    std::size_t step = options_.step_elems;
    if (span / step + 1 > options_.max_candidates)
      step = options_.max_candidates == 1 ? span + align
                                          : detail::layout_round_up((span + options_.max_candidates - 2) /
                                                                        (options_.max_candidates - 1),
                                                                    align);

    search_report r;
    r.first_candidate_elems = first;
    r.step_elems = step;
    for (std::size_t c = first; c <= options_.max_chunk_elems; c += step) {
      const std::size_t waste = detail::next_fit_waste(numels, c, align);
      if (r.candidates_tried == 0 || waste < r.best_waste_elems) {
        r.best_chunk_elems = c;
        r.best_waste_elems = waste;
      }
      if (r.candidates_tried == 0 || waste > r.worst_waste_elems) {
        r.worst_chunk_elems = c;
        r.worst_waste_elems = waste;
      }
      r.last_candidate_elems = c;
      ++r.candidates_tried;
      if (options_.max_chunk_elems - c < step) break;  // the next step would pass max (or wrap)
    }
    return {detail::next_fit_plan(numels, r.best_chunk_elems, align), r};
  }

  /** @brief The plan at the chosen size (`search(specs).plan`). */
  [[nodiscard]] chunk_plan plan(std::span<const tensor_spec> specs) const { return search(specs).plan; }

  /** @brief "searched", for reports. */
  [[nodiscard]] static constexpr std::string_view name() noexcept { return "searched"; }

  /** @brief The options this layout was built with. */
  [[nodiscard]] const searched_layout_options& options() const noexcept { return options_; }

 private:
  searched_layout_options options_;
};

static_assert(ChunkLayout<searched_chunk_layout>);

}  // namespace chunkstar
