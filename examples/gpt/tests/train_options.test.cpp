// SPDX-License-Identifier: Apache-2.0
// train_gpt's checks before any work: every bad option is a config_error naming it, nothing wraps;
// the data loader refuses what it could never read to an end; resume metadata is parsed with range
// checks and the configuration compared field by field; output paths and memory are probed.
#include "data.hpp"
#include "preflight.hpp"
#include "run_record.hpp"
#include "train_options.hpp"

#include <chunkstar/checkpoint/runtime_checkpoint.hpp>

#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

using namespace chunkstar;

namespace train_options_test {
namespace fs = std::filesystem;

namespace {

struct temp_dir {
  fs::path path;
  temp_dir() {
    static int counter = 0;
    path =
        fs::temp_directory_path() / ("chunkstar_opts_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

/** Validates options @p o after @p change, as train_gpt does before any work. */
void check(const std::function<void(gpt::train_options&)>& change) {
  gpt::train_options o;
  o.preset = "tiny";
  change(o);
  gpt::validate_options(o, gpt::model_config(o));
}

}  // namespace

TEST_CASE("defaults and ordinary runs pass; every bad option is a config_error that names it") {
  check([](gpt::train_options&) {});
  check([](gpt::train_options& o) { o.steps = 2; });  // the default warm-up shrinks with a short run
  check([](gpt::train_options& o) {
    o.schedule = "constant";
    o.warmup = 500;
    o.min_lr = 9;
  });  // unused by constant
  check([](gpt::train_options& o) { o.parallel = "rtp"; });
  for (const char* ahead : {"0", "2", "1024", "unbounded"})
    check([&](gpt::train_options& o) { o.scopes_ahead = ahead; });
  {
    gpt::train_options o;
    CHECK(gpt::scopes_ahead_of(o) == chunkstar::runtime_options{}.scopes_ahead);  // the library's default
    o.scopes_ahead = "unbounded";
    CHECK(gpt::scopes_ahead_of(o) == chunkstar::unbounded_scopes_ahead);
    o.scopes_ahead = "0";
    CHECK(gpt::scopes_ahead_of(o) == 0);
  }
  for (const char* p : {"bf16", "fp16"})  // 16-bit shards rotate
    check([&](gpt::train_options& o) {
      o.parallel = "rtp";
      o.precision = p;
    });
  check([](gpt::train_options& o) {
    o.parallel = "rtp";
    o.policy = "offload";
    o.device_budget = "64MiB";
  });
  struct bad_case {
    const char* option;
    std::function<void(gpt::train_options&)> change;
  };
  const std::vector<bad_case> cases = {
      {"--batch", [](auto& o) { o.batch = 1000000000000; }},
      {"--batch", [](auto& o) { o.batch = -1; }},
      {"--batch", [](auto& o) { o.batch = 0; }},
      {"--seq", [](auto& o) { o.seq = 129; }},  // tiny's context is 128
      {"--seq", [](auto& o) { o.seq = -1; }},
      {"--accum", [](auto& o) { o.accum = 0; }},
      {"--accum", [](auto& o) { o.accum = 1 << 16; }},  // the batch key holds 16 bits of micro-batch
      {"--steps", [](auto& o) { o.steps = 0; }},
      {"--steps", [](auto& o) { o.steps = -3; }},
      {"--stop-after", [](auto& o) { o.stop_after = 201; }},
      {"--stop-after", [](auto& o) { o.stop_after = -1; }},
      {"--warmup", [](auto& o) { o.warmup = -5; }},
      {"--warmup",
       [](auto& o) {
         o.steps = 10;
         o.warmup = 20;
       }},
      {"--min-lr",
       [](auto& o) {
         o.min_lr = 1;
         o.lr = 0.1f;
       }},
      {"--lr", [](auto& o) { o.lr = 0; }},
      {"--lr", [](auto& o) { o.lr = std::numeric_limits<float>::quiet_NaN(); }},
      {"--clip", [](auto& o) { o.clip = -1; }},
      {"--weight-decay", [](auto& o) { o.weight_decay = std::numeric_limits<float>::infinity(); }},
      {"--val-batches", [](auto& o) { o.val_batches = 0; }},
      {"--val-every", [](auto& o) { o.val_every = -1; }},
      {"--save-every", [](auto& o) { o.save_every = -2; }},
      {"--save-every", [](auto& o) { o.save_every = 5; }},  // without --save
      {"--sample", [](auto& o) { o.sample = -1; }},
      {"--sleep-after", [](auto& o) { o.sleep_after = o.steps + 1; }},
      {"--sleep-for", [](auto& o) { o.sleep_for = -1; }},
      {"--memory-saving",
       [](auto& o) {
         o.parallel = "replicated";
         o.memory_saving = true;
       }},
      {"--keep-gathered", [](auto& o) { o.keep_gathered = true; }},  // with --parallel none
      {"--prefetch", [](auto& o) { o.prefetch = -1; }},
      {"--chunk-elems", [](auto& o) { o.chunk_elems = -1; }},
      {"--policy", [](auto& o) { o.policy = "fastest"; }},
      {"--scopes-ahead", [](auto& o) { o.scopes_ahead = "-1"; }},
      {"--scopes-ahead", [](auto& o) { o.scopes_ahead = "1025"; }},
      {"--scopes-ahead", [](auto& o) { o.scopes_ahead = "2x"; }},
      {"--scopes-ahead", [](auto& o) { o.scopes_ahead = ""; }},
      {"--scopes-ahead", [](auto& o) { o.scopes_ahead = "forever"; }},
      {"--schedule", [](auto& o) { o.schedule = "linear"; }},
      {"--precision", [](auto& o) { o.precision = "fp8"; }},
      {"--device-budget", [](auto& o) { o.device_budget = "lots"; }},
      {"--host-budget", [](auto& o) { o.host_budget = "-1GiB"; }},
      {"--link-bandwidth", [](auto& o) { o.link_bandwidth = "fast"; }},
      {"--layers", [](auto& o) { o.layers = 2147483647; }},
      {"--layers", [](auto& o) { o.layers = -1; }},
      {"--width", [](auto& o) { o.width = std::int64_t{1} << 40; }},
      {"--context", [](auto& o) { o.context = -7; }},
      {"--trace",
       [](auto& o) {
         o.trace = "x";
         o.save = "x";
       }},
      {"--parallel", [](auto& o) { o.parallel = "tensor"; }},
      {"--device", [](auto& o) { o.device = "tpu"; }},
      {"--device-budget", [](auto& o) { o.device_budget = "0%"; }},
      {"--device-budget", [](auto& o) { o.device_budget = "101%"; }},
      {"--device-budget", [](auto& o) { o.device_budget = "half%"; }},
      {"--device-budget", [](auto& o) { o.device_budget = "%"; }},
      {"--device-budget", [](auto& o) { o.device_budget = "unlimited"; }},
      {"--link-bandwidth",
       [](auto& o) {
         o.device = "cuda";
         o.link_bandwidth = "8GiB";
       }},  // models the simulated link only
      // RTP's shards are fp32 and rotate: the loss scaler's and ZeRO's options are refused, named.
      {"--memory-saving",
       [](auto& o) {
         o.parallel = "rtp";
         o.memory_saving = true;
       }},
      {"--keep-gathered",
       [](auto& o) {
         o.parallel = "rtp";
         o.keep_gathered = true;
       }},
  };
  for (const auto& c : cases) {
    CAPTURE(c.option);
    CHECK_THROWS_WITH_AS(check(c.change), doctest::Contains(c.option), config_error);
  }
  CHECK_THROWS_WITH_AS(check([](auto& o) { o.preset = "huge"; }), doctest::Contains("unknown model preset"),
                       config_error);
  CHECK_THROWS_WITH_AS(check([](auto& o) { o.width = 65; }), doctest::Contains("multiple of heads"), config_error);
  // Shapes whose sizes would overflow are refused, not wrapped.
  CHECK_THROWS_AS(check([](auto& o) {
                    o.context = 1 << 20;
                    o.seq = 1 << 20;
                    o.batch = 1 << 20;
                  }),
                  config_error);
  CHECK_THROWS_AS(gpt::validate({.vocab = 256, .context = 8, .layers = 1 << 20, .heads = 1, .width = 8}), config_error);
}

TEST_CASE("the data loader refuses directories, FIFOs, devices and unreadable files at once") {
  temp_dir tmp;
  CHECK_THROWS_WITH_AS((void)gpt::load_text(tmp.path.string(), 8), doctest::Contains("is a directory"), config_error);
  const auto fifo = (tmp.path / "fifo").string();
  REQUIRE(::mkfifo(fifo.c_str(), 0644) == 0);
  CHECK_THROWS_WITH_AS((void)gpt::load_text(fifo, 8), doctest::Contains("is a FIFO"),
                       config_error);  // and never blocks
  CHECK_THROWS_WITH_AS((void)gpt::load_text("/dev/zero", 8), doctest::Contains("device"), config_error);
  if (fs::exists("/proc/self/mem")) CHECK_THROWS_AS((void)gpt::load_text("/proc/self/mem", 8), config_error);
  CHECK_THROWS_AS((void)gpt::load_text((tmp.path / "missing").string(), 8), config_error);
  std::ofstream(tmp.path / "short.txt") << "hello";
  CHECK_THROWS_WITH_AS((void)gpt::load_text((tmp.path / "short.txt").string(), 8), doctest::Contains("too short"),
                       config_error);
  std::ofstream(tmp.path / "big.txt") << std::string(5000, 'a');
  CHECK_THROWS_WITH_AS((void)gpt::load_text((tmp.path / "big.txt").string(), 8, 0.1, 4096),
                       doctest::Contains("more than"), config_error);
  const auto ok = gpt::load_text((tmp.path / "big.txt").string(), 8);
  CHECK(ok.train.size() + ok.val.size() == 5000);
}

TEST_CASE("resume state: every entry parsed with range checks; crafted values are refused, not misread") {
  const checkpoint_extra good{{"step", "10"}, {"optimizer_steps", "9"}};
  const auto r = gpt::parse_resume_state(good, "ck");
  CHECK(r.step == 10);
  CHECK(r.optimizer_steps == 9);
  CHECK(!r.loss_scale);
  const std::vector<checkpoint_extra> bad = {
      {{"step", "abc"}, {"optimizer_steps", "1"}},
      {{"optimizer_steps", "1"}},                                    // no step
      {{"step", "99999999999999999999"}, {"optimizer_steps", "1"}},  // 20 digits
      {{"step", "1e3"}, {"optimizer_steps", "1"}},                   // not resumed at step 1
      {{"step", "-5"}, {"optimizer_steps", "0"}},                    // not resumed at step -4
      {{"step", " 7"}, {"optimizer_steps", "0"}},
      {{"step", "10"}},                             // no optimizer_steps
      {{"step", "10"}, {"optimizer_steps", "11"}},  // more Adam steps than steps
      {{"step", "10"}, {"optimizer_steps", "9"}, {"loss_scale", "abc"}, {"clean_steps", "0"}},
      {{"step", "10"}, {"optimizer_steps", "9"}, {"loss_scale", "inf"}, {"clean_steps", "0"}},
      {{"step", "10"}, {"optimizer_steps", "9"}, {"loss_scale", "-2"}, {"clean_steps", "0"}},
      {{"step", "10"}, {"optimizer_steps", "9"}, {"loss_scale", "1024"}},  // no clean_steps
  };
  for (const auto& e : bad) {
    std::string text;
    for (const auto& [k, v] : e) text += k + "=" + v + " ";
    CAPTURE(text);
    CHECK_THROWS_WITH_AS((void)gpt::parse_resume_state(e, "ck"), doctest::Contains("--resume 'ck'"), config_error);
  }
  const auto scaled = gpt::parse_resume_state(
      {{"step", "3"}, {"optimizer_steps", "2"}, {"loss_scale", "65536"}, {"clean_steps", "4"}}, "ck");
  CHECK(scaled.loss_scale == 65536.0f);
  CHECK(scaled.clean_steps == 4);
}

TEST_CASE("resume configuration: each difference named; shape never changes; --allow-change lets the rest") {
  gpt::train_options o;
  o.preset = "tiny";
  const auto cfg = gpt::model_config(o);
  const auto saved = gpt::run_record(o, cfg, "abc");
  checkpoint_extra extra = gpt::save_record(saved, o, 5, 5, std::nullopt, 0);
  gpt::check_resume_config(saved, extra, {}, "ck");  // the same options: fine

  auto changed = o;
  changed.lr = 1e-3f;
  changed.precision = "fp16";
  const auto now = gpt::run_record(changed, cfg, "abc");
  CHECK_THROWS_WITH_AS(gpt::check_resume_config(now, extra, {}, "ck"), doctest::Contains("--lr: checkpoint 0.003"),
                       config_error);
  CHECK_THROWS_WITH_AS(gpt::check_resume_config(now, extra, {}, "ck"), doctest::Contains("--allow-change precision,lr"),
                       config_error);
  CHECK_THROWS_AS(gpt::check_resume_config(now, extra, {"lr"}, "ck"), config_error);
  gpt::check_resume_config(now, extra, {"lr", "precision"}, "ck");
  gpt::check_resume_config(now, extra, {"all"}, "ck");
  // Other data is noticed through its checksum.
  CHECK_THROWS_WITH_AS(gpt::check_resume_config(gpt::run_record(o, cfg, "def"), extra, {}, "ck"),
                       doctest::Contains("--data"), config_error);

  auto wider = o;
  wider.width = 128;
  const auto wide = gpt::run_record(wider, gpt::model_config(wider), "abc");
  CHECK_THROWS_WITH_AS(gpt::check_resume_config(wide, extra, {"all"}, "ck"), doctest::Contains("shape differs"),
                       config_error);
  // A checkpoint without the record (another trainer, an older train_gpt).
  CHECK_THROWS_WITH_AS(gpt::check_resume_config(saved, {{"step", "5"}}, {}, "ck"), doctest::Contains("not recorded"),
                       config_error);
  CHECK_THROWS_AS(gpt::validate_allow_change({"lr", "layers"}), config_error);
  gpt::validate_allow_change({"all", "min-lr", "weight-decay"});
}

TEST_CASE(
    "rank agreement: every option that decides the math, the collectives or a shared output; a rank's own resources "
    "not") {
  gpt::train_options o;
  o.preset = "tiny";
  const auto cfg = gpt::model_config(o);
  const gpt::transport_choice mpi{};
  const gpt::device_choice sim{};
  const auto fields = [&](const gpt::train_options& x) {
    return gpt::rank_agreement(gpt::run_record(x, cfg, "abc"), x, 1, mpi, sim);
  };
  const auto base = fields(o);
  const auto differs = [&](const std::function<void(gpt::train_options&)>& change) {
    auto x = o;
    change(x);
    const auto f = fields(x);
    if (f.size() != base.size()) return std::string("(count)");
    for (std::size_t i = 0; i < f.size(); ++i)
      if (f[i].name != base[i].name || f[i].value != base[i].value) return f[i].name;
    return std::string();
  };
  CHECK(differs([](auto& x) { x.seed = 7; }) == "--seed");
  CHECK(differs([](auto& x) { x.lr = 1e-2f; }) == "--lr");
  CHECK(differs([](auto& x) { x.steps = 9; }) == "--steps");
  CHECK(differs([](auto& x) { x.accum = 2; }) == "--accum");
  CHECK(differs([](auto& x) { x.clip = 0; }) == "--clip");
  CHECK(differs([](auto& x) { x.schedule = "constant"; }) == "--schedule");
  CHECK(differs([](auto& x) { x.val_every = 3; }) == "--val-every");
  CHECK(differs([](auto& x) { x.sample = 0; }) == "--sample");
  CHECK(differs([](auto& x) { x.stop_after = 2; }) == "--stop-after");
  CHECK(differs([](auto& x) { x.save = "ck"; }) == "--save");
  CHECK(differs([](auto& x) { x.resume = "ck"; }) == "--resume");
  CHECK(differs([](auto& x) { x.memory_saving = true; }) == "--memory-saving");
  CHECK(differs([](auto& x) { x.parallel = "rtp"; }) == "--parallel");
  CHECK(differs([](auto& x) { x.sleep_after = 3; }) == "--sleep-after");
  // A rank's own resources may differ.
  CHECK(differs([](auto& x) { x.device_budget = "1GiB"; }).empty());
  CHECK(differs([](auto& x) { x.host_budget = "1GiB"; }).empty());
  CHECK(differs([](auto& x) { x.prefetch = 0; }).empty());
  CHECK(differs([](auto& x) { x.policy = "lru"; }).empty());
  CHECK(differs([](auto& x) { x.disk_dir = "/tmp"; }).empty());
  CHECK(differs([](auto& x) { x.trace = "t.json"; }).empty());
  // Other data, another transport, another device kind.
  CHECK(gpt::rank_agreement(gpt::run_record(o, cfg, "def"), o, 1, mpi, sim) != base);
  CHECK(gpt::rank_agreement(gpt::run_record(o, cfg, "abc"), o, 1, {gpt::transport_choice::staged, ""}, sim) != base);
  CHECK(gpt::rank_agreement(gpt::run_record(o, cfg, "abc"), o, 1, mpi,
                            {.cuda = true, .gpu = 0, .sharing = 1, .why = ""}) != base);
}

TEST_CASE(
    "resume: the entries loaded with the tensors must be those checked before; another save in between is refused") {
  const checkpoint_extra checked{{"step", "4"}, {"train.lr", "0.003"}};
  gpt::require_same_save(checked, checked, "ck");
  CHECK_THROWS_WITH_AS(gpt::require_same_save(checked, {{"step", "6"}, {"train.lr", "0.003"}}, "ck"),
                       doctest::Contains("another process saved to the checkpoint while this run was starting (its "
                                         "step 4 when checked, 6 when loaded)"),
                       config_error);
  CHECK_THROWS_AS(gpt::require_same_save(checked, {{"step", "4"}, {"train.lr", "0.01"}}, "ck"), config_error);
}

TEST_CASE(
    "a launcher's processes are counted from its variables; --parallel none on several is refused, naming the modes") {
  const auto env = [](std::map<std::string, std::string> vars) {
    return [vars](const char* name) -> const char* {
      const auto it = vars.find(name);
      return it == vars.end() ? nullptr : it->second.c_str();
    };
  };
  CHECK(gpt::launched_processes(env({})) == 1);
  CHECK(gpt::launched_processes(env({{"OMPI_COMM_WORLD_SIZE", "3"}})) == 3);
  CHECK(gpt::launched_processes(env({{"PMI_SIZE", "2"}})) == 2);
  CHECK(gpt::launched_processes(env({{"MV2_COMM_WORLD_SIZE", "4"}})) == 4);
  CHECK(gpt::launched_processes(env({{"OMPI_COMM_WORLD_SIZE", "garbage"}})) == 1);
  gpt::train_options o;
  gpt::validate_ranks(o, 1);
  CHECK_THROWS_WITH_AS(gpt::validate_ranks(o, 2), doctest::Contains("use --parallel zero, replicated or rtp"),
                       config_error);
  o.parallel = "zero";
  gpt::validate_ranks(o, 2);
}

TEST_CASE("crafted metadata re-sealed with a valid checksum reaches the strict parser, never a crash") {
  temp_dir tmp;
  const auto dir = tmp.path / "ck";
  fs::create_directories(dir);
  safetensors_writer model;
  model.set_metadata("chunkstar.param_type", "f32");
  const std::vector<float> w(4, 1.0f);
  model.add_values<float>("w", {4}, w);
  const auto sum = model.write(dir / "model.safetensors");
  safetensors_writer opt;  // the checksum is recomputed by the writer: the file verifies
  opt.set_metadata("chunkstar.param_type", "f32");
  opt.set_metadata("chunkstar.optimizer_state", "0");
  opt.set_metadata("chunkstar.model_checksum", checkpoint_detail::hex64(sum));
  opt.set_metadata("step", "abc");
  (void)opt.write(dir / "optimizer.safetensors");
  const auto extra = read_checkpoint_extra(dir);
  CHECK(extra.at("step") == "abc");
  CHECK_THROWS_WITH_AS((void)gpt::parse_resume_state(extra, dir.string()), doctest::Contains("'step' is 'abc'"),
                       config_error);
}

TEST_CASE("output files are probed before the run: missing directories and non-files are refused, nothing is left") {
  temp_dir tmp;
  gpt::probe_output_file("--trace", (tmp.path / "t.json").string());
  CHECK(fs::is_empty(tmp.path));
  CHECK_THROWS_WITH_AS(gpt::probe_output_file("--trace", "/nonexistent-dir/t.json"), doctest::Contains("--trace"),
                       config_error);
  CHECK_THROWS_WITH_AS(gpt::probe_output_file("--trace", tmp.path.string()), doctest::Contains("not a regular file"),
                       config_error);
  std::ofstream(tmp.path / "old.json") << "keep";
  gpt::probe_output_file("--trace", (tmp.path / "old.json").string());
  CHECK(fs::file_size(tmp.path / "old.json") == 4);  // probed, not truncated
}

TEST_CASE("memory: more than the machine has, or more address space than ulimit -v leaves, is refused up front") {
  CHECK_THROWS_AS(gpt::check_memory({.model_data = std::size_t{1} << 62}), out_of_memory_error);
  gpt::check_memory({.model_data = 1 << 20});
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {  // the limit must not reach the test runner
    rlimit lim{std::size_t{256} << 20, std::size_t{256} << 20};
    ::setrlimit(RLIMIT_AS, &lim);
    int rc = 1;
    try {
      gpt::check_memory({.model_data = 64 << 20});
    } catch (const out_of_memory_error& e) {
      rc = std::string(e.what()).find("ulimit -v") != std::string::npos ? 0 : 2;
    }
    ::_exit(rc);
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE(
    "--device: auto takes a GPU when one is visible and the mode runs there; cuda that cannot run says what is "
    "missing") {
  gpt::train_options o;
  struct expect {
    std::string device, parallel;
    bool built;
    int gpus;
    bool cuda;
    const char* says;
  };
  const std::vector<expect> cases = {
      {"auto", "none", true, 1, true, "GPU 0 of 1"},
      {"auto", "none", true, 2, true, "GPU 0 of 2"},
      {"auto", "none", true, 0, false, "no CUDA device is visible"},
      {"auto", "none", false, 1, false, "built without the CUDA backend"},
      {"auto", "zero", true, 1, true, "GPU 0 of 1"},
      {"auto", "rtp", true, 4, true, "GPU 0 of 4"},
      {"auto", "rtp", true, 0, false, "no CUDA device is visible"},
      {"sim", "none", true, 1, false, "--device sim"},
      {"sim", "zero", false, 0, false, "--device sim"},
      {"cuda", "none", true, 1, true, "--device cuda"},
      {"cuda", "zero", true, 2, true, "--device cuda: GPU 0 of 2"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.device);
    CAPTURE(c.parallel);
    CAPTURE(c.gpus);
    o.device = c.device;
    o.parallel = c.parallel;
    const auto d = gpt::resolve_device(o, c.built, c.gpus);
    CHECK(d.cuda == c.cuda);
    CHECK(d.why.find(c.says) != std::string::npos);
  }
  o.parallel = "none";
  o.device = "cuda";
  CHECK_THROWS_WITH_AS(gpt::resolve_device(o, true, 0), doctest::Contains("no CUDA device is visible"), config_error);
  CHECK_THROWS_WITH_AS(gpt::resolve_device(o, false, 1), doctest::Contains("without the CUDA backend"), config_error);
  o.parallel = "rtp";
  CHECK(gpt::resolve_device(o, true, 1).cuda);
  CHECK_THROWS_WITH_AS(gpt::resolve_device(o, true, 0), doctest::Contains("--device cuda: no CUDA device is visible"),
                       config_error);
}

TEST_CASE("--parallel zero on GPUs: node-local rank k takes GPU k mod GPUs; ranks sharing a GPU are counted") {
  gpt::train_options o;
  o.parallel = "zero";
  o.device = "auto";
  // 3 ranks on a node with 2 GPUs: GPU 0 takes ranks 0 and 2, GPU 1 rank 1.
  const int gpu_of[] = {0, 1, 0}, sharing_of[] = {2, 1, 2};
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    const auto d = gpt::resolve_device(o, true, 2, {.local_rank = r, .local_ranks = 3});
    CHECK(d.cuda);
    CHECK(d.gpu == gpu_of[r]);
    CHECK(d.sharing == sharing_of[r]);
    CHECK(d.why.find("GPU " + std::to_string(gpu_of[r]) + " of 2") != std::string::npos);
    CHECK((d.why.find("shared by 2 ranks") != std::string::npos) == (sharing_of[r] == 2));
  }
  const auto alone = gpt::resolve_device(o, true, 8, {.local_rank = 5, .local_ranks = 8});
  CHECK(alone.gpu == 5);
  CHECK(alone.sharing == 1);
}

TEST_CASE("--comm: NCCL when every rank has its own GPU, else MPI through pinned host buffers; refusals say why") {
  using gpt::transport_choice;
  gpt::train_options o;
  const gpt::device_choice sim{}, own_gpu{.cuda = true, .gpu = 1, .sharing = 1, .why = ""},
      shared_gpu{.cuda = true, .gpu = 0, .sharing = 2, .why = ""};
  o.parallel = "none";
  CHECK(gpt::resolve_transport(o, own_gpu, true).kind == transport_choice::host);
  o.comm = "nccl";
  CHECK_THROWS_WITH_AS(gpt::resolve_transport(o, own_gpu, true),
                       doctest::Contains("applies to --parallel zero, replicated and rtp"), config_error);

  for (const char* mode : {"zero", "rtp"}) {  // the same transports: both keep their collectives' buffers on the GPU
    CAPTURE(mode);
    o.parallel = mode;
    struct expect {
      const char* comm;
      gpt::device_choice device;
      bool nccl_built;
      transport_choice::kind_t kind;
      const char* says;
    };
    const std::vector<expect> cases = {
        {"auto", sim, true, transport_choice::host, "MPI"},
        {"mpi", sim, true, transport_choice::host, "MPI"},
        {"staged", sim, false, transport_choice::staged, "--comm staged"},
        {"auto", own_gpu, true, transport_choice::nccl, "one rank per GPU"},
        {"auto", own_gpu, false, transport_choice::staged, "built without NCCL"},
        {"auto", shared_gpu, true, transport_choice::staged, "this GPU is shared"},
        {"nccl", own_gpu, true, transport_choice::nccl, "--comm nccl"},
        {"staged", own_gpu, true, transport_choice::staged, "--comm staged"},
    };
    for (const auto& c : cases) {
      CAPTURE(c.comm);
      CAPTURE(c.device.cuda);
      CAPTURE(c.device.sharing);
      CAPTURE(c.nccl_built);
      o.comm = c.comm;
      const auto t = gpt::resolve_transport(o, c.device, c.nccl_built);
      CHECK(t.kind == c.kind);
      CHECK(t.why.find(c.says) != std::string::npos);
    }
    o.comm = "nccl";
    CHECK_THROWS_WITH_AS(gpt::resolve_transport(o, sim, true), doctest::Contains("NCCL needs --device cuda"),
                         config_error);
    CHECK_THROWS_WITH_AS(gpt::resolve_transport(o, shared_gpu, true),
                         doctest::Contains("one rank of a communicator per GPU"), config_error);
    CHECK_THROWS_WITH_AS(gpt::resolve_transport(o, own_gpu, false), doctest::Contains("without NCCL"), config_error);
    o.comm = "mpi";
    CHECK_THROWS_WITH_AS(gpt::resolve_transport(o, own_gpu, true), doctest::Contains("use --comm nccl or staged"),
                         config_error);
  }
  o.comm = "mpi";
  CHECK_THROWS_WITH_AS(gpt::resolve_transport(o, own_gpu, true),
                       doctest::Contains("RTP's rotating shards are on the GPU"), config_error);
  o.comm = "gloo";
  CHECK_THROWS_WITH_AS(gpt::validate_options(o, gpt::model_config(o)), doctest::Contains("--comm 'gloo' is not one of"),
                       config_error);
}

TEST_CASE("--device-budget: a size, a share of the model data, or auto (a GPU's free memory less a reserve)") {
  gpt::train_options o;
  const gpt::budget_inputs sim{.non_model = 1000, .collective = 200, .model = 10000};
  o.device_budget = "4096";
  CHECK(gpt::device_budget_bytes(o, sim) == 4096);
  o.device_budget = "1KiB";
  CHECK(gpt::device_budget_bytes(o, sim) == 1024);
  o.device_budget = "50%";  // non-model + collective + half the model data
  CHECK(gpt::device_budget_bytes(o, sim) == 1200 + 5000);
  o.device_budget = "100%";
  CHECK(gpt::device_budget_bytes(o, sim) == 1200 + 10000);
  o.device_budget = "12.5%";
  CHECK(gpt::device_budget_bytes(o, sim) == 1200 + 1250);
  o.device_budget = "auto";  // the simulated device: --device-fraction (0.4) of the model data, all of it when resident
  CHECK(gpt::device_budget_bytes(o, sim) == 1200 + 4000);
  auto floored = sim;  // ... but never below the least the run can use (memory_plan::device_floor)
  floored.floor = 7000;
  CHECK(gpt::device_budget_bytes(o, floored) == 7000);
  o.device_budget = "25%";  // an explicit share is what it says (the trainer refuses it below the floor)
  CHECK(gpt::device_budget_bytes(o, floored) == 1200 + 2500);
  o.device_budget = "auto";
  o.policy = "resident";
  CHECK(gpt::device_budget_bytes(o, sim) == 1200 + 10000);
  // A real device: its free memory less 1/16 of it and 256 MiB, whatever the policy.
  const std::size_t free = std::size_t{64} << 30;
  auto gpu = sim;
  gpu.device_free = free;
  CHECK(gpt::device_budget_bytes(o, gpu) == free - free / 16 - (std::size_t{256} << 20));
  o.policy = "patrickstar";
  CHECK(gpt::device_budget_bytes(o, gpu) == free - gpt::device_reserve(free));
  gpu.device_free = 100 << 20;  // less free than the reserve: 0, which the trainer refuses as too small
  CHECK(gpt::device_budget_bytes(o, gpu) == 0);
  o.device_budget = "25%";  // a share ignores the device's size (the trainer checks it fits)
  CHECK(gpt::device_budget_bytes(o, gpu) == 1200 + 2500);
}

TEST_CASE("the memory check counts a real device's budget on the device, the simulated device's in host memory") {
  const double page = static_cast<double>(::sysconf(_SC_PAGESIZE));
  const auto physical = static_cast<std::size_t>(static_cast<double>(::sysconf(_SC_PHYS_PAGES)) * page);
  const std::size_t model = 64 << 20, act = 16 << 20, device = 2 * physical;  // a GPU larger than this host's memory
  CHECK_NOTHROW(gpt::check_memory(gpt::host_memory_need(model, act, device, false)));
  CHECK_THROWS_AS(gpt::check_memory(gpt::host_memory_need(model, act, device, true)), out_of_memory_error);
  const auto gpu = gpt::host_memory_need(model, act, device, false);
  CHECK(gpu.model_data == model);  // every chunk may come to the host
  CHECK(gpu.activations == 0);
  CHECK(gpu.device == 0);
}

}  // namespace train_options_test
