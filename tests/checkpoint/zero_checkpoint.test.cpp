// SPDX-License-Identifier: Apache-2.0
// Sharded checkpoints: N ZeRO ranks save collectively (each rank its own tensors, rank 0 the index
// and the swap), and the checkpoint loads at any M ranks — or in one process without sharding, and
// the reverse — with parameters and optimizer state bit-identical to those saved; a resume at the
// same N continues the uninterrupted trajectory bit for bit.
#include <chunkstar/checkpoint/runtime_checkpoint.hpp>
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>

#include <doctest/doctest.h>

#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "support/mlp_replica.hpp"
#include "support/runtimes.hpp"

using namespace chunkstar;

namespace zero_checkpoint_test {
using chunkstar::testing::mlp_adam;
using chunkstar::testing::mlp_replica;
namespace fs = std::filesystem;

namespace {

using state = std::map<std::string, std::vector<float>>;  // "<tensor>/<list>" -> values

template <class Comm>
void collect(const mlp_replica<Comm>& r, state& out, std::mutex& m) {
  std::lock_guard lock(m);
  for (std::size_t t = 0; t < r.rt.params().size(); ++t) {
    if (!r.rt.shards().owns(r.rt.plan().slots[t].chunk)) continue;
    for (auto k : {chunk_kind::param, chunk_kind::momentum, chunk_kind::variance}) {
      std::vector<float> v(r.rt.params()[t].numel());
      r.rt.read_tensor(param_id{static_cast<std::uint32_t>(t)}, k, v);
      out[r.rt.params()[t].name + "/" + std::string(chunk_kind_name(k))] = v;
    }
  }
}

/** Trains steps [from, to] on @p ranks ranks (1: one process, no sharding), resuming from @p load
 *  and saving to @p save when given; returns the whole state, assembled from the owners. */
state run(int ranks, int from, int to, const fs::path& load, const fs::path& save, state* loaded = nullptr) {
  state out, at_load;
  std::mutex m;
  const auto body = [&](auto& comm, runtime_options options) {
    using Comm = std::remove_reference_t<decltype(comm)>;
    mlp_replica<Comm> r(options, 1 << 20, comm);
    auto opt = mlp_adam();
    if (!load.empty()) {
      const auto extra = load_checkpoint(r.rt, load);
      opt.restore_step_count(std::stoll(extra.at("optimizer_steps")));
      collect(r, at_load, m);
    }
    for (int step = from; step <= to; ++step) {
      r.forward_backward(step, comm.rank(), [] {});
      REQUIRE(opt.step(r.rt, 2e-2f, comm.size()).stepped);
    }
    if (!save.empty()) save_checkpoint(r.rt, save, {{"optimizer_steps", std::to_string(opt.step_count())}});
    collect(r, out, m);
  };
  if (ranks == 1) {
    single_process_communicator one;
    body(one, {});
  } else {
    run_ranks(ranks, [&](in_process_communicator& comm) { body(comm, {.sharding = {.enabled = true}}); });
  }
  if (loaded) *loaded = at_load;
  return out;
}

struct temp_dir {
  fs::path path = fs::temp_directory_path() / ("chunkstar_zero_ckpt_" + std::to_string(::getpid()));
  temp_dir() {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

}  // namespace

TEST_CASE("a checkpoint written at N ranks loads at any M (1-4, one process included), state bit-identical") {
  temp_dir tmp;
  for (int n : {1, 2, 3, 4}) {
    const fs::path dir = tmp.path / ("ck" + std::to_string(n));
    const state saved = run(n, 1, 2, {}, dir);
    CHECK(fs::exists(dir / (n == 1 ? "model.safetensors" : "model.safetensors.index.json")));
    for (int m : {1, 2, 3, 4}) {
      CAPTURE(n);
      CAPTURE(m);
      state loaded;
      (void)run(m, 3, 3, dir, {}, &loaded);  // and training continues
      CHECK(loaded == saved);
    }
  }
}

TEST_CASE("resume at the same N continues the uninterrupted trajectory; a damaged shard set is refused") {
  temp_dir tmp;
  const state straight = run(3, 1, 4, {}, {});
  (void)run(3, 1, 2, {}, tmp.path / "ck");
  const state resumed = run(3, 3, 4, tmp.path / "ck", {});
  CHECK(resumed == straight);
  // A missing shard: every rank gets the same typed error, none hangs.
  fs::remove(tmp.path / "ck" / "optimizer-00002-of-00003.safetensors");
  CHECK_THROWS_AS((void)run(2, 3, 3, tmp.path / "ck", {}), checkpoint_error);
  // Its remaining files are still chunkstar's, so a new save (at another N) may replace it whole.
  (void)run(2, 1, 1, {}, tmp.path / "ck");
  CHECK(fs::exists(tmp.path / "ck" / "model-00002-of-00002.safetensors"));
  CHECK(!fs::exists(tmp.path / "ck" / "model-00003-of-00003.safetensors"));
}

TEST_CASE("a shard of another save copied into a sharded checkpoint is refused at every M, before any tensor is read") {
  temp_dir tmp;
  (void)run(3, 1, 2, {}, tmp.path / "a");
  (void)run(3, 1, 3, {}, tmp.path / "b");  // a later save of the same run
  const auto files_of_rank = [](int r) {
    const std::string n = std::to_string(r);
    return std::vector<std::string>{"model-0000" + n + "-of-00003.safetensors",
                                    "optimizer-0000" + n + "-of-00003.safetensors"};
  };
  for (const auto& f : files_of_rank(2))
    fs::copy_file(tmp.path / "b" / f, tmp.path / "a" / f, fs::copy_options::overwrite_existing);
  // Each pair is whole and matches (the optimizer shard names its model shard's checksum): only
  // the save's identity tells them apart.
  CHECK_THROWS_WITH_AS((void)read_checkpoint_extra(tmp.path / "a"), doctest::Contains("mixes the files of two saves"),
                       checkpoint_error);
  for (int m : {1, 2, 3}) {
    CAPTURE(m);
    CHECK_THROWS_WITH_AS((void)run(m, 3, 3, tmp.path / "a", {}),
                         doctest::Contains("model-00002-of-00003.safetensors belongs to a different save"),
                         checkpoint_error);
  }
  // An optimizer shard alone from the other save: refused too.
  fs::copy_file(tmp.path / "b" / "optimizer-00003-of-00003.safetensors",
                tmp.path / "a" / "optimizer-00003-of-00003.safetensors", fs::copy_options::overwrite_existing);
  CHECK_THROWS_AS((void)run(1, 3, 3, tmp.path / "a", {}), checkpoint_error);
  // The untouched save still loads.
  CHECK(read_checkpoint_extra(tmp.path / "b").at("optimizer_steps") == "3");
}

}  // namespace zero_checkpoint_test
