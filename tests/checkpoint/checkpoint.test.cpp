// SPDX-License-Identifier: Apache-2.0
// Runtime checkpoints: resume = continue (bit-identical losses and parameters), reload into a
// different chunk layout, exact fp16/bf16 round trips, typed errors for mismatched, corrupt or mixed
// checkpoints, and atomic replacement (a failed save leaves the previous checkpoint intact).
#include <chunkstar/checkpoint/runtime_checkpoint.hpp>
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/placement/static_placement.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>

#include "support/runtimes.hpp"

#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

using namespace chunkstar;

namespace checkpoint_test {
namespace fs = std::filesystem;

namespace {

struct temp_dir {
  fs::path path;
  temp_dir() {
    static int counter = 0;
    path =
        fs::temp_directory_path() / ("chunkstar_ckpt_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

using runtime_t = chunk_runtime<fixed_chunk_layout, static_placement>;

/** A small tanh MLP trained through a runtime with chunk_adam (AdamW, decay on weights only); the
 *  batch of each step is drawn from the data position, as a real data loader would. */
template <class T>
struct trainer {
  static constexpr int layers = 3, width = 12, batch = 4;
  simulated_device_space dev{{.capacity = std::size_t{64} << 20}};
  host_space host;
  host_copy_engine copier;
  std::unique_ptr<runtime_t> rt;
  chunk_adam<> opt{{.hyper = {.lr = 1e-2f, .weight_decay = 0.01f}}, param_groups::with_default_decay(0.01f)};
  std::vector<param_id> w, b;
  std::uint64_t data_pos = 0;

  explicit trainer(std::size_t chunk_elems, std::uint32_t seed = 5, int extra_layers = 0, int bias_width = width) {
    rt = std::make_unique<runtime_t>(dev, host, copier, runtime_options{.param_type = dtype_of_v<T>},
                                     fixed_chunk_layout({.chunk_elems = chunk_elems, .align_elems = 8}),
                                     static_placement{});
    std::mt19937 gen(seed);
    for (int l = 0; l < layers + extra_layers; ++l) {
      std::normal_distribution<float> dist(0.0f, 0.4f);
      std::vector<float> init(width * width);
      for (auto& x : init) x = dist(gen);
      w.push_back(
          rt->register_param({"l" + std::to_string(l) + ".w", {width, width}, dtype_of_v<T>, tensor_role::weight},
                             [init](std::span<float> v) { std::copy(init.begin(), init.end(), v.begin()); }));
      b.push_back(rt->register_param({"l" + std::to_string(l) + ".b", {bias_width}, dtype_of_v<T>, tensor_role::bias}));
    }
    rt->finalize();
  }

  float step() {
    std::mt19937 gen(1000 + static_cast<std::uint32_t>(data_pos++));
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<std::vector<float>> h(layers + 1, std::vector<float>(batch * width));
    std::vector<float> y(batch * width);
    for (auto& v : h[0]) v = u(gen);
    for (auto& v : y) v = 0.5f * u(gen);
    for (int l = 0; l < layers; ++l) {
      auto s = rt->forward("f" + std::to_string(l), {w[l], b[l]});
      const auto W = s.template param<T>(w[l]);
      const auto B = s.template param<T>(b[l]);
      for (int n = 0; n < batch; ++n)
        for (int o = 0; o < width; ++o) {
          float acc = to_float(B[o]);
          for (int i = 0; i < width; ++i) acc += to_float(W[o * width + i]) * h[l][n * width + i];
          h[l + 1][n * width + o] = std::tanh(acc);
        }
    }
    float loss = 0;
    std::vector<float> dh(batch * width), dprev(batch * width);
    for (int i = 0; i < batch * width; ++i) {
      const float d = h[layers][i] - y[i];
      loss += 0.5f * d * d / batch;
      dh[i] = d / batch;
    }
    for (int l = layers - 1; l >= 0; --l) {
      auto s = rt->backward("b" + std::to_string(l), {w[l], b[l]});
      const auto W = s.template param<T>(w[l]);
      auto gW = s.template grad<T>(w[l]);
      auto gb = s.template grad<T>(b[l]);
      for (int i = 0; i < batch * width; ++i) dh[i] *= 1.0f - h[l + 1][i] * h[l + 1][i];
      for (int n = 0; n < batch; ++n)
        for (int o = 0; o < width; ++o) {
          gb[o] = from_float<T>(to_float(gb[o]) + dh[n * width + o]);
          for (int i = 0; i < width; ++i)
            gW[o * width + i] = from_float<T>(to_float(gW[o * width + i]) + dh[n * width + o] * h[l][n * width + i]);
        }
      for (int n = 0; n < batch; ++n)
        for (int i = 0; i < width; ++i) {
          float acc = 0;
          for (int o = 0; o < width; ++o) acc += to_float(W[o * width + i]) * dh[n * width + o];
          dprev[n * width + i] = acc;
        }
      std::swap(dh, dprev);
    }
    REQUIRE(opt.step(*rt, 1e-2f).stepped);
    return loss;
  }

  checkpoint_extra extra() const {
    return {{"step", std::to_string(opt.step_count())},
            {"data_position", std::to_string(data_pos)},
            {"note", "toy \"mlp\""}};
  }
  void restore(const checkpoint_extra& e) {
    opt.restore_step_count(std::stoll(e.at("step")));
    data_pos = std::stoull(e.at("data_position"));
  }

  /** Every list of every parameter, as float bits. */
  std::vector<std::uint32_t> state(bool with_optimizer = true) const {
    std::vector<std::uint32_t> out;
    std::vector<chunk_kind> kinds = {chunk_kind::param};
    if (with_optimizer) {
      if (rt->options().param_type != dtype::f32) kinds.push_back(chunk_kind::master);
      kinds.push_back(chunk_kind::momentum);
      kinds.push_back(chunk_kind::variance);
    }
    for (auto k : kinds)
      for (std::size_t t = 0; t < rt->params().size(); ++t) {
        std::vector<float> v(rt->params()[t].numel());
        rt->read_tensor(param_id{static_cast<std::uint32_t>(t)}, k, v);
        for (float x : v) out.push_back(std::bit_cast<std::uint32_t>(x));
      }
    return out;
  }
};

std::vector<std::uint32_t> bits(const std::vector<float>& v) {
  std::vector<std::uint32_t> b;
  for (float x : v) b.push_back(std::bit_cast<std::uint32_t>(x));
  return b;
}

template <class T>
void resume_is_continue() {
  temp_dir tmp;
  const auto dir = tmp.path / "ckpt";
  // Uninterrupted run: 3 steps, save, 4 more.
  trainer<T> a(512);
  for (int i = 0; i < 3; ++i) (void)a.step();
  save_checkpoint(*a.rt, dir, a.extra());
  const auto saved_state = a.state();
  std::vector<float> losses_a;
  for (int i = 0; i < 4; ++i) losses_a.push_back(a.step());
  const auto final_a = a.state();

  // A fresh run (different seed, so its initial values differ) resumed from the checkpoint.
  trainer<T> b(512, /*seed=*/99);
  const auto extra = load_checkpoint(*b.rt, dir);
  CHECK(extra.at("note") == "toy \"mlp\"");
  CHECK(extra.size() == 3);  // the library's own keys are not handed back
  b.restore(extra);
  CHECK(b.state() == saved_state);
  std::vector<float> losses_b;
  for (int i = 0; i < 4; ++i) losses_b.push_back(b.step());
  CHECK(bits(losses_b) == bits(losses_a));
  CHECK(b.state() == final_a);

  // A different chunk size (another layout, another chunk count): identical tensors, same trajectory.
  trainer<T> c(160, /*seed=*/123);
  c.restore(load_checkpoint(*c.rt, dir));
  CHECK(c.rt->plan().num_chunks != a.rt->plan().num_chunks);
  CHECK(c.state() == saved_state);
  std::vector<float> losses_c;
  for (int i = 0; i < 4; ++i) losses_c.push_back(c.step());
  CHECK(bits(losses_c) == bits(losses_a));
  CHECK(c.state() == final_a);

  // The weights file is plain safetensors in the param dtype, named as registered.
  const auto model = safetensors_file::open(dir / "model.safetensors", {.require_checksum = true});
  CHECK(model.tensors().size() == a.rt->params().size());
  CHECK(model.at("l0.w").type == to_safetensors_dtype(dtype_of_v<T>));
  CHECK(model.at("l0.w").shape == std::vector<std::int64_t>{12, 12});
  CHECK(model.metadata().at("format") == "pt");
  const auto opt = safetensors_file::open(dir / "optimizer.safetensors", {.require_checksum = true});
  CHECK((opt.find("l2.b.master") != nullptr) == (dtype_of_v<T> != dtype::f32));
  CHECK(opt.at("l2.b.exp_avg_sq").type == safetensors_dtype::f32);
  CHECK(opt.metadata().at("step") == "3");
}

}  // namespace

TEST_CASE("resume = continue: bit-identical losses and state, also into another chunk layout") {
  SUBCASE("f32") { resume_is_continue<float>(); }
  SUBCASE("bf16") { resume_is_continue<bfloat16>(); }
  SUBCASE("f16") { resume_is_continue<float16>(); }
}

TEST_CASE("fp16 and bf16 parameters round-trip exactly through the float interface") {
  temp_dir tmp;
  auto check_type = [&]<class T>(T) {
    trainer<T> a(512);
    // Every finite bit pattern of the type, spread over the parameters.
    std::uint32_t next = 0;
    std::vector<std::uint16_t> written;
    for (std::size_t t = 0; t < a.rt->params().size(); ++t) {
      std::vector<float> v(a.rt->params()[t].numel());
      for (auto& x : v) {
        std::uint16_t pattern;
        do pattern = static_cast<std::uint16_t>((next++ * 40503u) & 0xffff);
        while (!std::isfinite(to_float(T::from_bits(pattern))));
        x = to_float(T::from_bits(pattern));
        written.push_back(pattern);
      }
      a.rt->write_tensor(param_id{static_cast<std::uint32_t>(t)}, chunk_kind::param, v);
    }
    save_checkpoint(*a.rt, tmp.path / "exact", {});
    // The file holds the very bits.
    const auto model = safetensors_file::open(tmp.path / "exact" / "model.safetensors");
    std::vector<std::uint16_t> in_file;
    for (std::size_t t = 0; t < a.rt->params().size(); ++t) {
      const auto raw = model.read_bytes(a.rt->params()[t].name);
      const auto n = raw.size() / 2;
      for (std::size_t i = 0; i < n; ++i) {
        std::uint16_t u;
        std::memcpy(&u, raw.data() + 2 * i, 2);
        in_file.push_back(u);
      }
    }
    CHECK(in_file == written);
    trainer<T> b(160, 77);
    (void)load_checkpoint(*b.rt, tmp.path / "exact");
    CHECK(b.state() == a.state());
  };
  check_type(float16{});
  check_type(bfloat16{});
}

TEST_CASE("cross precision: a bf16 checkpoint loads into an fp32 runtime from its fp32 master") {
  temp_dir tmp;
  trainer<bfloat16> a(256);
  (void)a.step();
  (void)a.step();
  save_checkpoint(*a.rt, tmp.path / "ck", a.extra());
  trainer<float> b(256, 9);
  (void)load_checkpoint(*b.rt, tmp.path / "ck");
  for (std::size_t t = 0; t < a.rt->params().size(); ++t) {
    const param_id p{static_cast<std::uint32_t>(t)};
    std::vector<float> master(a.rt->params()[t].numel()), got(master.size()), m(master.size()), m2(master.size());
    a.rt->read_tensor(p, chunk_kind::master, master);
    b.rt->read_tensor(p, chunk_kind::param, got);
    CHECK(bits(got) == bits(master));
    a.rt->read_tensor(p, chunk_kind::momentum, m);
    b.rt->read_tensor(p, chunk_kind::momentum, m2);
    CHECK(bits(m) == bits(m2));
  }
}

TEST_CASE("load rejects a checkpoint that does not match, naming every tensor, and leaves the runtime untouched") {
  temp_dir tmp;
  const auto dir = tmp.path / "ck";
  trainer<float> a(256);
  (void)a.step();
  save_checkpoint(*a.rt, dir, a.extra());

  auto message = [&](auto& t, checkpoint_load_options o = {}) {
    const auto before = t.state();
    std::string m;
    try {
      (void)load_checkpoint(*t.rt, dir, o);
    } catch (const checkpoint_error& e) {
      m = e.what();
    }
    CHECK(t.state() == before);
    return m;
  };
  {
    trainer<float> more(256, 5, /*extra_layers=*/1);  // l3.* are not in the checkpoint
    const auto m = message(more);
    CHECK(m.find("'l3.w' missing from model.safetensors") != std::string::npos);
    CHECK(m.find("'l3.b' missing") != std::string::npos);
  }
  {
    trainer<float> shape(256, 5, 0, /*bias_width=*/11);
    const auto m = message(shape);
    CHECK(m.find("'l0.b' has shape [12] in the checkpoint, [11] registered") != std::string::npos);
    CHECK(m.find("'l0.b.exp_avg' has shape") != std::string::npos);
  }
  {
    // A smaller model: the checkpoint's extra tensors are an error unless allowed.
    trainer<float> fewer(256);
    fewer.rt.reset();
    fewer.w.clear();
    fewer.b.clear();
    fewer.rt =
        std::make_unique<runtime_t>(fewer.dev, fewer.host, fewer.copier, runtime_options{},
                                    fixed_chunk_layout({.chunk_elems = 256, .align_elems = 8}), static_placement{});
    (void)fewer.rt->register_param({"l0.w", {12, 12}, dtype::f32, tensor_role::weight});
    fewer.rt->finalize();
    const auto m = message(fewer);
    CHECK(m.find("no registered parameter takes") != std::string::npos);
    CHECK(m.find("allow_unused") != std::string::npos);
    (void)load_checkpoint(*fewer.rt, dir, {.allow_unused = true});
    std::vector<float> got(144), want(144);
    fewer.rt->read_tensor(param_id{0}, chunk_kind::param, got);
    a.rt->read_tensor(param_id{0}, chunk_kind::param, want);
    CHECK(bits(got) == bits(want));
  }
  CHECK_THROWS_AS(save_checkpoint(*a.rt, tmp.path / "x", {{"chunkstar.step", "1"}}), checkpoint_error);
  CHECK_THROWS_AS((void)load_checkpoint(*a.rt, tmp.path / "nowhere"), checkpoint_error);
}

TEST_CASE("corrupt, truncated or mixed checkpoint files give checkpoint_error") {
  temp_dir tmp;
  trainer<float> a(256);
  (void)a.step();
  save_checkpoint(*a.rt, tmp.path / "one", a.extra());
  (void)a.step();
  save_checkpoint(*a.rt, tmp.path / "two", a.extra());
  trainer<float> b(256);
  const auto before = b.state();
  auto fails_with = [&](const fs::path& dir, std::string_view needle) {
    try {
      (void)load_checkpoint(*b.rt, dir);
      FAIL("loaded a bad checkpoint");
    } catch (const checkpoint_error& e) {
      CHECK(std::string(e.what()).find(needle) != std::string::npos);
    }
    CHECK(b.state() == before);
  };
  // Mixed: the optimizer file of another save.
  fs::copy(tmp.path / "one", tmp.path / "mixed");
  fs::copy_file(tmp.path / "two" / "optimizer.safetensors", tmp.path / "mixed" / "optimizer.safetensors",
                fs::copy_options::overwrite_existing);
  fails_with(tmp.path / "mixed", "different save");
  // A flipped bit in the data section of the optimizer file.
  fs::copy(tmp.path / "one", tmp.path / "flipped");
  {
    std::fstream f(tmp.path / "flipped" / "optimizer.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-5, std::ios::end);
    char c;
    f.get(c);
    f.seekp(-5, std::ios::end);
    f.put(static_cast<char>(c ^ 0x04));
  }
  fails_with(tmp.path / "flipped", "checksum mismatch");
  // A truncated model file.
  fs::copy(tmp.path / "one", tmp.path / "cut");
  fs::resize_file(tmp.path / "cut" / "model.safetensors", fs::file_size(tmp.path / "cut" / "model.safetensors") - 100);
  fails_with(tmp.path / "cut", "truncated");
  // A missing file.
  fs::copy(tmp.path / "one", tmp.path / "half");
  fs::remove(tmp.path / "half" / "optimizer.safetensors");
  fails_with(tmp.path / "half", "cannot open");
  // Weights only, from a checkpoint without optimizer state, must be asked for.
  {
    simulated_device_space dev({.capacity = std::size_t{64} << 20});
    host_space host;
    host_copy_engine copier;
    runtime_t plain(dev, host, copier, {.optimizer_state = false},
                    fixed_chunk_layout({.chunk_elems = 256, .align_elems = 8}));
    for (std::size_t t = 0; t < a.rt->params().size(); ++t) (void)plain.register_param(a.rt->params()[t]);
    plain.finalize();
    (void)load_checkpoint(plain, tmp.path / "two");  // state in the file, none in the runtime: fine
    save_checkpoint(plain, tmp.path / "weights", {});
    fails_with(tmp.path / "weights", "holds no optimizer state");
    (void)load_checkpoint(*b.rt, tmp.path / "weights", {.optimizer_state = false});
    std::vector<float> got(144), want(144);
    b.rt->read_tensor(param_id{0}, chunk_kind::param, got);
    a.rt->read_tensor(param_id{0}, chunk_kind::param, want);
    CHECK(bits(got) == bits(want));
  }
}

namespace {

/** A runtime double whose reads fail after a number of tensors: a save that dies half-way. */
struct failing_runtime {
  std::vector<tensor_spec> specs;
  runtime_options opts{};
  mutable int reads_left = 0;
  std::span<const tensor_spec> params() const { return specs; }
  const runtime_options& options() const { return opts; }
  bool has_list(chunk_kind k) const { return opts.optimizer_state.has(k, opts.param_type); }
  void read_tensor(param_id, chunk_kind, std::span<float> out) const {
    if (reads_left-- == 0) throw checkpoint_error("device lost");
    std::fill(out.begin(), out.end(), 0.0f);
  }
  void write_tensor(param_id, chunk_kind, std::span<const float>) {}
};
static_assert(CheckpointableRuntime<failing_runtime>);
static_assert(!CheckpointableRuntime<int>);

}  // namespace

TEST_CASE("atomicity: a failed save leaves the previous checkpoint intact and no temporary behind") {
  temp_dir tmp;
  const auto dir = tmp.path / "ck";
  trainer<float> a(256);
  (void)a.step();
  save_checkpoint(*a.rt, dir, a.extra());
  const auto saved = a.state();
  (void)a.step();
  save_checkpoint(*a.rt, dir, a.extra());  // replaces the first: the newest state loads
  const auto newer = a.state();
  CHECK(newer != saved);
  {
    trainer<float> b(256, 3);
    CHECK(load_checkpoint(*b.rt, dir).at("step") == "2");
    CHECK(b.state() == newer);
  }
  failing_runtime bad{{a.rt->params().begin(), a.rt->params().end()}};
  for (int reads : {0, 3, 6 + 4}) {  // in the model file, in it later, in the optimizer file
    bad.reads_left = reads;
    CHECK_THROWS_WITH_AS(save_checkpoint(bad, dir, {}), doctest::Contains("device lost"), checkpoint_error);
    trainer<float> b(256, 3);
    CHECK(load_checkpoint(*b.rt, dir).at("step") == "2");
    CHECK(b.state() == newer);
    for (const auto& e : fs::directory_iterator(tmp.path))
      CHECK(e.path().filename().string().find(".tmp") == std::string::npos);
  }
  // An unwritable destination (a path under a regular file) fails cleanly.
  std::ofstream(tmp.path / "file") << "x";
  CHECK_THROWS_AS(save_checkpoint(*a.rt, tmp.path / "file" / "ck", {}), checkpoint_error);
  // A path that holds something else is never replaced.
  CHECK_THROWS_WITH_AS(save_checkpoint(*a.rt, tmp.path / "file", {}), doctest::Contains("refusing to replace"),
                       checkpoint_error);
  fs::create_directories(tmp.path / "other");
  std::ofstream(tmp.path / "other" / "notes.txt") << "keep me";
  CHECK_THROWS_AS(save_checkpoint(*a.rt, tmp.path / "other", {}), checkpoint_error);
  CHECK(fs::exists(tmp.path / "other" / "notes.txt"));
  // Only the checkpoint directory and its lock file remain beside those.
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(tmp.path)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"ck", "ck.lock", "file", "other"});
}

TEST_CASE("directory replacement: atomic exchange and the portable rename path give the same result") {
  for (bool exchange : {true, false}) {
    CAPTURE(exchange);
    temp_dir tmp;
    const auto dir = tmp.path / "ck", fresh = tmp.path / "ck.tmp";
    fs::create_directories(dir);
    std::ofstream(dir / "model.safetensors") << "old";
    fs::create_directories(fresh);
    std::ofstream(fresh / "model.safetensors") << "new";
    checkpoint_detail::swap_into_place(fresh, dir, exchange);
    std::string content;
    std::ifstream(dir / "model.safetensors") >> content;
    CHECK(content == "new");
    CHECK(!fs::exists(fresh));
    CHECK(checkpoint_detail::interrupted_swap_leftovers(dir).empty());
    // Into a place that does not exist yet.
    fs::create_directories(fresh);
    checkpoint_detail::swap_into_place(fresh, tmp.path / "ck2", exchange);
    CHECK(fs::is_directory(tmp.path / "ck2"));
  }
  // A save interrupted between the two renames of the portable path is explained on load.
  temp_dir tmp;
  fs::create_directories(tmp.path / "ck.old.123.0");
  trainer<float> a(256);
  CHECK_THROWS_WITH_AS((void)load_checkpoint(*a.rt, tmp.path / "ck"), doctest::Contains("ck.old.123.0': rename it"),
                       checkpoint_error);
}

}  // namespace checkpoint_test
