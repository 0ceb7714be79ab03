// SPDX-License-Identifier: Apache-2.0
// MemorySpace: the conformance suite for host_space (uncapped, capped) and simulated_device_space,
// the concept checked both ways, the trait table, host_space's large-block cache, memory_space_ref.
#include <chunkstar/memory/host_space.hpp>
#include <chunkstar/memory/memory_space.hpp>
#include <chunkstar/memory/simulated_device_space.hpp>

#include <support/memory_conformance.hpp>

#include <doctest/doctest.h>

#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

using namespace chunkstar;

namespace memory_space_test {

namespace {

constexpr std::size_t mib = std::size_t{1} << 20;

struct host_memcpy {
  static void write(void* block, const void* host, std::size_t n) {
    if (n != 0) std::memcpy(block, host, n);
  }
  static void read(void* host, const void* block, std::size_t n) {
    if (n != 0) std::memcpy(host, block, n);
  }
};
struct host_uncapped : host_memcpy {
  using space_type = host_space;
  static std::unique_ptr<host_space> make() { return std::make_unique<host_space>(); }
};
struct host_capped : host_memcpy {
  using space_type = host_space;
  static std::unique_ptr<host_space> make() {
    return std::make_unique<host_space>(host_space_options{.capacity = 64 * mib, .name = "capped_host"});
  }
};
struct host_no_prefault_small_cache : host_memcpy {
  using space_type = host_space;
  static std::unique_ptr<host_space> make() {
    return std::make_unique<host_space>(host_space_options{.capacity = 64 * mib,
                                                           .large_block_threshold = 64 * 1024,
                                                           .cache_limit = 4 * mib,
                                                           .prefault = false,
                                                           .huge_pages = false});
  }
};
struct simulated_device : host_memcpy {
  using space_type = simulated_device_space;
  static std::unique_ptr<simulated_device_space> make() {
    return std::make_unique<simulated_device_space>(simulated_device_options{.capacity = 64 * mib});
  }
};
struct simulated_device_no_cache : host_memcpy {
  using space_type = simulated_device_space;
  static std::unique_ptr<simulated_device_space> make() {
    return std::make_unique<simulated_device_space>(simulated_device_options{
        .capacity = 64 * mib, .name = "uncached", .large_block_threshold = std::numeric_limits<std::size_t>::max()});
  }
};
struct simulated_device_small_blocks_cached : host_memcpy {
  using space_type = simulated_device_space;
  static std::unique_ptr<simulated_device_space> make() {
    return std::make_unique<simulated_device_space>(
        simulated_device_options{.capacity = 64 * mib, .name = "cached", .large_block_threshold = 1});
  }
};

}  // namespace

TEST_CASE_TEMPLATE_INVOKE(memory_space_conformance, host_uncapped, host_capped, host_no_prefault_small_cache,
                          simulated_device, simulated_device_no_cache, simulated_device_small_blocks_cached);

// ---------------------------------------------------------------------------------------------
// The concept, both ways.
namespace {
struct complete_space {  // every member, not copyable: satisfies
  static constexpr memory_kind kind = memory_kind::host;
  complete_space() = default;
  complete_space(const complete_space&) = delete;
  void* allocate(std::size_t, std::size_t);
  void* try_allocate(std::size_t, std::size_t);
  void deallocate(void*, std::size_t, std::size_t) noexcept;
  std::size_t capacity() const;
  std::size_t used() const;
  space_usage usage() const;
  std::string_view name() const;
};
struct copyable_space {  // copyable: a copy would double-free its blocks
  static constexpr memory_kind kind = memory_kind::host;
  void* allocate(std::size_t, std::size_t);
  void* try_allocate(std::size_t, std::size_t);
  void deallocate(void*, std::size_t, std::size_t) noexcept;
  std::size_t capacity() const;
  std::size_t used() const;
  space_usage usage() const;
  std::string_view name() const;
};
struct no_try_allocate {
  static constexpr memory_kind kind = memory_kind::host;
  no_try_allocate(const no_try_allocate&) = delete;
  void* allocate(std::size_t, std::size_t);
  void deallocate(void*, std::size_t, std::size_t) noexcept;
  std::size_t capacity() const;
  std::size_t used() const;
  space_usage usage() const;
  std::string_view name() const;
};
struct throwing_deallocate {
  static constexpr memory_kind kind = memory_kind::host;
  throwing_deallocate(const throwing_deallocate&) = delete;
  void* allocate(std::size_t, std::size_t);
  void* try_allocate(std::size_t, std::size_t);
  void deallocate(void*, std::size_t, std::size_t);  // not noexcept
  std::size_t capacity() const;
  std::size_t used() const;
  space_usage usage() const;
  std::string_view name() const;
};
struct no_kind {
  no_kind(const no_kind&) = delete;
  void* allocate(std::size_t, std::size_t);
  void* try_allocate(std::size_t, std::size_t);
  void deallocate(void*, std::size_t, std::size_t) noexcept;
  std::size_t capacity() const;
  std::size_t used() const;
  space_usage usage() const;
  std::string_view name() const;
};
}  // namespace

static_assert(MemorySpace<complete_space>);
static_assert(MemorySpace<host_space>);
static_assert(MemorySpace<simulated_device_space>);
static_assert(!MemorySpace<int>);
static_assert(!MemorySpace<void*>);
static_assert(!MemorySpace<copyable_space>);
static_assert(!MemorySpace<no_try_allocate>);
static_assert(!MemorySpace<throwing_deallocate>);
static_assert(!MemorySpace<no_kind>);
static_assert(!MemorySpace<memory_space_ref>);  // a copyable reference, not an owner

// The trait table.
static_assert(can_access_v<host_exec, host_space>);
static_assert(can_access_v<host_exec, simulated_device_space>);
static_assert(!can_access_v<cuda_exec, host_space>);
static_assert(!can_access_v<cuda_exec, simulated_device_space>);
static_assert(copy_traits<host_space, host_space>::possible && copy_traits<host_space, host_space>::async);
static_assert(copy_traits<host_space, simulated_device_space>::possible);
static_assert(copy_traits<host_space, simulated_device_space>::async);
static_assert(copy_traits<simulated_device_space, host_space>::possible);
static_assert(copy_traits<simulated_device_space, host_space>::async);
static_assert(!copy_traits<host_space, complete_space>::possible);  // unspecialised: impossible

TEST_CASE("host_space: freed large blocks are cached, reused, bounded and trimmed") {
  host_space s(host_space_options{.cache_limit = 8 * mib});
  void* a = s.allocate(3 * mib, 64);  // large: rounded to 4 MiB
  CHECK(reinterpret_cast<std::uintptr_t>(a) % host_space::huge_page_bytes == 0);
  CHECK(s.used() == 4 * mib);
  std::memset(a, 0x5a, 3 * mib);
  s.deallocate(a, 3 * mib, 64);
  CHECK(s.used() == 0);
  CHECK(s.cached_bytes() == 4 * mib);
  void* b = s.allocate(4 * mib, 128);  // same bucket: the cached block comes back
  CHECK(b == a);
  CHECK(s.cached_bytes() == 0);
  void* c = s.allocate(6 * mib, 64);
  s.deallocate(b, 4 * mib, 128);
  s.deallocate(c, 6 * mib, 64);  // 4 + 6 > 8 MiB limit: this one is unmapped, not cached
  CHECK(s.cached_bytes() == 4 * mib);
  s.trim();
  CHECK(s.cached_bytes() == 0);
  CHECK(s.used() == 0);
  CHECK(s.usage().peak == 10 * mib);
  s.reset_peak();
  CHECK(s.usage().peak == 0);
}

TEST_CASE("host_space: mid-size blocks are cached too, accounted at their requested size") {
  host_space s(host_space_options{.capacity = 6 * mib});
  void* a = s.allocate(mib + 3, 64);  // between 256 KiB and 2 MiB: mapped in 64 KiB granules
  CHECK(s.used() == mib + 3);         // requested bytes, as for small blocks
  std::memset(a, 1, mib + 3);
  s.deallocate(a, mib + 3, 64);
  CHECK(s.used() == 0);
  CHECK(s.cached_bytes() == mib + 64 * 1024);
  void* b = s.allocate(mib + 1000, 64);  // the same 64 KiB bucket: the faulted block comes back
  CHECK(b == a);
  CHECK(s.cached_bytes() == 0);
  void* c = s.allocate(3 * mib / 2, 64);
  s.deallocate(c, 3 * mib / 2, 64);
  CHECK(s.cached_bytes() == 3 * mib / 2);
  // 1 MiB + 4 MiB (a large block: whole 2 MiB pages) in use; with the 1.5 MiB cached that would
  // exceed the 6 MiB capacity, so the cached block is unmapped first.
  void* d = s.allocate(2 * mib + 512 * 1024, 64);
  CHECK(s.used() == mib + 1000 + 4 * mib);
  CHECK(s.cached_bytes() == 0);
  s.deallocate(d, 2 * mib + 512 * 1024, 64);
  s.deallocate(b, mib + 1000, 64);
  CHECK(s.used() == 0);
  CHECK(s.used() + s.cached_bytes() <= s.capacity() + 64 * 1024);
  host_space off(host_space_options{.cached_block_threshold = std::numeric_limits<std::size_t>::max()});
  void* e = off.allocate(mib, 64);
  off.deallocate(e, mib, 64);
  CHECK(off.cached_bytes() == 0);  // turned off: operator new
}

TEST_CASE("host_space: a capacity bounds handed-out plus cached bytes") {
  host_space s(host_space_options{.capacity = 16 * mib, .cache_limit = 64 * mib});
  void* a = s.allocate(8 * mib, 64);
  void* b = s.allocate(8 * mib, 64);
  s.deallocate(a, 8 * mib, 64);
  s.deallocate(b, 8 * mib, 64);
  CHECK(s.cached_bytes() == 16 * mib);
  void* c = s.allocate(12 * mib, 64);  // no 12 MiB bucket: cached blocks make room
  CHECK(s.used() + s.cached_bytes() <= s.capacity());
  CHECK(s.try_allocate(6 * mib, 64) == nullptr);
  s.deallocate(c, 12 * mib, 64);
  CHECK(s.used() == 0);
  CHECK_THROWS_AS(host_space(host_space_options{.large_block_threshold = 0}), config_error);
}

TEST_CASE("simulated_device_space: freed large blocks are reused, used() stays exact, the cache is bounded") {
  simulated_device_space d({.capacity = 10 * mib, .cache_limit = 6 * mib});
  void* a = d.allocate(3 * mib + 5, 64);  // large: mapped in whole 2 MiB pages (4 MiB)
  CHECK(d.used() == 3 * mib + 5);         // requested bytes, exactly
  CHECK(reinterpret_cast<std::uintptr_t>(a) % (2 * mib) == 0);
  std::memset(a, 0x5a, 3 * mib + 5);
  d.deallocate(a, 3 * mib + 5, 64);
  CHECK(d.used() == 0);
  CHECK(d.cached_bytes() == 4 * mib);
  void* b = d.allocate(4 * mib, 256);  // same rounded size: the cached (already faulted) block comes back
  CHECK(b == a);
  CHECK(d.cached_bytes() == 0);
  void* small = d.allocate(300 * 1024, 64);  // 256 KiB and up: 64 KiB granules, cached too
  d.deallocate(small, 300 * 1024, 64);
  CHECK(d.cached_bytes() == 320 * 1024);
  CHECK(d.allocate(300 * 1024 - 7, 64) == small);
  d.deallocate(small, 300 * 1024 - 7, 64);
  void* tiny = d.allocate(1000, 64);  // below the threshold: operator new, never cached
  d.deallocate(tiny, 1000, 64);
  CHECK(d.cached_bytes() == 320 * 1024);
  void* c = d.allocate(6 * mib, 64);  // no 6 MiB block cached: a new one
  CHECK(d.used() == d.capacity());
  CHECK(d.try_allocate(1, 64) == nullptr);  // full: the cache does not change the capacity
  d.deallocate(b, 4 * mib, 256);
  CHECK(d.cached_bytes() == 4 * mib + 320 * 1024);
  d.deallocate(c, 6 * mib, 64);  // 4.3 + 6 MiB > the 6 MiB limit: unmapped, not cached
  CHECK(d.cached_bytes() == 4 * mib + 320 * 1024);
  CHECK(d.usage().peak <= d.capacity());
  d.trim();
  CHECK(d.cached_bytes() == 0);
  simulated_device_space by_default({.capacity = 8 * mib});  // the limit defaults to the capacity
  void* x = by_default.allocate(8 * mib, 64);
  by_default.deallocate(x, 8 * mib, 64);
  CHECK(by_default.cached_bytes() == 8 * mib);
}

TEST_CASE("host_space: uncapped usage reports unlimited") {
  host_space s;
  const space_usage u = s.usage();
  CHECK(u.capacity == std::numeric_limits<std::size_t>::max());
  CHECK(u.largest_free_block == std::numeric_limits<std::size_t>::max());
  CHECK(u.name == "host");
  CHECK(memory_report{{u}}.to_string().find("unlimited") != std::string::npos);
}

TEST_CASE("simulated_device_space: capacity is required, the link is exposed, peak stays within capacity") {
  CHECK_THROWS_AS(simulated_device_space(simulated_device_options{}), config_error);
  CHECK_THROWS_AS(
      simulated_device_space(simulated_device_options{.capacity = 1, .link = {.bandwidth_bytes_per_s = -1}}),
      config_error);
  simulated_device_space d(simulated_device_options{
      .capacity = 10000, .link = {.bandwidth_bytes_per_s = 1e9, .latency_s = 1e-5}, .name = "sim0"});
  CHECK(d.link().modelled());
  CHECK(d.link().bandwidth_bytes_per_s == 1e9);
  CHECK(d.link().latency_s == 1e-5);
  CHECK(d.name() == "sim0");
  CHECK(simulated_device_space::kind == memory_kind::device);
  void* a = d.allocate(6000, 8);
  CHECK(d.used() == 6000);  // exact: requested bytes
  CHECK(d.usage().largest_free_block == 4000);
  CHECK(d.try_allocate(4001, 8) == nullptr);
  void* b = d.allocate(4000, 8);
  CHECK(d.used() == d.capacity());
  CHECK(d.peak() <= d.capacity());
  try {
    (void)d.allocate(1, 1);
    FAIL("allocate beyond capacity must throw");
  } catch (const out_of_memory_error& e) {
    const space_usage& u = e.report().spaces.at(0);
    CHECK(u.name == "sim0");
    CHECK(u.capacity == 10000);
    CHECK(u.used == 10000);
    CHECK(u.peak == 10000);
    CHECK(u.largest_free_block == 0);
    CHECK(e.requested_bytes() == 1);
  }
  d.deallocate(a, 6000, 8);
  d.deallocate(b, 4000, 8);
  CHECK(d.used() == 0);
  CHECK(d.peak() == 10000);
  d.reset_peak();
  CHECK(d.peak() == 0);
}

// ---------------------------------------------------------------------------------------------
namespace {
// A function at an API boundary: knows nothing of the concrete type.
std::size_t allocate_and_free_through(memory_space_ref r, std::size_t n) {
  void* p = r.allocate(n, 64);
  std::memset(p, 1, n);
  const std::size_t during = r.used();
  r.deallocate(p, n, 64);
  return during;
}
}  // namespace

TEST_CASE("memory_space_ref: erases the type and gives the same results as the space") {
  host_space h(host_space_options{.capacity = 32 * mib, .name = "h"});
  simulated_device_space d(simulated_device_options{.capacity = 1000, .name = "d"});
  std::vector<memory_space_ref> refs{h, d};
  CHECK(refs[0].kind() == memory_kind::host);
  CHECK(refs[1].kind() == memory_kind::device);
  CHECK(refs[0].name() == "h");
  CHECK(refs[1].name() == "d");
  CHECK(refs[0].capacity() == h.capacity());
  CHECK(refs[1].capacity() == 1000);
  CHECK(refs[0] == memory_space_ref(h));
  CHECK_FALSE(refs[0] == refs[1]);

  CHECK(allocate_and_free_through(refs[1], 700) == 700);
  CHECK(allocate_and_free_through(refs[0], 3 * mib) == 4 * mib);  // large block: rounded, as h counts it
  CHECK(h.used() == 0);
  CHECK(d.used() == 0);
  CHECK(d.peak() == 700);

  void* p = refs[1].allocate(600, 8);
  CHECK(d.used() == 600);
  CHECK(refs[1].used() == 600);
  const space_usage via_ref = refs[1].usage();
  const space_usage direct = d.usage();
  CHECK(via_ref.name == direct.name);
  CHECK(via_ref.used == direct.used);
  CHECK(via_ref.peak == direct.peak);
  CHECK(via_ref.largest_free_block == direct.largest_free_block);
  CHECK(refs[1].try_allocate(401, 8) == nullptr);
  CHECK_THROWS_AS((void)refs[1].allocate(401, 8), out_of_memory_error);
  refs[1].deallocate(p, 600, 8);
  CHECK(d.used() == 0);
}

}  // namespace memory_space_test
