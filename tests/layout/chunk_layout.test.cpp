// SPDX-License-Identifier: Apache-2.0
// ChunkLayout: the installed conformance check (chunkstar/testing/layout_conformance.hpp) for both
// models, for a layout written here as a user would, and against broken layouts it must reject;
// then what is particular to each model: the next-fit rule, option validation, messages, and the
// searched layout's optimality against brute force.
#include <chunkstar/layout/chunk_layout.hpp>
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/layout/searched_chunk_layout.hpp>
#include <chunkstar/testing/layout_conformance.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

using namespace chunkstar;

namespace chunk_layout_test {
using chunkstar::testing::for_each_small_layout_case;
using chunkstar::testing::spec_of_numel;

namespace {

// The factories the conformance check builds layouts with: chunks of at most `bound` elements.
fixed_chunk_layout make_fixed(std::size_t bound, std::size_t align) {
  return fixed_chunk_layout({.chunk_elems = bound, .align_elems = align});
}
searched_chunk_layout make_searched(std::size_t bound, std::size_t align) {
  return searched_chunk_layout(
      {.min_chunk_elems = align, .max_chunk_elems = bound, .step_elems = align, .align_elems = align});
}

// "" when the plan keeps every ChunkLayout law, else the first broken one (for CHECK(... == "")).
std::string plan_law_violation(const chunk_plan& p, std::span<const tensor_spec> specs, std::size_t align,
                               std::size_t max_chunk_elems) {
  return chunkstar::testing::plan_law_violation(specs, p, align, max_chunk_elems).value_or("");
}

}  // namespace

TEST_CASE("ChunkLayout: the installed conformance check passes for both models") {
  const auto fixed = chunkstar::testing::check_chunk_layout(make_fixed);
  CHECK_MESSAGE(fixed.ok(), fixed.to_string());
  CHECK(fixed.subject == "ChunkLayout 'fixed'");
  CHECK(fixed.checks > 25u * 11111u);  // the whole small domain was walked
  const auto searched = chunkstar::testing::check_chunk_layout(make_searched);
  CHECK_MESSAGE(searched.ok(), searched.to_string());
  CHECK(searched.subject == "ChunkLayout 'searched'");
}

namespace {

// ---- the concept, both ways ----
struct minimal_layout {
  chunk_plan plan(std::span<const tensor_spec>) const;
  const char* name() const;
};
struct no_name {
  chunk_plan plan(std::span<const tensor_spec>) const;
};
struct non_const_plan {
  chunk_plan plan(std::span<const tensor_spec>);
  std::string_view name() const;
};
struct returns_slots {
  std::vector<tensor_slot> plan(std::span<const tensor_spec>) const;
  std::string_view name() const;
};
struct name_is_a_number {
  chunk_plan plan(std::span<const tensor_spec>) const;
  int name() const;
};
struct plan_wants_a_mutable_vector {
  chunk_plan plan(std::vector<tensor_spec>&) const;
  std::string_view name() const;
};

static_assert(ChunkLayout<minimal_layout>);
static_assert(ChunkLayout<fixed_chunk_layout>);
static_assert(ChunkLayout<searched_chunk_layout>);
static_assert(!ChunkLayout<no_name>);
static_assert(!ChunkLayout<non_const_plan>);
static_assert(!ChunkLayout<returns_slots>);
static_assert(!ChunkLayout<name_is_a_number>);
static_assert(!ChunkLayout<plan_wants_a_mutable_vector>);
static_assert(!ChunkLayout<int>);

// ---- independent references ----

// The next-fit rule as the specification states it, read off a finished plan: chunks are opened
// in order; inside a chunk each tensor starts at the first aligned offset after its predecessor;
// a new chunk is opened only when that offset would leave no room for the tensor.
std::string next_fit_violation(const chunk_plan& p, const std::vector<std::size_t>& sizes) {
  std::size_t end = 0;  // end of the previous tensor in its chunk
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const tensor_slot& s = p.slots[i];
    const std::size_t next = (end + p.align_elems - 1) / p.align_elems * p.align_elems;
    if (i == 0 || s.chunk != p.slots[i - 1].chunk) {
      if (s.chunk != (i == 0 ? 0 : p.slots[i - 1].chunk + 1)) return "chunk skipped at tensor " + std::to_string(i);
      if (s.offset != 0) return "first tensor of a chunk not at 0, tensor " + std::to_string(i);
      if (i > 0 && next + sizes[i] <= p.chunk_elems)
        return "tensor " + std::to_string(i) + " opened a chunk though it fit in the previous one";
    } else if (s.offset != next) {
      return "tensor " + std::to_string(i) + " not at the first aligned offset after its predecessor";
    }
    end = s.offset + s.numel;
  }
  return {};
}

// Waste of next-fit at chunk size c, simulated element by element rather than by offsets.
std::size_t reference_waste(const std::vector<std::size_t>& sizes, std::size_t c, std::size_t align) {
  std::size_t chunks = 0, pos = 0, used = 0;
  for (auto n : sizes) {
    while (pos % align != 0) ++pos;
    if (chunks == 0 || pos + n > c) {
      ++chunks;
      pos = 0;
    }
    pos += n;
    used += n;
  }
  return chunks * c - used;
}

std::vector<tensor_spec> specs_of(const std::vector<std::size_t>& sizes) {
  return chunkstar::testing::specs_of_numels(sizes);
}

// Bytes of one element, from the storage types (not from dtype_size).
std::size_t element_bytes(dtype t) {
  switch (t) {
    case dtype::f32: return sizeof(float);
    case dtype::f16: return sizeof(float16);
    case dtype::bf16: return sizeof(bfloat16);
  }
  return 0;
}

// The first way `make_chunk_lists(p, ...)` breaks parallelism, over every option, or "".
std::string chunk_lists_violation(const chunk_plan& p) {
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

// GPT-2 small (124M): wte, wpe, 12 blocks, final norm, in registration (= use) order.
std::vector<tensor_spec> gpt2_small_specs() {
  const std::int64_t v = 50257, t = 1024, c = 768;
  std::vector<tensor_spec> s;
  s.push_back({"wte", {v, c}, dtype::bf16, tensor_role::embedding});
  s.push_back({"wpe", {t, c}, dtype::bf16, tensor_role::embedding});
  for (int l = 0; l < 12; ++l) {
    const std::string h = "h." + std::to_string(l) + ".";
    s.push_back({h + "ln_1.weight", {c}, dtype::bf16, tensor_role::norm});
    s.push_back({h + "ln_1.bias", {c}, dtype::bf16, tensor_role::norm});
    s.push_back({h + "attn.c_attn.weight", {c, 3 * c}, dtype::bf16, tensor_role::weight});
    s.push_back({h + "attn.c_attn.bias", {3 * c}, dtype::bf16, tensor_role::bias});
    s.push_back({h + "attn.c_proj.weight", {c, c}, dtype::bf16, tensor_role::weight});
    s.push_back({h + "attn.c_proj.bias", {c}, dtype::bf16, tensor_role::bias});
    s.push_back({h + "ln_2.weight", {c}, dtype::bf16, tensor_role::norm});
    s.push_back({h + "ln_2.bias", {c}, dtype::bf16, tensor_role::norm});
    s.push_back({h + "mlp.c_fc.weight", {c, 4 * c}, dtype::bf16, tensor_role::weight});
    s.push_back({h + "mlp.c_fc.bias", {4 * c}, dtype::bf16, tensor_role::bias});
    s.push_back({h + "mlp.c_proj.weight", {4 * c, c}, dtype::bf16, tensor_role::weight});
    s.push_back({h + "mlp.c_proj.bias", {c}, dtype::bf16, tensor_role::bias});
  }
  s.push_back({"ln_f.weight", {c}, dtype::bf16, tensor_role::norm});
  s.push_back({"ln_f.bias", {c}, dtype::bf16, tensor_role::norm});
  return s;
}

}  // namespace

TEST_CASE("both layouts pack next-fit: checked on every small tensor list") {
  std::size_t failures = 0, checked = 0;
  auto check = [&](const chunk_plan& p, const std::vector<std::size_t>& sizes, const char* who) {
    const std::string bad = next_fit_violation(p, sizes);
    ++checked;
    if (!bad.empty() && ++failures <= 10) FAIL_CHECK(who << ": " << bad);
  };
  for_each_small_layout_case(make_fixed, {},
                             [&](const fixed_chunk_layout& l, std::size_t, std::size_t chunk,
                                 const std::vector<std::size_t>& sizes, const std::vector<tensor_spec>& specs) {
                               if (!sizes.empty() && *std::max_element(sizes.begin(), sizes.end()) > chunk) return;
                               const chunk_plan p = l.plan(specs);
                               if (p.chunk_elems != chunk && ++failures <= 10)
                                 FAIL_CHECK("fixed plan changed the chunk size");
                               check(p, sizes, "fixed");
                               // make_chunk_lists is the same for every layout: checked on the plans of one.
                               if (sizes.size() <= 2) {
                                 const std::string bad = chunk_lists_violation(p);
                                 if (!bad.empty() && ++failures <= 10) FAIL_CHECK("make_chunk_lists: " << bad);
                               }
                             });
  for_each_small_layout_case(make_searched, {},
                             [&](const searched_chunk_layout& l, std::size_t, std::size_t chunk,
                                 const std::vector<std::size_t>& sizes, const std::vector<tensor_spec>& specs) {
                               if (!sizes.empty() && *std::max_element(sizes.begin(), sizes.end()) > chunk) return;
                               check(l.plan(specs), sizes, "searched");
                             });
  CHECK(failures == 0);
  CHECK(checked > 100000);
}

TEST_CASE("fixed_chunk_layout: worked examples") {
  const fixed_chunk_layout l({.chunk_elems = 64, .align_elems = 8});
  SUBCASE("gaps, a new chunk when the next tensor does not fit, a zero-element slot") {
    // 10 @0, 7 @16 (ends 23); 41 does not fit at 24 (24 + 41 > 64) -> chunk 1 @0 (ends 41);
    // the empty tensor @48; 16 @48 ends exactly at 64.
    const chunk_plan p = l.plan(specs_of({10, 7, 41, 0, 16}));
    CHECK(p.num_chunks == 2);
    CHECK(p.chunk_elems == 64);
    CHECK(p.slots[0].chunk == 0);
    CHECK(p.slots[0].offset == 0);
    CHECK(p.slots[1].offset == 16);
    CHECK(p.slots[2].chunk == 1);
    CHECK(p.slots[2].offset == 0);
    CHECK(p.slots[3].chunk == 1);
    CHECK(p.slots[3].offset == 48);
    CHECK(p.slots[4].chunk == 1);
    CHECK(p.slots[4].offset == 48);
    CHECK(p.used_elems() == 74);
    CHECK(p.waste_elems() == 128 - 74);
    CHECK(p.chunk_tensors == std::vector<std::vector<std::size_t>>{{0, 1}, {2, 3, 4}});
  }
  SUBCASE("a tensor that fits exactly stays; an empty tensor after a full chunk sits at its end") {
    const chunk_plan p = l.plan(specs_of({10, 7, 40, 0, 8}));
    CHECK(p.slots[2].chunk == 0);
    CHECK(p.slots[2].offset == 24);
    CHECK(p.slots[3].chunk == 0);
    CHECK(p.slots[3].offset == 64);  // [64, 64): inside the chunk, holds nothing
    CHECK(p.slots[4].chunk == 1);
    CHECK(p.slots[4].offset == 0);
  }
  SUBCASE("only empty tensors: one chunk, all waste") {
    const chunk_plan p = l.plan(specs_of({0, 0, 0}));
    CHECK(p.num_chunks == 1);
    CHECK(p.waste_elems() == 64);
    CHECK(p.waste_fraction() == 1.0);
  }
}

TEST_CASE("fixed_chunk_layout: options are validated with a fix in the message") {
  CHECK_NOTHROW(fixed_chunk_layout());
  CHECK(fixed_chunk_layout().options().align_elems == 32);
  CHECK(fixed_chunk_layout().options().chunk_elems % 32 == 0);
  try {
    fixed_chunk_layout({.chunk_elems = 1000, .align_elems = 32});
    FAIL("accepted a chunk size that is not a multiple of the alignment");
  } catch (const config_error& e) {
    const std::string m = e.what();
    CHECK(m.find("chunk_elems") != std::string::npos);
    CHECK(m.find("1024") != std::string::npos);  // rounded up
    CHECK(m.find("992") != std::string::npos);   // rounded down
  }
  CHECK_THROWS_AS(fixed_chunk_layout({.chunk_elems = 0, .align_elems = 32}), config_error);
  CHECK_THROWS_AS(fixed_chunk_layout({.chunk_elems = 64, .align_elems = 0}), config_error);
  CHECK_NOTHROW(fixed_chunk_layout({.chunk_elems = 7, .align_elems = 1}));
}

TEST_CASE("fixed_chunk_layout: an oversized tensor's message says what would fix it") {
  const fixed_chunk_layout l({.chunk_elems = 1024, .align_elems = 32});
  std::vector<tensor_spec> specs{{"wte", {50, 30}, dtype::f16, tensor_role::embedding}};
  try {
    (void)l.plan(specs);
    FAIL("accepted an oversized tensor");
  } catch (const config_error& e) {
    const std::string m = e.what();
    CHECK(m.find("'wte'") != std::string::npos);
    CHECK(m.find("[50, 30]") != std::string::npos);
    CHECK(m.find("1500") != std::string::npos);
    CHECK(m.find("1024") != std::string::npos);
    CHECK(m.find("1504") != std::string::npos);  // the smallest aligned chunk that would hold it
    CHECK(m.find("searched_chunk_layout") != std::string::npos);
  }
}

TEST_CASE("searched_chunk_layout picks the least waste among its candidates (brute force)") {
  std::mt19937_64 rng(20240611);
  auto pick = [&](std::size_t lo, std::size_t hi) { return std::uniform_int_distribution<std::size_t>(lo, hi)(rng); };
  std::size_t failures = 0;
  for (int round = 0; round < 4000; ++round) {
    const std::size_t align = std::size_t{1} << pick(0, 3);
    std::vector<std::size_t> sizes(pick(0, 12));
    for (auto& s : sizes) s = pick(0, 3) == 0 ? pick(0, 3) : pick(0, 40);
    const std::size_t largest = sizes.empty() ? 0 : *std::max_element(sizes.begin(), sizes.end());
    const std::size_t min_c = align * pick(1, 8);
    const std::size_t max_c = std::max(min_c, (largest + align - 1) / align * align) + align * pick(0, 24);
    const std::size_t step = align * pick(1, 5);
    const searched_chunk_layout l(
        {.min_chunk_elems = min_c, .max_chunk_elems = max_c, .step_elems = step, .align_elems = align});
    const auto specs = specs_of(sizes);
    const searched_layout_result r = l.search(specs);

    // The grid, as documented: from max(min, largest rounded up) to max, every `step`.
    const std::size_t first = std::max(min_c, (largest + align - 1) / align * align);
    std::size_t best_c = 0, best_w = SIZE_MAX, worst_w = 0, count = 0;
    for (std::size_t c = first; c <= max_c; c += step, ++count) {
      const std::size_t w = reference_waste(sizes, c, align);
      if (w < best_w) best_c = c, best_w = w;
      worst_w = std::max(worst_w, w);
    }
    std::string bad;
    if (r.plan.chunk_elems != best_c)
      bad = "chose " + std::to_string(r.plan.chunk_elems) + ", best is " + std::to_string(best_c);
    else if (r.plan.waste_elems() != best_w) bad = "plan waste differs from the reference";
    else if (r.report.best_chunk_elems != best_c || r.report.best_waste_elems != best_w) bad = "report best wrong";
    else if (r.report.worst_waste_elems != worst_w) bad = "report worst wrong";
    else if (r.report.candidates_tried != count)
      bad = "candidates_tried " + std::to_string(r.report.candidates_tried) + " != " + std::to_string(count);
    else if (r.report.first_candidate_elems != first) bad = "first candidate wrong";
    else bad = plan_law_violation(r.plan, specs, align, max_c);
    if (!bad.empty() && ++failures <= 10) FAIL_CHECK("round " << round << ": " << bad);
  }
  CHECK(failures == 0);
}

TEST_CASE("searched_chunk_layout: exhaustive minimality over every aligned size in range") {
  // With step = alignment the grid is every aligned size from the largest tensor to the bound.
  std::size_t failures = 0;
  for_each_small_layout_case(
      make_searched, {},
      [&](const searched_chunk_layout& l, std::size_t align, std::size_t chunk, const std::vector<std::size_t>& sizes,
          const std::vector<tensor_spec>& specs) {
        const std::size_t largest = sizes.empty() ? 0 : *std::max_element(sizes.begin(), sizes.end());
        if (largest > chunk) return;
        const chunk_plan p = l.plan(specs);
        for (std::size_t c = std::max(align, (largest + align - 1) / align * align); c <= chunk; c += align) {
          const std::size_t w = reference_waste(sizes, c, align);
          if ((w < p.waste_elems() || (w == p.waste_elems() && c < p.chunk_elems)) && ++failures <= 10)
            FAIL_CHECK("size " << c << " beats the chosen " << p.chunk_elems);
        }
      });
  CHECK(failures == 0);
}

TEST_CASE("searched_chunk_layout: ties go to the smaller chunk") {
  // Only zero-element tensors: one chunk at any size, so waste = size; smallest wins.
  const searched_chunk_layout l({.min_chunk_elems = 64, .max_chunk_elems = 1024, .step_elems = 64, .align_elems = 32});
  const chunk_plan p = l.plan(specs_of({0, 0}));
  CHECK(p.chunk_elems == 64);
  CHECK(p.num_chunks == 1);
  // Two tensors of 64 fill any chunk of 64 or 128 exactly (waste 0 both): 64 wins.
  CHECK(l.plan(specs_of({64, 64})).chunk_elems == 64);
  CHECK(l.plan({}).num_chunks == 0);
}

TEST_CASE("searched_chunk_layout: the candidate count is capped for large ranges") {
  const searched_chunk_layout l({.min_chunk_elems = 32,
                                 .max_chunk_elems = std::size_t{64} << 20,
                                 .step_elems = 32,
                                 .align_elems = 32,
                                 .max_candidates = 100});
  const auto specs = gpt2_small_specs();
  const searched_layout_result r = l.search(specs);
  CHECK(r.report.candidates_tried <= 100);
  CHECK(r.report.candidates_tried >= 50);
  CHECK(r.report.step_elems % 32 == 0);
  CHECK(r.report.step_elems > 32);
  CHECK(r.report.last_candidate_elems <= (std::size_t{64} << 20));
  CHECK(r.report.first_candidate_elems == (50257u * 768u + 31u) / 32u * 32u);  // wte, rounded up to 32
  CHECK(r.report.best_waste_elems <= r.report.worst_waste_elems);
  CHECK(plan_law_violation(r.plan, specs, 32, std::size_t{64} << 20) == "");

  const searched_chunk_layout one(
      {.min_chunk_elems = 32, .max_chunk_elems = 4096, .step_elems = 32, .align_elems = 32, .max_candidates = 1});
  const searched_layout_result r1 = one.search(specs_of({100}));
  CHECK(r1.report.candidates_tried == 1);
  CHECK(r1.plan.chunk_elems == 128);
}

TEST_CASE("both layouts plan GPT-2 small within their laws; searched wastes no more than fixed") {
  const auto specs = gpt2_small_specs();
  const std::size_t total = 124439808;  // published parameter count of GPT-2 small (tied lm_head)
  const fixed_chunk_layout fixed({.chunk_elems = std::size_t{48} << 20, .align_elems = 32});
  const chunk_plan pf = fixed.plan(specs);
  CHECK(plan_law_violation(pf, specs, 32, std::size_t{48} << 20) == "");
  CHECK(pf.used_elems() == total);

  const searched_chunk_layout searched;  // defaults
  const searched_layout_result r = searched.search(specs);
  CHECK(plan_law_violation(r.plan, specs, 32, searched.options().fitted_to(specs).max_chunk_elems) == "");
  CHECK(r.plan.used_elems() == total);
  CHECK(r.report.candidates_tried <= searched.options().max_candidates);
  CHECK(r.plan.waste_elems() <=
        fixed_chunk_layout({.chunk_elems = r.report.worst_chunk_elems}).plan(specs).waste_elems());
  CHECK(r.plan.chunk_elems >= 50257u * 768u);
  MESSAGE("GPT-2 small: searched chunk " << r.plan.chunk_elems << " elems, " << r.plan.num_chunks << " chunks, waste "
                                         << r.plan.waste_fraction() * 100 << "%");
}

TEST_CASE("searched_chunk_layout: options and oversized tensors") {
  CHECK_NOTHROW(searched_chunk_layout());
  CHECK_THROWS_AS(searched_chunk_layout({.min_chunk_elems = 100}), config_error);
  CHECK_THROWS_AS(searched_chunk_layout({.step_elems = 33}), config_error);
  // Zero bounds fit the tensors: a small model gets chunks of its own scale.
  {
    std::vector<tensor_spec> small;
    for (int i = 0; i < 6; ++i) small.push_back({"t" + std::to_string(i), {3000}, dtype::f32, tensor_role::weight});
    const auto fitted = searched_layout_options{}.fitted_to(small);
    CHECK(fitted.min_chunk_elems == 3008);
    CHECK(fitted.max_chunk_elems == 4 * 3008);
    CHECK(fitted.step_elems == 32);
    const auto p = searched_chunk_layout().plan(small);
    CHECK(p.chunk_elems >= 3008);
    CHECK(p.chunk_elems <= 4 * 3008);
    CHECK(p.waste_fraction() < 0.05);
  }
  CHECK_THROWS_AS(searched_chunk_layout({.align_elems = 0}), config_error);
  CHECK_THROWS_AS(searched_chunk_layout({.min_chunk_elems = 2048, .max_chunk_elems = 1024, .step_elems = 32}),
                  config_error);
  CHECK_THROWS_AS(searched_chunk_layout({.max_candidates = 0}), config_error);

  const searched_chunk_layout l({.min_chunk_elems = 32, .max_chunk_elems = 1024, .step_elems = 32, .align_elems = 32});
  std::vector<tensor_spec> specs{spec_of_numel(10, 0), {"lm_head", {33, 32}, dtype::bf16, tensor_role::weight}};
  try {
    (void)l.plan(specs);
    FAIL("accepted a tensor over max_chunk_elems");
  } catch (const config_error& e) {
    const std::string m = e.what();
    CHECK(m.find("'lm_head'") != std::string::npos);
    CHECK(m.find("1056") != std::string::npos);
    CHECK(m.find("max_chunk_elems") != std::string::npos);
  }
}

TEST_CASE_TEMPLATE("both layouts: edge cases particular to the library's models", L, fixed_chunk_layout,
                   searched_chunk_layout) {
  const L layout = [] {
    if constexpr (std::is_same_v<L, fixed_chunk_layout>) return make_fixed(64, 8);
    else return make_searched(64, 8);
  }();
  SUBCASE("zero-element tensors get aligned slots in a chunk") {
    std::vector<tensor_spec> specs{spec_of_numel(0, 0), spec_of_numel(5, 1), spec_of_numel(0, 2), spec_of_numel(3, 3)};
    const chunk_plan p = layout.plan(specs);
    CHECK(plan_law_violation(p, specs, 8, 64) == "");
    CHECK(p.slots[0].numel == 0);
    CHECK(p.slots[2].numel == 0);
    CHECK(p.used_elems() == 8);
  }
  SUBCASE("a tensor over the chunk bound is refused with its name, shape and size") {
    std::vector<tensor_spec> specs{spec_of_numel(10, 0),
                                   {"h.3.mlp.c_fc.weight", {13, 5}, dtype::f16, tensor_role::weight}};
    try {
      (void)layout.plan(specs);
      FAIL("accepted a 65-element tensor with chunks of at most 64");
    } catch (const config_error& e) {
      const std::string m = e.what();
      CHECK(m.find("'h.3.mlp.c_fc.weight'") != std::string::npos);
      CHECK(m.find("[13, 5]") != std::string::npos);
      CHECK(m.find("65") != std::string::npos);
      CHECK(m.find("64") != std::string::npos);
    }
  }
  SUBCASE("a negative dimension is refused") {
    std::vector<tensor_spec> specs{{"bad", {4, -1}, dtype::f16, tensor_role::weight}};
    CHECK_THROWS_AS((void)layout.plan(specs), config_error);
  }
}

namespace {

// A layout written outside the library, as a user would from docs/concepts.md: every tensor in a
// chunk of its own (no packing: the simplest layout that keeps every law).
class chunk_per_tensor_layout {
 public:
  chunk_per_tensor_layout(std::size_t max_chunk_elems, std::size_t align) : max_(max_chunk_elems), align_(align) {}
  [[nodiscard]] chunk_plan plan(std::span<const tensor_spec> specs) const {
    chunk_plan p;
    p.align_elems = align_;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const std::size_t n = specs[i].numel();
      if (n > max_)
        throw config_error("chunk_per_tensor: tensor " + specs[i].name + " has " + std::to_string(n) +
                           " elements, more than the largest chunk (" + std::to_string(max_) + ")");
      p.chunk_elems = std::max(p.chunk_elems, (n + align_ - 1) / align_ * align_);
      p.slots.push_back({i, 0, n});
      p.chunk_tensors.push_back({i});
    }
    p.num_chunks = specs.size();
    if (p.num_chunks > 0 && p.chunk_elems == 0) p.chunk_elems = align_;
    return p;
  }
  [[nodiscard]] static std::string_view name() { return "chunk-per-tensor"; }

 private:
  std::size_t max_, align_;
};
static_assert(ChunkLayout<chunk_per_tensor_layout>);

// Layouts that break one law each, built on fixed_chunk_layout's plan.
enum class layout_bug {
  unaligned,
  reversed_lists,
  accepts_oversized,
  wrong_exception,
  name_dependent,
  nondeterministic
};

template <layout_bug Bug>
class broken_layout {
 public:
  broken_layout(std::size_t bound, std::size_t align) : inner_(make_fixed(bound, align)), bound_(bound) {}
  [[nodiscard]] chunk_plan plan(std::span<const tensor_spec> specs) const {
    if constexpr (Bug == layout_bug::accepts_oversized || Bug == layout_bug::wrong_exception) {
      std::size_t largest = 0;
      for (const auto& s : specs) largest = std::max(largest, s.numel());
      if (largest > bound_) {
        if constexpr (Bug == layout_bug::wrong_exception) throw std::runtime_error("too big");
        return make_fixed(largest, inner_.options().align_elems).plan(specs);
      }
    }
    chunk_plan p = inner_.plan(specs);
    if constexpr (Bug == layout_bug::unaligned) {
      // Packs tightly, ignoring the alignment it reports.
      std::size_t cursor = 0, chunk = 0;
      for (std::size_t i = 0; i < p.slots.size(); ++i) {
        if (p.slots[i].chunk != chunk) {
          chunk = p.slots[i].chunk;
          cursor = 0;
        }
        p.slots[i].offset = cursor;
        cursor += p.slots[i].numel;
      }
    }
    if constexpr (Bug == layout_bug::reversed_lists)
      for (auto& l : p.chunk_tensors) std::reverse(l.begin(), l.end());
    if constexpr (Bug == layout_bug::name_dependent)
      if (!specs.empty() && specs[0].name.rfind("renamed", 0) == 0) p.chunk_elems += p.align_elems;
    if constexpr (Bug == layout_bug::nondeterministic)
      if (++calls_ % 2 == 0 && p.num_chunks > 0) p.chunk_tensors.back().push_back(p.chunk_tensors.back().back());
    return p;
  }
  [[nodiscard]] static std::string_view name() { return "broken"; }

 private:
  fixed_chunk_layout inner_;
  std::size_t bound_;
  mutable std::size_t calls_ = 0;
};

template <layout_bug Bug>
chunkstar::testing::conformance_report check_broken() {
  return chunkstar::testing::check_chunk_layout([](std::size_t b, std::size_t a) { return broken_layout<Bug>(b, a); },
                                                {.max_tensors = 3, .random_trials = 20});
}

bool mentions(const chunkstar::testing::conformance_report& r, const std::string& part) {
  return std::any_of(r.failures.begin(), r.failures.end(),
                     [&](const std::string& f) { return f.find(part) != std::string::npos; });
}

}  // namespace

TEST_CASE("ChunkLayout: a layout written outside the library passes the installed check") {
  const auto r = chunkstar::testing::check_chunk_layout(
      [](std::size_t b, std::size_t a) { return chunk_per_tensor_layout(b, a); });
  CHECK_MESSAGE(r.ok(), r.to_string());
  CHECK(r.subject == "ChunkLayout 'chunk-per-tensor'");
}

TEST_CASE("ChunkLayout: the conformance check rejects layouts that break a law") {
  const auto unaligned = check_broken<layout_bug::unaligned>();
  CHECK(!unaligned.ok());
  CHECK_MESSAGE(mentions(unaligned, "is not a multiple of align_elems"), unaligned.to_string());
  const auto reversed = check_broken<layout_bug::reversed_lists>();
  CHECK(!reversed.ok());
  CHECK_MESSAGE(mentions(reversed, "not in offset order"), reversed.to_string());
  const auto oversized = check_broken<layout_bug::accepts_oversized>();
  CHECK(!oversized.ok());
  CHECK_MESSAGE(mentions(oversized, "larger than the chunk bound was accepted"), oversized.to_string());
  const auto wrong = check_broken<layout_bug::wrong_exception>();
  CHECK(!wrong.ok());
  CHECK_MESSAGE(mentions(wrong, "must throw config_error, not: too big"), wrong.to_string());
  const auto named = check_broken<layout_bug::name_dependent>();
  CHECK(!named.ok());
  CHECK_MESSAGE(mentions(named, "only needs numel()"), named.to_string());
  const auto flaky = check_broken<layout_bug::nondeterministic>();
  CHECK(!flaky.ok());
  CHECK_MESSAGE(mentions(flaky, "not deterministic"), flaky.to_string());
}

}  // namespace chunk_layout_test
