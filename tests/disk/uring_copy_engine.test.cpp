// SPDX-License-Identifier: Apache-2.0
// uring_copy_engine: the disk engine suite on io_uring, its error mapping, and the fallback.
// Skips (with a MESSAGE) where the build has no liburing or the kernel refuses io_uring.
#include <chunkstar/config.hpp>
#include <chunkstar/disk/uring_copy_engine.hpp>

#include <doctest/doctest.h>

#if CHUNKSTAR_HAS_URING()

#include <support/disk_engine_suite.hpp>

#include <memory>
#include <string>
#include <variant>

using namespace chunkstar;

namespace uring_copy_engine_test {

namespace {

bool uring_usable() {
  static const bool ok = io_uring_available();
  if (!ok) MESSAGE("SKIPPED: the kernel refuses io_uring here (seccomp, container policy or kernel.io_uring_disabled)");
  return ok;
}

struct uring {
  using engine_type = uring_copy_engine;
  static bool available() { return uring_usable(); }
  static std::unique_ptr<uring_copy_engine> make(disk_space& s, disk_copy_engine_options o) {
    return std::make_unique<uring_copy_engine>(s, o);
  }
};
struct uring_one_request_per_lane {
  using engine_type = uring_copy_engine;
  static bool available() { return uring_usable(); }
  static std::unique_ptr<uring_copy_engine> make(disk_space& s, disk_copy_engine_options o) {
    o.threads_per_direction = 1;
    o.max_io_bytes = 8192;  // many requests per copy
    return std::make_unique<uring_copy_engine>(s, o);
  }
};

}  // namespace

TEST_CASE_TEMPLATE_INVOKE(disk_engine_suite, uring, uring_one_request_per_lane);

TEST_CASE("uring_copy_engine: a lost descriptor is an io_error naming the request, offset, bytes and errno") {
  if (!uring_usable()) return;
  disk_space s(
      {.directory = chunkstar::test::engine_dir().path(), .capacity = std::size_t{4} << 20, .name = "uring_ebadf"});
  uring_copy_engine e(s);
  void* block = s.allocate(8192, 4096);
  chunkstar::test::host_buffer buf(8192);
  e.copy(block, buf.p, 8192, copy_direction::to_host);
  s.invalidate_fd_for_testing();
  std::string m;
  try {
    e.copy(static_cast<char*>(block) + 4096, buf.p, 4096, copy_direction::to_host);
  } catch (const io_error& err) {
    m = err.what();
  }
  CHECK(m.find("io_uring write") != std::string::npos);
  CHECK(m.find("offset " + std::to_string(s.offset_of(block) + 4096)) != std::string::npos);
  CHECK(m.find("4096 bytes") != std::string::npos);
  CHECK(m.find(std::strerror(EBADF)) != std::string::npos);
  CHECK_THROWS_AS(e.copy(buf.p, block, 4096, copy_direction::to_device), io_error);
}

TEST_CASE("make_uring_or_pool_engine: io_uring where allowed, the thread pool otherwise") {
  disk_space s({.directory = chunkstar::test::engine_dir().path(), .capacity = std::size_t{1} << 20, .name = "choose"});
  auto any = make_uring_or_pool_engine(s);
  CHECK(std::holds_alternative<std::unique_ptr<uring_copy_engine>>(any) == io_uring_available());
  std::visit(
      [&](auto& e) {
        void* block = s.allocate(100, 1);
        chunkstar::test::host_buffer a(100), b(100);
        for (int i = 0; i < 100; ++i) a.p[i] = static_cast<unsigned char>(i);
        e->copy(block, a.p, 100, copy_direction::to_host);
        e->copy(b.p, block, 100, copy_direction::to_device);
        CHECK(std::equal(a.p, a.p + 100, b.p));
        s.deallocate(block, 100, 1);
      },
      any);
}

}  // namespace uring_copy_engine_test

#else

TEST_CASE("uring_copy_engine: not built") {
  MESSAGE("SKIPPED: this build has no liburing (install liburing-dev and reconfigure)");
}

#endif
