// SPDX-License-Identifier: Apache-2.0
// caching_space, the accounting and block cache under the CUDA spaces, over a raw allocator that
// counts its calls (as cudaMalloc/cudaFree would be counted): a steady state of the same requests
// makes no raw call, used() and cached_bytes() are exact, in use + cached stays within the
// capacity (cached blocks are freed before a request is refused), alignment beyond the raw
// allocator's is honoured, and trim() frees everything cached.
#include <chunkstar/memory/caching_space.hpp>
#include <chunkstar/memory/memory_space.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <new>
#include <map>
#include <vector>

namespace chunkstar {
namespace caching_space_test {

/** Aligned host memory whose every call is counted; `limit` bytes at most (a device's memory). */
struct counting_blocks {
  static constexpr std::size_t native_alignment = 256;
  struct counts {
    std::size_t allocations = 0, frees = 0, live_bytes = 0;
    std::size_t limit = SIZE_MAX;
    std::map<void*, std::size_t> live;  // block -> size
  };
  counts* c = nullptr;
  [[nodiscard]] void* allocate(std::size_t n) const {
    if (n > c->limit - c->live_bytes) return nullptr;
    void* p = ::operator new (n, std::align_val_t{native_alignment});
    ++c->allocations;
    c->live_bytes += n;
    c->live.emplace(p, n);
    return p;
  }
  void deallocate(void* p) const noexcept {
    ++c->frees;
    c->live_bytes -= c->live.at(p);  // the test knows each block's size; a raw free needs none
    c->live.erase(p);
    ::operator delete (p, std::align_val_t{native_alignment});
  }
};
static_assert(RawBlocks<counting_blocks>);

using space_t = caching_space<counting_blocks>;

TEST_CASE("caching_space: a repeated step of the same requests makes no raw allocation or free") {
  counting_blocks::counts c;
  space_t s({.capacity = 1u << 20, .name = "dev"}, counting_blocks{&c});
  const std::vector<std::size_t> sizes = {4096, 4096, 100, 65536, 4096, 0};
  auto step = [&] {
    std::vector<void*> ps;
    for (auto n : sizes) {
      ps.push_back(s.try_allocate(n, 256));
      REQUIRE(ps.back() != nullptr);
      CHECK(reinterpret_cast<std::uintptr_t>(ps.back()) % 256 == 0);
    }
    CHECK(s.used() == 4096 * 3 + 100 + 65536);
    for (std::size_t i = 0; i < ps.size(); ++i) s.deallocate(ps[i], sizes[i], 256);
    CHECK(s.used() == 0);
  };
  step();
  const auto allocations = c.allocations;
  CHECK(allocations == sizes.size());
  CHECK(c.frees == 0);
  CHECK(s.cached_bytes() == 4096 * 3 + 100 + 65536);
  for (int i = 0; i < 5; ++i) step();
  CHECK(c.allocations == allocations);  // steady state: the cache serves every request
  CHECK(c.frees == 0);
  CHECK(s.raw_allocations() == allocations);
  CHECK(s.peak() == 4096 * 3 + 100 + 65536);
  s.trim();
  CHECK(s.cached_bytes() == 0);
  CHECK(c.frees == allocations);
  CHECK(c.live.empty());
}

TEST_CASE("caching_space: in use plus cached stays within the capacity; cached blocks go before a refusal") {
  counting_blocks::counts c;
  space_t s({.capacity = 10000, .name = "dev"}, counting_blocks{&c});
  void* a = s.try_allocate(6000, 256);
  REQUIRE(a != nullptr);
  s.deallocate(a, 6000, 256);
  CHECK(s.cached_bytes() == 6000);
  void* b = s.try_allocate(5000, 256);  // 5000 + 6000 cached > 10000: the cached block is freed first
  REQUIRE(b != nullptr);
  CHECK(s.cached_bytes() == 0);
  CHECK(c.frees == 1);
  CHECK(c.live_bytes == 5000);
  CHECK(s.try_allocate(5001, 256) == nullptr);  // 5000 in use: the cap refuses, nothing changes
  CHECK(s.used() == 5000);
  s.deallocate(b, 5000, 256);
  CHECK(s.used() == 0);
  CHECK(s.usage().largest_free_block == 10000);  // cached blocks count as free
}

TEST_CASE("caching_space: the raw allocator out of memory gives back the cache and tries once more") {
  counting_blocks::counts c;
  c.limit = 8000;  // the device holds less than the space's capacity (another process, say)
  space_t s({.name = "dev"}, counting_blocks{&c});
  void* a = s.try_allocate(6000, 256);
  REQUIRE(a != nullptr);
  s.deallocate(a, 6000, 256);  // cached: it still holds 6000 of the device's 8000
  void* b = s.try_allocate(7000, 256);
  REQUIRE(b != nullptr);
  CHECK(s.cached_bytes() == 0);
  CHECK(c.frees == 1);
  s.deallocate(b, 7000, 256);
}

TEST_CASE("caching_space: alignment beyond the raw allocator's, a cached block reused only where aligned") {
  counting_blocks::counts c;
  space_t s({.name = "dev"}, counting_blocks{&c});
  void* p = s.try_allocate(1000, 4096);
  REQUIRE(p != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(p) % 4096 == 0);
  s.deallocate(p, 1000, 4096);
  void* q = s.try_allocate(1000, 256);  // the cached block is aligned to 4096: it serves
  CHECK(q == p);
  s.deallocate(q, 1000, 256);
  CHECK_THROWS_AS((void)s.try_allocate(8, 3), config_error);
  s.trim();
  CHECK(c.live.empty());  // the over-allocated base, not the aligned pointer, went back raw
}

TEST_CASE("caching_space: cache_limit 0 frees every block raw") {
  counting_blocks::counts c;
  space_t s({.cache_limit = 0, .name = "dev"}, counting_blocks{&c});
  for (int i = 0; i < 3; ++i) s.deallocate(s.try_allocate(512, 256), 512, 256);
  CHECK(c.allocations == 3);
  CHECK(c.frees == 3);
  CHECK(s.cached_bytes() == 0);
}

}  // namespace caching_space_test
}  // namespace chunkstar
