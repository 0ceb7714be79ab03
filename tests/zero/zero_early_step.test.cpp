// SPDX-License-Identifier: Apache-2.0
// The optimizer step inside backward under ZeRO (chunk_adam::prepare over a sharded runtime): each
// rank steps the chunks it owns as soon as their reduction to it has completed, speculatively, and
// every owned parameter, master and moment ends with the bits of the plain sharded step — in the
// group mode and the memory-saving mode, with clipping off, never active, and active on a step that
// was speculated (undone and redone); and with a disk tier under a host too small for a rank's
// share (one process too), where the Adam state reaches the early update through the disk; and
// under replicated data parallelism, each chunk once its all-reduce has completed. Below a disk
// tier, the chunks still due at the step without room are carried over to the next forward (one
// process and ZeRO ranks), never given room by sending Adam state down; an early update whose state is on the
// disk reads it while the thread that queued it goes on, and the next forward starts an update
// carried over one scope ahead of the scope that reads its chunk.
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/disk/disk_copy_engine.hpp>
#include <chunkstar/disk/disk_space.hpp>
#include <chunkstar/disk/disk_tier.hpp>
#include <chunkstar/placement/static_placement.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>
#include <chunkstar/zero/replicated_gradients.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <atomic>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "support/disk_test_dir.hpp"
#include "support/mlp_replica.hpp"
#include "support/runtimes.hpp"

using namespace chunkstar;

namespace zero_early_step_test {
using chunkstar::testing::mlp_replica;

namespace {

/** Every chunk stepped on the host: the steps that start inside backward. */
struct all_host : static_placement {
  all_host() : static_placement(static_placement::all_host()) {}
};

constexpr int steps = 8;

struct outcome {
  std::map<std::string, std::vector<float>> lists;  // "<list>/<tensor>" of every owned tensor, all ranks
  std::vector<optimizer_step_result> results;       // rank 0's, per step
  std::size_t early_steps = 0;                      // over all ranks
  std::size_t carried = 0;  // updates the steps carried over to the next forward, over all ranks and steps
};

/** @p ranks ZeRO ranks; with @p disk_dir, each with a host of 8 blocks (less than its share of
 *  the model data) and a disk tier of its own there, and a device of the activations and 6 chunks. */
outcome train(int ranks, bool memory_saving, float max_grad_norm, bool prepare, const std::string& disk_dir = {}) {
  outcome out;
  std::vector<outcome> per_rank(static_cast<std::size_t>(ranks));
  run_ranks(ranks, [&](in_process_communicator& comm) {
    auto& me = per_rank[static_cast<std::size_t>(comm.rank())];
    constexpr std::size_t block = 4096;  // a chunk's footprint on the host and the disk with a disk tier
    std::optional<disk_space> disk;
    std::optional<disk_copy_engine> disk_io;
    if (!disk_dir.empty()) {
      disk.emplace(disk_space_options{
          .directory = disk_dir, .capacity = 64 * block, .name = "rank" + std::to_string(comm.rank())});
      disk_io.emplace(*disk);
    }
    using replica = mlp_replica<in_process_communicator, all_host>;
    const std::size_t device = disk_dir.empty() ? std::size_t{1} << 20
                                                : chunkstar::testing::mlp_act_bytes +
                                                      (memory_saving ? 6 : 4 * static_cast<std::size_t>(ranks) + 2) *
                                                          chunkstar::testing::mlp_chunk_bytes;
    replica r(
        {.sharding = {.enabled = true, .memory_saving = memory_saving}}, device,
        host_space_options{.capacity = disk_dir.empty() ? host_space_options{}.capacity : 8 * block},
        [&](replica::runtime_type& rt) {
          if (disk) rt.attach_disk(disk_tier(*disk, *disk_io));
        },
        comm);
    chunk_adam<> opt({.hyper = {.weight_decay = 0.01f}, .max_grad_norm = max_grad_norm, .threads = 1});
    for (int step = 1; step <= steps; ++step) {
      const float lr = 2e-2f;
      if (prepare) (void)opt.prepare(r.rt, lr, ranks);
      r.forward_backward(step, comm.rank(), [] {});
      me.results.push_back(opt.step(r.rt, lr, ranks));
      me.carried += r.rt.carried_steps().size();
      for (const auto& v : r.rt.invariant_violations(true)) FAIL_CHECK(v);
    }
    for (std::size_t t = 0; t < r.rt.params().size(); ++t) {
      const chunk_id id{chunk_kind::param, static_cast<std::uint32_t>(r.rt.plan().slots[t].chunk)};
      if (!r.rt.shards().owns(id.index)) continue;  // gathered (device) between steps, too
      for (auto k : {chunk_kind::param, chunk_kind::momentum, chunk_kind::variance}) {
        std::vector<float> v(r.rt.params()[t].numel());
        r.rt.read_tensor(param_id{static_cast<std::uint32_t>(t)}, k, v);
        me.lists[std::string(chunk_kind_name(k)) + "/" + r.rt.params()[t].name] = v;
      }
    }
    me.early_steps = r.rt.stats().early_steps;
    if (disk) CHECK(r.rt.stats().bytes_from_disk > 0);
  });
  for (auto& p : per_rank) {
    for (auto& [name, v] : p.lists) {
      CHECK(!out.lists.contains(name));  // one owner each
      out.lists[name] = v;
    }
    out.early_steps += p.early_steps;
    out.carried += p.carried;
  }
  out.results = per_rank[0].results;
  return out;
}

void same_bits(const outcome& plain, const outcome& early) {
  CHECK(plain.lists.size() == early.lists.size());
  for (const auto& [name, v] : plain.lists) {
    CAPTURE(name);
    CHECK(early.lists.at(name) == v);
  }
  for (std::size_t s = 0; s < plain.results.size(); ++s) {
    CAPTURE(s);
    CHECK(plain.results[s].stepped == early.results[s].stepped);
    CHECK(plain.results[s].grad_norm == early.results[s].grad_norm);
    CHECK(plain.results[s].clip_coefficient == early.results[s].clip_coefficient);
  }
}

}  // namespace

TEST_CASE("ZeRO, the step inside backward: each rank steps its own chunks once reduced to it, the plain step's bits") {
  for (int ranks : {2, 3}) {
    for (bool memory_saving : {false, true}) {
      CAPTURE(ranks);
      CAPTURE(memory_saving);
      SUBCASE("no clipping: nothing kept, every update stands") {
        const outcome plain = train(ranks, memory_saving, 0.0f, false), early = train(ranks, memory_saving, 0.0f, true);
        same_bits(plain, early);
        // From the second step (the first records the trace), the chunks reduced before the last
        // backward scope step inside backward, on their owners.
        CHECK(early.results[0].early_steps == 0);
        CHECK(early.early_steps > 0);
        CHECK(plain.early_steps == 0);
        for (std::size_t s = 1; s < early.results.size(); ++s) CHECK_FALSE(early.results[s].early_redone);
      }
      SUBCASE("clipping never active, then active on a speculated step (undone and redone)") {
        const outcome free_run = train(ranks, memory_saving, 0.0f, false);
        same_bits(free_run, train(ranks, memory_saving, 1e6f, true));
        // A threshold the first steps stay under and step s goes over: steps before s keep their
        // speculative updates, step s's are redone with its coefficient.
        std::vector<double> norms;
        for (const auto& r : free_run.results) norms.push_back(r.grad_norm);
        std::size_t s = 2;
        while (s < norms.size() && norms[s] <= *std::max_element(norms.begin(), norms.begin() + s)) ++s;
        REQUIRE(s < norms.size());
        const float threshold =
            static_cast<float>((*std::max_element(norms.begin(), norms.begin() + s) + norms[s]) / 2);
        CAPTURE(s);
        CAPTURE(threshold);
        const outcome plain = train(ranks, memory_saving, threshold, false);
        const outcome early = train(ranks, memory_saving, threshold, true);
        same_bits(plain, early);
        CHECK(early.results[s].clip_coefficient < 1.0f);
        CHECK(early.results[s].early_steps > 0);  // on rank 0
        CHECK(early.results[s].early_redone);
        CHECK_FALSE(early.results[s - 1].early_redone);
      }
    }
  }
}

TEST_CASE(
    "The step inside backward with a disk tier (one process, and per ZeRO rank): the plain step's bits, the state "
    "moving through the disk") {
  chunkstar::test::scratch_dir dir;
  std::size_t zero_carried = 0;
  for (int ranks : {1, 2, 3}) {
    for (bool memory_saving : {false, true}) {
      CAPTURE(ranks);
      CAPTURE(memory_saving);
      INFO("the step after backward");
      const outcome plain = train(ranks, memory_saving, 0.0f, false, dir.path());
      INFO("the step inside backward");
      const outcome early = train(ranks, memory_saving, 0.0f, true, dir.path());
      same_bits(plain, early);
      CHECK(early.early_steps > 0);
      if (ranks > 1) zero_carried += early.carried;
    }
  }
  // Under ZeRO too, chunks without room at the step are carried over to the next forward (their
  // update started and waited for before the chunk is sent to the other ranks), with the bits
  // above. How many depends on when the worker frees room (tens over these 32 steps per rank
  // count in every run seen; none would mean the step waited for room again).
  CHECK(zero_carried > 0);
}

TEST_CASE(
    "ZeRO, the step inside backward: an update still running into the next forward is waited for before its chunk "
    "is sent to the other ranks (a group's gather)") {
  // Two ranks, groups {0,1} and {2,3}: chunks 2 (rank 0) and 3 (rank 1) step inside backward, 0 and
  // 1 (their group's last use is the last scope) when the step starts. The updates are held until
  // 300 ms after the step; the next forward's gather of {2,3} sends rank 1's chunk 3 from a scope
  // that uses only chunk 2, so only the gather itself can wait for it.
  std::vector<std::string> errors(2);
  std::vector<std::uint64_t> early(2);
  run_ranks(2, [&](in_process_communicator& comm) {
    const auto me = static_cast<std::size_t>(comm.rank());
    mlp_replica<in_process_communicator, all_host> r({.sharding = {.enabled = true}}, 1 << 20, comm);
    const auto bump = [](const step_chunk& c) {
      for (std::size_t i = 0; i < c.elems; ++i) static_cast<float*>(c.param)[i] += 1e-3f;
    };
    r.forward_backward(1, comm.rank(), [] {});
    r.rt.step(bump);  // the trace
    std::promise<void> gate;
    REQUIRE(r.rt.arm_early_steps({.update =
                                      [&bump, open = gate.get_future().share()](const step_chunk& c) {
                                        open.wait();
                                        bump(c);
                                      },
                                  .undo = {}}));
    r.forward_backward(2, comm.rank(), [] {});
    r.rt.step(bump);  // keeps the held updates, still running
    early[me] = r.rt.stats().early_steps;
    std::thread opener([&gate] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      gate.set_value();
    });
    try {
      r.forward_backward(3, comm.rank(), [] {});
      r.rt.step(bump);
    } catch (const std::exception& e) {
      errors[me] = e.what();
    }
    opener.join();
  });
  for (std::size_t k = 0; k < 2; ++k) {
    CAPTURE(k);
    CHECK(early[k] == 2);
    CHECK(errors[k].empty());
  }
}

namespace {

/** @p ranks ranks of replicated data parallelism (every rank holds everything; gradient chunks
 *  all-reduced as they become final), every chunk stepped on the host. Every rank's lists (they
 *  must agree) and rank 0's results. */
outcome train_replicated(int ranks, float max_grad_norm, bool prepare) {
  std::vector<outcome> per_rank(static_cast<std::size_t>(ranks));
  run_ranks(ranks, [&](in_process_communicator& comm) {
    auto& me = per_rank[static_cast<std::size_t>(comm.rank())];
    mlp_replica<in_process_communicator, all_host> r({.gradients = gradient_mode::replicated}, 1 << 20, comm);
    replicated_gradients dp(r.rt);
    chunk_adam<> opt({.hyper = {.weight_decay = 0.01f}, .max_grad_norm = max_grad_norm, .threads = 1});
    for (int step = 1; step <= steps; ++step) {
      if (prepare) (void)opt.prepare(r.rt, 2e-2f, ranks);
      r.forward_backward(step, comm.rank(), [&] { dp.after_backward(); });
      dp.synchronize();
      me.results.push_back(opt.step(r.rt, 2e-2f, ranks));
      for (const auto& v : r.rt.invariant_violations(true)) FAIL_CHECK(v);
    }
    for (std::size_t t = 0; t < r.rt.params().size(); ++t)
      for (auto k : {chunk_kind::param, chunk_kind::momentum, chunk_kind::variance}) {
        std::vector<float> v(r.rt.params()[t].numel());
        r.rt.read_tensor(param_id{static_cast<std::uint32_t>(t)}, k, v);
        me.lists[std::string(chunk_kind_name(k)) + "/" + r.rt.params()[t].name] = v;
      }
    me.early_steps = r.rt.stats().early_steps;
  });
  for (const auto& p : per_rank) CHECK(p.lists == per_rank[0].lists);  // every rank holds the same
  return per_rank[0];
}

}  // namespace

TEST_CASE(
    "Replicated gradients, the step inside backward: each chunk once its all-reduce has completed, the plain "
    "step's bits") {
  for (int ranks : {2, 3}) {
    CAPTURE(ranks);
    for (const float max_norm : {0.0f, 1e6f}) {
      CAPTURE(max_norm);
      const outcome plain = train_replicated(ranks, max_norm, false), early = train_replicated(ranks, max_norm, true);
      same_bits(plain, early);
      CHECK(plain.early_steps == 0);
      CHECK(early.early_steps > 0);
    }
  }
}

namespace {

/** Weights and gradients on the device (its whole room), every chunk stepped on the host. */
struct weights_on_device {
  [[nodiscard]] std::size_t chunk_budget(const placement_inputs& in) const noexcept {
    return room_after(in.device_capacity, in.non_model_now);
  }
  [[nodiscard]] tier optimizer_tier(const placement_inputs&, std::size_t) const noexcept { return tier::host; }
  [[nodiscard]] static constexpr std::string_view name() noexcept { return "weights_on_device"; }
};

/** Six fp32 chunks of one tensor each (weights_on_device) below a disk tier whose engine is @p
 *  Engine, under a host of @p host_blocks chunks besides the staging buffers; every step adds
 *  (bump) -1e-3 x the gradient 0.25 to the weights, 1 to the first moment and 2 to the second. */
template <class Engine>
struct host_stepped_six {
  static constexpr std::size_t elems = 1024, block = elems * sizeof(float), chunks = 6;
  chunkstar::test::scratch_dir dir;
  disk_space disk{{.directory = dir.path(), .capacity = 64 * block, .name = "early"}};
  Engine disk_io{disk};
  simulated_device_space dev{{.capacity = 64 * block}};
  host_space host;
  host_copy_engine copier;
  chunk_runtime<fixed_chunk_layout, weights_on_device> rt;
  std::vector<param_id> ids;

  host_stepped_six(std::size_t host_blocks, runtime_options options)
      : host({.capacity = (runtime_options{}.disk_staging_chunks + host_blocks) * block,
              .large_block_threshold = SIZE_MAX}),
        rt(dev, host, copier, options, fixed_chunk_layout({.chunk_elems = elems}), {}) {
    rt.attach_disk(disk_tier(disk, disk_io));
    for (std::size_t i = 0; i < chunks; ++i)
      ids.push_back(rt.register_param(
          {"w" + std::to_string(i), {static_cast<std::int64_t>(elems)}, dtype::f32, tensor_role::weight},
          [](std::span<float> v) { std::fill(v.begin(), v.end(), 0.5f); }));
    rt.finalize();
  }
  void forward(std::size_t first = 0) {
    for (std::size_t i = first; i < chunks; ++i) auto f = rt.forward("f" + std::to_string(i), {ids[i]});
  }
  void backward() {
    for (std::size_t i = chunks; i-- > 0;) {
      auto g = rt.backward("b" + std::to_string(i), {ids[i]});
      for (auto& x : g.template grad<float>(ids[i])) x = 0.25f;
    }
  }
  /** Two plain steps (bump): the trace, and every list in place. */
  void two_plain_steps() {
    for (int s = 0; s < 2; ++s) {
      forward();
      backward();
      rt.step(bump);
    }
  }
  static void bump(const step_chunk& c) {
    for (std::size_t k = 0; k < c.elems; ++k) {
      static_cast<float*>(c.param)[k] -= 1e-3f * static_cast<const float*>(c.grad)[k];
      c.momentum[k] += 1.0f;
      c.variance[k] += 2.0f;
    }
  }
  /** Every chunk's weights and moments as three steps leave them. */
  void check_three_steps() {
    std::vector<float> v(elems), want(elems, 0.5f);
    for (int s = 0; s < 3; ++s)
      for (auto& x : want) x -= 1e-3f * 0.25f;
    for (std::size_t i = 0; i < chunks; ++i) {
      CAPTURE(i);
      rt.read_tensor(ids[i], chunk_kind::param, v);
      CHECK(v == want);
      rt.read_tensor(ids[i], chunk_kind::momentum, v);
      CHECK(v[0] == 3.0f);
      rt.read_tensor(ids[i], chunk_kind::variance, v);
      CHECK(v[0] == 6.0f);
    }
  }
};

}  // namespace

TEST_CASE(
    "The step inside backward below a disk tier: at the step, chunks without room are carried over to the next "
    "forward, which starts them as room frees; no Adam state goes down to the disk for them") {
  // Six fp32 chunks stepped on the host, one tensor each, their weights and gradients living on the
  // device; the host holds every chunk's moments and two chunks' weights and gradient besides (the
  // staging buffers apart), so only two early updates hold their lists there at once. The updates
  // of chunks 3 and 2 are held until the step has returned: at the step they (and what queues
  // behind them on the worker) hold the room that the chunks still due need. Waiting for it would hold the step (and the next forward) for the updates
  // running; taking it from the disk would send down moments the next backward reads back. So the
  // step carries them over, and the next forward's scopes start them, the one that reads a
  // chunk first waiting for its update.
  using six = host_stepped_six<disk_copy_engine>;
  constexpr std::size_t chunks = six::chunks;
  six t(2 * chunks + 4, {});
  auto& rt = t.rt;
  const auto bump = six::bump;
  t.two_plain_steps();
  std::promise<void> release;
  const std::shared_future<void> held = release.get_future().share();
  std::atomic<int> updates{0};
  REQUIRE(rt.arm_early_steps({.update =
                                  [&bump, &updates, held](const step_chunk& c) {
                                    // Bounded: a step that waited for room would end the test, not hang it.
                                    if (c.index == 3 || c.index == 2) (void)held.wait_for(std::chrono::seconds(20));
                                    bump(c);
                                    updates.fetch_add(1);
                                  },
                              .undo = {},
                              .spends_gradient = true}));
  t.forward();
  t.backward();
  const auto written = rt.stats().bytes_to_disk;
  rt.step(bump);  // every chunk steps early: nothing is left to this
  const std::vector<std::uint32_t> carried(rt.carried_steps().begin(), rt.carried_steps().end());
  // Which chunks find room inside backward depends on when the worker finishes 5 and 4, but the
  // held updates leave at most one free place at the step, where 0 and another chunk are due at
  // least: some are carried over, in the order the next forward reads them.
  REQUIRE_FALSE(carried.empty());
  CHECK(std::is_sorted(carried.begin(), carried.end()));
  CHECK(updates.load() < static_cast<int>(chunks));  // the step returned with the held updates not run
  release.set_value();
  t.forward();  // f0 and f1 start the updates carried over and wait for them
  CHECK(rt.carried_steps().empty());
  CHECK(updates.load() == static_cast<int>(chunks));
  CHECK(rt.stats().early_steps == chunks);
  CHECK(rt.stats().bytes_to_disk == written);  // nothing sent down to make room at the step or after
  t.check_three_steps();
  t.backward();  // the next iteration goes on as the trace says (the gradients carried over are spent)
  rt.step(bump);
  std::vector<float> v(six::elems);
  for (std::size_t i = 0; i < chunks; ++i) {
    rt.read_tensor(t.ids[i], chunk_kind::momentum, v);
    CHECK(v[0] == 4.0f);
  }
  CHECK(rt.invariant_violations(true).empty());
}

namespace {

/** The disk engine, except that reads issued while it holds are queued, not started, until the
 *  test releases them (from any thread): whoever waits for one waits until then. */
class held_reads_engine {
 public:
  explicit held_reads_engine(disk_space& space) : space_(space), inner_(space) {}
  held_reads_engine(const held_reads_engine&) = delete;
  held_reads_engine& operator=(const held_reads_engine&) = delete;
  ~held_reads_engine() { (void)release(); }

  void hold() {
    const std::lock_guard lock(m_);
    holding_ = true;
  }
  /** Stops holding and runs the reads held, in order (@p fail: each fails with io_error instead);
   *  returns how many. */
  std::size_t release(bool fail = false) {
    std::vector<held> now;
    {
      const std::lock_guard lock(m_);
      holding_ = false;
      now.swap(held_);
    }
    for (auto& h : now) {
      try {
        if (fail) throw io_error("injected read failure (held)");
        inner_.copy_async(h.dst, h.src, h.n, h.d).wait();
        h.done.set_value();
      } catch (...) {
        h.done.set_exception(std::current_exception());
      }
    }
    return now.size();
  }
  [[nodiscard]] std::size_t ever_held() const {
    const std::lock_guard lock(m_);
    return ever_;
  }

  disk_copy_handle copy_async(void* dst, const void* src, std::size_t n, copy_direction d) {
    const std::lock_guard lock(m_);
    if (!holding_ || !space_.contains(src)) return inner_.copy_async(dst, src, n, d);
    ++ever_;
    held_.push_back({dst, src, n, d, {}});
    return disk_copy_handle(held_.back().done.get_future().share());
  }
  void copy(void* dst, const void* src, std::size_t n, copy_direction d) { copy_async(dst, src, n, d).wait(); }
  disk_copy_handle zero_async(void* dst, std::size_t n) { return inner_.zero_async(dst, n); }
  template <CopyHandle H>
  void order_after(const H& h, copy_direction d) {
    inner_.order_after(h, d);
  }
  void synchronize() { inner_.synchronize(); }
  [[nodiscard]] copy_stats stats() const { return inner_.stats(); }
  [[nodiscard]] disk_io_stats io_stats() const { return inner_.io_stats(); }

 private:
  struct held {
    void* dst;
    const void* src;
    std::size_t n;
    copy_direction d;
    std::promise<void> done;
  };
  disk_space& space_;
  disk_copy_engine inner_;
  mutable std::mutex m_;
  bool holding_ = false;
  std::size_t ever_ = 0;
  std::vector<held> held_;
};

}  // namespace

TEST_CASE(
    "The step inside backward below a disk tier: the next forward starts an update carried over one scope ahead, "
    "its Adam state read while that scope computes; a failed read is reported and retried, the same values") {
  // Six fp32 chunks stepped on the host, weights and gradients on the device; the host holds four
  // chunks' moments and one chunk's four lists besides, so some moments are on the disk. Chunk 5's
  // update (the only one with room inside backward) is held until the step has returned, so chunks
  // 0-4 are carried over. The next forward's first scope starts and waits for chunk 0's update,
  // then starts chunk 1's while it computes: the disk holds every read from chunk 0's update on,
  // and the scope must not wait for them (a watchdog releases them after 20 s, which fails the
  // test rather than hang it).
  using six = host_stepped_six<held_reads_engine>;
  for (bool fail : {false, true}) {
    CAPTURE(fail);
    six t(4 + 2 * 4, {.disk_prefetch_depth = 0});
    auto& rt = t.rt;
    auto& disk_io = t.disk_io;
    const auto& ids = t.ids;
    const auto bump = six::bump;
    t.two_plain_steps();
    std::promise<void> release5;
    const std::shared_future<void> held5 = release5.get_future().share();
    REQUIRE(rt.arm_early_steps({.update =
                                    [&](const step_chunk& c) {
                                      if (c.index == 5) (void)held5.wait_for(std::chrono::seconds(20));
                                      bump(c);
                                      if (c.index == 0) disk_io.hold();  // before the scope that waits for it goes on
                                    },
                                .undo = {},
                                .spends_gradient = true}));
    t.forward();
    t.backward();
    rt.step(bump);
    const std::vector<std::uint32_t> carried(rt.carried_steps().begin(), rt.carried_steps().end());
    REQUIRE(carried == std::vector<std::uint32_t>{0, 1, 2, 3, 4});
    release5.set_value();
    const auto read_before = rt.stats().bytes_from_disk;
    std::promise<void> done;
    std::atomic<bool> by_watchdog{false};
    std::thread watchdog([&, f = done.get_future()] {
      if (f.wait_for(std::chrono::seconds(20)) == std::future_status::timeout) {
        by_watchdog = true;
        (void)disk_io.release();
      }
    });
    { auto f = rt.forward("f0", {ids[0]}); }  // waits for chunk 0's update, starts chunk 1's
    CHECK(rt.carried_steps().size() == 3);    // 2, 3, 4: no room for a second one ahead
    const std::size_t held = disk_io.release(fail);
    done.set_value();
    watchdog.join();
    CHECK_FALSE(by_watchdog.load());  // f0 never waited for chunk 1's read
    CHECK(held > 0);
    CHECK(rt.stats().bytes_from_disk > read_before);
    if (fail) {
      // The update waited for its read, which failed: it never ran, the chunk is as it was (its
      // moments on the disk) and still carried over; the scope that needs it reports the failure,
      // and the same call again starts the update afresh.
      CHECK_THROWS_AS((void)rt.forward("f1", {ids[1]}), io_error);
      CHECK(rt.stats().disk_failures == 1);
      CHECK(rt.carried_steps().front() == 1);
    }
    t.forward(1);
    CHECK(rt.carried_steps().empty());
    t.check_three_steps();
    t.backward();
    rt.step(bump);
    CHECK(rt.invariant_violations(true).empty());
  }
}

}  // namespace zero_early_step_test
