// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `plan_violation` and `validate_plan`: is a `chunk_plan` (from any layout, including a
 *         user's) one the runtime can use for these tensors? Safe on any plan, however corrupt.
 *
 *  The laws, checked in this order (the first one broken is reported):
 *  1. `align_elems` >= 1;
 *  2. one slot per spec (`slots.size() == specs.size()`) and one list per chunk
 *     (`chunk_tensors.size() == num_chunks`); a plan with chunks has `chunk_elems` >= 1;
 *  3. sizes fit: `chunk_elems * num_chunks` elements of the widest list (fp32 master, momentum,
 *     variance) are addressable in `size_t` bytes;
 *  4. per tensor, in registration order: its spec has an element count (no negative dimension, no
 *     overflow), the slot's `numel` is that count, its `chunk` is `< num_chunks`, its `offset` is a
 *     multiple of `align_elems`, and `[offset, offset + numel)` lies inside the chunk;
 *  5. `chunk_tensors[c]` lists exactly the tensors whose slot is in chunk `c`, each once, in
 *     non-decreasing offset order;
 *  6. no two tensors share an element (zero-element tensors share nothing).
 *  What a layout promises beyond these — registration order kept, chunk sizes within its bounds —
 *  is checked by `chunkstar::testing::check_chunk_layout` (chunkstar/testing/layout_conformance.hpp).
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/tensor_spec.hpp>
#include <chunkstar/layout/chunk_layout.hpp>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace chunkstar {

namespace detail {

/** @brief The element count of @p s, or nullopt when its shape has none: a negative dimension,
 *  or a running product past `size_t` (the rule the library's layouts apply). */
inline std::optional<std::size_t> checked_numel(const tensor_spec& s) noexcept {
  std::size_t n = 1;
  for (auto d : s.shape) {
    if (d < 0) return std::nullopt;
    const auto ud = static_cast<std::size_t>(d);
    if (ud != 0 && n > std::numeric_limits<std::size_t>::max() / ud) return std::nullopt;
    n *= ud;
  }
  return n;
}

/** @brief "tensor 'h.0.w' (#3)". */
inline std::string plan_tensor_name(std::span<const tensor_spec> specs, std::size_t i) {
  return "tensor '" + specs[i].name + "' (#" + std::to_string(i) + ")";
}

}  // namespace detail

/** @brief The first law (see the file comment) that @p plan breaks for @p specs, naming the tensor
 *  (by its spec's name) and the chunk; nullopt when the plan keeps them all. Reads only what it has
 *  checked is in range, so it is safe on any plan: O(tensors + chunk list entries) time, O(tensors)
 *  memory. */
[[nodiscard]] inline std::optional<std::string> plan_violation(std::span<const tensor_spec> specs,
                                                               const chunk_plan& plan) {
  auto str = [](std::size_t v) { return std::to_string(v); };
  const std::size_t n = specs.size();
  if (plan.align_elems == 0)
    return std::string("align_elems is 0; every offset must be a multiple of it, so it must be >= 1");
  if (plan.slots.size() != n) {
    std::string msg = "the plan has " + str(plan.slots.size()) + " slots for " + str(n) + " tensors";
    if (plan.slots.size() < n) msg += "; " + detail::plan_tensor_name(specs, plan.slots.size()) + " has none";
    return msg + " (slots are indexed like the specs passed to plan())";
  }
  if (plan.chunk_tensors.size() != plan.num_chunks)
    return "chunk_tensors has " + str(plan.chunk_tensors.size()) + " lists for num_chunks = " + str(plan.num_chunks) +
           " chunks (one list per chunk)";
  if (plan.num_chunks > 0 && plan.chunk_elems == 0)
    return "chunk_elems is 0 but the plan has " + str(plan.num_chunks) + " chunks";
  constexpr std::size_t widest = 4;  // bytes of an fp32 element: master, momentum and variance lists
  if (plan.chunk_elems != 0 && (plan.chunk_elems > std::numeric_limits<std::size_t>::max() / widest ||
                                plan.num_chunks > std::numeric_limits<std::size_t>::max() / widest / plan.chunk_elems))
    return "num_chunks = " + str(plan.num_chunks) + " chunks of chunk_elems = " + str(plan.chunk_elems) +
           " elements overflow size_t bytes in an fp32 list";

  for (std::size_t i = 0; i < n; ++i) {
    const tensor_slot& s = plan.slots[i];
    auto who = [&] { return detail::plan_tensor_name(specs, i); };  // built only for a message
    const auto numel = detail::checked_numel(specs[i]);
    if (!numel)
      return who() + " has shape " + specs[i].shape_string() +
             ", which has no element count (a negative dimension, or more than size_t elements)";
    if (s.numel != *numel)
      return who() + " in chunk " + str(s.chunk) + ": the slot holds " + str(s.numel) + " elements, the spec (shape " +
             specs[i].shape_string() + ") has " + str(*numel);
    if (s.chunk >= plan.num_chunks)
      return who() + ": its slot names chunk " + str(s.chunk) + ", but the plan has " + str(plan.num_chunks) +
             " chunks";
    if (s.offset % plan.align_elems != 0)
      return who() + " in chunk " + str(s.chunk) + ": offset " + str(s.offset) +
             " is not a multiple of align_elems = " + str(plan.align_elems);
    if (s.offset > plan.chunk_elems || s.numel > plan.chunk_elems - s.offset)
      return who() + " in chunk " + str(s.chunk) + ": elements [" + str(s.offset) + ", " + str(s.offset) + " + " +
             str(s.numel) + ") run past the chunk's end at " + str(plan.chunk_elems) +
             " (a tensor never straddles chunks)";
  }

  std::vector<std::uint8_t> listed(n, 0);
  for (std::size_t c = 0; c < plan.num_chunks; ++c) {
    const auto& list = plan.chunk_tensors[c];
    auto where = [&] { return "chunk_tensors[" + str(c) + "]"; };
    for (std::size_t k = 0; k < list.size(); ++k) {
      const std::size_t t = list[k];
      if (t >= n) return where() + " lists tensor #" + str(t) + ", but there are only " + str(n) + " tensors";
      auto who = [&] { return detail::plan_tensor_name(specs, t); };
      if (plan.slots[t].chunk != c)
        return where() + " lists " + who() + ", whose slot is in chunk " + str(plan.slots[t].chunk);
      if (listed[t]) return where() + " lists " + who() + " twice";
      listed[t] = 1;
      if (k > 0 && plan.slots[list[k - 1]].offset > plan.slots[t].offset)
        return where() + " is not in offset order: " + who() + " at offset " + str(plan.slots[t].offset) +
               " comes after " + detail::plan_tensor_name(specs, list[k - 1]) + " at offset " +
               str(plan.slots[list[k - 1]].offset);
    }
  }
  for (std::size_t t = 0; t < n; ++t)
    if (!listed[t])
      return detail::plan_tensor_name(specs, t) + " in chunk " + str(plan.slots[t].chunk) +
             " is missing from chunk_tensors[" + str(plan.slots[t].chunk) + "]";

  // Every list is complete and sorted by offset: a tensor overlaps an earlier one exactly when it
  // starts before the furthest end so far (offsets and sizes are within the chunk: no overflow).
  for (std::size_t c = 0; c < plan.num_chunks; ++c) {
    std::size_t end = 0, owner = 0;
    bool any = false;
    for (const std::size_t t : plan.chunk_tensors[c]) {
      const tensor_slot& s = plan.slots[t];
      if (s.numel == 0) continue;
      if (any && s.offset < end)
        return detail::plan_tensor_name(specs, t) + " in chunk " + str(c) + ": elements [" + str(s.offset) + ", " +
               str(s.offset + s.numel) + ") overlap " + detail::plan_tensor_name(specs, owner) + ", which ends at " +
               str(end);
      if (!any || s.offset + s.numel > end) {
        end = s.offset + s.numel;
        owner = t;
      }
      any = true;
    }
  }
  return std::nullopt;
}

/** @brief Throws `config_error` when @p plan breaks a law for @p specs: the message names the
 *  layout (@p layout_name, as its `name()`), the tensor and the chunk, and says what to fix. */
inline void validate_plan(std::span<const tensor_spec> specs, const chunk_plan& plan, std::string_view layout_name) {
  const auto violation = plan_violation(specs, plan);
  if (!violation) return;
  throw config_error("chunk layout '" + std::string(layout_name) + "' produced an unusable plan for " +
                     std::to_string(specs.size()) + " tensors: " + *violation +
                     ". Fix the layout's plan(): every tensor needs one aligned slot inside one chunk, matching its "
                     "spec, listed once in its chunk's chunk_tensors in offset order, overlapping no other tensor "
                     "(check a layout with chunkstar::testing::check_chunk_layout, "
                     "chunkstar/testing/layout_conformance.hpp)");
}

}  // namespace chunkstar
