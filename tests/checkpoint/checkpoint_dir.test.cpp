// SPDX-License-Identifier: Apache-2.0
// The checkpoint directory's guarantees: a save deletes nothing it did not create (an unrelated
// `<dir>.tmp`, a foreign directory that happens to hold a model.safetensors, a checkpoint with
// notes beside it), concurrent writers take turns under the lock and the previous checkpoint always
// survives, a lock held too long is a typed error naming its holder, leftovers of killed writers are
// cleaned, and a checkpoint path that cannot work is refused before any training.
#include <chunkstar/checkpoint/runtime_checkpoint.hpp>
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/placement/static_placement.hpp>

#include "support/runtimes.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <csignal>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

using namespace chunkstar;

namespace checkpoint_dir_test {
namespace fs = std::filesystem;

namespace {

struct temp_dir {
  fs::path path;
  temp_dir() {
    static int counter = 0;
    path =
        fs::temp_directory_path() / ("chunkstar_ckdir_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

using runtime_t = chunk_runtime<fixed_chunk_layout, static_placement>;

/** A runtime with two small parameters whose values are all @p value. */
struct model {
  simulated_device_space dev{{.capacity = std::size_t{8} << 20}};
  host_space host;
  host_copy_engine copier;
  runtime_t rt{dev, host, copier, {}, fixed_chunk_layout({.chunk_elems = 256}), static_placement{}};
  explicit model(float value) {
    for (const char* n : {"a", "b"})
      rt.register_param({n, {8, 8}, dtype::f32, tensor_role::weight}, [value](std::span<float> v) {
        for (float& x : v) x = value;
      });
    rt.finalize();
  }
  float first() const {
    std::vector<float> v(64);
    rt.read_tensor(param_id{0}, chunk_kind::param, v);
    return v[0];
  }
};

std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

void write_text(const fs::path& p, const std::string& text) { std::ofstream(p) << text; }

}  // namespace

TEST_CASE("a save never deletes an unrelated <dir>.tmp, and leaves only the checkpoint and its lock") {
  temp_dir tmp;
  fs::create_directories(tmp.path / "o8.tmp");
  write_text(tmp.path / "o8.tmp" / "notes.txt", "mine");
  model m(1.0f);
  save_checkpoint(m.rt, tmp.path / "o8", {{"step", "1"}});
  save_checkpoint(m.rt, tmp.path / "o8", {{"step", "2"}});  // replaces its own checkpoint
  CHECK(fs::exists(tmp.path / "o8.tmp" / "notes.txt"));
  CHECK(names_in(tmp.path) == std::vector<std::string>{"o8", "o8.lock", "o8.tmp"});
  CHECK(names_in(tmp.path / "o8") == std::vector<std::string>{"model.safetensors", "optimizer.safetensors"});
  CHECK(read_checkpoint_extra(tmp.path / "o8").at("step") == "2");
}

TEST_CASE("a directory is replaced only when it is a chunkstar checkpoint and nothing else") {
  temp_dir tmp;
  model m(2.0f);
  SUBCASE("a Hugging Face model directory: model.safetensors from another writer, config and tokenizer") {
    const auto hf = tmp.path / "gpt2";
    fs::create_directories(hf);
    safetensors_writer w;  // a valid safetensors file, but not a chunkstar checkpoint's
    const std::vector<float> x(4, 1.0f);
    w.add("wte", safetensors_dtype::f32, {4}, std::as_bytes(std::span<const float>(x)));
    (void)w.write(hf / "model.safetensors");
    write_text(hf / "config.json", "{}");
    write_text(hf / "tokenizer.json", "{}");
    CHECK_THROWS_WITH_AS(save_checkpoint(m.rt, hf), doctest::Contains("refusing to replace"), checkpoint_error);
    CHECK_THROWS_AS(check_checkpoint_target(hf), checkpoint_error);
    CHECK(names_in(hf) == std::vector<std::string>{"config.json", "model.safetensors", "tokenizer.json"});
  }
  SUBCASE("a safetensors file without chunkstar metadata alone") {
    const auto other = tmp.path / "weights";
    fs::create_directories(other);
    // Hand-built, as other tools write it: no chunkstar.* metadata at all.
    const std::string header = R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
    std::string file(8, '\0');
    for (int i = 0; i < 8; ++i)
      file[static_cast<std::size_t>(i)] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
    file += header + std::string(4, '\0');
    write_text(other / "model.safetensors", file);
    CHECK_THROWS_WITH_AS(save_checkpoint(m.rt, other), doctest::Contains("no chunkstar metadata"), checkpoint_error);
    CHECK(fs::file_size(other / "model.safetensors") == file.size());
  }
  SUBCASE("a chunkstar checkpoint with the user's notes beside it") {
    save_checkpoint(m.rt, tmp.path / "ck");
    write_text(tmp.path / "ck" / "notes.txt", "run 7: lr 3e-3");
    CHECK_THROWS_WITH_AS(save_checkpoint(m.rt, tmp.path / "ck"), doctest::Contains("'notes.txt'"), checkpoint_error);
    CHECK(fs::exists(tmp.path / "ck" / "notes.txt"));
  }
  SUBCASE("a damaged chunkstar checkpoint is not replaced silently either") {
    save_checkpoint(m.rt, tmp.path / "ck");
    fs::resize_file(tmp.path / "ck" / "model.safetensors", 4);
    CHECK_THROWS_WITH_AS(save_checkpoint(m.rt, tmp.path / "ck"), doctest::Contains("truncated"), checkpoint_error);
  }
  SUBCASE("an empty directory and a symbolic link") {
    fs::create_directories(tmp.path / "empty");
    save_checkpoint(m.rt, tmp.path / "empty");
    CHECK(fs::exists(tmp.path / "empty" / "model.safetensors"));
    fs::create_directory_symlink(tmp.path / "empty", tmp.path / "link");
    CHECK_THROWS_WITH_AS(save_checkpoint(m.rt, tmp.path / "link"), doctest::Contains("symbolic link"),
                         checkpoint_error);
  }
}

TEST_CASE("concurrent writers to one directory take turns; every result is one complete checkpoint") {
  temp_dir tmp;
  const auto dir = tmp.path / "cc";
  constexpr int writers = 4, saves = 6;
  std::vector<std::unique_ptr<model>> models;
  for (int w = 0; w < writers; ++w) models.push_back(std::make_unique<model>(static_cast<float>(w + 1)));
  save_checkpoint(models[0]->rt, dir, {{"writer", "1"}});
  std::atomic<int> failures{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (int w = 0; w < writers; ++w)
    threads.emplace_back([&, w] {
      for (int i = 0; i < saves; ++i) {
        try {
          save_checkpoint(models[static_cast<std::size_t>(w)]->rt, dir, {{"writer", std::to_string(w + 1)}});
        } catch (const std::exception&) {
          ++failures;
        }
      }
    });
  // A reader alongside: every load sees one complete checkpoint, never a mixture.
  std::atomic<int> loads{0}, bad_loads{0};
  std::thread reader([&] {
    model r(0.0f);
    while (!stop) {
      try {
        const auto extra = load_checkpoint(r.rt, dir);
        if (r.first() != std::stof(extra.at("writer"))) ++bad_loads;
        ++loads;
      } catch (const std::exception&) {
        ++bad_loads;
      }
    }
  });
  for (auto& t : threads) t.join();
  stop = true;
  reader.join();
  CHECK(failures == 0);
  CHECK(bad_loads == 0);
  CHECK(loads > 0);
  CHECK(names_in(tmp.path) == std::vector<std::string>{"cc", "cc.lock"});
  model r(0.0f);
  const auto extra = load_checkpoint(r.rt, dir);
  CHECK(r.first() == std::stof(extra.at("writer")));
}

TEST_CASE("two processes saving to one directory: both complete, the checkpoint survives") {
  temp_dir tmp;
  const auto dir = tmp.path / "pp";
  {
    model m(9.0f);
    save_checkpoint(m.rt, dir, {{"writer", "9"}});
  }
  std::vector<pid_t> children;
  for (int c = 0; c < 2; ++c) {
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      int rc = 0;
      try {
        model m(static_cast<float>(c + 1));
        for (int i = 0; i < 5; ++i) save_checkpoint(m.rt, dir, {{"writer", std::to_string(c + 1)}});
      } catch (...) {
        rc = 1;
      }
      ::_exit(rc);
    }
    children.push_back(pid);
  }
  for (pid_t pid : children) {
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
  }
  model r(0.0f);
  const auto extra = load_checkpoint(r.rt, dir);
  CHECK(r.first() == std::stof(extra.at("writer")));
  CHECK(names_in(tmp.path) == std::vector<std::string>{"pp", "pp.lock"});
}

TEST_CASE("a lock held longer than the timeout is a checkpoint_error naming the holder; the checkpoint is untouched") {
  temp_dir tmp;
  const auto dir = tmp.path / "ck";
  model m(1.0f), n(5.0f);
  save_checkpoint(m.rt, dir, {{"v", "1"}});
  {
    const checkpoint_detail::directory_lock holder(dir, true, std::chrono::milliseconds(100));
    const auto t0 = std::chrono::steady_clock::now();
    const std::string me = "pid " + std::to_string(::getpid());
    CHECK_THROWS_WITH_AS(save_checkpoint(n.rt, dir, {{"v", "5"}}, {.timeout = std::chrono::milliseconds(200)}),
                         doctest::Contains(me.c_str()), checkpoint_error);
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
    // Readers wait for writers too.
    model r(0.0f);
    CHECK_THROWS_AS((void)load_checkpoint(r.rt, dir, {}, {.timeout = std::chrono::milliseconds(50)}), checkpoint_error);
  }
  model r(0.0f);
  CHECK(load_checkpoint(r.rt, dir).at("v") == "1");
  CHECK(r.first() == 1.0f);
}

TEST_CASE("a lock file or a temporary that is a symbolic link or not a regular file is never written through") {
  temp_dir tmp;
  const auto dir = tmp.path / "ck";
  const auto precious = tmp.path / "precious.txt";
  write_text(precious, "precious\n");
  model m(1.0f);
  SUBCASE("a symlinked lock: saves, checks and loads refused before anything is written, the target unchanged") {
    save_checkpoint(m.rt, dir, {{"v", "1"}});
    fs::remove(tmp.path / "ck.lock");
    fs::create_symlink(precious, tmp.path / "ck.lock");
    model n(2.0f);
    CHECK_THROWS_WITH_AS(save_checkpoint(n.rt, dir, {{"v", "2"}}), doctest::Contains("symbolic link"),
                         checkpoint_error);
    CHECK_THROWS_WITH_AS(check_checkpoint_target(dir), doctest::Contains("symbolic link"), checkpoint_error);
    model r(0.0f);
    CHECK_THROWS_WITH_AS((void)load_checkpoint(r.rt, dir), doctest::Contains("symbolic link"), checkpoint_error);
    CHECK_THROWS_WITH_AS((void)read_checkpoint_extra(dir), doctest::Contains("symbolic link"), checkpoint_error);
    fs::remove(tmp.path / "ck.lock");
    CHECK(load_checkpoint(r.rt, dir).at("v") == "1");  // the checkpoint is the first save's
  }
  SUBCASE("a lock that is a directory or a FIFO: refused") {
    SUBCASE("directory") { fs::create_directories(tmp.path / "ck.lock"); }
    SUBCASE("FIFO") { REQUIRE(::mkfifo((tmp.path / "ck.lock").c_str(), 0644) == 0); }
    CHECK_THROWS_AS(save_checkpoint(m.rt, dir, {{"v", "1"}}), checkpoint_error);
    CHECK_FALSE(fs::exists(dir));
  }
  SUBCASE("links planted at a temporary file's next names: skipped, the write completes") {
    // The serial the next temporary takes, read from the name a failing creation reports.
    std::string failed;
    try {
      (void)checkpoint_detail::create_temporary(tmp.path / "no-such-dir" / "f");
    } catch (const checkpoint_error& e) {
      failed = e.what();
    }
    const std::string stem = "f.tmp." + std::to_string(::getpid()) + ".";
    REQUIRE(failed.find(stem) != std::string::npos);
    const unsigned next = static_cast<unsigned>(std::stoul(failed.substr(failed.find(stem) + stem.size()))) + 1;
    const auto target = tmp.path / "x.safetensors";
    for (unsigned k = next; k < next + 8; ++k)
      fs::create_symlink(precious, target.string() + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(k));
    safetensors_writer w;
    const std::vector<float> v(4, 1.0f);
    w.add_values<float>("x", {4}, v);
    (void)w.write(target);
    CHECK(safetensors_file::open(target).find("x") != nullptr);
  }
  std::ifstream in(precious);
  std::string text;
  std::getline(in, text);
  CHECK(text == "precious");
}

TEST_CASE("temporaries of killed writers are removed by the next save; anything else of that name stays") {
  temp_dir tmp;
  const auto dir = tmp.path / "ck";
  // A pid that is not running: a child that has exited and been reaped.
  const pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  REQUIRE(dead > 0);
  int status = 0;
  ::waitpid(dead, &status, 0);
  const auto stale = tmp.path / ("ck.tmp." + std::to_string(dead) + ".0");
  const auto foreign = tmp.path / ("ck.tmp." + std::to_string(dead) + ".1");
  fs::create_directories(stale);
  write_text(stale / "model.safetensors", "half written");
  write_text(stale / ("optimizer.safetensors.tmp." + std::to_string(dead) + ".3"), "half written");
  fs::create_directories(foreign);
  write_text(foreign / "notes.txt", "not ours");
  model m(1.0f);
  save_checkpoint(m.rt, dir);
  CHECK(!fs::exists(stale));
  CHECK(fs::exists(foreign / "notes.txt"));
}

TEST_CASE("check_checkpoint_target refuses up front what a save would refuse, and creates nothing that stays") {
  temp_dir tmp;
  write_text(tmp.path / "file", "x");
  CHECK_THROWS_WITH_AS(check_checkpoint_target(tmp.path / "file"), doctest::Contains("not a directory"),
                       checkpoint_error);
  CHECK_THROWS_AS(check_checkpoint_target(tmp.path / "file" / "ck"), checkpoint_error);
  CHECK_THROWS_AS(check_checkpoint_target(""), checkpoint_error);
  if (fs::is_directory("/proc/self")) CHECK_THROWS_AS(check_checkpoint_target("/proc/ck"), checkpoint_error);
  check_checkpoint_target(tmp.path / "new" / "ck");  // parents are created, as a save would
  CHECK(names_in(tmp.path) == std::vector<std::string>{"file", "new"});
  CHECK(fs::is_empty(tmp.path / "new"));
}

TEST_CASE("loading: a regular file, a FIFO in a checkpoint's place, and reading the extra entries alone") {
  temp_dir tmp;
  model m(3.0f);
  write_text(tmp.path / "file", "x");
  CHECK_THROWS_WITH_AS((void)load_checkpoint(m.rt, tmp.path / "file"), doctest::Contains("is not a directory"),
                       checkpoint_error);
  CHECK_THROWS_WITH_AS((void)read_checkpoint_extra(tmp.path / "file"), doctest::Contains("is not a directory"),
                       checkpoint_error);
  save_checkpoint(m.rt, tmp.path / "ck", {{"step", "7"}});
  CHECK(read_checkpoint_extra(tmp.path / "ck") == checkpoint_extra{{"step", "7"}});
  fs::remove(tmp.path / "ck" / "model.safetensors");
  REQUIRE(::mkfifo((tmp.path / "ck" / "model.safetensors").c_str(), 0644) == 0);
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS((void)load_checkpoint(m.rt, tmp.path / "ck"), doctest::Contains("not a regular file"),
                       checkpoint_error);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
}

namespace {
/** A model big enough that a save takes a while (a few MiB), so a kill lands inside one. */
struct big_model {
  simulated_device_space dev{{.capacity = std::size_t{64} << 20}};
  host_space host;
  host_copy_engine copier;
  runtime_t rt{dev, host, copier, {}, fixed_chunk_layout({.chunk_elems = 1 << 18}), static_placement{}};
  explicit big_model(float value) {
    for (int t = 0; t < 4; ++t)
      rt.register_param({"w" + std::to_string(t), {512, 512}, dtype::f32, tensor_role::weight},
                        [value](std::span<float> v) {
                          for (float& x : v) x = value;
                        });
    rt.finalize();
  }
};
}  // namespace

TEST_CASE("kill -9 during saves: the directory always holds one complete checkpoint, and the next save cleans up") {
  temp_dir tmp;
  const auto dir = tmp.path / "ck";
  {
    big_model m(1.0f);
    save_checkpoint(m.rt, dir, {{"v", "1"}});
  }
  int killed_mid_save = 0;  // trials whose kill left a temporary: the saves are back to back, so most
  for (int trial = 0; trial < 6; ++trial) {
    CAPTURE(trial);
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      big_model m(static_cast<float>(trial + 2));
      for (;;) save_checkpoint(m.rt, dir, {{"v", std::to_string(trial + 2)}});
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20 + 37 * trial));
    ::kill(pid, SIGKILL);
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    const auto extra = read_checkpoint_extra(dir);
    const float v = std::stof(extra.at("v"));
    const auto f = safetensors_file::open(dir / "model.safetensors", {.require_checksum = true});
    CHECK(f.read_floats("w3")[1000] == v);
    killed_mid_save += checkpoint_detail::interrupted_swap_leftovers(dir).empty() ? 0 : 1;
  }
  CHECK(killed_mid_save > 0);
  big_model m(9.0f);
  save_checkpoint(m.rt, dir, {{"v", "9"}});
  CHECK(names_in(tmp.path) == std::vector<std::string>{"ck", "ck.lock"});  // killed writers' temporaries are gone
}

TEST_CASE("a full disk (file-size limit) fails the save with checkpoint_error and keeps the previous checkpoint") {
  temp_dir tmp;
  const auto dir = tmp.path / "ck";
  {
    big_model m(1.0f);
    save_checkpoint(m.rt, dir, {{"v", "1"}});
  }
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {                   // in a child: the limit must not reach the test runner
    std::signal(SIGXFSZ, SIG_IGN);  // writes past the limit then fail with EFBIG, as on a full disk
    rlimit lim{std::size_t{1} << 20, std::size_t{1} << 20};
    ::setrlimit(RLIMIT_FSIZE, &lim);
    int rc = 2;
    try {
      big_model m(2.0f);
      save_checkpoint(m.rt, dir, {{"v", "2"}});
    } catch (const checkpoint_error& e) {
      rc = std::string(e.what()).find("cannot write") != std::string::npos ? 0 : 3;
    } catch (...) {
      rc = 4;
    }
    ::_exit(rc);
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(read_checkpoint_extra(dir).at("v") == "1");
  CHECK(names_in(tmp.path) == std::vector<std::string>{"ck", "ck.lock"});
}

}  // namespace checkpoint_dir_test
