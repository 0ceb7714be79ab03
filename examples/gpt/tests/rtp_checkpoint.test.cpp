// SPDX-License-Identifier: Apache-2.0
// Checkpoints across modes (rtp_checkpoint.hpp): a checkpoint saved under RTP at N ranks holds the
// whole model in chunkstar's per-tensor format, loads under RTP at another N and in one process's
// chunk runtime, and the reverse; weights and both Adam moments arrive bit for bit, and a resume
// continues the uninterrupted trajectory bit for bit.
#include "chunked_gpt.hpp"
#include "rtp_checkpoint.hpp"
#include "support/runtimes.hpp"

#include <chunkstar/checkpoint/runtime_checkpoint.hpp>
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/comm/single_process.hpp>
#include <chunkstar/runtime/assemblies.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>

#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

namespace rtp_checkpoint_test {

namespace fs = std::filesystem;
using chunkstar::chunk_kind;
using chunkstar::in_process_communicator;

namespace {

const gpt::gpt_config config{.vocab = 50, .context = 8, .layers = 2, .heads = 12, .width = 48};
constexpr std::size_t B = 2, Tn = 6, rows = B * Tn;
constexpr std::uint64_t seed = 11;
const std::size_t elems = gpt::param_count(config);
constexpr chunk_kind kinds[] = {chunk_kind::param, chunk_kind::momentum, chunk_kind::variance};

/** The model's lists, whole: weights, exp_avg, exp_avg_sq, param_specs order, flat. */
struct state {
  std::vector<float> l[3];
  state() {
    for (auto& v : l) v.assign(elems, 0.0f);
  }
  bool operator==(const state& o) const {
    for (int k = 0; k < 3; ++k)
      if (std::memcmp(l[k].data(), o.l[k].data(), elems * sizeof(float)) != 0) return false;
    return true;
  }
};

std::vector<std::size_t> bases() {
  std::vector<std::size_t> b;
  std::size_t off = 0;
  for (const auto& s : gpt::param_specs(config)) b.push_back(off), off += s.numel();
  return b;
}

void batch(int step, int m, std::vector<int>& tokens, std::vector<int>& targets) {
  std::mt19937 rng(static_cast<std::uint32_t>(977 * step + m));
  std::uniform_int_distribution<int> tok(0, config.vocab - 1);
  std::vector<int> seq(rows + 1);
  for (auto& t : seq) t = tok(rng);
  tokens.assign(seq.begin(), seq.end() - 1);
  targets.assign(seq.begin() + 1, seq.end());
}

const chunkstar::param_groups groups = chunkstar::param_groups::with_default_decay(0.1f);
const chunkstar::adam_hyper hyper{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f};

/** Trains steps [from, to] under RTP on @p n ranks (AdamW, clipping at 1), loading @p load first
 *  and saving to @p save at the end when given; returns the whole state, assembled. */
state run_rtp(int n, int from, int to, const fs::path& load, const fs::path& save) {
  state out;
  const auto base = bases();
  std::mutex mu;
  chunkstar::run_ranks(n, [&](in_process_communicator& comm) {
    gpt::rtp_gpt<in_process_communicator> m(comm, config, B, Tn);
    m.init(seed);
    if (!load.empty()) {
      gpt::rtp_load_view<in_process_communicator> view(m);
      const auto extra = chunkstar::load_checkpoint(view, load);
      m.restore_step_count(std::stoll(extra.at("optimizer_steps")));
    }
    std::vector<int> tokens, targets;
    for (int step = from; step <= to; ++step) {
      batch(step, comm.rank(), tokens, targets);
      m.forward(tokens.data(), targets.data());
      m.backward(tokens.data(), targets.data());
      m.step(hyper, groups, n, 1.0f);
    }
    if (!save.empty()) {
      gpt::rtp_save_view<in_process_communicator> view(m, comm);
      chunkstar::save_checkpoint(view, save, {{"optimizer_steps", std::to_string(m.optimizer_steps())}});
    }
    std::lock_guard lock(mu);
    std::vector<float> v;
    for (std::size_t k = 0; k < m.parts().size(); ++k)
      for (int l = 0; l < 3; ++l) {
        v.resize(m.parts()[k].elems);
        m.read(k, kinds[l], v);
        m.parts()[k].for_each([&](std::size_t t, std::size_t i, std::size_t off) { out.l[l][base[t] + i] = v[off]; });
      }
  });
  return out;
}

/** One process's chunk runtime holding the model, trained steps [from, to] with chunk_adam on one
 *  micro-batch per step (none when from > to), after loading @p load; saves to @p save. */
state run_single(int from, int to, const fs::path& load, const fs::path& save) {
  using runtime = chunkstar::patrickstar_runtime;
  chunkstar::simulated_device_space dev({.capacity = std::size_t{64} << 20});
  chunkstar::host_space host;
  chunkstar::host_copy_engine copier;
  chunkstar::single_process_communicator one;
  runtime rt(dev, host, copier, one, {}, chunkstar::searched_chunk_layout());
  gpt::chunked_gpt<runtime> model(rt, config, {B, Tn}, seed);
  model.finalize();
  chunkstar::chunk_adam<> opt({.hyper = hyper, .max_grad_norm = 1.0f}, groups);
  if (!load.empty()) {
    const auto extra = chunkstar::load_checkpoint(rt, load);
    opt.restore_step_count(std::stoll(extra.at("optimizer_steps")));
  }
  std::vector<int> tokens, targets;
  for (int step = from; step <= to; ++step) {
    batch(step, 0, tokens, targets);
    model.forward_backward(tokens.data(), targets.data());
    REQUIRE(opt.step(rt, hyper.lr).stepped);
  }
  if (!save.empty()) chunkstar::save_checkpoint(rt, save, {{"optimizer_steps", std::to_string(opt.step_count())}});
  state out;
  const auto base = bases();
  for (std::size_t t = 0; t < rt.params().size(); ++t)
    for (int k = 0; k < 3; ++k) {
      if (!rt.has_list(kinds[k])) continue;
      rt.read_tensor(chunkstar::param_id{static_cast<std::uint32_t>(t)}, kinds[k],
                     std::span<float>(out.l[k].data() + base[t], rt.params()[t].numel()));
    }
  return out;
}

struct temp_dir {
  fs::path path = fs::temp_directory_path() / ("chunkstar_rtp_ckpt_" + std::to_string(::getpid()));
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

TEST_CASE(
    "rtp checkpoints: saved at N ranks, loaded at M ranks, weights and Adam moments bit for bit; the file is the whole "
    "model") {
  temp_dir tmp;
  for (const int n : {1, 2, 3, 4}) {
    CAPTURE(n);
    const fs::path dir = tmp.path / ("n" + std::to_string(n));
    const state saved = run_rtp(n, 1, 2, {}, dir);
    // The model file holds every tensor whole, whatever the world size.
    state from_files;
    {
      const auto base = bases();
      const auto specs = gpt::param_specs(config);
      std::vector<fs::path> files;
      for (const auto& e : fs::directory_iterator(dir))
        if (e.path().filename().string().starts_with("model")) files.push_back(e.path());
      CHECK(files.size() == (n == 1 ? 1u : static_cast<std::size_t>(n) + 1));  // + the index for N > 1
      std::size_t found = 0;
      for (const auto& f : files) {
        if (f.extension() != ".safetensors") continue;
        const auto file = chunkstar::safetensors_file::open(f);
        for (std::size_t t = 0; t < specs.size(); ++t)
          if (file.find(specs[t].name)) {
            file.read_floats(specs[t].name, std::span<float>(from_files.l[0].data() + base[t], specs[t].numel()));
            ++found;
          }
      }
      CHECK(found == specs.size());
      CHECK(std::memcmp(from_files.l[0].data(), saved.l[0].data(), elems * sizeof(float)) == 0);
    }
    CHECK_FALSE(run_rtp(n, 1, 0, {}, {}) == saved);  // what a load that restored nothing would give
    for (const int m : {1, 2, 3, 4}) {
      CAPTURE(m);
      // Loading and training no step (from > to) reads the state back.
      CHECK(run_rtp(m, 1, 0, dir, {}) == saved);
    }
  }
}

TEST_CASE("rtp checkpoints: a resume continues the uninterrupted trajectory bit for bit") {
  temp_dir tmp;
  for (const int n : {2, 3}) {
    CAPTURE(n);
    const state straight = run_rtp(n, 1, 4, {}, {});
    run_rtp(n, 1, 2, {}, tmp.path / "half");
    CHECK(run_rtp(n, 3, 4, tmp.path / "half", {}) == straight);
  }
}

TEST_CASE("rtp checkpoints: one process's chunk runtime loads an RTP checkpoint, and RTP loads one process's") {
  temp_dir tmp;
  // RTP (3 ranks, 2 AdamW steps) -> one process.
  const state rtp = run_rtp(3, 1, 2, {}, tmp.path / "rtp");
  CHECK(run_single(1, 0, tmp.path / "rtp", {}) == rtp);
  // One process (2 chunk_adam steps) -> RTP at 2 and 4 ranks.
  const state single = run_single(1, 2, {}, tmp.path / "single");
  CHECK(run_rtp(2, 1, 0, tmp.path / "single", {}) == single);
  CHECK(run_rtp(4, 1, 0, tmp.path / "single", {}) == single);
}

}  // namespace rtp_checkpoint_test
