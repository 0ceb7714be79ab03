// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `check_chunk_layout`: the laws of the `ChunkLayout` concept
 *         (chunkstar/layout/chunk_layout.hpp), checked exhaustively on a small domain and on larger
 *         random tensor lists; and `plan_law_violation`, the law checker it applies to each plan.
 *
 *  The layout under test is built by a factory you pass, `make(max_chunk_elems, align_elems)`,
 *  which returns a layout whose plans have `align_elems == align_elems`, that accepts every tensor
 *  of at most `max_chunk_elems` elements and never uses chunks larger than that (for
 *  `fixed_chunk_layout`: chunks of exactly `max_chunk_elems`). Laws checked:
 *  - every plan is usable (`plan_violation`, chunkstar/layout/plan_validation.hpp: one aligned slot
 *    per tensor inside one chunk, matching its spec, listed once in `chunk_tensors` in offset order,
 *    no overlap);
 *  - a tensor never straddles chunks and tensors keep registration order within and across chunks
 *    (chunk order is use order: prefetch relies on it), also in `chunk_tensors`;
 *  - the plan's alignment is the layout's, chunk sizes are positive multiples of it within the
 *    bound, no chunk is empty, and an empty list gives no chunks;
 *  - deterministic: the same specs give the same plan, also from a copy of the layout (the copy
 *    and the next law on every fourth case of the small domain, which is redundant enough);
 *  - the plan depends only on the element counts (tensor_spec: "the layout only needs numel()"):
 *    other names, dtypes, roles or shapes of the same size give the same plan;
 *  - a tensor larger than the largest chunk the layout allows throws `config_error` naming the
 *    tensor (and, in the named edge case, its size and the bound); nothing else throws;
 *  - `name()` is not empty.
 *  The small domain: alignments 1..4, every aligned chunk bound up to 12, every list of up to 4
 *  tensors of 0..9 elements (25 x 11111 plans with the defaults).
 */
#pragma once

#include <chunkstar/core/dtype.hpp>
#include <chunkstar/core/error.hpp>
#include <chunkstar/core/tensor_spec.hpp>
#include <chunkstar/layout/chunk_layout.hpp>
#include <chunkstar/layout/plan_validation.hpp>
#include <chunkstar/testing/conformance.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace chunkstar::testing {

/** @brief The domain `check_chunk_layout` walks. */
struct layout_conformance_options {
  std::size_t max_align = 4;         ///< alignments 1..max_align
  std::size_t max_chunk_elems = 12;  ///< chunk bounds align, 2 align, ... up to this
  std::size_t max_tensors = 4;       ///< every list of up to this many tensors ...
  std::size_t max_numel = 9;         ///< ... of 0..max_numel elements each
  std::size_t random_trials = 300;   ///< larger random lists (up to 40 tensors, alignments up to 32)
  std::uint64_t seed = 11;           ///< the random lists' seed (reports are reproducible)
};

/** @brief A spec of @p numel elements named "t<index>", whose shape and dtype vary with the size
 *  and index (scalar, 2-D, 3-D, zero-sized 2-D; f16 or bf16), so `numel()` is exercised through
 *  different shapes. */
inline tensor_spec spec_of_numel(std::size_t numel, std::size_t index) {
  tensor_spec s;
  s.name = "t" + std::to_string(index);
  switch (numel) {
    case 0: s.shape = {3, 0}; break;
    case 1: s.shape = {}; break;
    case 6: s.shape = {2, 3}; break;
    case 9: s.shape = {3, 1, 3}; break;
    default: s.shape = {static_cast<std::int64_t>(numel)}; break;
  }
  s.type = index % 2 ? dtype::bf16 : dtype::f16;
  return s;
}

/** @brief Specs of the given sizes, `spec_of_numel(sizes[i], i)`. */
inline std::vector<tensor_spec> specs_of_numels(std::span<const std::size_t> sizes) {
  std::vector<tensor_spec> specs;
  specs.reserve(sizes.size());
  for (std::size_t i = 0; i < sizes.size(); ++i) specs.push_back(spec_of_numel(sizes[i], i));
  return specs;
}

/** @brief Every list of length <= @p max_len with element counts in [0, max_numel], shortest first. */
inline std::vector<std::vector<std::size_t>> all_size_lists(std::size_t max_len, std::size_t max_numel) {
  std::vector<std::vector<std::size_t>> out{{}};
  std::size_t begin = 0;
  for (std::size_t len = 1; len <= max_len; ++len) {
    const std::size_t end = out.size();
    for (std::size_t i = begin; i < end; ++i)
      for (std::size_t n = 0; n <= max_numel; ++n) {
        auto l = out[i];
        l.push_back(n);
        out.push_back(std::move(l));
      }
    begin = end;
  }
  return out;
}

/** @brief The first `ChunkLayout` law that @p p, planned by a layout aligned to @p align whose
 *  chunks are at most @p max_chunk_elems, breaks for @p specs; nullopt when it keeps them all.
 *  Independent of how any layout works: it only reads the plan, and is safe on any plan (it
 *  starts with `plan_violation`). */
[[nodiscard]] inline std::optional<std::string> plan_law_violation(std::span<const tensor_spec> specs,
                                                                   const chunk_plan& p, std::size_t align,
                                                                   std::size_t max_chunk_elems) {
  if (auto v = plan_violation(specs, p)) return v;
  auto str = [](std::size_t v) { return std::to_string(v); };
  auto who = [&](std::size_t i) { return "tensor " + str(i) + " ('" + specs[i].name + "')"; };
  if (p.align_elems != align)
    return "plan.align_elems is " + str(p.align_elems) + ", the layout aligns to " + str(align);
  if (specs.empty() && p.num_chunks != 0) return "no tensors but " + str(p.num_chunks) + " chunks";
  if (p.num_chunks > 0 && (p.chunk_elems % align != 0 || p.chunk_elems > max_chunk_elems))
    return "chunk_elems " + str(p.chunk_elems) + " is not a positive multiple of " + str(align) +
           " <= " + str(max_chunk_elems);
  for (std::size_t c = 0; c < p.num_chunks; ++c)
    if (p.chunk_tensors[c].empty()) return "chunk " + str(c) + " holds no tensor";

  // Registration order: each tensor starts in a later chunk, or in the same chunk at or after the
  // end of every earlier tensor there.
  std::size_t used = 0;
  std::size_t max_end = 0;  // end of the furthest tensor so far in the current chunk
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const tensor_slot& s = p.slots[i];
    if (i > 0) {
      const tensor_slot& prev = p.slots[i - 1];
      if (s.chunk < prev.chunk)
        return who(i) + ": placed in an earlier chunk than tensor " + str(i - 1) + ": order not kept";
      if (s.chunk == prev.chunk && s.offset < max_end)
        return who(i) + ": starts at " + str(s.offset) + " before an earlier tensor of its chunk ends (" +
               str(max_end) + "): order not kept";
      if (s.chunk != prev.chunk) max_end = 0;
    }
    max_end = std::max(max_end, s.offset + s.numel);
    used += s.numel;
  }
  for (std::size_t c = 0; c < p.num_chunks; ++c)
    for (std::size_t k = 1; k < p.chunk_tensors[c].size(); ++k)
      if (p.chunk_tensors[c][k - 1] > p.chunk_tensors[c][k])
        return "chunk_tensors[" + str(c) + "] is not in registration order";

  // Every element of every tensor maps to exactly one (chunk, offset), and no two tensors share one:
  // an independent check of the interval reasoning, with a full map when the plan is small.
  const std::size_t total = p.chunk_elems * p.num_chunks;
  if (total <= (std::size_t{1} << 20)) {
    std::vector<std::int64_t> owner(total, -1);
    for (std::size_t i = 0; i < specs.size(); ++i)
      for (std::size_t e = 0; e < p.slots[i].numel; ++e) {
        auto& o = owner[p.slots[i].chunk * p.chunk_elems + p.slots[i].offset + e];
        if (o != -1) return "tensors " + str(static_cast<std::size_t>(o)) + " and " + str(i) + " overlap";
        o = static_cast<std::int64_t>(i);
      }
    if (static_cast<std::size_t>(std::count(owner.begin(), owner.end(), -1)) != p.waste_elems())
      return "free elements in the map != waste_elems()";
  }
  if (p.used_elems() != used) return "used_elems() " + str(p.used_elems()) + " != " + str(used);
  if (p.total_elems() != total) return "total_elems() != chunk_elems * num_chunks";
  if (p.waste_elems() != total - used) return "waste_elems() != total - used";
  const double frac = p.waste_fraction();
  // In [0, 1); exactly 1 only when every tensor is empty (a chunk exists but holds no element).
  if (total == 0 ? frac != 0.0
                 : (frac < 0.0 || frac > 1.0 || (used > 0 && frac >= 1.0) ||
                    frac != static_cast<double>(total - used) / static_cast<double>(total)))
    return "waste_fraction() " + std::to_string(frac) + " wrong";
  return std::nullopt;
}

/** @brief Runs @p body over the small domain of @p o: for each alignment and aligned chunk bound,
 *  the layout `make(bound, align)`, then every size list: `body(layout, align, bound, sizes, specs)`. */
template <class Make, class Body>
void for_each_small_layout_case(Make&& make, const layout_conformance_options& o, Body&& body) {
  const auto lists = all_size_lists(o.max_tensors, o.max_numel);
  std::vector<std::vector<tensor_spec>> spec_lists;
  spec_lists.reserve(lists.size());
  for (const auto& l : lists) spec_lists.push_back(specs_of_numels(l));
  for (std::size_t align = 1; align <= o.max_align; ++align)
    for (std::size_t bound = align; bound <= o.max_chunk_elems; bound += align) {
      const auto layout = make(bound, align);
      for (std::size_t k = 0; k < lists.size(); ++k) body(layout, align, bound, lists[k], spec_lists[k]);
    }
}

namespace conformance_detail {

inline bool same_plan(const chunk_plan& a, const chunk_plan& b) {
  return a.chunk_elems == b.chunk_elems && a.align_elems == b.align_elems && a.num_chunks == b.num_chunks &&
         a.chunk_tensors == b.chunk_tensors &&
         std::equal(a.slots.begin(), a.slots.end(), b.slots.begin(), b.slots.end(),
                    [](const tensor_slot& x, const tensor_slot& y) {
                      return x.chunk == y.chunk && x.offset == y.offset && x.numel == y.numel;
                    });
}

/** @brief True when @p word occurs in @p text as a whole token (not inside a longer name or number). */
inline bool names_token(std::string_view text, std::string_view word) {
  auto part = [](char ch) {
    return (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || ch == '_' || ch == '.';
  };
  for (auto pos = text.find(word); pos != std::string_view::npos; pos = text.find(word, pos + 1)) {
    const bool starts = pos == 0 || !part(text[pos - 1]);
    const std::size_t end = pos + word.size();
    // A trailing '.' ends a sentence; only a following name character or digit continues the token.
    const bool ends = end == text.size() || !part(text[end]) ||
                      (text[end] == '.' && (end + 1 == text.size() || !part(text[end + 1])));
    if (starts && ends) return true;
  }
  return false;
}

inline std::string describe_sizes(std::span<const std::size_t> sizes) {
  std::string s = "[";
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (i) s += ' ';
    s += std::to_string(sizes[i]);
  }
  return s + "]";
}

/** @brief The same element counts under other names, dtypes, roles and shapes. */
inline std::vector<tensor_spec> respecified(std::span<const tensor_spec> specs) {
  std::vector<tensor_spec> out;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const auto n = static_cast<std::int64_t>(specs[i].numel());
    tensor_spec s;
    s.name = "renamed." + std::to_string(i);
    s.shape = i % 2 ? std::vector<std::int64_t>{n} : std::vector<std::int64_t>{1, n, 1};
    s.type = dtype::f32;
    s.role = i % 3 == 0 ? tensor_role::bias : tensor_role::other;
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace conformance_detail

/** @brief Checks the `ChunkLayout` laws (see the file comment) on the layouts @p make builds:
 *  `make(max_chunk_elems, align_elems)` returns a `ChunkLayout`. */
template <class Make>
requires std::invocable<Make&, std::size_t, std::size_t> &&
    ChunkLayout<std::remove_cvref_t<std::invoke_result_t<Make&, std::size_t, std::size_t>>>
[[nodiscard]] conformance_report check_chunk_layout(Make&& make, const layout_conformance_options& o = {}) {
  using L = std::remove_cvref_t<std::invoke_result_t<Make&, std::size_t, std::size_t>>;
  conformance_report r;
  r.subject = "ChunkLayout";
  std::size_t planned = 0, rejected = 0;

  // One case: a layout with this alignment and bound, and these sizes.
  auto check_case = [&](const L& layout, std::size_t align, std::size_t bound, std::span<const std::size_t> sizes,
                        std::span<const tensor_spec> specs, std::span<const tensor_spec> other) {
    const std::size_t largest = sizes.empty() ? 0 : *std::max_element(sizes.begin(), sizes.end());
    auto where = [&] {
      return "align " + std::to_string(align) + ", chunk bound " + std::to_string(bound) + ", sizes " +
             conformance_detail::describe_sizes(sizes) + ": ";
    };
    if (largest > bound) {
      ++rejected;
      try {
        (void)layout.plan(specs);
        r.fail(where() +
               "a tensor larger than the chunk bound was accepted (a tensor never straddles chunks: "
               "plan() must throw config_error naming it)");
      } catch (const config_error& e) {
        bool named = false;  // which oversized tensor it names, when several are, is the layout's choice
        for (std::size_t i = 0; i < sizes.size(); ++i)
          named = named || (sizes[i] > bound && conformance_detail::names_token(e.what(), specs[i].name));
        r.expect(named, [&] { return where() + "the config_error names no oversized tensor: " + e.what(); });
      } catch (...) {
        r.fail(where() + "an oversized tensor must throw config_error, not: " + current_exception_message());
      }
      return;
    }
    ++planned;
    chunk_plan p;
    try {
      p = layout.plan(specs);
    } catch (...) {
      r.fail(where() + "plan() threw though every tensor fits the bound: " + current_exception_message());
      return;
    }
    const auto bad = plan_law_violation(specs, p, align, bound);
    if (!r.expect(!bad, [&] { return where() + *bad; })) return;
    try {
      r.expect(conformance_detail::same_plan(layout.plan(specs), p),
               [&] { return where() + "not deterministic: a second plan() differs"; });
      if (planned % 4 != 1) return;  // the copy and the renamed specs on every fourth case: the domain is redundant
      if constexpr (std::copy_constructible<L>) {
        const L copy = layout;
        r.expect(conformance_detail::same_plan(copy.plan(specs), p),
                 [&] { return where() + "a copy of the layout plans differently"; });
      }
      r.expect(conformance_detail::same_plan(layout.plan(other), p), [&] {
        return where() +
               "the plan changes with the tensors' names, dtypes, roles or shapes, not only their element "
               "counts (the layout only needs numel())";
      });
    } catch (...) {
      r.fail(where() + "plan() threw on a repeat: " + current_exception_message());
    }
  };

  std::string name;
  try {
    {
      // The small domain, as for_each_small_layout_case walks it, with the respecified lists built once.
      const auto lists = all_size_lists(o.max_tensors, o.max_numel);
      std::vector<std::vector<tensor_spec>> specs, others;
      specs.reserve(lists.size());
      others.reserve(lists.size());
      for (const auto& l : lists) {
        specs.push_back(specs_of_numels(l));
        others.push_back(conformance_detail::respecified(specs.back()));
      }
      for (std::size_t align = 1; align <= o.max_align; ++align)
        for (std::size_t bound = align; bound <= o.max_chunk_elems; bound += align) {
          const auto layout = make(bound, align);
          for (std::size_t k = 0; k < lists.size(); ++k)
            check_case(layout, align, bound, lists[k], specs[k], others[k]);
        }
    }

    // Larger random lists, alignments up to 32.
    conformance_detail::conformance_rng rng(o.seed);
    static constexpr std::size_t aligns[] = {1, 2, 8, 32};
    for (std::size_t trial = 0; trial < o.random_trials; ++trial) {
      const std::size_t align = aligns[rng.below(4)];
      const std::size_t bound = align * (1 + rng.below(64));
      std::vector<std::size_t> sizes(rng.below(41));
      for (auto& s : sizes) s = rng.one_in(5) ? rng.below(3) : rng.below(bound + (rng.one_in(40) ? bound : 1));
      const auto layout = make(bound, align);
      const auto specs = specs_of_numels(sizes);
      check_case(layout, align, bound, sizes, specs, conformance_detail::respecified(specs));
    }

    // Edge cases on one layout.
    const auto layout = make(64, 8);
    name = std::string(std::string_view(layout.name()));
    r.expect(!name.empty(), "name() is empty; it names the layout in reports");
    {
      const chunk_plan p = layout.plan(std::span<const tensor_spec>{});
      r.expect(p.num_chunks == 0 && p.slots.empty() && p.chunk_tensors.empty() && p.total_elems() == 0,
               "an empty tensor list must give a plan with no chunks");
    }
    {
      const std::vector<tensor_spec> specs{spec_of_numel(10, 0),
                                           {"h.3.mlp.c_fc.weight", {13, 5}, dtype::f16, tensor_role::weight}};
      try {
        (void)layout.plan(specs);
        r.fail("a 65-element tensor was accepted by a layout whose chunks hold at most 64");
      } catch (const config_error& e) {
        const std::string m = e.what();
        r.expect(conformance_detail::names_token(m, "h.3.mlp.c_fc.weight") &&
                     conformance_detail::names_token(m, "65") && conformance_detail::names_token(m, "64"),
                 "the config_error for a 65-element tensor 'h.3.mlp.c_fc.weight' over a 64-element bound must name the "
                 "tensor and both sizes: " +
                     m);
      } catch (...) {
        r.fail("an oversized tensor must throw config_error, not: " + current_exception_message());
      }
    }
  } catch (...) {
    r.fail("the layout (or its factory) threw outside plan(): " + current_exception_message());
  }
  if (!name.empty()) r.subject = "ChunkLayout '" + name + "'";
  r.expect(planned > 0 && (o.max_numel <= o.max_chunk_elems || rejected > 0), "the domain was not walked");
  return r;
}

}  // namespace chunkstar::testing
