// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `fixed_chunk_layout`: every chunk holds exactly `chunk_elems` elements; tensors are packed
 *         next-fit in registration order. The `ChunkLayout` model to use when the chunk size is known.
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/tensor_spec.hpp>
#include <chunkstar/layout/chunk_layout.hpp>
#include <chunkstar/layout/detail/next_fit.hpp>

#include <cstddef>
#include <span>
#include <string>
#include <string_view>

namespace chunkstar {

/** @brief Knobs of `fixed_chunk_layout`. */
struct fixed_layout_options {
  /** Capacity of every chunk, in elements; a positive multiple of `align_elems`. The default
   *  (32 Mi elements: 64 MiB of fp16 params, 128 MiB per fp32 list) holds the largest tensor of
   *  GPT-2 XL-sized models and keeps transfers long enough to run near link bandwidth. */
  std::size_t chunk_elems = std::size_t{32} << 20;
  /** Every tensor starts at a multiple of this many elements (32 = 64 bytes at 2-byte dtypes,
   *  128 bytes in the fp32 lists: enough for vectorised kernels on every tensor). */
  std::size_t align_elems = 32;
};

/** @brief Packs tensors in registration order into chunks of exactly `chunk_elems` elements:
 *  a tensor goes at the next aligned offset of the current chunk, or opens a new chunk when it
 *  does not fit there. Never reorders, because chunk order is use order.
 *
 *  Zero-element tensors get a slot (numel 0) at an aligned offset of the current chunk (which is
 *  the chunk's end when the chunk is full: `[end, end)` holds nothing and crosses nothing). A tensor
 *  larger than `chunk_elems` throws `config_error` naming it. */
class fixed_chunk_layout {
 public:
  /** @brief The default options. Not explicit, so that a defaulted `Layout layout = {}` parameter
   *  (chunk_runtime's) is valid copy-list-initialization: with only the explicit constructor below
   *  taking a defaulted argument, clang rejects `patrickstar_runtime rt(device, host, copier);`
   *  ("chosen constructor is explicit in copy-initialization"; GCC accepts it). */
  fixed_chunk_layout() : fixed_chunk_layout(fixed_layout_options{}) {}

  /** @brief Validates @p options; throws `config_error` when `chunk_elems` is not a positive
   *  multiple of `align_elems` (the message suggests the rounded values) or `align_elems` is 0. */
  explicit fixed_chunk_layout(fixed_layout_options options) : options_(options) {
    detail::require_alignment("fixed_layout_options::align_elems", options_.align_elems);
    detail::require_positive_multiple("fixed_layout_options::chunk_elems", options_.chunk_elems, options_.align_elems);
  }

  /** @brief Lays out @p specs; see the class comment. An empty list gives a plan with no chunks. */
  [[nodiscard]] chunk_plan plan(std::span<const tensor_spec> specs) const {
    const auto numels = detail::layout_numels(specs, "fixed_chunk_layout");
    for (std::size_t i = 0; i < numels.size(); ++i) {
      if (numels[i] > options_.chunk_elems)
        throw config_error("fixed_chunk_layout: " + detail::describe_tensor(specs[i], numels[i]) +
                           " does not fit in a chunk of " + std::to_string(options_.chunk_elems) +
                           " elements, and a tensor never straddles chunks; set chunk_elems to at least " +
                           std::to_string(detail::layout_round_up(numels[i], options_.align_elems)) +
                           " or use searched_chunk_layout, which picks a chunk size that fits the largest tensor");
    }
    return detail::next_fit_plan(numels, options_.chunk_elems, options_.align_elems);
  }

  /** @brief "fixed", for reports. */
  [[nodiscard]] static constexpr std::string_view name() noexcept { return "fixed"; }

  /** @brief The options this layout was built with. */
  [[nodiscard]] const fixed_layout_options& options() const noexcept { return options_; }

 private:
  fixed_layout_options options_;
};

static_assert(ChunkLayout<fixed_chunk_layout>);

}  // namespace chunkstar
