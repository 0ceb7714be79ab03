// SPDX-License-Identifier: Apache-2.0
// The ShardStore laws (chunkstar/testing/shard_store_conformance.hpp) on both stores: the host one,
// and a chunk runtime's at a roomy and at a tight device budget (chunks moving between the device
// and the host as the stages run); and chunk_shard_store's buffers zeroed where the runtime hands
// back memory another buffer has just dirtied.
#include <chunkstar/rtp/chunk_shard_store.hpp>
#include <chunkstar/testing/shard_store_conformance.hpp>

#include "support/runtimes.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <vector>

namespace shard_store_test {

using namespace chunkstar;

static_assert(rtp::ShardStore<rtp::chunk_shard_store<testing::fixed_runtime>>);
static_assert(!rtp::ShardStore<int>);

TEST_CASE("ShardStore laws: host_shard_store") {
  const auto r = testing::check_shard_store<rtp::host_shard_store>(
      [](auto&& body) {
        rtp::host_shard_store store;
        body(store);
      },
      "host_shard_store");
  CHECK_MESSAGE(r.ok(), r.to_string());
  CHECK(r.checks > 40);
}

/** A store that overwrites gradients instead of adding them: the laws must catch it. */
struct overwriting_store : rtp::host_shard_store {
  void add_grad(std::size_t k, std::span<const float> g) { write(k, chunk_kind::grad, g); }
};
/** A store whose step forgets the micro-batches: the laws must catch it. */
struct unaveraged_store : rtp::host_shard_store {
  rtp::shard_step_result step(const adam_hyper& base, const param_groups& groups, int, float max_norm,
                              const std::function<double(double)>& global_sum_sq) {
    return rtp::host_shard_store::step(base, groups, 1, max_norm, global_sum_sq);
  }
};

/** A store whose sleep loses the accumulated gradients: the laws must catch it. */
struct forgetful_store : rtp::host_shard_store {
  void sleep() {
    rtp::host_shard_store::sleep();
    zero_grad();
  }
};

TEST_CASE("ShardStore laws: a store that breaks them is reported, naming the law") {
  const auto a = testing::check_shard_store<overwriting_store>([](auto&& body) {
    overwriting_store s;
    body(s);
  });
  CHECK_FALSE(a.ok());
  CHECK(a.to_string().find("did not leave (0 + a) + b") != std::string::npos);
  const auto b = testing::check_shard_store<unaveraged_store>([](auto&& body) {
    unaveraged_store s;
    body(s);
  });
  CHECK_FALSE(b.ok());
  CHECK(b.to_string().find("expected 1 / micro_batches") != std::string::npos);
  const auto c = testing::check_shard_store<forgetful_store>([](auto&& body) {
    forgetful_store s;
    body(s);
  });
  CHECK_FALSE(c.ok());
  CHECK(c.to_string().find("read() while asleep changed the bits") != std::string::npos);
}

TEST_CASE("ShardStore laws: chunk_shard_store, everything on the device and a device holding a few chunks") {
  using store_type = rtp::chunk_shard_store<testing::fixed_runtime>;
  for (const std::size_t capacity : {std::size_t{1} << 20, std::size_t{8} << 10}) {
    CAPTURE(capacity);
    std::size_t to_host = 0;
    const auto r = testing::check_shard_store<store_type>(
        [&](auto&& body) {
          simulated_device_space device({.capacity = capacity});
          host_space host;
          host_copy_engine copier;
          testing::fixed_runtime rt(device, host, copier, {},
                                    fixed_chunk_layout({.chunk_elems = 64, .align_elems = 8}));
          store_type store(rt);
          body(store);
          to_host += rt.stats().bytes_to_host;
        },
        "chunk_shard_store");
    CHECK_MESSAGE(r.ok(), r.to_string());
    if (capacity < (std::size_t{64} << 10)) CHECK(to_host > 0);  // the tight budget did move chunks
  }
}

TEST_CASE("chunk_shard_store::allocate returns zeroed floats, also in memory freed dirty just before") {
  simulated_device_space device({.capacity = std::size_t{8} << 20});
  host_space host;
  host_copy_engine copier;
  testing::fixed_runtime rt(device, host, copier, {}, fixed_chunk_layout({.chunk_elems = 1024}));
  rtp::chunk_shard_store<testing::fixed_runtime> store(rt);
  (void)store.add_shard(256, {{"w@0", 0, 256, tensor_role::weight}});
  store.finalize();
  constexpr std::size_t n = 4096;
  bool reused = false;
  for (int round = 0; round < 4; ++round) {
    float* p = store.allocate(n);
    CHECK(std::all_of(p, p + n, [](float x) { return x == 0.0f; }));
    std::fill(p, p + n, 7.0f);  // dirty it for the next round
    store.deallocate(p, n);
    float* q = store.allocate(n);
    reused = reused || q == p;
    CHECK_MESSAGE(std::all_of(q, q + n, [](float x) { return x == 0.0f; }), "round ", round,
                  (q == p ? ": the same memory" : ""));
    store.deallocate(q, n);
  }
  MESSAGE("the runtime handed the freed memory back: ", reused);
}

}  // namespace shard_store_test
