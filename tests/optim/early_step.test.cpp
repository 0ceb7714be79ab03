// SPDX-License-Identifier: Apache-2.0
// Early (speculative) optimizer steps inside backward (chunk_adam::prepare, the runtime's
// arm_early_steps, plan_early_steps): the plan from a hand-written trace, and the bits — every
// parameter, master and moment after each step equals the run that never called prepare(), with
// clipping inactive, active on every step and on some, fp16 overflow, accumulation, placements that
// step on the host and on the device, and an iteration that leaves its trace.
#include <chunkstar/disk/disk_copy_engine.hpp>
#include <chunkstar/disk/disk_space.hpp>
#include <chunkstar/disk/disk_tier.hpp>
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/placement/static_placement.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>
#include <chunkstar/runtime/early_step_plan.hpp>

#include "support/disk_test_dir.hpp"
#include "support/runtimes.hpp"

#include <doctest/doctest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <future>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using namespace chunkstar;

namespace early_step_test {

namespace {

// --- the plan ----------------------------------------------------------------------------------

/** A trace of scopes: forward over @p fwd (param chunk per moment), backward over @p bwd (param
 *  and grad chunk per moment), then one optimizer moment per chunk. */
sharding_trace trace(const std::vector<std::vector<std::uint32_t>>& fwd,
                     const std::vector<std::vector<std::uint32_t>>& bwd, std::size_t chunks) {
  sharding_trace t;
  for (const auto& p : fwd) {
    t.kinds.push_back(moment_kind::forward);
    t.params.push_back(p);
    t.grads.emplace_back();
  }
  for (const auto& p : bwd) {
    t.kinds.push_back(moment_kind::backward);
    t.params.push_back(p);
    t.grads.push_back(p);
  }
  for (std::size_t c = 0; c < chunks; ++c) {
    t.kinds.push_back(moment_kind::optimizer);
    t.params.emplace_back();
    t.grads.emplace_back();
  }
  return t;
}

std::vector<std::vector<std::uint32_t>> planned(const early_step_plan& p) { return p.after; }

}  // namespace

TEST_CASE("plan_early_steps: after the last use of a chunk's gradient and weights, host steps only, within budget") {
  using V = std::vector<std::vector<std::uint32_t>>;
  const auto host4 = std::vector<tier>(4, tier::host);
  // Forward 0,1,2,3; backward 3,2,1,0 at moments 4..7. Chunk 0's last use is the last moment
  // before the step: it starts there too (on the worker, so the step returns at once and the next
  // forward waits for that chunk alone).
  const auto t = trace({{0}, {1}, {2}, {3}}, {{3}, {2}, {1}, {0}}, 4);
  CHECK(planned(plan_early_steps(t, {.step_tier = host4})) == V{{}, {}, {}, {}, {3}, {2}, {1}, {0}});
  // A chunk stepped on the device is left to the step.
  CHECK(planned(plan_early_steps(t, {.step_tier = {tier::host, tier::device, tier::host, tier::device}})) ==
        V{{}, {}, {}, {}, {}, {2}, {}, {0}});
  // The kept state's budget: two chunks' worth, earliest ready first.
  CHECK(planned(plan_early_steps(t, {.step_tier = host4, .kept_bytes_per_chunk = 10, .kept_budget = 25})) ==
        V{{}, {}, {}, {}, {3}, {2}, {}, {}});
  // A tied weight (chunk 0 in the first forward scope and the last): its weights are read again by
  // the last backward scope, so chunk 0 waits although its gradient was final earlier.
  const auto tied = trace({{0}, {1}, {0}}, {{0}, {1}, {0}}, 2);
  CHECK(planned(plan_early_steps(tied, {.step_tier = {tier::host, tier::host}})) == V{{}, {}, {}, {}, {1}, {0}});
  // Two micro-batches: nothing is final before the second's backward.
  sharding_trace two = trace({{0}, {1}}, {{1}, {0}}, 0);
  const sharding_trace second = trace({{0}, {1}}, {{1}, {0}}, 2);
  two.kinds.insert(two.kinds.end(), second.kinds.begin(), second.kinds.end());
  two.params.insert(two.params.end(), second.params.begin(), second.params.end());
  two.grads.insert(two.grads.end(), second.grads.begin(), second.grads.end());
  CHECK(planned(plan_early_steps(two, {.step_tier = {tier::host, tier::host}})) == V{{}, {}, {}, {}, {}, {}, {1}, {0}});
  // A chunk whose gradient the iteration never writes (frozen, chunk 1) is not stepped early.
  const auto frozen = trace({{0}, {1}}, {{0}}, 2);
  CHECK(planned(plan_early_steps(frozen, {.step_tier = {tier::host, tier::host}})) == V{{}, {}, {0}});
}

TEST_CASE("plan_early_steps under ZeRO: this rank's chunks only, a group's chunks used as one") {
  using V = std::vector<std::vector<std::uint32_t>>;
  // Six chunks, forward 0..5, backward 5..0 at moments 6..11.
  const auto t = trace({{0}, {1}, {2}, {3}, {4}, {5}}, {{5}, {4}, {3}, {2}, {1}, {0}}, 6);
  // Rank 1 of 2 owns 1, 3, 5 (the others step on rank 0: remote here).
  const std::vector<tier> odd = {tier::remote, tier::host, tier::remote, tier::host, tier::remote, tier::host};
  // The memory-saving mode: each chunk on its own, after its own backward scope.
  CHECK(planned(plan_early_steps(t, {.step_tier = odd})) == V{{}, {}, {}, {}, {}, {}, {5}, {}, {3}, {}, {1}, {}});
  // The group mode, groups {0,1}, {2,3}, {4,5}: chunk 5 is sent by the gather of 4 and reduced
  // with it, so it waits for 4's backward (moment 7); chunk 1's group ends with the last scope.
  CHECK(planned(plan_early_steps(t, {.step_tier = odd, .together = 2})) ==
        V{{}, {}, {}, {}, {}, {}, {}, {5}, {}, {3}, {}, {1}});
  // Rank 1 of 3 owns 1 and 4; groups {0,1,2}, {3,4,5}: chunk 4 waits for 3's backward (moment 8).
  const std::vector<tier> rank1 = {tier::remote, tier::host, tier::remote, tier::remote, tier::host, tier::remote};
  CHECK(planned(plan_early_steps(t, {.step_tier = rank1, .together = 3})) ==
        V{{}, {}, {}, {}, {}, {}, {}, {}, {4}, {}, {}, {1}});
}

TEST_CASE(
    "early_update_threads: every core once the step has begun, where the load needs it or while chunks wait for room, "
    "else all but one; before the load is known, every core while updates wait behind this one") {
  using enum early_load;
  CHECK(early_update_threads(16, 0, 0, false, fits) == 15);     // the worker keeps up: the queuing thread keeps a core
  CHECK(early_update_threads(16, 3, 0, false, fits) == 15);     // a backlog 15 threads clear in time
  CHECK(early_update_threads(16, 0, 0, false, exceeds) == 16);  // 15 threads do not carry the iteration's updates
  CHECK(early_update_threads(16, 0, 2, false, fits) == 16);     // chunks due wait for this update's room
  CHECK(early_update_threads(16, 0, 0, true, fits) == 16);      // after the step: the next forward waits for this one
  CHECK(early_update_threads(16, 0, 0, false, unknown) == 15);  // not measured yet: the backlog decides
  CHECK(early_update_threads(16, 3, 0, false, unknown) == 16);  // behind: the next forward will wait for these
  CHECK(early_update_threads(16, 0, 1, false, unknown) == 16);
  CHECK(early_update_threads(2, 0, 0, false, fits) == 1);
  CHECK(early_update_threads(2, 1, 0, false, fits) == 1);
  CHECK(early_update_threads(2, 1, 0, false, unknown) == 2);
  CHECK(early_update_threads(2, 0, 0, false, exceeds) == 2);
  CHECK(early_update_threads(2, 0, 1, false, fits) == 2);
  CHECK(early_update_threads(1, 5, 5, true, exceeds) == 1);
  CHECK(early_update_threads(0, 0, 0, false, fits) == 1);  // not known
  CHECK(early_update_threads(0, 2, 2, true, exceeds) == 1);
}

TEST_CASE(
    "early_load_of: an iteration's update thread-seconds against its time, less its waits, on all threads but one") {
  using enum early_load;
  CHECK(early_load_of(0.9, 1.0, 2) == fits);     // one thread of two: 0.9 s of updates in 1 s of the iteration's own
  CHECK(early_load_of(1.0, 1.0, 2) == fits);     // exactly
  CHECK(early_load_of(1.1, 1.0, 2) == exceeds);  // the worker falls behind on one thread
  CHECK(early_load_of(14.0, 1.0, 16) == fits);   // 15 threads carry 14 thread-seconds a second
  CHECK(early_load_of(15.5, 1.0, 16) == exceeds);
  CHECK(early_load_of(0.9, 1.0, 1) == fits);        // one hardware thread: it is the worker's
  CHECK(early_load_of(0.9, 1.0, 0) == fits);        // not known: counts as one
  CHECK(early_load_of(0.1, 0.0, 2) == exceeds);     // the iteration only waited for its updates
  CHECK(early_load_of(0.1, -0.001, 2) == exceeds);  // (clock steps)
  CHECK(early_load_of(0.0, 0.0, 2) == fits);
}

TEST_CASE(
    "order_due_updates: inside backward, finished gradients first; then, and at the step alone, the next forward's "
    "first") {
  // Backward closed chunk 7's scope, then 4's, then 2's (the device is still computing 2's and 4's);
  // chunk 5 waited from before for room. The next forward reads chunk c at moment c.
  const auto next_use = [](std::uint32_t c) { return std::size_t{c}; };
  const auto computed = [](std::uint32_t c) { return c == 7 || c == 5; };
  std::vector<std::uint32_t> due{7, 4, 5, 2};
  order_due_updates(due, next_use, computed, false);
  CHECK(due == std::vector<std::uint32_t>{5, 7, 2, 4});
  due = {7, 4, 5, 2};
  order_due_updates(due, next_use, computed, true);
  CHECK(due == std::vector<std::uint32_t>{2, 4, 5, 7});
  // Nothing computed yet, or everything (a host platform: its handles are ready): next use alone.
  const auto none = [](std::uint32_t) { return false; };
  const auto all = [](std::uint32_t) { return true; };
  for (const bool at_step : {false, true}) {
    due = {7, 4, 5, 2};
    order_due_updates(due, next_use, none, at_step);
    CHECK(due == std::vector<std::uint32_t>{2, 4, 5, 7});
    due = {7, 4, 5, 2};
    order_due_updates(due, next_use, all, at_step);
    CHECK(due == std::vector<std::uint32_t>{2, 4, 5, 7});
  }
  // Equal next uses (a chunk read twice, never) keep the order they became due in.
  const auto same = [](std::uint32_t) { return std::size_t{1}; };
  due = {9, 3, 8};
  const auto not_3 = [](std::uint32_t c) { return c != 3; };
  order_due_updates(due, same, not_3, false);
  CHECK(due == std::vector<std::uint32_t>{9, 8, 3});
  due.clear();
  order_due_updates(due, next_use, computed, false);
  CHECK(due.empty());
}

TEST_CASE("speculation_advised: always when nothing can undo the step, else after a clean step") {
  CHECK(speculation_advised(false, true, true));
  CHECK(speculation_advised(true, false, false));
  CHECK_FALSE(speculation_advised(true, true, false));
  CHECK_FALSE(speculation_advised(true, false, true));
}

// --- the bits ----------------------------------------------------------------------------------

namespace {

using rt_t = chunk_runtime<fixed_chunk_layout, static_placement>;
constexpr int tensors = 6;

struct run_options {
  dtype type = dtype::f32;
  static_placement placement = static_placement::all_host();
  float max_grad_norm = 0;
  int micro_batches = 1;
  bool prepare = false;
  int steps = 6;
  std::vector<float> grad_scale = {};  // per step (default 1): the norm each step sees
  int overflow_at = -1;                // a step whose gradients hold an inf (fp16)
  int extra_from = -1;                 // from this step on, backward uses tensor 5 again at its end
  std::size_t host_blocks = 0;         // > 0: a disk tier under a host of this many chunk lists
  float step_lr_factor = 1.0f;         // step() gets prepare()'s lr times this
};

struct result {
  std::vector<std::vector<float>> lists;  // param, master (16-bit), m, v of every tensor
  std::vector<optimizer_step_result> steps;
  std::uint64_t early_steps = 0;
};

template <class T, class Scaler>
result train(const run_options& o, Scaler scaler) {
  constexpr std::size_t elems = 512;
  simulated_device_space dev({.capacity = 1 << 22});
  host_space host(o.host_blocks == 0
                      ? host_space_options{}
                      : host_space_options{
                            .capacity = (runtime_options{}.disk_staging_chunks + o.host_blocks) * elems * sizeof(float),
                            .large_block_threshold = SIZE_MAX});
  host_copy_engine copier;
  chunkstar::test::scratch_dir dir;
  disk_space disk({.directory = dir.path(), .capacity = 64 * elems * sizeof(float), .name = "early"});
  disk_copy_engine disk_io(disk);
  rt_t rt(dev, host, copier, {.param_type = o.type}, fixed_chunk_layout({.chunk_elems = elems, .align_elems = 32}),
          o.placement);
  if (o.host_blocks > 0) rt.attach_disk(disk_tier(disk, disk_io));
  std::vector<param_id> ids;
  const std::int64_t sizes[tensors] = {300, 200, 37, 400, 120, 90};
  for (int i = 0; i < tensors; ++i)
    ids.push_back(rt.register_param(
        {"t" + std::to_string(i), {sizes[i]}, o.type, i % 2 ? tensor_role::bias : tensor_role::weight},
        [i](std::span<float> v) {
          for (std::size_t k = 0; k < v.size(); ++k)
            v[k] = std::sin(0.1f * static_cast<float>(k) + static_cast<float>(i));
        }));
  rt.finalize();
  chunk_adam<Scaler> opt({.hyper = {.weight_decay = 0.01f}, .max_grad_norm = o.max_grad_norm},
                         param_groups::with_default_decay(0.01f), std::move(scaler));
  result out;
  for (int s = 0; s < o.steps; ++s) {
    const float lr = 1e-2f * static_cast<float>(s + 1) / static_cast<float>(o.steps);
    if (o.prepare) (void)opt.prepare(rt, lr, o.micro_batches);
    const float g_scale = s < static_cast<int>(o.grad_scale.size()) ? o.grad_scale[s] : 1.0f;
    for (int mb = 0; mb < o.micro_batches; ++mb) {
      for (int i = 0; i < tensors; ++i) (void)rt.forward("f" + std::to_string(i), {ids[i]});
      const auto backward = [&](int i, const std::string& name, bool inf) {
        auto sc = rt.backward(name, {ids[i]});
        auto g = sc.template grad<T>(ids[i]);
        for (std::size_t k = 0; k < g.size(); ++k)
          g[k] = from_float<T>(to_float(g[k]) +
                               opt.loss_scale() * g_scale * 0.2f *
                                   std::cos(0.37f * static_cast<float>(k) + static_cast<float>(i + 3 * s + 7 * mb)));
        if (inf) g[1] = from_float<T>(std::numeric_limits<float>::infinity());
      };
      for (int i = tensors - 1; i >= 0; --i) backward(i, "b" + std::to_string(i), s == o.overflow_at && i == 2);
      if (o.extra_from >= 0 && s >= o.extra_from) backward(5, "extra", false);  // after its step may have started
    }
    out.steps.push_back(opt.step(rt, lr * o.step_lr_factor, o.micro_batches));
  }
  for (auto k : {chunk_kind::param, chunk_kind::master, chunk_kind::momentum, chunk_kind::variance}) {
    if (!rt.has_list(k)) continue;
    for (auto id : ids) {
      std::vector<float> v(rt.spec(id).numel());
      rt.read_tensor(id, k, v);
      out.lists.push_back(v);
    }
  }
  out.early_steps = rt.stats().early_steps;
  return out;
}

/** Two fp32 weights of one chunk each, stepped on the host: the runtime of the hand-stepped cases. */
struct two_weights {
  simulated_device_space dev{{.capacity = 1 << 22}};
  host_space host;
  host_copy_engine copier;
  rt_t rt{
      dev, host, copier, {}, fixed_chunk_layout({.chunk_elems = 512, .align_elems = 32}), static_placement::all_host()};
  param_id a, b;
  explicit two_weights(param_initializer init_a = {})
      : a(rt.register_param({"a", {300}, dtype::f32, tensor_role::weight}, std::move(init_a))),
        b(rt.register_param({"b", {300}, dtype::f32, tensor_role::weight})) {
    rt.finalize();
  }
  /** Forward a, b; backward b, a: opening a's backward starts b's update (nothing uses b again). */
  void iteration() {
    { auto f = rt.forward("fa", {a}); }
    { auto f = rt.forward("fb", {b}); }
    { auto g = rt.backward("bb", {b}); }
    { auto g = rt.backward("ba", {a}); }
  }
  /** One iteration and a step that changes nothing: the trace the early steps plan from. */
  void record_trace() {
    iteration();
    rt.step([](const step_chunk&) {});
  }
};

template <class T, class Scaler = static_loss_scaler>
void same_bits(run_options o, Scaler scaler = Scaler{}) {
  o.prepare = false;
  const result plain = train<T>(o, scaler);
  o.prepare = true;
  const result early = train<T>(o, scaler);
  REQUIRE(plain.lists.size() == early.lists.size());
  for (std::size_t l = 0; l < plain.lists.size(); ++l) {
    CAPTURE(l);
    CHECK(plain.lists[l] == early.lists[l]);
  }
  for (std::size_t s = 0; s < plain.steps.size(); ++s) {
    CAPTURE(s);
    CHECK(plain.steps[s].stepped == early.steps[s].stepped);
    CHECK(plain.steps[s].grad_norm == early.steps[s].grad_norm);  // scanned in the update where it spends its gradient
    CHECK(plain.steps[s].clip_coefficient == early.steps[s].clip_coefficient);
  }
}

}  // namespace

TEST_CASE("early steps: the bits of the plain step in fp32 and bf16, on the host, without clipping") {
  for (dtype t : {dtype::f32, dtype::bf16}) {
    CAPTURE(dtype_name(t));
    run_options o{.type = t};
    if (t == dtype::f32) same_bits<float>(o);
    else same_bits<bfloat16>(o);
    o.prepare = true;
    const result r = t == dtype::f32 ? train<float>(o, static_loss_scaler{}) : train<bfloat16>(o, static_loss_scaler{});
    // The first iteration records the trace; from the second every chunk but the last backward
    // scope's steps inside backward, and nothing can undo it, so nothing is kept or redone.
    CHECK(r.steps[0].early_steps == 0);
    for (std::size_t s = 1; s < r.steps.size(); ++s) {
      CHECK(r.steps[s].early_steps > 0);
      CHECK_FALSE(r.steps[s].early_redone);
    }
    CHECK(r.early_steps > 0);
  }
}

TEST_CASE("early steps: clipping never active, always active, and on some steps (kept, then redone)") {
  SUBCASE("never") { same_bits<float>({.max_grad_norm = 1e6f}); }
  SUBCASE("always") { same_bits<float>({.max_grad_norm = 1e-3f}); }
  SUBCASE("some: a speculated step that clips is undone and redone") {
    const run_options o{
        .max_grad_norm = 5.0f, .steps = 8, .grad_scale = {0.1f, 0.1f, 0.1f, 10.f, 0.1f, 0.1f, 10.f, 0.1f}};
    same_bits<float>(o);
    run_options p = o;
    p.prepare = true;
    const result r = train<float>(p, static_loss_scaler{});
    CHECK(r.steps[3].clip_coefficient < 1.0f);
    CHECK(r.steps[3].early_steps > 0);   // speculated after a clean step ...
    CHECK(r.steps[3].early_redone);      // ... clipped, so redone
    CHECK(r.steps[4].early_steps == 0);  // after a clipped step: not speculated
    CHECK(r.steps[5].early_steps > 0);
    CHECK_FALSE(r.steps[5].early_redone);
  }
  SUBCASE("bf16, some") {
    same_bits<bfloat16>({.type = dtype::bf16, .max_grad_norm = 5.0f, .steps = 5, .grad_scale = {0.1f, 0.1f, 10.f}});
  }
}

TEST_CASE("early steps below a disk tier: updates carried over to the next forward take the step's true arguments") {
  // A host with room for one update's lists at most: the chunks due at the step are carried over
  // to the next forward, none (or few) started inside backward. Where the step clips, or its lr is
  // not prepare()'s, what runs later must be the plain step's update, not the speculated one.
  for (std::size_t blocks : {std::size_t{8}, std::size_t{10}, std::size_t{12}, std::size_t{16}}) {
    CAPTURE(blocks);
    SUBCASE("clipping on some steps") {
      const run_options o{.max_grad_norm = 5.0f,
                          .steps = 8,
                          .grad_scale = {0.1f, 0.1f, 0.1f, 10.f, 0.1f, 0.1f, 10.f, 0.1f},
                          .host_blocks = blocks};
      same_bits<float>(o);
      run_options p = o;
      p.prepare = true;
      const result r = train<float>(p, static_loss_scaler{});
      CHECK(r.steps[3].clip_coefficient < 1.0f);                       // speculated after a clean step, then clipped:
      CHECK(r.steps[3].early_redone == (r.steps[3].early_steps > 0));  // those started redone,
      CHECK(r.steps[3].carried_steps == 0);                            // none carried over
      std::size_t carried = 0;
      for (const auto& step : r.steps) carried += step.carried_steps;
      CHECK(carried > 0);  // on the clean steps the speculated updates were carried over
    }
    SUBCASE("step() with another lr than prepare()'s, clipping kept what undoes it") {
      same_bits<float>({.max_grad_norm = 1e6f, .host_blocks = blocks, .step_lr_factor = 2.0f});
    }
    SUBCASE("an fp16 overflow on a step whose updates were carried over") {
      same_bits<float16>({.type = dtype::f16, .steps = 6, .overflow_at = 3, .host_blocks = blocks},
                         dynamic_loss_scaler({.init_scale = 1024.0f, .growth_interval = 100}));
    }
  }
}

TEST_CASE("early steps: an fp16 overflow undoes the speculated chunks and skips the step") {
  const run_options o{.type = dtype::f16, .steps = 6, .overflow_at = 3};
  same_bits<float16>(o, dynamic_loss_scaler({.init_scale = 1024.0f, .growth_interval = 100}));
  run_options p = o;
  p.prepare = true;
  const result r = train<float16>(p, dynamic_loss_scaler({.init_scale = 1024.0f, .growth_interval = 100}));
  CHECK_FALSE(r.steps[3].stepped);
  CHECK(r.steps[3].early_steps > 0);
  CHECK(r.steps[3].early_redone);
  CHECK(r.steps[4].early_steps == 0);  // after an overflow: not speculated
}

TEST_CASE("early steps: accumulation over micro-batches, placements, and a budget for what is kept") {
  SUBCASE("two micro-batches") { same_bits<float>({.max_grad_norm = 3.0f, .micro_batches = 2}); }
  SUBCASE("a fraction on the host") { same_bits<float>({.placement = static_placement::fraction(0.4)}); }
  SUBCASE("everything on the device: nothing steps early") {
    run_options o{.placement = static_placement::all_device(), .prepare = true};
    same_bits<float>(o);
    CHECK(train<float>(o, static_loss_scaler{}).early_steps == 0);
  }
}

TEST_CASE("early steps: an iteration that leaves its trace has the chunk undone, or is refused") {
  // With clipping the state is kept: a later scope that uses a chunk stepped early gets it undone
  // first, and the step redoes it — the bits of the plain run with the same extra scope. From the
  // next iteration on the trace has the extra scope, and the chunk waits for it.
  same_bits<float>({.max_grad_norm = 1e6f, .steps = 5, .extra_from = 2});
  // Always there: in the trace from the first iteration.
  same_bits<float>({.max_grad_norm = 0, .steps = 4, .extra_from = 0});
  // Without anything kept (no clipping, a static scale), the scope is refused with a state_error.
  two_weights w;
  auto& rt = w.rt;
  const param_id a = w.a, b = w.b;
  chunk_adam<> opt;
  for (int s = 0; s < 3; ++s) {
    CHECK(opt.prepare(rt, 1e-3f));  // armed; the first iteration (no trace yet) steps nothing early
    { auto f = rt.forward("fa", {a}); }
    { auto f = rt.forward("fb", {b}); }
    { auto g = rt.backward("bb", {b}); }
    { auto g = rt.backward("ba", {a}); }
    if (s == 2) {  // b's chunk stepped when "ba" opened; using it again is not the traced iteration
      CHECK(rt.stepped_early().size() == 1);
      CHECK_THROWS_AS((void)rt.backward("bb", {b}), state_error);
    }
    (void)opt.step(rt, 1e-3f);
  }
}

TEST_CASE("early steps: an iteration abandoned before its step (a throw in backward) leaves the state of before it") {
  // b's chunk steps early when "ba" opens; the user's backward then throws. The recovery the runtime
  // documents for an abandoned iteration, zero_grad() and end_iteration(), must take b's update back
  // where the speculation kept what undoes it (clipping on), and say so where it did not.
  const auto lists = [](rt_t& rt, param_id p) {
    std::vector<float> out;
    for (auto k : {chunk_kind::param, chunk_kind::momentum, chunk_kind::variance}) {
      std::vector<float> v(rt.spec(p).numel());
      rt.read_tensor(p, k, v);
      out.insert(out.end(), v.begin(), v.end());
    }
    return out;
  };
  const auto run = [&](float max_grad_norm) {
    two_weights w;
    auto& rt = w.rt;
    chunk_adam<> opt({.max_grad_norm = max_grad_norm});
    const auto iteration = [&](bool fail) {
      { auto f = rt.forward("fa", {w.a}); }
      { auto f = rt.forward("fb", {w.b}); }
      {
        auto g = rt.backward("bb", {w.b});
        for (auto& x : g.grad<float>(w.b)) x = 0.5f;
      }
      auto g = rt.backward("ba", {w.a});  // b's chunk steps early here
      for (auto& x : g.grad<float>(w.a)) x = 0.25f;
      if (fail) throw std::runtime_error("the user's backward failed");
    };
    for (int s = 0; s < 2; ++s) {  // the trace, then one clean speculated step
      (void)opt.prepare(rt, 1e-2f);
      iteration(false);
      (void)opt.step(rt, 1e-2f);
    }
    const std::vector<float> a0 = lists(rt, w.a), b0 = lists(rt, w.b);
    CHECK(opt.prepare(rt, 1e-2f));
    CHECK_THROWS_AS(iteration(true), std::runtime_error);
    CHECK(rt.stepped_early().size() == 1);
    // The next iteration's prepare() without ending this one would forget b's update: refused.
    CHECK_THROWS_WITH_AS(opt.prepare(rt, 1e-2f), doctest::Contains("await its step"), state_error);
    CHECK(rt.stepped_early().size() == 1);
    opt.abandon();
    struct outcome {
      bool a_same, b_same;
    } o{};
    if (max_grad_norm > 0) {
      rt.zero_grad();
      rt.end_iteration();
    } else {
      CHECK_THROWS_WITH_AS(rt.undo_early_steps(), doctest::Contains("cannot be undone"), state_error);
      rt.zero_grad();
      rt.end_iteration();
    }
    o.a_same = lists(rt, w.a) == a0;
    o.b_same = lists(rt, w.b) == b0;
    // Training goes on: the next iteration steps as usual.
    (void)opt.prepare(rt, 1e-2f);
    iteration(false);
    CHECK(opt.step(rt, 1e-2f).stepped);
    return o;
  };
  SUBCASE("clipping on: the early update is undone") {
    const auto o = run(1e6f);
    CHECK(o.a_same);
    CHECK(o.b_same);
  }
  SUBCASE("nothing kept: the update stands, and undo_early_steps() says why") {
    const auto o = run(0.0f);
    CHECK(o.a_same);
    CHECK_FALSE(o.b_same);
  }
}

TEST_CASE("early steps: step() with other arguments than prepare()'s is refused before it changes anything") {
  two_weights w([](std::span<float> v) {
    for (std::size_t k = 0; k < v.size(); ++k) v[k] = 0.01f * static_cast<float>(k);
  });
  auto& rt = w.rt;
  const param_id a = w.a, b = w.b;
  chunk_adam<> opt;  // no clipping, a static scale: nothing is kept, nothing can be undone
  for (int s = 0; s < 2; ++s) {
    (void)opt.prepare(rt, 1e-3f);
    { auto f = rt.forward("fa", {a}); }
    { auto f = rt.forward("fb", {b}); }
    for (const auto& [name, p] : {std::pair{"bb", b}, std::pair{"ba", a}}) {
      auto g = rt.backward(name, {p});
      for (auto& x : g.grad<float>(p)) x = 0.5f;
    }
    if (s == 1) {
      REQUIRE(rt.stepped_early().size() == 1);
      CHECK_THROWS_AS((void)opt.step(rt, 2e-3f), state_error);
      CHECK(opt.step_count() == 1);
    }
    CHECK(opt.step(rt, 1e-3f).stepped);
  }
  CHECK(opt.step_count() == 2);
}

TEST_CASE("early steps: an update kept as it is runs on after step() returns; a read waits for it") {
  two_weights w;
  auto& rt = w.rt;
  const param_id b = w.b;
  w.record_trace();
  std::promise<void> gate;
  std::atomic<int> ran{0};
  std::array<std::atomic<int>, 2> threads{};  // per chunk: a's is 0, b's is 1
  REQUIRE(rt.arm_early_steps({.update =
                                  [&ran, &threads, open = gate.get_future().share()](const step_chunk& c) {
                                    threads.at(c.index) = c.threads;  // the runtime's choice
                                    open.wait();
                                    static_cast<float*>(c.param)[0] = 42.0f;
                                    ++ran;
                                  },
                              .undo = {}}));
  w.iteration();
  CHECK(rt.stepped_early().size() == 1);
  // The gate opens once step() has returned, or after 2 s if it does not (a step that waited for
  // the update would then fail the check below instead of hanging).
  std::promise<void> returned;
  std::thread opener([&gate, done = returned.get_future()] {
    (void)done.wait_for(std::chrono::seconds(2));
    gate.set_value();
  });
  // Keeps b's update, still waiting on the gate, and queues a's (whose last use was the last scope)
  // behind it: the step waits for neither.
  rt.step([](const step_chunk&) {});
  CHECK(ran.load() == 0);
  CHECK(rt.stats().early_steps == 2);
  returned.set_value();
  std::vector<float> v(300);
  rt.read_tensor(b, chunk_kind::param, v);  // joins the update first
  opener.join();
  CHECK(ran.load() >= 1);  // b's; a's may have run too
  CHECK(v[0] == 42.0f);
  rt.read_tensor(w.a, chunk_kind::param, v);
  CHECK(ran.load() == 2);
  CHECK(v[0] == 42.0f);
  // a's was queued once the step had begun: every core. (b's started inside backward with nothing
  // behind it, or, on a worker slow to start, after the step too: either choice.)
  CHECK(threads[0].load() ==
        early_update_threads(std::thread::hardware_concurrency(), 0, 0, true, early_load::unknown));
  CHECK(threads[1].load() >=
        early_update_threads(std::thread::hardware_concurrency(), 0, 0, false, early_load::unknown));
  CHECK(rt.invariant_violations(true).empty());
}

TEST_CASE("early steps: where the last iteration's updates need every thread, an update takes them from the start") {
  two_weights w;
  auto& rt = w.rt;
  w.record_trace();
  // Each update takes 20 ms per hardware thread, whatever its threads: an iteration's updates
  // (thread-seconds) then exceed its time on all threads but one by far more than the test's own work.
  const unsigned hardware = std::thread::hardware_concurrency();
  const auto slow = std::chrono::milliseconds(20) * std::max(hardware, 1u);
  std::atomic<int> b_threads{-1}, b_started{0};
  for (int i = 0; i < 3; ++i) {
    REQUIRE(rt.arm_early_steps({.update =
                                    [&b_threads, &b_started, slow](const step_chunk& c) {
                                      if (c.index == 1) {
                                        b_threads = c.threads;
                                        ++b_started;
                                      }
                                      std::this_thread::sleep_for(slow);
                                    },
                                .undo = {}}));
    w.iteration();
    // The step begins once b's update has started (inside backward, then, whatever the worker's
    // latency): its threads are the load rule's alone.
    for (int wait = 0; b_started.load() <= i && wait < 5000; ++wait)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    REQUIRE(b_started.load() == i + 1);
    rt.step([](const step_chunk&) {});
  }
  std::vector<float> v(300);
  rt.read_tensor(w.b, chunk_kind::param, v);  // joins b's update
  // b's last update started inside backward with nothing behind it: all threads but one, were it
  // not for the iteration before, whose updates (20 ms x hardware each, thread-seconds) did not fit
  // all but one thread in the time it did not spend waiting for them.
  CHECK(b_threads.load() == early_update_threads(hardware, 0, 0, false, early_load::exceeds));
  rt.read_tensor(w.a, chunk_kind::param, v);
  CHECK(rt.invariant_violations(true).empty());
}

TEST_CASE("early steps: an update that fails reaches the caller, even when it fails while room is being made") {
  two_weights w;
  auto& rt = w.rt;
  const param_id b = w.b;
  w.record_trace();
  REQUIRE(rt.arm_early_steps({.update =
                                  [](const step_chunk& c) {
                                    static_cast<float*>(c.param)[0] = 7.0f;  // changed, then failed
                                    throw io_error("the early update failed");
                                  },
                              .undo = {}}));
  w.iteration();
  CHECK(rt.stepped_early().size() == 1);
  // Joined where it cannot throw (as when a host full below a disk tier needs the update's chunks),
  // the failure is kept ...
  CHECK_NOTHROW((void)rt.invariant_violations(true));
  // ... and surfaces at the runtime's next call that joins, never swallowed: the chunk was
  // changed, so nothing may pass it off as stepped.
  bool reported = false;
  try {
    rt.step([](const step_chunk&) {});
    std::vector<float> v(300);
    rt.read_tensor(b, chunk_kind::param, v);
  } catch (const io_error& e) {
    reported = std::string(e.what()).find("the early update failed") != std::string::npos;
  }
  CHECK(reported);
}

}  // namespace early_step_test
