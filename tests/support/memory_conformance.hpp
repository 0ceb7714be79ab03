// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Conformance suites for `MemorySpace` and `CopyEngine`, instantiated for every model,
 *         CPU and CUDA alike (doctest TEST_CASE_TEMPLATE_DEFINE; invoke with TEST_CASE_TEMPLATE_INVOKE).
 *
 *  A MemorySpace fixture `F` provides:
 *    `using space_type`; `static std::unique_ptr<space_type> make()`;
 *    `static void write(void* block, const void* host, std::size_t n)` and
 *    `static void read(void* host, const void* block, std::size_t n)` (memcpy or cudaMemcpy).
 *  A CopyEngine fixture `F` is default-constructible and provides:
 *    `engine_type& engine()`; `void* alloc(copy_side, std::size_t)`; `void free(copy_side, void*, std::size_t)`;
 *    `void put(copy_side, void* block, const void* host, std::size_t)`;
 *    `void get(copy_side, void* host, const void* block, std::size_t)`.
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/memory/copy_engine.hpp>
#include <chunkstar/memory/memory_space.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace chunkstar::test {

/** @brief Deterministic bytes, different for each (seed, index), from an independent generator. */
inline std::vector<unsigned char> pattern(std::size_t n, std::uint32_t seed) {
  std::vector<unsigned char> v(n);
  std::uint32_t x = seed * 2654435761u + 1u;
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    b = static_cast<unsigned char>(x >> 24);
  }
  return v;
}

/** @brief A request no space can satisfy: just over the remaining capacity, or 2^62 bytes when
 *  the space is unlimited (beyond any address space). */
template <class S>
std::size_t impossible_request(const S& s) {
  if (s.capacity() == std::numeric_limits<std::size_t>::max()) return std::size_t{1} << 62;
  return s.capacity() - s.used() + 1;
}

/** @brief Which side of a copy a buffer lives on. */
enum class copy_side { host, device };
constexpr copy_side src_side(copy_direction d) {
  return d == copy_direction::to_host ? copy_side::device : copy_side::host;
}
constexpr copy_side dst_side(copy_direction d) {
  return d == copy_direction::to_device ? copy_side::device : copy_side::host;
}
inline constexpr copy_direction all_directions[] = {copy_direction::to_device, copy_direction::to_host,
                                                    copy_direction::host_to_host};

}  // namespace chunkstar::test

// ---------------------------------------------------------------------------------------------
TEST_CASE_TEMPLATE_DEFINE("MemorySpace conformance", F, memory_space_conformance) {
  using namespace chunkstar;
  using chunkstar::test::pattern;
  using S = typename F::space_type;
  static_assert(MemorySpace<S>);
  auto owner = F::make();
  S& s = *owner;
  const std::size_t used0 = s.used();
  CHECK(used0 == 0);

  SUBCASE("allocate, write, read back, deallocate") {
    const std::size_t sizes[] = {0, 1, 7, 64, 4095, 100000, std::size_t{3} << 20, (std::size_t{4} << 20) + 5};
    std::uint32_t seed = 1;
    for (std::size_t n : sizes) {
      CAPTURE(n);
      const std::size_t before = s.used();
      void* p = s.allocate(n, 64);
      REQUIRE(p != nullptr);
      CHECK(s.used() >= before + n);
      CHECK(s.usage().peak >= s.used());
      const auto data = pattern(n, seed++);
      F::write(p, data.data(), n);
      std::vector<unsigned char> back(n);
      F::read(back.data(), p, n);
      CHECK(back == data);
      s.deallocate(p, n, 64);
      CHECK(s.used() == before);
    }
    // Several live blocks at once never alias.
    std::vector<void*> live;
    for (std::uint32_t i = 0; i < 8; ++i) {
      live.push_back(s.allocate(1000 + i, 16));
      const auto d = pattern(1000 + i, 100 + i);
      F::write(live.back(), d.data(), d.size());
    }
    for (std::uint32_t i = 0; i < 8; ++i) {
      std::vector<unsigned char> back(1000 + i);
      F::read(back.data(), live[i], back.size());
      CHECK(back == pattern(1000 + i, 100 + i));
      s.deallocate(live[i], 1000 + i, 16);
    }
    CHECK(s.used() == used0);
  }

  SUBCASE("alignment is honoured") {
    const std::size_t aligns[] = {1, 2, 8, 16, 64, 256, 4096, 65536, std::size_t{2} << 20, std::size_t{4} << 20};
    const std::size_t sizes[] = {1, 100, std::size_t{3} << 20};
    for (std::size_t a : aligns) {
      for (std::size_t n : sizes) {
        CAPTURE(a);
        CAPTURE(n);
        void* p = s.allocate(n, a);
        CHECK(reinterpret_cast<std::uintptr_t>(p) % a == 0);
        const auto data = pattern(n, static_cast<std::uint32_t>(a + n));
        F::write(p, data.data(), n);
        std::vector<unsigned char> back(n);
        F::read(back.data(), p, n);
        CHECK(back == data);
        s.deallocate(p, n, a);
      }
    }
    CHECK(s.used() == used0);
    CHECK_THROWS_AS((void)s.allocate(64, 3), config_error);
    CHECK_THROWS_AS((void)s.try_allocate(64, 0), config_error);
    CHECK(s.used() == used0);
  }

  SUBCASE("used, peak and usage() agree") {
    void* a = s.allocate(1000, 8);
    void* b = s.allocate(5000, 8);
    const std::size_t both = s.used();
    CHECK(both >= used0 + 6000);
    s.deallocate(a, 1000, 8);
    const space_usage u = s.usage();
    CHECK(u.name == std::string(s.name()));
    CHECK(!u.name.empty());
    CHECK(u.capacity == s.capacity());
    CHECK(u.used == s.used());
    CHECK(u.used < both);
    CHECK(u.peak >= both);
    CHECK(u.peak <= u.capacity);
    CHECK(u.largest_free_block > 0);
    if (u.capacity != std::numeric_limits<std::size_t>::max()) CHECK(u.largest_free_block <= u.capacity - u.used);
    s.deallocate(b, 5000, 8);
    CHECK(s.used() == used0);
  }

  SUBCASE("a request beyond capacity: try_allocate gives nullptr, allocate throws with a report") {
    const std::size_t n = chunkstar::test::impossible_request(s);
    CHECK(s.try_allocate(n, 64) == nullptr);
    CHECK(s.used() == used0);
    bool thrown = false;
    try {
      (void)s.allocate(n, 64);
    } catch (const out_of_memory_error& e) {
      thrown = true;
      CHECK(e.requested_bytes() == n);
      REQUIRE(e.report().spaces.size() >= 1);
      CHECK(e.report().spaces[0].name == std::string(s.name()));
      CHECK(e.report().spaces[0].used == s.used());
      CHECK(std::string(e.what()).find(std::string(s.name())) != std::string::npos);
    }
    CHECK(thrown);
    CHECK(s.used() == used0);
  }

  SUBCASE("a capped space fills exactly to its capacity and never beyond") {
    // Only when the whole capacity is free now (a device without a cap shares itself with others).
    if (s.capacity() == std::numeric_limits<std::size_t>::max() || s.usage().largest_free_block != s.capacity()) return;
    const std::size_t piece = s.capacity() / 8;
    REQUIRE(piece * 8 == s.capacity());
    for (int round = 0; round < 2; ++round) {  // the second round reuses whatever the first freed
      std::vector<void*> blocks;
      while (void* p = s.try_allocate(piece, 64)) {
        blocks.push_back(p);
        REQUIRE(blocks.size() <= 8);
      }
      CHECK(blocks.size() == 8);
      CHECK(s.used() == s.capacity());
      CHECK(s.try_allocate(1, 1) == nullptr);
      CHECK_THROWS_AS((void)s.allocate(1, 1), out_of_memory_error);
      CHECK(s.usage().peak <= s.capacity());
      CHECK(s.usage().largest_free_block == 0);
      for (void* p : blocks) s.deallocate(p, piece, 64);
      CHECK(s.used() == used0);
    }
  }

  SUBCASE("concurrent allocations from several threads") {
    constexpr int threads = 4;
    constexpr int iterations = 150;
    std::atomic<int> mismatches{0};
    std::atomic<bool> over_capacity{false};
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        std::mt19937 rng(static_cast<std::uint32_t>(t) + 7u);
        struct block {
          void* p;
          std::size_t n;
          std::uint32_t seed;
        };
        std::vector<block> mine;
        for (int i = 0; i < iterations; ++i) {
          const std::size_t n = (i % 50 == 49) ? (std::size_t{2} << 20) + rng() % 4096 : 1 + rng() % 20000;
          void* p = s.try_allocate(n, 32);
          if (s.used() > s.capacity()) over_capacity = true;
          if (p != nullptr) {
            const auto seed = static_cast<std::uint32_t>(t * 1000 + i);
            const auto d = chunkstar::test::pattern(n, seed);
            F::write(p, d.data(), n);
            mine.push_back({p, n, seed});
          }
          if (mine.size() > 4 || i == iterations - 1) {
            // Other threads allocated meanwhile: a block handed out twice would be overwritten.
            for (const block& b : mine) {
              std::vector<unsigned char> back(b.n);
              F::read(back.data(), b.p, b.n);
              if (back != chunkstar::test::pattern(b.n, b.seed)) ++mismatches;
              s.deallocate(b.p, b.n, 32);
            }
            mine.clear();
          }
        }
      });
    }
    for (auto& th : pool) th.join();
    CHECK(mismatches.load() == 0);
    CHECK_FALSE(over_capacity.load());
    CHECK(s.used() == used0);
    CHECK(s.usage().peak <= s.capacity());
  }
}

// ---------------------------------------------------------------------------------------------
TEST_CASE_TEMPLATE_DEFINE("CopyEngine conformance", F, copy_engine_conformance) {
  using namespace chunkstar;
  using chunkstar::test::copy_side;
  using chunkstar::test::pattern;
  F f;
  auto& e = f.engine();
  static_assert(CopyEngine<std::remove_reference_t<decltype(e)>>);

  // A source filled with `data` and a destination, both with room for offsets.
  struct buffers {
    F& f;
    copy_direction d;
    std::size_t cap;
    void* src;
    void* dst;
    buffers(F& fx, copy_direction dir, std::size_t n)
        : f(fx),
          d(dir),
          cap(n + 64),
          src(fx.alloc(chunkstar::test::src_side(dir), cap)),
          dst(fx.alloc(chunkstar::test::dst_side(dir), cap)) {}
    ~buffers() {
      f.free(chunkstar::test::src_side(d), src, cap);
      f.free(chunkstar::test::dst_side(d), dst, cap);
    }
    buffers(const buffers&) = delete;
    buffers& operator=(const buffers&) = delete;
  };
  auto at = [](void* p, std::size_t off) { return static_cast<unsigned char*>(p) + off; };

  SUBCASE("sync and async copies are byte-exact, for many sizes and unaligned offsets") {
    const std::size_t sizes[] = {0, 1, 3, 17, 4096, 4097, 65537, (std::size_t{1} << 20) + 13};
    std::uint32_t seed = 1;
    for (copy_direction d : chunkstar::test::all_directions) {
      for (std::size_t n : sizes) {
        for (int async = 0; async < 2; ++async) {
          CAPTURE(to_string(d));
          CAPTURE(n);
          CAPTURE(async);
          buffers b(f, d, n);
          const auto data = pattern(b.cap, seed++);
          const auto junk = pattern(b.cap, seed++);
          f.put(chunkstar::test::src_side(d), b.src, data.data(), b.cap);
          f.put(chunkstar::test::dst_side(d), b.dst, junk.data(), b.cap);
          const std::size_t so = 1, dof = 3;  // odd offsets: unaligned source and destination
          if (async) {
            auto h = e.copy_async(at(b.dst, dof), at(b.src, so), n, d);
            h.wait();
            CHECK(h.ready());
          } else {
            e.copy(at(b.dst, dof), at(b.src, so), n, d);
          }
          std::vector<unsigned char> back(b.cap);
          f.get(chunkstar::test::dst_side(d), back.data(), b.dst, b.cap);
          std::vector<unsigned char> expect = junk;
          std::copy_n(data.begin() + static_cast<std::ptrdiff_t>(so), n,
                      expect.begin() + static_cast<std::ptrdiff_t>(dof));
          CHECK(back == expect);
        }
      }
    }
  }

  SUBCASE("copies within a direction complete in submission order") {
    for (copy_direction d : chunkstar::test::all_directions) {
      CAPTURE(to_string(d));
      constexpr std::size_t big = std::size_t{8} << 20;
      constexpr int writers = 6;
      buffers dst_buf(f, d, big);
      // Distinct sources: one big, then progressively smaller writes over the same destination
      // prefix; only in-order execution leaves the reference's bytes.
      std::vector<std::unique_ptr<buffers>> srcs;
      std::vector<std::vector<unsigned char>> datas;
      std::vector<unsigned char> expect(big);
      std::vector<decltype(e.copy_async(nullptr, nullptr, 0, d))> handles;
      for (int w = 0; w < writers; ++w) {
        const std::size_t n = w == 0 ? big : big >> w;
        srcs.push_back(std::make_unique<buffers>(f, d, n));
        datas.push_back(pattern(n, 500u + static_cast<std::uint32_t>(w)));
        f.put(chunkstar::test::src_side(d), srcs.back()->src, datas.back().data(), n);
        std::copy(datas.back().begin(), datas.back().end(), expect.begin());
      }
      for (int w = 0; w < writers; ++w) {
        const std::size_t n = w == 0 ? big : big >> w;
        handles.push_back(e.copy_async(dst_buf.dst, srcs[static_cast<std::size_t>(w)]->src, n, d));
      }
      handles.back().wait();
      for (auto& h : handles) CHECK(h.ready());  // in order: the last done means all done
      std::vector<unsigned char> back(big);
      f.get(chunkstar::test::dst_side(d), back.data(), dst_buf.dst, big);
      CHECK(back == expect);
    }
  }

  SUBCASE("handles: empty ones are ready; copies share state; wait from several threads; wait twice") {
    decltype(e.copy_async(nullptr, nullptr, 0, copy_direction::to_device)) empty{};
    CHECK(empty.ready());
    empty.wait();
    const std::size_t n = std::size_t{4} << 20;
    buffers b(f, copy_direction::to_device, n);
    const auto data = pattern(n, 77);
    f.put(copy_side::host, b.src, data.data(), n);
    auto h = e.copy_async(b.dst, b.src, n, copy_direction::to_device);
    auto h2 = h;
    std::vector<std::thread> waiters;
    for (int i = 0; i < 3; ++i) waiters.emplace_back([h] { h.wait(); });
    h2.wait();
    for (auto& t : waiters) t.join();
    CHECK(h.ready());
    CHECK(h2.ready());
    h.wait();  // waiting on a completed handle returns at once
    std::vector<unsigned char> back(n);
    f.get(copy_side::device, back.data(), b.dst, n);
    CHECK(back == data);
  }

  SUBCASE("zero_async zeroes exactly its range on either side, in order, outside the copy stats") {
    for (copy_side side : {copy_side::host, copy_side::device}) {
      CAPTURE(static_cast<int>(side));
      for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{4099}, (std::size_t{2} << 20) + 5}) {
        CAPTURE(n);
        const std::size_t cap = n + 64, off = 3;
        void* block = f.alloc(side, cap);
        const auto junk = pattern(cap, 4242u + static_cast<std::uint32_t>(n));
        f.put(side, block, junk.data(), cap);
        const copy_stats before = e.stats();
        auto h = e.zero_async(at(block, off), n);
        h.wait();
        CHECK(h.ready());
        std::vector<unsigned char> back(cap), expect = junk;
        std::fill_n(expect.begin() + static_cast<std::ptrdiff_t>(off), n, static_cast<unsigned char>(0));
        f.get(side, back.data(), block, cap);
        CHECK(back == expect);
        const copy_stats after = e.stats();
        CHECK(after.total_bytes() == before.total_bytes());
        f.free(side, block, cap);
      }
    }
    // Ordered behind earlier host_to_host jobs: a copy then a zero of the same bytes leaves zeros.
    const std::size_t n = std::size_t{4} << 20;
    buffers b(f, copy_direction::host_to_host, n);
    const auto data = pattern(n, 4343);
    f.put(copy_side::host, b.src, data.data(), n);
    (void)e.copy_async(b.dst, b.src, n, copy_direction::host_to_host);
    e.zero_async(b.dst, n).wait();
    std::vector<unsigned char> back(n);
    f.get(copy_side::host, back.data(), b.dst, n);
    CHECK(std::all_of(back.begin(), back.end(), [](unsigned char c) { return c == 0; }));
  }

  SUBCASE("order_after: a load into the buffer an eviction still reads starts after the eviction") {
    // A big eviction (device -> host) and a small load into the same device buffer: unordered, the
    // load would finish first and overwrite bytes the eviction has yet to read.
    const std::size_t big = std::size_t{32} << 20, small = 4096;
    void* buffer = f.alloc(copy_side::device, big);
    void* evicted = f.alloc(copy_side::host, big);
    void* incoming = f.alloc(copy_side::host, small);
    for (int rep = 0; rep < 3; ++rep) {
      CAPTURE(rep);
      const auto old_data = pattern(big, 6000u + static_cast<std::uint32_t>(rep));
      const auto new_data = pattern(small, 7000u + static_cast<std::uint32_t>(rep));
      f.put(copy_side::device, buffer, old_data.data(), big);
      f.put(copy_side::host, incoming, new_data.data(), small);
      auto out = e.copy_async(evicted, buffer, big, copy_direction::to_host);
      e.order_after(out, copy_direction::to_device);
      auto in = e.copy_async(buffer, incoming, small, copy_direction::to_device);
      in.wait();
      CHECK(out.ready());  // in order: the load could not finish before the eviction
      std::vector<unsigned char> back(big);
      f.get(copy_side::host, back.data(), evicted, big);
      CHECK(back == old_data);
      std::vector<unsigned char> now(small);
      f.get(copy_side::device, now.data(), buffer, small);
      CHECK(now == new_data);
      // The same for a zero fill on the local lane.
      out = e.copy_async(evicted, buffer, big, copy_direction::to_host);
      e.order_after(out, copy_direction::host_to_host);
      e.zero_async(buffer, small).wait();
      CHECK(out.ready());
    }
    // An empty (ready) handle orders nothing and does not block.
    e.order_after(decltype(e.copy_async(nullptr, nullptr, 0, copy_direction::to_device)){}, copy_direction::to_device);
    e.synchronize();
    f.free(copy_side::device, buffer, big);
    f.free(copy_side::host, evicted, big);
    f.free(copy_side::host, incoming, small);
  }

  SUBCASE("synchronize waits for every direction; stats count bytes and copies per direction") {
    const copy_stats before = e.stats();
    std::vector<std::unique_ptr<buffers>> bufs;
    std::vector<decltype(e.copy_async(nullptr, nullptr, 0, copy_direction::to_device))> handles;
    std::uint64_t expect_bytes[3] = {0, 0, 0};
    std::uint64_t expect_copies[3] = {0, 0, 0};
    std::vector<std::vector<unsigned char>> datas;
    std::uint32_t seed = 900;
    for (int rep = 0; rep < 3; ++rep) {
      for (copy_direction d : chunkstar::test::all_directions) {
        const std::size_t n = (std::size_t{1} << 16) * static_cast<std::size_t>(rep + 1) + static_cast<std::size_t>(d);
        bufs.push_back(std::make_unique<buffers>(f, d, n));
        datas.push_back(pattern(n, seed++));
        f.put(chunkstar::test::src_side(d), bufs.back()->src, datas.back().data(), n);
        handles.push_back(e.copy_async(bufs.back()->dst, bufs.back()->src, n, d));
        expect_bytes[static_cast<std::size_t>(d)] += n;
        expect_copies[static_cast<std::size_t>(d)] += 1;
      }
    }
    e.synchronize();
    for (auto& h : handles) CHECK(h.ready());
    for (std::size_t i = 0; i < bufs.size(); ++i) {
      std::vector<unsigned char> back(datas[i].size());
      f.get(chunkstar::test::dst_side(bufs[i]->d), back.data(), bufs[i]->dst, back.size());
      CHECK(back == datas[i]);
    }
    const copy_stats after = e.stats();
    for (copy_direction d : chunkstar::test::all_directions) {
      CAPTURE(to_string(d));
      const auto i = static_cast<std::size_t>(d);
      CHECK(after[d].bytes - before[d].bytes == expect_bytes[i]);
      CHECK(after[d].copies - before[d].copies == expect_copies[i]);
      CHECK(after[d].busy_s >= before[d].busy_s);
    }
    CHECK(after.total_bytes() - before.total_bytes() == expect_bytes[0] + expect_bytes[1] + expect_bytes[2]);
  }
}
