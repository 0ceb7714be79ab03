// SPDX-License-Identifier: Apache-2.0
// owned_disk_tier: the space and the engine a disk tier refers to, in one object. The engine the
// kind picks (io_uring where this build and the kernel allow it for automatic), a block written
// through the tier and read back, a runtime trained with it against one without a disk, and the
// refusal of io_uring where there is none.
#include <chunkstar/disk/owned_disk_tier.hpp>

#include "support/disk_test_dir.hpp"
#include "support/mlp_replica.hpp"

#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <vector>

using namespace chunkstar;

namespace owned_disk_tier_test {

namespace {

bool uring_here() {
#if CHUNKSTAR_HAS_URING()
  return io_uring_available();
#else
  return false;
#endif
}

}  // namespace

TEST_CASE("owned_disk_tier: the engine the kind picks, a block through the tier, and what it says of itself") {
  chunkstar::test::scratch_dir dir;
  for (const auto kind : {disk_engine_kind::automatic, disk_engine_kind::pool}) {
    owned_disk_tier d({.directory = dir.path(), .capacity = std::size_t{1} << 20, .name = "owned"}, kind);
    CHECK(d.uses_uring() == (kind == disk_engine_kind::automatic && uring_here()));
    CHECK(d.engine_name() == (d.uses_uring() ? "io_uring" : "pread/pwrite threads"));
    CHECK(d.describe().find("1.00 MiB in a file without a name in " + dir.path()) == 0);
    CHECK(d.describe().find(std::string(d.engine_name())) != std::string::npos);
    // A block written to the disk and read back through the tier, as the runtime moves chunks.
    const disk_tier t = d.tier();
    void* block = d.space().allocate(8192, 4096);
    std::vector<unsigned char> out(8192), in(8192, 0);
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<unsigned char>(i * 7 + 3);
    t.copy(block, out.data(), out.size(), copy_direction::to_host);
    t.copy(in.data(), block, in.size(), copy_direction::to_device);
    CHECK(in == out);
    CHECK(d.stats()[copy_direction::to_host].bytes == 8192);
    CHECK(d.stats()[copy_direction::to_device].bytes == 8192);
    d.space().deallocate(block, 8192, 4096);
  }
}

TEST_CASE("owned_disk_tier: io_uring asked for where there is none is a config_error saying to use the pool") {
  chunkstar::test::scratch_dir dir;
  if (uring_here()) {
    owned_disk_tier d({.directory = dir.path(), .capacity = std::size_t{1} << 20}, disk_engine_kind::uring);
    CHECK(d.uses_uring());
  } else {
    CHECK_THROWS_WITH_AS(
        owned_disk_tier({.directory = dir.path(), .capacity = std::size_t{1} << 20}, disk_engine_kind::uring),
        doctest::Contains("disk_engine_kind::pool"), config_error);
  }
}

TEST_CASE("owned_disk_tier: a runtime with it below a small host trains with the bits of one without a disk") {
  using chunkstar::testing::mlp_replica;
  constexpr std::size_t block = 4096,
                        capacity = chunkstar::testing::mlp_act_bytes + 6 * chunkstar::testing::mlp_chunk_bytes;
  chunkstar::test::scratch_dir dir;
  const auto train = [&](owned_disk_tier* disk) {
    using replica = mlp_replica<single_process_communicator>;
    replica r({}, capacity, host_space_options{.capacity = disk ? 6 * block : host_space_options{}.capacity},
              [&](replica::runtime_type& rt) {
                if (disk) rt.attach_disk(disk->tier());
              });
    auto opt = chunkstar::testing::mlp_adam();
    for (int step = 1; step <= 3; ++step) {
      r.forward_backward(step, 0, [] {});
      REQUIRE(opt.step(r.rt, 2e-2f, 1).stepped);
    }
    if (disk) CHECK(r.rt.stats().bytes_from_disk > 0);
    return r.all(chunk_kind::param);
  };
  owned_disk_tier disk({.directory = dir.path(), .capacity = 64 * block});
  CHECK(train(&disk) == train(nullptr));
}

}  // namespace owned_disk_tier_test
