// SPDX-License-Identifier: Apache-2.0
// plan_violation / validate_plan (chunkstar/layout/plan_validation.hpp): each law on a targeted
// corruption of a valid plan, the message validate_plan throws, and a fuzz of randomly corrupted
// plans checked against an independent element-by-element oracle (and, under ASan, for reads out
// of bounds: the validator must be safe on any plan).
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/layout/plan_validation.hpp>
#include <chunkstar/layout/searched_chunk_layout.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

using namespace chunkstar;

namespace plan_validation_test {

namespace {

constexpr std::size_t top = std::numeric_limits<std::size_t>::max();

std::vector<tensor_spec> specs_of(const std::vector<std::int64_t>& sizes) {
  std::vector<tensor_spec> specs;
  for (std::size_t i = 0; i < sizes.size(); ++i)
    specs.push_back({"layer" + std::to_string(i) + ".w", {sizes[i]}, dtype::f16, tensor_role::weight});
  return specs;
}

// Three tensors in two chunks of 16: "layer0.w" [0,6) and "layer1.w" [8,12) in chunk 0,
// "layer2.w" [0,10) in chunk 1.
struct fixture {
  std::vector<tensor_spec> specs = specs_of({6, 4, 10});
  chunk_plan plan = fixed_chunk_layout({.chunk_elems = 16, .align_elems = 8}).plan(specs);
};

std::string violation(const std::vector<tensor_spec>& specs, const chunk_plan& p) {
  const auto v = plan_violation(specs, p);
  return v ? *v : std::string("(none)");
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// An independent oracle: valid iff every law holds, decided element by element (small plans only).
bool oracle_valid(const std::vector<tensor_spec>& specs, const chunk_plan& p) {
  using u128 = unsigned __int128;
  const std::size_t n = specs.size();
  if (p.align_elems == 0 || p.slots.size() != n || p.chunk_tensors.size() != p.num_chunks) return false;
  if (p.num_chunks > 0 && p.chunk_elems == 0) return false;
  if (u128(p.chunk_elems) * p.num_chunks * 4 > u128(top)) return false;
  for (std::size_t i = 0; i < n; ++i) {
    u128 numel = 1;
    bool ok = true;
    for (auto d : specs[i].shape) {
      if (d < 0) return false;
      numel *= static_cast<std::uint64_t>(d);
      if (numel > u128(top)) ok = false;
      if (d == 0 && ok) numel = 0;
    }
    if (!ok) return false;
    const auto& s = p.slots[i];
    if (u128(s.numel) != numel || s.chunk >= p.num_chunks || s.offset % p.align_elems != 0) return false;
    if (u128(s.offset) + s.numel > p.chunk_elems) return false;
  }
  std::vector<int> count(n, 0);
  for (std::size_t c = 0; c < p.num_chunks; ++c) {
    const auto& l = p.chunk_tensors[c];
    for (std::size_t k = 0; k < l.size(); ++k) {
      if (l[k] >= n || p.slots[l[k]].chunk != c) return false;
      ++count[l[k]];
      if (k > 0 && p.slots[l[k - 1]].offset > p.slots[l[k]].offset) return false;
    }
  }
  for (int x : count)
    if (x != 1) return false;
  std::vector<int> owner(p.chunk_elems * p.num_chunks, -1);
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t e = 0; e < p.slots[i].numel; ++e) {
      auto& o = owner[p.slots[i].chunk * p.chunk_elems + p.slots[i].offset + e];
      if (o != -1) return false;
      o = static_cast<int>(i);
    }
  return true;
}

}  // namespace

TEST_CASE("plan_violation: plans from the library's layouts keep every law") {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 300; ++round) {
    std::vector<std::int64_t> sizes(rng() % 12);
    for (auto& s : sizes) s = static_cast<std::int64_t>(rng() % 3 == 0 ? rng() % 3 : rng() % 200);
    const auto specs = specs_of(sizes);
    const std::size_t align = std::size_t{1} << (rng() % 6);
    const fixed_chunk_layout fixed({.chunk_elems = align * 256, .align_elems = align});
    const searched_chunk_layout searched(
        {.min_chunk_elems = align, .max_chunk_elems = align * 256, .step_elems = align, .align_elems = align});
    for (const chunk_plan& p : {fixed.plan(specs), searched.plan(specs)}) {
      CHECK_MESSAGE(!plan_violation(specs, p), violation(specs, p));
      CHECK_NOTHROW(validate_plan(specs, p, "fixed"));
      CHECK(oracle_valid(specs, p));
    }
  }
  CHECK(!plan_violation({}, chunk_plan{}));  // nothing to place, no chunks
}

TEST_CASE("plan_violation: each law, on a corruption of a valid plan, names the tensor and the chunk") {
  fixture f;
  REQUIRE(!plan_violation(f.specs, f.plan));
  auto& p = f.plan;
  SUBCASE("align_elems 0") {
    p.align_elems = 0;
    CHECK(has(violation(f.specs, p), "align_elems is 0"));
  }
  SUBCASE("fewer slots than specs") {
    p.slots.pop_back();
    const auto v = violation(f.specs, p);
    CHECK(has(v, "2 slots for 3 tensors"));
    CHECK(has(v, "'layer2.w'"));
  }
  SUBCASE("more slots than specs") {
    p.slots.push_back({0, 0, 0});
    CHECK(has(violation(f.specs, p), "4 slots for 3 tensors"));
  }
  SUBCASE("chunk_tensors size differs from num_chunks") {
    p.chunk_tensors.pop_back();
    CHECK(has(violation(f.specs, p), "chunk_tensors has 1 lists for num_chunks = 2"));
    p.chunk_tensors.resize(5000000);  // a garbage count: refused without walking it
    CHECK(has(violation(f.specs, p), "5000000 lists"));
  }
  SUBCASE("a huge num_chunks") {
    p.num_chunks = top;
    CHECK(has(violation(f.specs, p), "lists for num_chunks"));
  }
  SUBCASE("chunk sizes that overflow size_t") {
    p.chunk_elems = top / 2;
    CHECK(has(violation(f.specs, p), "overflow size_t"));
    p.chunk_elems = 0;
    CHECK(has(violation(f.specs, p), "chunk_elems is 0"));
  }
  SUBCASE("numel differs from the spec") {
    p.slots[1].numel = 5;
    const auto v = violation(f.specs, p);
    CHECK(has(v, "'layer1.w'"));
    CHECK(has(v, "in chunk 0"));
    CHECK(has(v, "holds 5 elements"));
    CHECK(has(v, "has 4"));
  }
  SUBCASE("a spec without an element count") {
    f.specs[2].shape = {4, -1};
    CHECK(has(violation(f.specs, p), "'layer2.w' (#2) has shape [4, -1]"));
    f.specs[2].shape = {std::int64_t{1} << 40, std::int64_t{1} << 40};
    CHECK(has(violation(f.specs, p), "no element count"));
  }
  SUBCASE("a chunk index out of range") {
    p.slots[2].chunk = 7;
    const auto v = violation(f.specs, p);
    CHECK(has(v, "'layer2.w'"));
    CHECK(has(v, "names chunk 7, but the plan has 2 chunks"));
    p.slots[2].chunk = top;
    CHECK(has(violation(f.specs, p), "names chunk"));
  }
  SUBCASE("a misaligned offset") {
    p.slots[1].offset = 9;
    const auto v = violation(f.specs, p);
    CHECK(has(v, "'layer1.w' (#1) in chunk 0: offset 9 is not a multiple of align_elems = 8"));
  }
  SUBCASE("elements past the chunk's end, offsets and sizes near SIZE_MAX") {
    p.slots[2].offset = 8;  // [8, 18) in a chunk of 16
    CHECK(
        has(violation(f.specs, p), "'layer2.w' (#2) in chunk 1: elements [8, 8 + 10) run past the chunk's end at 16"));
    p.slots[2].offset = top - 7;  // aligned to 8, offset + numel wraps
    CHECK(has(violation(f.specs, p), "run past the chunk's end"));
    f.specs[2].shape = {static_cast<std::int64_t>(std::numeric_limits<std::int64_t>::max())};
    p.slots[2] = {1, 8, static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max())};
    CHECK(has(violation(f.specs, p), "run past the chunk's end"));
  }
  SUBCASE("chunk_tensors inconsistent with the slots") {
    auto q = p;
    q.chunk_tensors[0] = {0};  // layer1.w missing
    CHECK(has(violation(f.specs, q), "'layer1.w' (#1) in chunk 0 is missing from chunk_tensors[0]"));
    q = p;
    q.chunk_tensors[0] = {0, 1, 1};
    CHECK(has(violation(f.specs, q), "chunk_tensors[0] lists tensor 'layer1.w' (#1) twice"));
    q = p;
    q.chunk_tensors[1] = {2, 0};
    CHECK(has(violation(f.specs, q), "chunk_tensors[1] lists tensor 'layer0.w' (#0), whose slot is in chunk 0"));
    q = p;
    q.chunk_tensors[1] = {2, 99};
    CHECK(has(violation(f.specs, q), "chunk_tensors[1] lists tensor #99, but there are only 3 tensors"));
    q = p;
    q.chunk_tensors[0] = {1, 0};
    CHECK(has(violation(f.specs, q), "chunk_tensors[0] is not in offset order"));
    q = p;
    q.chunk_tensors[1].push_back(top);
    CHECK(has(violation(f.specs, q), "lists tensor #18446744073709551615"));
  }
  SUBCASE("overlapping tensors") {
    p.slots[1].offset = 0;  // layer1.w [0,4) inside layer0.w [0,6); chunk_tensors still in offset order
    const auto v = violation(f.specs, p);
    CHECK(has(v, "'layer1.w' (#1) in chunk 0: elements [0, 4) overlap tensor 'layer0.w' (#0), which ends at 6"));
  }
  SUBCASE("zero-element tensors overlap nothing") {
    f.specs.push_back({"empty", {0, 3}, dtype::f16, tensor_role::bias});
    p.slots.push_back({0, 0, 0});  // inside layer0.w's elements, holding none
    p.chunk_tensors[0].insert(p.chunk_tensors[0].begin(), 3);
    CHECK(violation(f.specs, p) == "(none)");
  }
}

TEST_CASE("validate_plan: config_error naming the layout, the tensor and the chunk, and what to fix") {
  fixture f;
  CHECK_NOTHROW(validate_plan(f.specs, f.plan, "fixed"));
  f.plan.slots[2].offset = 8;
  try {
    validate_plan(f.specs, f.plan, "my_layout");
    FAIL("accepted a tensor past its chunk's end");
  } catch (const config_error& e) {
    const std::string m = e.what();
    CHECK(has(m, "chunk layout 'my_layout'"));
    CHECK(has(m, "'layer2.w'"));
    CHECK(has(m, "chunk 1"));
    CHECK(has(m, "Fix the layout's plan()"));
    CHECK(has(m, "check_chunk_layout"));
  }
}

TEST_CASE("plan_violation: random corruptions agree with an element-by-element oracle, and never read out of bounds") {
  std::mt19937_64 rng(20240611);
  auto below = [&](std::size_t n) { return n == 0 ? std::size_t{0} : static_cast<std::size_t>(rng() % n); };
  auto wild = [&](std::size_t small) -> std::size_t {  // a plausible value, or an extreme one
    switch (below(8)) {
      case 0: return top - below(3);
      case 1: return top / 2 + below(2);
      case 2: return 0;
      default: return below(small + 1);
    }
  };
  std::size_t valid = 0, invalid = 0;
  for (int round = 0; round < 20000; ++round) {
    std::vector<std::int64_t> sizes(below(7));
    for (auto& s : sizes) s = static_cast<std::int64_t>(below(4) == 0 ? below(2) : below(24));
    auto specs = specs_of(sizes);
    const std::size_t align = std::size_t{1} << below(3);
    chunk_plan p =
        fixed_chunk_layout({.chunk_elems = 24, .align_elems = align}).plan(specs);  // 24: a multiple of 1, 2, 4
    for (std::size_t k = 0, mutations = below(4); k < mutations; ++k) {
      switch (below(14)) {
        case 0: p.align_elems = below(3) == 0 ? 0 : wild(8); break;
        case 1: p.chunk_elems = wild(40); break;
        case 2: p.num_chunks = wild(4); break;
        case 3:
          if (!p.slots.empty()) p.slots[below(p.slots.size())].chunk = wild(4);
          break;
        case 4:
          if (!p.slots.empty()) p.slots[below(p.slots.size())].offset = wild(40);
          break;
        case 5:
          if (!p.slots.empty()) p.slots[below(p.slots.size())].numel = wild(24);
          break;
        case 6:
          if (below(2)) p.slots.push_back({below(3), below(3) * align, below(3)});
          else if (!p.slots.empty()) p.slots.pop_back();
          break;
        case 7:
          if (below(2)) p.chunk_tensors.emplace_back();
          else if (!p.chunk_tensors.empty()) p.chunk_tensors.pop_back();
          break;
        case 8:
          if (!p.chunk_tensors.empty()) {
            auto& l = p.chunk_tensors[below(p.chunk_tensors.size())];
            if (below(2) || l.empty()) l.push_back(wild(6));
            else l.erase(l.begin() + static_cast<std::ptrdiff_t>(below(l.size())));
          }
          break;
        case 9:
          if (!p.chunk_tensors.empty()) {
            auto& l = p.chunk_tensors[below(p.chunk_tensors.size())];
            if (l.size() > 1) std::swap(l[below(l.size())], l[below(l.size())]);
          }
          break;
        case 10:
          if (!specs.empty()) specs[below(specs.size())].shape = {static_cast<std::int64_t>(below(30)) - 3};
          break;
        case 11:
          if (!specs.empty())
            specs[below(specs.size())].shape = {std::int64_t{1} << 33, std::int64_t{1} << 33,
                                                static_cast<std::int64_t>(below(2))};
          break;
        case 12:
          if (p.slots.size() > 1) std::swap(p.slots[0], p.slots[below(p.slots.size())]);
          break;
        default:  // a consistent move: the slot and its chunk_tensors entry together
          if (!p.slots.empty() && p.num_chunks == p.chunk_tensors.size() && p.num_chunks > 0) {
            const std::size_t t = below(p.slots.size());
            const std::size_t from = p.slots[t].chunk;
            if (from < p.chunk_tensors.size()) {
              auto& l = p.chunk_tensors[from];
              l.erase(std::remove(l.begin(), l.end(), t), l.end());
            }
            const std::size_t to = below(p.num_chunks);
            p.slots[t].chunk = to;
            p.slots[t].offset = below(p.chunk_elems / align + 1) * align;
            auto& dst = p.chunk_tensors[to];
            auto pos = dst.begin();
            while (pos != dst.end() && *pos < p.slots.size() && p.slots[*pos].offset <= p.slots[t].offset) ++pos;
            dst.insert(pos, t);
          }
          break;
      }
    }
    const auto v = plan_violation(specs, p);
    // The oracle builds an element map: only for plans that small (and whose sizes do not overflow).
    const bool small = p.align_elems != 0 && p.chunk_elems <= 4096 && p.num_chunks <= 64;
    if (small) {
      const bool ok = oracle_valid(specs, p);
      if (ok != !v.has_value()) {
        FAIL_CHECK("round " << round << ": oracle says " << (ok ? "valid" : "invalid") << ", plan_violation says "
                            << (v ? *v : std::string("valid")));
        break;
      }
    }
    v ? ++invalid : ++valid;
    if (v) CHECK_THROWS_AS(validate_plan(specs, p, "fuzzed"), config_error);
  }
  CHECK(valid > 1000);  // the fuzz exercises both answers
  CHECK(invalid > 5000);
}

}  // namespace plan_validation_test
