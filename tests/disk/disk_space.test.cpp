// SPDX-License-Identifier: Apache-2.0
// disk_space: the MemorySpace conformance suite (O_DIRECT and buffered), capacity and block
// rounding, first fit and coalescing, pointers that only map to offsets, construction errors, a
// file without a name (nothing left after SIGKILL).
#include <chunkstar/disk/disk_space.hpp>

#include <support/disk_test_dir.hpp>
#include <support/memory_conformance.hpp>

#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

using namespace chunkstar;

namespace disk_space_test {

namespace {

constexpr std::size_t kib = std::size_t{1} << 10;
constexpr std::size_t mib = std::size_t{1} << 20;

chunkstar::test::scratch_dir& dir() {
  static chunkstar::test::scratch_dir d;
  return d;
}

// The conformance suite reads and writes blocks through the file itself (a second, buffered
// descriptor, so unaligned ranges work under O_DIRECT too); the space's pointers are never touched.
struct file_io {
  static inline const disk_space* current = nullptr;
  static inline int fd = -1;
  static void attach(const disk_space& s) {
    if (fd >= 0) ::close(fd);
    current = &s;
    fd = ::open(s.path().c_str(), O_RDWR | O_CLOEXEC);
    REQUIRE(fd >= 0);
  }
  static void write(void* block, const void* host, std::size_t n) {
    REQUIRE(current->contains(block));
    REQUIRE(::pwrite(fd, host, n, static_cast<off_t>(current->offset_of(block))) == static_cast<ssize_t>(n));
  }
  static void read(void* host, const void* block, std::size_t n) {
    REQUIRE(current->contains(block));
    REQUIRE(::pread(fd, host, n, static_cast<off_t>(current->offset_of(block))) == static_cast<ssize_t>(n));
  }
};
struct disk_direct : file_io {
  using space_type = disk_space;
  static std::unique_ptr<disk_space> make() {
    auto s = std::make_unique<disk_space>(disk_space_options{.directory = dir().path(), .capacity = 64 * mib});
    attach(*s);
    return s;
  }
};
struct disk_buffered : file_io {
  using space_type = disk_space;
  static std::unique_ptr<disk_space> make() {
    auto s = std::make_unique<disk_space>(disk_space_options{.directory = dir().path(),
                                                             .capacity = 64 * mib,
                                                             .block_alignment = 512,
                                                             .name = "buffered",
                                                             .use_direct_io = false});
    attach(*s);
    return s;
  }
};

}  // namespace

TEST_CASE_TEMPLATE_INVOKE(memory_space_conformance, disk_direct, disk_buffered);

static_assert(MemorySpace<disk_space>);
static_assert(disk_space::kind == memory_kind::file);
static_assert(!can_access_v<host_exec, disk_space>);
static_assert(!can_access_v<cuda_exec, disk_space>);

TEST_CASE("disk_space: the file has no name, is preallocated, and its blocks return when the space goes") {
  const std::size_t before = dir().entries();
  {
    disk_space s({.directory = dir().path(), .capacity = 3 * mib + 1, .name = "t"});
    CHECK(dir().entries() == before);  // nothing another process could find, or a crash leave behind
    struct stat st {};
    REQUIRE(::fstat(s.fd(), &st) == 0);
    CHECK(st.st_nlink == 0);
    CHECK(s.capacity() == 3 * mib + 4 * kib);  // rounded up to the block
    CHECK(static_cast<std::size_t>(st.st_size) == s.capacity());
    CHECK(static_cast<std::size_t>(st.st_blocks) * 512 >= s.capacity());  // really allocated
    struct stat via_path {};
    REQUIRE(::stat(s.path().c_str(), &via_path) == 0);  // path(): this process's way in
    CHECK(via_path.st_ino == st.st_ino);
    MESSAGE("O_DIRECT on " << dir().path() << ": " << (s.direct() ? "yes" : "no (" + s.note() + ")"));
    CHECK(s.direct() == s.note().empty());
  }
  CHECK(dir().entries() == before);
}

TEST_CASE("disk_space: a process killed with SIGKILL leaves no file behind") {
  chunkstar::test::scratch_dir own;
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {  // the child: only async-signal-safe calls after the space exists
    try {
      disk_space s({.directory = own.path(), .capacity = 8 * mib, .name = "killed"});
      const char ok = 'y';
      (void)!::write(ready[1], &ok, 1);
      for (;;) ::pause();
    } catch (...) {
      ::_exit(1);
    }
  }
  ::close(ready[1]);
  char got = 0;
  REQUIRE(::read(ready[0], &got, 1) == 1);
  ::close(ready[0]);
  CHECK(own.entries() == 0);  // alive and holding 8 MiB, yet nothing in the directory
  REQUIRE(::kill(child, SIGKILL) == 0);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFSIGNALED(status));
  CHECK(own.entries() == 0);
}

TEST_CASE("disk_space: sizes round up to the block, offsets honour max(alignment, block)") {
  disk_space s({.directory = dir().path(), .capacity = 4 * mib});
  void* a = s.allocate(1, 1);
  CHECK(s.used() == 4 * kib);
  CHECK(s.offset_of(a) % 4096 == 0);
  void* b = s.allocate(100, 65536);
  CHECK(s.offset_of(b) % 65536 == 0);
  CHECK(reinterpret_cast<std::uintptr_t>(b) % 65536 == 0);
  CHECK(s.used() == 8 * kib);
  void* c = s.allocate(4097, 8);
  CHECK(s.used() == 16 * kib);
  CHECK(s.offset_of(c) % 4096 == 0);
  s.deallocate(a, 1, 1);
  s.deallocate(b, 100, 65536);
  s.deallocate(c, 4097, 8);
  CHECK(s.used() == 0);
  CHECK(s.peak() == 16 * kib);
  CHECK(s.usage().largest_free_block == s.capacity());
  // Larger than the capacity, or than the largest free extent: nullptr, never beyond capacity.
  CHECK(s.try_allocate(4 * mib + 1, 1) == nullptr);
  CHECK_THROWS_AS((void)s.allocate(8 * mib, 1), out_of_memory_error);
}

TEST_CASE("disk_space: first fit reuses the lowest hole, frees coalesce, fragmentation shows in usage()") {
  constexpr std::size_t blk = 4 * kib;
  disk_space s({.directory = dir().path(), .capacity = 16 * blk});
  std::vector<void*> p;
  for (int i = 0; i < 4; ++i) p.push_back(s.allocate(4 * blk, 1));
  for (int i = 0; i < 4; ++i)
    CHECK(s.offset_of(p[static_cast<std::size_t>(i)]) == static_cast<std::uint64_t>(i) * 4 * blk);
  CHECK(s.try_allocate(1, 1) == nullptr);
  CHECK(s.usage().largest_free_block == 0);
  s.deallocate(p[1], 4 * blk, 1);
  s.deallocate(p[3], 4 * blk, 1);
  CHECK(s.usage().largest_free_block == 4 * blk);  // two holes of 4 blocks, not one of 8
  CHECK(s.try_allocate(5 * blk, 1) == nullptr);    // 8 blocks free, but not contiguous
  void* q = s.allocate(2 * blk, 1);
  CHECK(s.offset_of(q) == 4 * blk);  // the first hole
  void* r = s.allocate(3 * blk, 1);
  CHECK(s.offset_of(r) == 12 * blk);  // the first hole that fits
  s.deallocate(q, 2 * blk, 1);
  s.deallocate(p[2], 4 * blk, 1);  // joins [4,8) and [8,12)
  CHECK(s.usage().largest_free_block == 8 * blk);
  void* big = s.allocate(8 * blk, 1);
  CHECK(s.offset_of(big) == 4 * blk);
  s.deallocate(big, 8 * blk, 1);
  s.deallocate(r, 3 * blk, 1);
  s.deallocate(p[0], 4 * blk, 1);
  CHECK(s.used() == 0);
  CHECK(s.usage().largest_free_block == 16 * blk);  // everything merged back into one extent
  void* all = s.allocate(16 * blk, 1);
  CHECK(s.offset_of(all) == 0);
  s.deallocate(all, 16 * blk, 1);
}

TEST_CASE("disk_space: pointers only map to offsets; host pointers are not in the space") {
  disk_space s({.directory = dir().path(), .capacity = 1 * mib});
  void* p = s.allocate(8 * kib, 1);
  CHECK(s.contains(p));
  CHECK(s.contains(static_cast<char*>(p) + 8 * kib - 1));
  CHECK(s.offset_of(p) == static_cast<std::uint64_t>(static_cast<const char*>(p) - static_cast<const char*>(s.base())));
  CHECK(s.contains(s.base()));
  CHECK_FALSE(s.contains(static_cast<const char*>(s.base()) + s.capacity()));
  int local = 0;
  std::vector<char> heap(16);
  CHECK_FALSE(s.contains(&local));
  CHECK_FALSE(s.contains(heap.data()));
  CHECK_FALSE(s.contains(nullptr));
  s.deallocate(&local, 4, 1);  // not ours: ignored
  CHECK(s.used() == 8 * kib);
  s.deallocate(p, 8 * kib, 1);
  // A second space reserves a disjoint range.
  disk_space t({.directory = dir().path(), .capacity = 1 * mib, .name = "other"});
  void* q = t.allocate(1, 1);
  CHECK_FALSE(s.contains(q));
  t.deallocate(q, 1, 1);
}

TEST_CASE("disk_space: bad options and bad directories are typed errors that name the problem") {
  auto message = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const std::exception& e) {
      return e.what();
    }
    return {};
  };
  CHECK_THROWS_AS(disk_space({.directory = "", .capacity = mib}), config_error);
  CHECK_THROWS_AS(disk_space({.directory = dir().path(), .capacity = 0}), config_error);
  CHECK_THROWS_AS(disk_space({.directory = dir().path(), .capacity = mib, .block_alignment = 1000}), config_error);
  CHECK_THROWS_AS(disk_space({.directory = dir().path(), .capacity = mib, .block_alignment = 256}), config_error);

  const std::string missing = dir().path() + "/does/not/exist";
  CHECK_THROWS_AS(disk_space({.directory = missing, .capacity = mib}), config_error);
  CHECK(message([&] { disk_space s({.directory = missing, .capacity = mib}); }).find(missing) != std::string::npos);

  const std::string file = dir().path() + "/plain_file";
  {
    const int fd = ::open(file.c_str(), O_CREAT | O_WRONLY, 0600);
    REQUIRE(fd >= 0);
    ::close(fd);
  }
  CHECK_THROWS_AS(disk_space({.directory = file, .capacity = mib}), config_error);
  std::filesystem::remove(file);

  const std::string locked = dir().path() + "/read_only";
  std::filesystem::create_directory(locked);
  ::chmod(locked.c_str(), 0500);
  if (::geteuid() == 0) {
    MESSAGE("running as root, which bypasses permission checks: the no-permission case is skipped");
  } else {
    CHECK_THROWS_AS(disk_space({.directory = locked, .capacity = mib}), io_error);
    const std::string m = message([&] { disk_space s({.directory = locked, .capacity = mib}); });
    CHECK(m.find(locked) != std::string::npos);
    CHECK(m.find("writable") != std::string::npos);
  }
  ::chmod(locked.c_str(), 0700);
}

TEST_CASE("disk_space: a capacity beyond the filesystem's free space is an io_error, leaving nothing behind") {
  // A 1 MiB tmpfs stands in for a full disk (filling the real disk would hurt everyone else).
  const std::string small = dir().path() + "/small_fs";
  std::filesystem::create_directory(small);
  if (::mount("tmpfs", small.c_str(), "tmpfs", 0, "size=1m") != 0) {
    MESSAGE("cannot mount a 1 MiB tmpfs here (" << std::strerror(errno)
                                                << "; needs root and CAP_SYS_ADMIN): ENOSPC case skipped");
    return;
  }
  std::string m;
  try {
    disk_space s({.directory = small, .capacity = 8 * mib, .name = "full"});
  } catch (const io_error& e) {
    m = e.what();
  } catch (const std::exception& e) {
    FAIL("wrong error type: " << e.what());
  }
  CHECK(m.find(small) != std::string::npos);
  CHECK(m.find("8388608 bytes") != std::string::npos);
  CHECK(m.find("lower disk_space_options::capacity") != std::string::npos);
  CHECK(std::filesystem::is_empty(small));  // the half-made file is gone
  // A capacity that fits works on the same filesystem (tmpfs: O_DIRECT may be refused, with a note).
  {
    disk_space s({.directory = small, .capacity = 256 * kib, .name = "fits"});
    CHECK(s.capacity() == 256 * kib);
    if (!s.direct()) MESSAGE("tmpfs: " << s.note());
  }
  ::umount(small.c_str());
}

}  // namespace disk_space_test
