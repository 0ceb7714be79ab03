// rtp::chunk_shard_store as the ShardStore contract (rtp/shard_store.hpp) asks: the buffers it
// allocates for the model (transit buffers, activations) are zeroed, even where the runtime hands
// back memory another buffer has just used and dirtied.
#include <chunkstar/rtp/chunk_shard_store.hpp>

#include "support/runtimes.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <vector>

namespace chunk_shard_store_test {

using namespace chunkstar;

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
    CHECK_MESSAGE(std::all_of(q, q + n, [](float x) { return x == 0.0f; }), "round ", round, (q == p ? ": the same memory" : ""));
    store.deallocate(q, n);
  }
  MESSAGE("the runtime handed the freed memory back: ", reused);
}

}  // namespace chunk_shard_store_test
