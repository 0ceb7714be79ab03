// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief The round-trip, ordering, concurrency and zero-fill suite every disk copy engine runs
 *         (disk_copy_engine, uring_copy_engine). A fixture `F` provides
 *         `static std::unique_ptr<engine_type> make(disk_space&, disk_copy_engine_options)` and
 *         `static bool available()` (false, with a MESSAGE already given, where the engine cannot run).
 */
#pragma once

#include <chunkstar/disk/disk_copy_engine.hpp>
#include <chunkstar/disk/disk_space.hpp>

#include <support/disk_test_dir.hpp>
#include <support/memory_conformance.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <future>
#include <memory>
#include <new>
#include <vector>

namespace chunkstar::test {

/** @brief Host bytes aligned to 4096, viewed at `shift` bytes past the aligned start. */
struct host_buffer {
  host_buffer(std::size_t n, std::size_t shift = 0)
      : raw(static_cast<unsigned char*>(::operator new (n + shift + 1, std::align_val_t{4096}))), p(raw + shift) {}
  ~host_buffer() { ::operator delete (raw, std::align_val_t{4096}); }
  host_buffer(const host_buffer&) = delete;
  host_buffer& operator=(const host_buffer&) = delete;
  unsigned char* raw;
  unsigned char* p;
};

inline scratch_dir& engine_dir() {
  static scratch_dir d;
  return d;
}

}  // namespace chunkstar::test

TEST_CASE_TEMPLATE_DEFINE("disk engine: round trips, order, concurrency, zero fill", F, disk_engine_suite) {
  using namespace chunkstar;
  using chunkstar::test::host_buffer;
  using chunkstar::test::pattern;
  if (!F::available()) return;
  constexpr std::size_t mib = std::size_t{1} << 20;

  for (bool direct : {true, false}) {
    for (bool checksums : {true, false}) {
      CAPTURE(direct);
      CAPTURE(checksums);
      disk_space space({.directory = chunkstar::test::engine_dir().path(),
                        .capacity = 16 * mib,
                        .name = direct ? "direct" : "buffered",
                        .use_direct_io = direct});
      disk_copy_engine_options o;
      o.verify_checksums = checksums;
      o.piece_bytes = 256 * 1024;  // several pieces per copy
      auto engine = F::make(space, o);
      auto& e = *engine;
      static_assert(CopyEngine<std::remove_reference_t<decltype(e)>>);

      {
        INFO("host -> disk -> host, aligned and unaligned buffers, offsets and sizes");
        const std::size_t sizes[] = {0, 1, 511, 4095, 4096, 4097, 65536 + 7, mib + 13, 3 * mib};
        std::uint32_t seed = 1;
        for (std::size_t n : sizes) {
          for (std::size_t host_shift : {std::size_t{0}, std::size_t{1}}) {
            for (std::size_t disk_shift : {std::size_t{0}, std::size_t{3}}) {
              CAPTURE(n);
              CAPTURE(host_shift);
              CAPTURE(disk_shift);
              void* block = space.allocate(n + 64, 4096);
              unsigned char* at = static_cast<unsigned char*>(block) + disk_shift;
              // Neighbours first, to prove a partial-block write keeps them.
              const auto fence = pattern(n + 64, seed++);
              host_buffer f(n + 64);
              std::copy(fence.begin(), fence.end(), f.p);
              e.copy(block, f.p, n + 64, copy_direction::to_host);
              const auto data = pattern(n, seed++);
              host_buffer src(n, host_shift), dst(n, host_shift);
              std::copy(data.begin(), data.end(), src.p);
              auto w = e.copy_async(at, src.p, n, copy_direction::to_host);
              w.wait();
              CHECK(w.ready());
              e.copy(dst.p, at, n, copy_direction::to_device);
              CHECK(std::equal(data.begin(), data.end(), dst.p));
              host_buffer whole(n + 64);
              e.copy(whole.p, block, n + 64, copy_direction::to_device);
              std::vector<unsigned char> expect = fence;
              std::copy(data.begin(), data.end(), expect.begin() + static_cast<std::ptrdiff_t>(disk_shift));
              CHECK(std::equal(expect.begin(), expect.end(), whole.p));
              space.deallocate(block, n + 64, 4096);
            }
          }
        }
        if (space.direct()) CHECK(e.io_stats().bounced_pieces > 0);
        if (checksums) CHECK(e.io_stats().verified_reads > 0);
      }

      {
        INFO("within a direction, jobs complete in submission order");
        const std::size_t n = 2 * mib;
        void* block = space.allocate(n, 4096);
        constexpr int writes = 5;
        std::vector<std::unique_ptr<host_buffer>> srcs;
        std::vector<disk_copy_handle> hs;
        std::vector<unsigned char> expect(n);
        for (int i = 0; i < writes; ++i) {  // a big write, then smaller ones over its prefix
          const std::size_t len = n >> i;
          srcs.push_back(std::make_unique<host_buffer>(len, static_cast<std::size_t>(i % 2)));
          const auto d = pattern(len, 300u + static_cast<std::uint32_t>(i));
          std::copy(d.begin(), d.end(), srcs.back()->p);
          std::copy(d.begin(), d.end(), expect.begin());
        }
        for (int i = 0; i < writes; ++i)
          hs.push_back(e.copy_async(block, srcs[static_cast<std::size_t>(i)]->p, n >> i, copy_direction::to_host));
        // A load of the same range, ordered after the last eviction through order_after.
        e.order_after(hs.back(), copy_direction::to_device);
        host_buffer back(n);
        auto r = e.copy_async(back.p, block, n, copy_direction::to_device);
        r.wait();
        for (auto& h : hs) CHECK(h.ready());
        CHECK(std::equal(expect.begin(), expect.end(), back.p));
        space.deallocate(block, n, 4096);
      }

      {
        INFO("the directions run concurrently: a blocked lane does not stop the others");
        std::promise<void> gate;
        disk_copy_handle gate_handle(gate.get_future().share());
        e.order_after(gate_handle, copy_direction::to_host);  // to_host now waits for the test
        const std::size_t n = mib;
        void* a = space.allocate(n, 4096);
        void* b = space.allocate(n, 4096);
        host_buffer src(n), back(n);
        const auto d = pattern(n, 77);
        std::copy(d.begin(), d.end(), src.p);
        auto blocked = e.copy_async(a, src.p, n, copy_direction::to_host);
        e.copy(b, src.p, n, copy_direction::host_to_host);  // another lane: completes
        e.copy(back.p, b, n, copy_direction::to_device);    // and another
        CHECK(std::equal(d.begin(), d.end(), back.p));
        CHECK_FALSE(blocked.ready());
        gate.set_value();
        blocked.wait();
        e.copy(back.p, a, n, copy_direction::to_device);
        CHECK(std::equal(d.begin(), d.end(), back.p));
        space.deallocate(a, n, 4096);
        space.deallocate(b, n, 4096);
      }

      {
        INFO("zero_async zeroes exactly its range on disk or in host memory, outside the stats");
        const std::size_t n = 300000, cap = n + 64;
        void* block = space.allocate(cap, 4096);
        host_buffer junk(cap), back(cap);
        const auto j = pattern(cap, 91);
        std::copy(j.begin(), j.end(), junk.p);
        e.copy(block, junk.p, cap, copy_direction::to_host);
        const copy_stats before = e.stats();
        e.zero_async(static_cast<unsigned char*>(block) + 5, n).wait();
        CHECK(e.stats().total_bytes() == before.total_bytes());
        e.copy(back.p, block, cap, copy_direction::to_device);
        std::vector<unsigned char> expect = j;
        std::fill_n(expect.begin() + 5, n, static_cast<unsigned char>(0));
        CHECK(std::equal(expect.begin(), expect.end(), back.p));
        // Host memory: a memset on the same lane.
        e.zero_async(junk.p + 1, 100).wait();
        CHECK(std::all_of(junk.p + 1, junk.p + 101, [](unsigned char c) { return c == 0; }));
        CHECK(junk.p[0] == j[0]);
        CHECK(junk.p[101] == j[101]);
        // Ordered behind an eviction through order_after.
        auto w = e.copy_async(block, junk.p, cap, copy_direction::to_host);
        e.order_after(w, copy_direction::host_to_host);
        e.zero_async(block, cap).wait();
        CHECK(w.ready());
        e.copy(back.p, block, cap, copy_direction::to_device);
        CHECK(std::all_of(back.p, back.p + cap, [](unsigned char c) { return c == 0; }));
        space.deallocate(block, cap, 4096);
      }

      {
        INFO("synchronize and stats: bytes and copies per direction");
        const copy_stats before = e.stats();
        const std::size_t n = 100000;
        void* block = space.allocate(n, 4096);
        host_buffer src(n), dst(n);
        std::vector<disk_copy_handle> hs;
        for (int i = 0; i < 3; ++i) hs.push_back(e.copy_async(block, src.p, n, copy_direction::to_host));
        e.order_after(hs.back(), copy_direction::to_device);
        for (int i = 0; i < 2; ++i) hs.push_back(e.copy_async(dst.p, block, n, copy_direction::to_device));
        e.synchronize();
        for (auto& h : hs) CHECK(h.ready());
        const copy_stats s = e.stats();
        CHECK(s[copy_direction::to_host].bytes - before[copy_direction::to_host].bytes == 3 * n);
        CHECK(s[copy_direction::to_host].copies - before[copy_direction::to_host].copies == 3);
        CHECK(s[copy_direction::to_device].bytes - before[copy_direction::to_device].bytes == 2 * n);
        CHECK(s[copy_direction::to_device].busy_s >= before[copy_direction::to_device].busy_s);
        CHECK(e.record(host_stream{}).ready());
        space.deallocate(block, n, 4096);
      }

      {
        INFO("misuse is a config_error from wait(): neither or both pointers on disk, past the end");
        host_buffer a(64), b(64);
        CHECK_THROWS_AS(e.copy(a.p, b.p, 64, copy_direction::to_device), config_error);
        void* x = space.allocate(4096, 4096);
        void* y = space.allocate(4096, 4096);
        CHECK_THROWS_AS(e.copy(x, y, 64, copy_direction::to_device), config_error);
        CHECK_THROWS_AS(e.copy(nullptr, x, 64, copy_direction::to_device), config_error);
        const void* last = static_cast<const unsigned char*>(space.base()) + space.capacity() - 8;
        CHECK_THROWS_AS(e.copy(a.p, last, 64, copy_direction::to_device), config_error);
        e.copy(a.p, x, 64, copy_direction::to_device);  // still works
        space.deallocate(x, 4096, 4096);
        space.deallocate(y, 4096, 4096);
      }
    }
  }
}
