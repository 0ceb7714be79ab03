/** @file
 *  @brief Conformance suite for the `ChunkLayout` concept: the laws every layout must obey, checked
 *         exhaustively on small domains. Instantiate per model with
 *         `TEST_CASE_TEMPLATE_INVOKE(chunk_layout_conformance, my_layout, ...)` after specialising
 *         `chunkstar::testing::layout_conformance_traits<my_layout>` with
 *           `static my_layout make(std::size_t max_chunk_elems, std::size_t align_elems);`
 *         returning a layout with that alignment that accepts every tensor of at most
 *         `max_chunk_elems` elements and never uses chunks larger than that.
 */
#pragma once

#include <chunkstar/core/dtype.hpp>
#include <chunkstar/core/error.hpp>
#include <chunkstar/core/tensor_spec.hpp>
#include <chunkstar/layout/chunk_layout.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace chunkstar::testing {

template <class L>
struct layout_conformance_traits;

/** @brief A spec of @p numel elements whose shape varies with the size (scalar, 2-D, zero-sized
 *  2-D), so numel() is exercised through different shapes. */
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

/** @brief Every list of length <= @p max_len with element counts in [0, max_numel]. */
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

/** @brief The first law @p p breaks for @p specs, or "" when it keeps them all. Independent of how
 *  any layout works: it only reads the plan. Checks element ownership with a full map when the
 *  plan is small enough, and with ordered intervals always. */
inline std::string plan_law_violation(const chunk_plan& p, std::span<const tensor_spec> specs, std::size_t align,
                                      std::size_t max_chunk_elems) {
  auto str = [](std::size_t v) { return std::to_string(v); };
  if (p.align_elems != align) return "plan.align_elems is " + str(p.align_elems) + ", layout aligns to " + str(align);
  if (p.slots.size() != specs.size()) return "slots.size() " + str(p.slots.size()) + " != specs " + str(specs.size());
  if (p.chunk_tensors.size() != p.num_chunks) return "chunk_tensors.size() != num_chunks";
  if (specs.empty() && p.num_chunks != 0) return "no tensors but " + str(p.num_chunks) + " chunks";
  if (p.num_chunks > specs.size()) return "more chunks than tensors: some chunk is empty";
  if (p.num_chunks > 0 && (p.chunk_elems == 0 || p.chunk_elems % align != 0 || p.chunk_elems > max_chunk_elems))
    return "chunk_elems " + str(p.chunk_elems) + " is not a positive multiple of " + str(align) + " <= " +
           str(max_chunk_elems);

  std::size_t used = 0;
  std::size_t max_end = 0;  // end of the furthest tensor so far in the current chunk
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const tensor_slot& s = p.slots[i];
    const std::string who = "tensor " + str(i) + " (" + specs[i].name + ")";
    if (s.numel != specs[i].numel()) return who + ": slot numel " + str(s.numel) + " != spec " + str(specs[i].numel());
    if (s.chunk >= p.num_chunks) return who + ": chunk " + str(s.chunk) + " out of range";
    if (s.offset % align != 0) return who + ": offset " + str(s.offset) + " not aligned to " + str(align);
    if (s.offset > p.chunk_elems || s.numel > p.chunk_elems - s.offset)
      return who + ": [" + str(s.offset) + ", " + str(s.offset + s.numel) + ") crosses the chunk end " +
             str(p.chunk_elems);
    if (i > 0) {
      const tensor_slot& prev = p.slots[i - 1];
      if (s.chunk < prev.chunk) return who + ": placed in an earlier chunk than tensor " + str(i - 1);
      if (s.chunk == prev.chunk && s.offset < max_end)
        return who + ": starts at " + str(s.offset) + " before an earlier tensor of its chunk ends (" + str(max_end) +
               "): order not kept or overlap";
      if (s.chunk != prev.chunk) max_end = 0;
    }
    max_end = std::max(max_end, s.offset + s.numel);
    used += s.numel;
  }

  // chunk_tensors lists exactly the tensors of each chunk, once, in offset (then registration) order.
  std::vector<std::size_t> seen(specs.size(), 0);
  for (std::size_t c = 0; c < p.num_chunks; ++c) {
    const auto& list = p.chunk_tensors[c];
    if (list.empty()) return "chunk " + str(c) + " holds no tensor";
    for (std::size_t k = 0; k < list.size(); ++k) {
      const std::size_t t = list[k];
      if (t >= specs.size()) return "chunk_tensors[" + str(c) + "] names tensor " + str(t) + " out of range";
      if (p.slots[t].chunk != c) return "chunk_tensors[" + str(c) + "] lists tensor " + str(t) + " of another chunk";
      if (k > 0 && !(list[k - 1] < t && p.slots[list[k - 1]].offset <= p.slots[t].offset))
        return "chunk_tensors[" + str(c) + "] not in offset order";
      ++seen[t];
    }
  }
  for (std::size_t t = 0; t < specs.size(); ++t)
    if (seen[t] != 1) return "tensor " + str(t) + " appears " + str(seen[t]) + " times in chunk_tensors";

  // Every element of every tensor maps to exactly one (chunk, offset), and no two tensors share one.
  const std::size_t total = p.chunk_elems * p.num_chunks;
  if (total <= (std::size_t{1} << 20)) {
    std::vector<std::int64_t> owner(total, -1);
    std::size_t owned = 0;
    for (std::size_t i = 0; i < specs.size(); ++i)
      for (std::size_t e = 0; e < p.slots[i].numel; ++e) {
        auto& o = owner[p.slots[i].chunk * p.chunk_elems + p.slots[i].offset + e];
        if (o != -1) return "tensors " + str(static_cast<std::size_t>(o)) + " and " + str(i) + " overlap";
        o = static_cast<std::int64_t>(i);
        ++owned;
      }
    if (owned != used) return "owned elements != used";
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
  return {};
}

/** @brief Bytes of one element, from the storage types (not from dtype_size). */
inline std::size_t element_bytes(dtype t) {
  switch (t) {
    case dtype::f32: return sizeof(float);
    case dtype::f16: return sizeof(float16);
    case dtype::bf16: return sizeof(bfloat16);
  }
  return 0;
}

/** @brief The first way `make_chunk_lists(p, ...)` breaks parallelism, over every option, or "". */
inline std::string chunk_lists_violation(const chunk_plan& p) {
  for (dtype pt : {dtype::f32, dtype::f16, dtype::bf16})
    for (grad_storage gs : {grad_storage::separate, grad_storage::shared_with_param})
      for (bool opt : {false, true}) {
        const auto lists = make_chunk_lists(p, {.param_type = pt, .grads = gs, .optimizer_state = opt});
        std::vector<chunk_kind> want{chunk_kind::param, chunk_kind::grad};
        if (opt) {
          if (pt != dtype::f32) want.push_back(chunk_kind::master);
          want.push_back(chunk_kind::momentum);
          want.push_back(chunk_kind::variance);
        }
        const std::string ctx = std::string(dtype_name(pt)) + (gs == grad_storage::separate ? " separate" : " shared") +
                                (opt ? " +opt" : "") + ": ";
        if (lists.size() != want.size()) return ctx + "wrong number of lists";
        for (std::size_t k = 0; k < lists.size(); ++k) {
          const auto& l = lists[k];
          const dtype t = (want[k] == chunk_kind::param || want[k] == chunk_kind::grad) ? pt : dtype::f32;
          if (l.kind != want[k]) return ctx + "list " + std::to_string(k) + " has the wrong kind";
          if (l.type != t) return ctx + std::string(chunk_kind_name(l.kind)) + " has the wrong dtype";
          if (l.num_chunks != p.num_chunks) return ctx + std::string(chunk_kind_name(l.kind)) + " not parallel";
          if (l.chunk_bytes != p.chunk_elems * element_bytes(t))
            return ctx + std::string(chunk_kind_name(l.kind)) + " chunk_bytes != chunk_elems * element size";
          if (l.aliases_param != (l.kind == chunk_kind::grad && gs == grad_storage::shared_with_param))
            return ctx + std::string(chunk_kind_name(l.kind)) + " aliases_param wrong";
        }
      }
  return {};
}

/** @brief Runs @p body over the small domain: alignments 1..4, every aligned chunk bound up to 12,
 *  every size list of length <= 4 with sizes 0..9. @p body(layout, align, max_chunk, sizes, specs). */
template <class L, class Body>
void for_small_domain(Body&& body) {
  const auto lists = all_size_lists(4, 9);
  std::vector<std::vector<tensor_spec>> spec_lists;
  spec_lists.reserve(lists.size());
  for (const auto& l : lists) {
    std::vector<tensor_spec> specs;
    for (std::size_t i = 0; i < l.size(); ++i) specs.push_back(spec_of_numel(l[i], i));
    spec_lists.push_back(std::move(specs));
  }
  for (std::size_t align = 1; align <= 4; ++align)
    for (std::size_t chunk = align; chunk <= 12; chunk += align) {
      const L layout = layout_conformance_traits<L>::make(chunk, align);
      for (std::size_t k = 0; k < lists.size(); ++k) body(layout, align, chunk, lists[k], spec_lists[k]);
    }
}

}  // namespace chunkstar::testing

TEST_CASE_TEMPLATE_DEFINE("ChunkLayout laws hold for every small tensor list", L, chunk_layout_conformance) {
  using namespace chunkstar;
  using namespace chunkstar::testing;
  static_assert(ChunkLayout<L>);
  std::size_t planned = 0, rejected = 0, failures = 0;
  for_small_domain<L>([&](const L& layout, std::size_t align, std::size_t chunk, const std::vector<std::size_t>& sizes,
                          const std::vector<tensor_spec>& specs) {
    const std::size_t largest = sizes.empty() ? 0 : *std::max_element(sizes.begin(), sizes.end());
    std::string bad;
    if (largest > chunk) {
      // Too large for any chunk the layout may use: must be refused, naming the culprit.
      try {
        (void)layout.plan(specs);
        bad = "a tensor larger than the chunk bound was accepted";
      } catch (const config_error& e) {
        // The message names an oversized tensor (which one, when several are, is the model's choice).
        bool named = false;
        for (std::size_t i = 0; i < sizes.size(); ++i)
          named = named || (sizes[i] > chunk && std::string(e.what()).find("'" + specs[i].name + "'") != std::string::npos);
        if (!named) bad = std::string("message names no oversized tensor: ") + e.what();
      }
      ++rejected;
    } else {
      const chunk_plan p = layout.plan(specs);
      bad = plan_law_violation(p, specs, align, chunk);
      if (bad.empty()) {
        const chunk_plan again = layout.plan(specs);
        if (again.chunk_elems != p.chunk_elems || again.num_chunks != p.num_chunks ||
            !std::equal(p.slots.begin(), p.slots.end(), again.slots.begin(), again.slots.end(),
                        [](const tensor_slot& a, const tensor_slot& b) {
                          return a.chunk == b.chunk && a.offset == b.offset && a.numel == b.numel;
                        }))
          bad = "not deterministic";
      }
      if (bad.empty() && sizes.size() <= 2) bad = chunk_lists_violation(p);
      ++planned;
    }
    if (!bad.empty() && ++failures <= 10) {
      std::string sz;
      for (auto s : sizes) sz += std::to_string(s) + " ";
      FAIL_CHECK("align " << align << ", chunk bound " << chunk << ", sizes [ " << sz << "]: " << bad);
    }
  });
  CHECK(failures == 0);
  // The domain really was walked: 25 (align, bound) pairs x 11111 lists.
  CHECK(planned + rejected == 25u * 11111u);
  CHECK(rejected > 0);
}

TEST_CASE_TEMPLATE_DEFINE("ChunkLayout edge cases", L, chunk_layout_edge_cases) {
  using namespace chunkstar;
  using namespace chunkstar::testing;
  const L layout = layout_conformance_traits<L>::make(64, 8);

  SUBCASE("an empty list has no chunks") {
    const chunk_plan p = layout.plan({});
    CHECK(p.num_chunks == 0);
    CHECK(p.slots.empty());
    CHECK(p.chunk_tensors.empty());
    CHECK(p.total_elems() == 0);
    CHECK(p.waste_fraction() == 0.0);
  }
  SUBCASE("zero-element tensors get aligned slots in a chunk") {
    std::vector<tensor_spec> specs{spec_of_numel(0, 0), spec_of_numel(5, 1), spec_of_numel(0, 2), spec_of_numel(3, 3)};
    const chunk_plan p = layout.plan(specs);
    CHECK(plan_law_violation(p, specs, 8, 64) == "");
    CHECK(p.slots[0].numel == 0);
    CHECK(p.slots[2].numel == 0);
    CHECK(p.used_elems() == 8);
  }
  SUBCASE("a tensor over the chunk bound is refused with its name, shape and size") {
    std::vector<tensor_spec> specs{spec_of_numel(10, 0), {"h.3.mlp.c_fc.weight", {13, 5}, dtype::f16, tensor_role::weight}};
    try {
      (void)layout.plan(specs);
      FAIL("accepted a 65-element tensor with chunks of at most 64");
    } catch (const config_error& e) {
      const std::string m = e.what();
      CHECK(m.find("h.3.mlp.c_fc.weight") != std::string::npos);
      CHECK(m.find("[13, 5]") != std::string::npos);
      CHECK(m.find("65") != std::string::npos);
      CHECK(m.find("64") != std::string::npos);
    }
  }
  SUBCASE("a negative dimension is refused") {
    std::vector<tensor_spec> specs{{"bad", {4, -1}, dtype::f16, tensor_role::weight}};
    CHECK_THROWS_AS((void)layout.plan(specs), config_error);
  }
  SUBCASE("name() is printable") { CHECK(!std::string_view(layout.name()).empty()); }
}
