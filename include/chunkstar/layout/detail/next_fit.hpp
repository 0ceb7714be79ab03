// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief The next-fit packing rule shared by every chunk layout, and the checks and messages
 *         both layouts give for bad options and oversized tensors. Private: include the layouts.
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/tensor_spec.hpp>
#include <chunkstar/layout/chunk_layout.hpp>

#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace chunkstar::detail {

/** @brief @p n rounded up to a multiple of @p align (align >= 1; no overflow for layout sizes). */
constexpr std::size_t layout_round_up(std::size_t n, std::size_t align) noexcept {
  return (n + align - 1) / align * align;
}

/** @brief The next-fit rule: tensors go in registration order; each starts at the first aligned
 *  offset after the previous one, and a new chunk opens when it would run past the chunk's end
 *  (or when no chunk is open yet, so even a zero-element tensor has a chunk). Never reorders:
 *  chunk order is use order, which is what prefetch relies on.
 *
 *  Preconditions: `align_elems >= 1`, `chunk_elems` a multiple of it, every numel <= chunk_elems.
 *  Calls `on_place(index, chunk, offset)` for each tensor; returns the number of chunks. */
template <class OnPlace>
constexpr std::size_t next_fit(std::span<const std::size_t> numels, std::size_t chunk_elems, std::size_t align_elems,
                               OnPlace&& on_place) {
  std::size_t chunks = 0;
  std::size_t cursor = 0;  // first free element of the open chunk
  for (std::size_t i = 0; i < numels.size(); ++i) {
    std::size_t offset = layout_round_up(cursor, align_elems);
    // offset <= chunk_elems always (cursor <= chunk_elems, chunk_elems aligned), so no overflow.
    if (chunks == 0 || numels[i] > chunk_elems - offset) {
      ++chunks;
      offset = 0;
    }
    on_place(i, chunks - 1, offset);
    cursor = offset + numels[i];
  }
  return chunks;
}

/** @brief Waste (allocated minus used elements) of next-fit at @p chunk_elems, without building
 *  the plan: what the chunk-size search evaluates for each candidate. */
constexpr std::size_t next_fit_waste(std::span<const std::size_t> numels, std::size_t chunk_elems,
                                     std::size_t align_elems) {
  std::size_t used = 0;
  for (auto n : numels) used += n;
  const std::size_t chunks = next_fit(numels, chunk_elems, align_elems, [](std::size_t, std::size_t, std::size_t) {});
  return chunks * chunk_elems - used;
}

/** @brief The full plan of next-fit at @p chunk_elems. */
inline chunk_plan next_fit_plan(std::span<const std::size_t> numels, std::size_t chunk_elems, std::size_t align_elems) {
  chunk_plan p;
  p.chunk_elems = chunk_elems;
  p.align_elems = align_elems;
  p.slots.resize(numels.size());
  p.num_chunks = next_fit(numels, chunk_elems, align_elems, [&](std::size_t i, std::size_t c, std::size_t off) {
    p.slots[i] = tensor_slot{c, off, numels[i]};
    if (c == p.chunk_tensors.size()) p.chunk_tensors.emplace_back();
    p.chunk_tensors[c].push_back(i);  // placement order is offset order within a chunk
  });
  return p;
}

/** @brief "tensor 'h.0.attn.w' (shape [768, 2304], 1769472 elements)" for messages. */
inline std::string describe_tensor(const tensor_spec& s, std::size_t numel) {
  return "tensor '" + s.name + "' (shape " + s.shape_string() + ", " + std::to_string(numel) + " elements)";
}

/** @brief Element counts of @p specs, rejecting shapes that have no element count (a negative
 *  dimension, or a product that does not fit in size_t). @p who names the layout in messages. */
inline std::vector<std::size_t> layout_numels(std::span<const tensor_spec> specs, std::string_view who) {
  std::vector<std::size_t> numels;
  numels.reserve(specs.size());
  for (const auto& s : specs) {
    std::size_t n = 1;
    for (auto d : s.shape) {
      if (d < 0)
        throw config_error(std::string(who) + ": tensor '" + s.name + "' has shape " + s.shape_string() +
                           " with a negative dimension; register it with its real (non-negative) shape");
      const auto ud = static_cast<std::size_t>(d);
      if (ud != 0 && n > std::numeric_limits<std::size_t>::max() / ud)
        throw config_error(std::string(who) + ": tensor '" + s.name + "' has shape " + s.shape_string() +
                           " whose element count overflows size_t; check the shape it was registered with");
      n *= ud;
    }
    numels.push_back(n);
  }
  return numels;
}

/** @brief Throws unless @p value is a positive multiple of @p align, suggesting the nearest
 *  multiples. @p option is e.g. "fixed_layout_options::chunk_elems". */
inline void require_positive_multiple(std::string_view option, std::size_t value, std::size_t align) {
  if (value != 0 && value % align == 0) return;
  const std::size_t up = value == 0 ? align : layout_round_up(value, align);
  const std::size_t down = value / align * align;
  std::string fix = "use " + std::to_string(up) + " (rounded up)";
  if (down != 0) fix += " or " + std::to_string(down) + " (rounded down)";
  throw config_error(std::string(option) + " is " + std::to_string(value) +
                     ", but it must be a positive multiple of align_elems (" + std::to_string(align) + "); " + fix);
}

/** @brief Throws unless @p align is at least one element. */
inline void require_alignment(std::string_view option, std::size_t align) {
  if (align == 0)
    throw config_error(std::string(option) +
                       " is 0; it must be at least 1 element (32 elements = 64 bytes at 2-byte dtypes is the default)");
}

/** @brief Index of the largest tensor (the first one on ties); numels must not be empty. */
inline std::size_t largest_tensor(std::span<const std::size_t> numels) noexcept {
  std::size_t best = 0;
  for (std::size_t i = 1; i < numels.size(); ++i)
    if (numels[i] > numels[best]) best = i;
  return best;
}

}  // namespace chunkstar::detail
