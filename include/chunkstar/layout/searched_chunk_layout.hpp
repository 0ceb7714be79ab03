// SPDX-License-Identifier: Apache-2.0
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

/** @brief Knobs of `searched_chunk_layout`. Sizes are elements; a non-zero size must be a positive
 *  multiple of `align_elems`. Zero (the default) fits the bound to the tensors being laid out:
 *  chunks from the largest tensor (rounded up to the alignment) to `spread` times that, on a grid
 *  of the alignment, so a model of any size gets chunks of its own scale (a 150k-parameter model is
 *  not packed into one 1 Mi-element chunk per list) and a layer spans a few of them. */
struct searched_layout_options {
  std::size_t min_chunk_elems = 0;  ///< smallest chunk considered (0: the largest tensor)
  std::size_t max_chunk_elems = 0;  ///< largest chunk considered (0: `spread` times the smallest)
  std::size_t step_elems = 0;       ///< grid spacing (0: the alignment, widened to max_candidates)
  std::size_t align_elems = 32;     ///< every offset is a multiple of this
  /** At most this many sizes are packed; a finer grid is widened (step rounded up to alignment)
   *  so planning stays fast for any bounds. At least 1. */
  std::size_t max_candidates = 1024;
  std::size_t spread = 4;  ///< with max_chunk_elems 0: how many times the smallest chunk the largest may be

  /** @brief These options with every zero bound fitted to @p specs (see the struct comment). */
  [[nodiscard]] searched_layout_options fitted_to(std::span<const tensor_spec> specs) const {
    searched_layout_options o = *this;
    std::size_t largest = 0;
    for (const auto& s : specs) largest = std::max(largest, s.numel());
    const std::size_t a = std::max<std::size_t>(align_elems, 1);
    const std::size_t lo = std::max<std::size_t>((largest + a - 1) / a * a, a);
    if (o.min_chunk_elems == 0) o.min_chunk_elems = lo;
    if (o.max_chunk_elems == 0) o.max_chunk_elems = std::max<std::size_t>(spread, 1) * std::max(o.min_chunk_elems, lo);
    if (o.step_elems == 0) o.step_elems = a;
    return o;
  }
};

/** @brief How the search went: the grid it walked and the best and worst sizes on it. */
struct search_report {
  std::size_t candidates_tried = 0;
  std::size_t first_candidate_elems = 0;  ///< max(min_chunk_elems, largest tensor rounded up to alignment)
  std::size_t last_candidate_elems = 0;
  std::size_t step_elems = 0;        ///< the step walked: options.step_elems, or wider when capped
  std::size_t best_chunk_elems = 0;  ///< the chosen size (the smallest one on ties)
  std::size_t best_waste_elems = 0;
  std::size_t worst_chunk_elems = 0;  ///< the smallest size with the most waste
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

  /** @brief Validates @p options (alignment >= 1; min, max and step zero — fitted to the tensors —
   *  or positive multiples of the alignment; min <= max; max_candidates >= 1), throwing
   *  `config_error` otherwise. */
  explicit searched_chunk_layout(searched_layout_options options) : options_(options) {
    detail::require_alignment("searched_layout_options::align_elems", options_.align_elems);
    const auto fitted_or_multiple = [&](const char* name, std::size_t v) {
      if (v != 0) detail::require_positive_multiple(name, v, options_.align_elems);
    };
    fitted_or_multiple("searched_layout_options::min_chunk_elems", options_.min_chunk_elems);
    fitted_or_multiple("searched_layout_options::max_chunk_elems", options_.max_chunk_elems);
    fitted_or_multiple("searched_layout_options::step_elems", options_.step_elems);
    if (options_.min_chunk_elems != 0 && options_.max_chunk_elems != 0 &&
        options_.min_chunk_elems > options_.max_chunk_elems)
      throw config_error("searched_layout_options: min_chunk_elems (" + std::to_string(options_.min_chunk_elems) +
                         ") is larger than max_chunk_elems (" + std::to_string(options_.max_chunk_elems) +
                         "); swap them or raise max_chunk_elems");
    if (options_.max_candidates == 0)
      throw config_error("searched_layout_options::max_candidates is 0; it must be at least 1 (default 1024)");
  }

  /** @brief The plan at the chosen size, with the search's report. */
  [[nodiscard]] searched_layout_result search(std::span<const tensor_spec> specs) const {
    const searched_layout_options o = options_.fitted_to(specs);  // the bounds for these tensors
    const auto numels = detail::layout_numels(specs, "searched_chunk_layout");
    const std::size_t align = o.align_elems;
    std::size_t first = o.min_chunk_elems;
    if (!numels.empty()) {
      const std::size_t big = detail::largest_tensor(numels);
      if (numels[big] > o.max_chunk_elems)
        throw config_error("searched_chunk_layout: " + detail::describe_tensor(specs[big], numels[big]) +
                           " is larger than max_chunk_elems (" + std::to_string(o.max_chunk_elems) +
                           "), and a tensor never straddles chunks; raise max_chunk_elems to at least " +
                           std::to_string(detail::layout_round_up(numels[big], align)) + " or split the tensor");
      first = std::max(first, detail::layout_round_up(numels[big], align));
    }
    // max is aligned and >= the largest tensor, so first <= max.
    const std::size_t span = o.max_chunk_elems - first;
    std::size_t step = o.step_elems;
    if (span / step + 1 > o.max_candidates)
      step = o.max_candidates == 1
                 ? span + align
                 : detail::layout_round_up((span + o.max_candidates - 2) / (o.max_candidates - 1), align);

    search_report r;
    r.first_candidate_elems = first;
    r.step_elems = step;
    for (std::size_t c = first; c <= o.max_chunk_elems; c += step) {
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
      if (o.max_chunk_elems - c < step) break;  // the next step would pass max (or wrap)
    }
    return {detail::next_fit_plan(numels, r.best_chunk_elems, align), r};
  }

  /** @brief The plan at the chosen size (`search(specs).plan`). */
  [[nodiscard]] chunk_plan plan(std::span<const tensor_spec> specs) const { return search(specs).plan; }

  /** @brief "searched", for reports. */
  [[nodiscard]] static constexpr std::string_view name() noexcept { return "searched"; }

  /** @brief The options this layout was built with (zero bounds: fitted to each plan's tensors,
   *  see searched_layout_options::fitted_to). */
  [[nodiscard]] const searched_layout_options& options() const noexcept { return options_; }

 private:
  searched_layout_options options_;
};

static_assert(ChunkLayout<searched_chunk_layout>);

}  // namespace chunkstar
