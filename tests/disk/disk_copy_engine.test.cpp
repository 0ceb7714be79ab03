// SPDX-License-Identifier: Apache-2.0
// disk_copy_engine: the disk engine suite (round trips, order, concurrency, zero fill) and the
// faults: short transfers (max_io_bytes), a lost descriptor (EBADF), a corrupted file (checksums),
// a destructor with work queued.
#include <chunkstar/disk/disk_copy_engine.hpp>
#include <chunkstar/disk/disk_space.hpp>

#include <support/disk_engine_suite.hpp>

#include <doctest/doctest.h>

#include <fcntl.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

using namespace chunkstar;

namespace disk_copy_engine_test {
using chunkstar::test::host_buffer;
using chunkstar::test::pattern;

namespace {

constexpr std::size_t mib = std::size_t{1} << 20;

struct thread_pool {
  using engine_type = disk_copy_engine;
  static bool available() { return true; }
  static std::unique_ptr<disk_copy_engine> make(disk_space& s, disk_copy_engine_options o) {
    return std::make_unique<disk_copy_engine>(s, o);
  }
};
struct thread_pool_one_thread {
  using engine_type = disk_copy_engine;
  static bool available() { return true; }
  static std::unique_ptr<disk_copy_engine> make(disk_space& s, disk_copy_engine_options o) {
    o.threads_per_direction = 1;
    return std::make_unique<disk_copy_engine>(s, o);
  }
};

disk_space make_space(const char* name, bool direct = true) {
  return disk_space(
      {.directory = chunkstar::test::engine_dir().path(), .capacity = 8 * mib, .name = name, .use_direct_io = direct});
}

std::string what_of(const disk_copy_handle& h) {
  try {
    h.wait();
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}

}  // namespace

TEST_CASE_TEMPLATE_INVOKE(disk_engine_suite, thread_pool, thread_pool_one_thread);

static_assert(CopyEngine<disk_copy_engine>);
static_assert(CopyHandle<disk_copy_handle>);

TEST_CASE("disk_copy_engine: options are checked") {
  disk_space s = make_space("opts");
  CHECK_THROWS_AS(disk_copy_engine(s, {.threads_per_direction = 0}), config_error);
  CHECK_THROWS_AS(disk_copy_engine(s, {.piece_bytes = 1000}), config_error);
  CHECK_THROWS_AS(disk_copy_engine(s, {.piece_bytes = 1024}), config_error);  // below the block
}

TEST_CASE("disk_copy_engine: every syscall limited to a few bytes still moves every byte (the retry loop)") {
  for (bool direct : {true, false}) {
    CAPTURE(direct);
    disk_space s = make_space("short", direct);
    // Under O_DIRECT 1000 rounds down to one block per syscall; buffered, 1000 bytes exactly.
    disk_copy_engine e(s, {.max_io_bytes = 1000});
    const std::size_t n = 300000 + 13;
    void* block = s.allocate(n, 1);
    host_buffer src(n, 1), dst(n, 3);
    const auto d = pattern(n, 5);
    std::copy(d.begin(), d.end(), src.p);
    e.copy(block, src.p, n, copy_direction::to_host);
    e.copy(dst.p, block, n, copy_direction::to_device);
    CHECK(std::equal(d.begin(), d.end(), dst.p));
    const std::uint64_t per_call = direct ? 4096 : 1000;
    CHECK(e.io_stats().io_calls >= 2 * n / per_call);
    s.deallocate(block, n, 1);
  }
}

TEST_CASE("disk_copy_engine: a lost descriptor fails copies with io_error naming the call, offset, bytes and errno") {
  disk_space s = make_space("ebadf");
  disk_copy_engine e(s);
  void* block = s.allocate(64 * 1024, 4096);
  host_buffer src(64 * 1024), dst(64 * 1024);
  e.copy(block, src.p, 64 * 1024, copy_direction::to_host);
  s.invalidate_fd_for_testing();
  auto w = e.copy_async(static_cast<char*>(block) + 8192, src.p, 4096, copy_direction::to_host);
  const std::string m = what_of(w);
  CHECK(m.find("pwrite") != std::string::npos);
  CHECK(m.find("offset " + std::to_string(s.offset_of(block) + 8192)) != std::string::npos);
  CHECK(m.find("4096 bytes") != std::string::npos);
  CHECK(m.find(std::strerror(EBADF)) != std::string::npos);
  CHECK_THROWS_AS(w.wait(), io_error);
  auto r = e.copy_async(dst.p, block, 4096, copy_direction::to_device);
  CHECK(what_of(r).find("pread") != std::string::npos);
  const copy_stats st = e.stats();
  CHECK(st[copy_direction::to_host].copies == 1);  // failed copies are not counted
  CHECK(st[copy_direction::to_device].copies == 0);
  e.synchronize();
}  // the destructors run fine after failures

TEST_CASE("disk_copy_engine: bytes changed behind the engine's back fail the read with corruption_error") {
  disk_space s = make_space("crc");
  disk_copy_engine e(s, {.verify_checksums = true});
  const std::size_t n = 3 * 65536 + 5;
  void* block = s.allocate(n, 4096);
  host_buffer src(n), dst(n);
  const auto d = pattern(n, 8);
  std::copy(d.begin(), d.end(), src.p);
  e.copy(block, src.p, n, copy_direction::to_host);
  e.copy(dst.p, block, n, copy_direction::to_device);  // clean: verified, passes
  CHECK(e.io_stats().verified_reads == 1);
  // Flip one byte in the middle through a second, buffered descriptor.
  const int fd = ::open(s.path().c_str(), O_RDWR | O_CLOEXEC);
  REQUIRE(fd >= 0);
  const unsigned char flipped = static_cast<unsigned char>(d[70000] ^ 0xFF);
  const std::uint64_t off = s.offset_of(block);
  REQUIRE(::pwrite(fd, &flipped, 1, static_cast<off_t>(off + 70000)) == 1);
  REQUIRE(::fdatasync(fd) == 0);
  ::close(fd);
  auto r = e.copy_async(dst.p, block, n, copy_direction::to_device);
  CHECK_THROWS_AS(r.wait(), corruption_error);
  CHECK_THROWS_AS(r.wait(), io_error);  // a corruption_error is an io_error
  CHECK(what_of(r).find("offset " + std::to_string(off)) != std::string::npos);
  // Rewriting the range records a fresh checksum.
  e.copy(block, src.p, n, copy_direction::to_host);
  e.copy(dst.p, block, n, copy_direction::to_device);
  CHECK(std::equal(d.begin(), d.end(), dst.p));
  // Without checksums the same damage goes unnoticed (that is what the option buys).
  disk_copy_engine quiet(s, {.verify_checksums = false});
  quiet.copy(block, src.p, n, copy_direction::to_host);
  const int fd2 = ::open(s.path().c_str(), O_RDWR | O_CLOEXEC);
  REQUIRE(::pwrite(fd2, &flipped, 1, static_cast<off_t>(off + 70000)) == 1);
  ::close(fd2);
  CHECK_NOTHROW(quiet.copy(dst.p, block, n, copy_direction::to_device));
  s.deallocate(block, n, 4096);
}

TEST_CASE("disk_copy_engine: the destructor finishes every queued job; submitters on several threads") {
  disk_space s = make_space("dtor");
  const std::size_t n = 128 * 1024;
  std::vector<void*> blocks;
  std::vector<std::unique_ptr<host_buffer>> bufs;
  std::vector<disk_copy_handle> hs;
  for (int i = 0; i < 8; ++i) {
    blocks.push_back(s.allocate(n, 4096));
    bufs.push_back(std::make_unique<host_buffer>(n));
    const auto d = pattern(n, 40u + static_cast<std::uint32_t>(i));
    std::copy(d.begin(), d.end(), bufs.back()->p);
  }
  {
    disk_copy_engine e(s);
    std::vector<std::thread> ts;
    for (int t = 0; t < 4; ++t) {
      ts.emplace_back([&, t] {
        for (int k = 0; k < 2; ++k) {
          const auto i = static_cast<std::size_t>(t * 2 + k);
          (void)e.copy_async(blocks[i], bufs[i]->p, n, copy_direction::to_host);
        }
      });
    }
    for (auto& t : ts) t.join();
  }  // destroyed with the writes possibly still queued: they finish first
  disk_copy_engine e(s);
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    host_buffer back(n);
    e.copy(back.p, blocks[i], n, copy_direction::to_device);
    CHECK(std::equal(bufs[i]->p, bufs[i]->p + n, back.p));
    s.deallocate(blocks[i], n, 4096);
  }
}

}  // namespace disk_copy_engine_test
