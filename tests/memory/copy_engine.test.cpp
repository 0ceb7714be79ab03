// SPDX-License-Identifier: Apache-2.0
// CopyEngine: the conformance suite for host_copy_engine (unmodelled and modelled), the concepts
// checked both ways, the modelled link's lower bound, errors, ordering, duplex and draining.
#include <chunkstar/memory/copy_engine.hpp>
#include <chunkstar/memory/host_copy_engine.hpp>
#include <chunkstar/memory/host_space.hpp>
#include <chunkstar/memory/simulated_device_space.hpp>

#include <support/memory_conformance.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

using namespace chunkstar;

namespace copy_engine_test {
using chunkstar::test::copy_side;

namespace {

constexpr std::size_t mib = std::size_t{1} << 20;

// Host side: a host_space; device side: a simulated device (host memory, so memcpy moves data in
// and out independently of the engine under test).
template <copy_model Model>
struct host_engine_fixture {
  using engine_type = host_copy_engine;
  host_space host;
  simulated_device_space device{simulated_device_options{.capacity = 512 * mib, .link = Model}};
  host_copy_engine e{Model};

  host_copy_engine& engine() { return e; }
  void* alloc(copy_side s, std::size_t n) {
    return s == copy_side::host ? host.allocate(n, 64) : device.allocate(n, 64);
  }
  void free(copy_side s, void* p, std::size_t n) {
    if (s == copy_side::host) host.deallocate(p, n, 64);
    else device.deallocate(p, n, 64);
  }
  void put(copy_side, void* block, const void* src, std::size_t n) { std::memcpy(block, src, n); }
  void get(copy_side, void* dst, const void* block, std::size_t n) { std::memcpy(dst, block, n); }
};
using unmodelled = host_engine_fixture<copy_model{}>;
using modelled = host_engine_fixture<copy_model{.bandwidth_bytes_per_s = 20e9, .latency_s = 2e-6}>;

}  // namespace

TEST_CASE_TEMPLATE_INVOKE(copy_engine_conformance, unmodelled, modelled);

// ---------------------------------------------------------------------------------------------
// The concepts, both ways.
namespace {
struct good_handle {
  bool ready() const;
  void wait() const;
};
struct handle_without_ready {
  void wait() const;
};
struct good_engine {
  good_engine() = default;
  good_engine(const good_engine&) = delete;
  void copy(void*, const void*, std::size_t, copy_direction);
  good_handle copy_async(void*, const void*, std::size_t, copy_direction);
  good_handle zero_async(void*, std::size_t);
  void order_after(const good_handle&, copy_direction);
  void synchronize();
  copy_stats stats() const;
};
struct engine_without_zero {  // copies but cannot zero a chunk asynchronously
  engine_without_zero(const engine_without_zero&) = delete;
  void copy(void*, const void*, std::size_t, copy_direction);
  good_handle copy_async(void*, const void*, std::size_t, copy_direction);
  void order_after(const good_handle&, copy_direction);
  void synchronize();
  copy_stats stats() const;
};
struct engine_without_order {  // cannot make one direction wait for another
  engine_without_order(const engine_without_order&) = delete;
  void copy(void*, const void*, std::size_t, copy_direction);
  good_handle copy_async(void*, const void*, std::size_t, copy_direction);
  good_handle zero_async(void*, std::size_t);
  void synchronize();
  copy_stats stats() const;
};
struct engine_without_synchronize {
  engine_without_synchronize(const engine_without_synchronize&) = delete;
  void copy(void*, const void*, std::size_t, copy_direction);
  good_handle copy_async(void*, const void*, std::size_t, copy_direction);
  good_handle zero_async(void*, std::size_t);
  void order_after(const good_handle&, copy_direction);
  copy_stats stats() const;
};
struct engine_returning_int {
  engine_returning_int(const engine_returning_int&) = delete;
  void copy(void*, const void*, std::size_t, copy_direction);
  int copy_async(void*, const void*, std::size_t, copy_direction);
  int zero_async(void*, std::size_t);
  void order_after(int, copy_direction);
  void synchronize();
  copy_stats stats() const;
};
struct copyable_engine {
  void copy(void*, const void*, std::size_t, copy_direction);
  good_handle copy_async(void*, const void*, std::size_t, copy_direction);
  good_handle zero_async(void*, std::size_t);
  void order_after(const good_handle&, copy_direction);
  void synchronize();
  copy_stats stats() const;
};
struct engine_with_mutable_stats {
  engine_with_mutable_stats(const engine_with_mutable_stats&) = delete;
  void copy(void*, const void*, std::size_t, copy_direction);
  good_handle copy_async(void*, const void*, std::size_t, copy_direction);
  good_handle zero_async(void*, std::size_t);
  void order_after(const good_handle&, copy_direction);
  void synchronize();
  copy_stats stats();  // not const
};
}  // namespace

static_assert(CopyHandle<good_handle>);
static_assert(CopyHandle<host_copy_handle>);
static_assert(!CopyHandle<int>);
static_assert(!CopyHandle<handle_without_ready>);
static_assert(CopyEngine<good_engine>);
static_assert(CopyEngine<host_copy_engine>);
static_assert(!CopyEngine<int>);
static_assert(!CopyEngine<engine_without_zero>);
static_assert(!CopyEngine<engine_without_order>);
static_assert(!CopyEngine<engine_without_synchronize>);
static_assert(!CopyEngine<engine_returning_int>);
static_assert(!CopyEngine<copyable_engine>);
static_assert(!CopyEngine<engine_with_mutable_stats>);
static_assert(!CopyEngine<host_space>);

TEST_CASE("copy_model: seconds = latency + bytes / bandwidth; 0 bandwidth is unmodelled") {
  constexpr copy_model none{};
  static_assert(!none.modelled());
  static_assert(none.seconds(1 << 30) == 0.0);
  constexpr copy_model m{.bandwidth_bytes_per_s = 1000, .latency_s = 0.5};
  static_assert(m.modelled());
  CHECK(m.seconds(0) == doctest::Approx(0.5));
  CHECK(m.seconds(2000) == doctest::Approx(2.5));
  CHECK(to_string(copy_direction::to_device) == "to_device");
  CHECK(to_string(copy_direction::to_host) == "to_host");
  CHECK(to_string(copy_direction::host_to_host) == "host_to_host");
}

TEST_CASE("host_copy_engine: a modelled copy of B bytes at bandwidth W takes at least latency + B/W") {
  const copy_model m{.bandwidth_bytes_per_s = 2e9, .latency_s = 1e-3};
  host_copy_engine e(m);
  const std::size_t n = 8 * mib;
  std::vector<unsigned char> src = chunkstar::test::pattern(n, 3), dst(n);
  using clock = std::chrono::steady_clock;
  for (copy_direction d : {copy_direction::to_device, copy_direction::to_host}) {
    CAPTURE(to_string(d));
    auto t0 = clock::now();
    e.copy(dst.data(), src.data(), n, d);
    CHECK(std::chrono::duration<double>(clock::now() - t0).count() >= m.seconds(n));
    CHECK(dst == src);

    t0 = clock::now();
    auto h1 = e.copy_async(dst.data(), src.data(), n / 2, d);
    auto h2 = e.copy_async(dst.data() + n / 2, src.data() + n / 2, n / 2, d);
    h2.wait();
    // Both share one in-order link: together they take at least two modelled copies.
    CHECK(std::chrono::duration<double>(clock::now() - t0).count() >= 2 * m.seconds(n / 2));
    CHECK(h1.ready());
  }
  const copy_stats s = e.stats();
  CHECK(s[copy_direction::to_device].busy_s >= m.seconds(n) + 2 * m.seconds(n / 2));
  CHECK(s[copy_direction::to_device].bytes == 2 * n);
  CHECK(s[copy_direction::to_device].copies == 3);
  CHECK(s[copy_direction::to_host].copies == 3);
  CHECK(s[copy_direction::host_to_host].copies == 0);
  CHECK(e.model().bandwidth_bytes_per_s == 2e9);
  CHECK_THROWS_AS(host_copy_engine(copy_model{.bandwidth_bytes_per_s = 1, .latency_s = -1}), config_error);
}

TEST_CASE("host_copy_engine: a failing copy or job surfaces from wait(), and the direction keeps working") {
  host_copy_engine e;
  std::vector<unsigned char> a(256, 1), b(256, 2);
  auto null_src = e.copy_async(b.data(), nullptr, 16, copy_direction::to_device);
  CHECK_THROWS_AS(null_src.wait(), config_error);
  CHECK_THROWS_AS(null_src.wait(), config_error);  // every wait reports it
  CHECK(null_src.ready());
  auto overlap = e.copy_async(a.data() + 8, a.data(), 64, copy_direction::to_device);
  CHECK_THROWS_AS(overlap.wait(), config_error);
  CHECK_THROWS_AS(e.copy(a.data(), a.data() + 100, 101, copy_direction::to_host), config_error);
  // Zero bytes with null pointers is a valid no-op.
  e.copy(nullptr, nullptr, 0, copy_direction::to_device);

  struct custom_failure : std::runtime_error {
    using std::runtime_error::runtime_error;
  };
  auto job = e.submit(copy_direction::to_device, [] { throw custom_failure("job failed"); });
  CHECK_THROWS_AS(job.wait(), custom_failure);

  e.copy(b.data(), a.data(), 256, copy_direction::to_device);
  CHECK(b == a);
  const copy_stats s = e.stats();
  CHECK(s[copy_direction::to_device].copies == 2);  // the zero-byte one and the good one; failures uncounted
  CHECK(s[copy_direction::to_device].bytes == 256);
  CHECK(s[copy_direction::to_host].copies == 0);
}

TEST_CASE("host_copy_engine: jobs in one direction run in submission order") {
  host_copy_engine e;
  std::vector<int> order;  // touched only by the to_host worker
  std::vector<host_copy_handle> hs;
  for (int i = 0; i < 200; ++i) {
    hs.push_back(e.submit(copy_direction::to_host, [&order, i] {
      if (i % 17 == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
      order.push_back(i);
    }));
  }
  e.synchronize();
  for (const auto& h : hs) CHECK(h.ready());
  REQUIRE(order.size() == 200);
  for (int i = 0; i < 200; ++i) CHECK(order[static_cast<std::size_t>(i)] == i);
}

TEST_CASE("host_copy_engine: the directions run concurrently (a blocked to_device does not stop to_host)") {
  host_copy_engine e;
  std::mutex m;
  std::condition_variable cv;
  bool released = false;
  bool timed_out = false;
  auto blocker = e.submit(copy_direction::to_device, [&] {
    std::unique_lock lock(m);
    // A generous liveness bound, so a wrong engine fails instead of hanging the suite.
    timed_out = !cv.wait_for(lock, std::chrono::seconds(60), [&] { return released; });
  });
  std::vector<unsigned char> src = chunkstar::test::pattern(1 << 16, 9), dst(1 << 16);
  e.copy(dst.data(), src.data(), src.size(), copy_direction::to_host);
  e.copy(dst.data(), src.data(), src.size(), copy_direction::host_to_host);
  CHECK(dst == src);
  CHECK_FALSE(blocker.ready());
  {
    const std::lock_guard lock(m);
    released = true;
  }
  cv.notify_all();
  blocker.wait();
  CHECK_FALSE(timed_out);
}

TEST_CASE("host_copy_engine: the destructor finishes every queued job; submitters on several threads") {
  std::atomic<int> done{0};
  std::vector<unsigned char> src = chunkstar::test::pattern(4096, 5);
  std::vector<std::vector<unsigned char>> dsts(64, std::vector<unsigned char>(4096));
  {
    host_copy_engine e(copy_model{.bandwidth_bytes_per_s = 1e9, .latency_s = 1e-4});
    std::vector<std::thread> submitters;
    for (int t = 0; t < 4; ++t) {
      submitters.emplace_back([&, t] {
        for (int i = 0; i < 16; ++i) {
          const auto d = static_cast<copy_direction>(i % 3);
          (void)e.copy_async(dsts[static_cast<std::size_t>(t * 16 + i)].data(), src.data(), src.size(), d);
          (void)e.submit(d, [&done] { ++done; });
        }
      });
    }
    for (auto& t : submitters) t.join();
  }  // no synchronize: the destructor drains
  CHECK(done.load() == 64);
  for (const auto& d : dsts) CHECK(d == src);
}

}  // namespace copy_engine_test
