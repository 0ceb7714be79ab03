// SPDX-License-Identifier: Apache-2.0
// Exception safety of the runtime: a throw injected from the copy engine, the eviction strategy,
// the placement policy or a memory allocation, at each stage of a scope and of step(), leaves no
// chunk pinned and the bookkeeping consistent, and training that retries the failed call continues
// with exactly the bits of a run without the fault.
#include <chunkstar/eviction/belady.hpp>
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/placement/auto_placement.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>

#include "support/runtimes.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <new>
#include <string>
#include <vector>

using namespace chunkstar;

namespace runtime_faults_test {

namespace {

/** The injected failure (what a real one would be: a device error, a failed allocation...). */
struct injected_fault : chunkstar::error {
  injected_fault() : chunkstar::error("injected fault") {}
};

/** Where faults come from, and when: the `at`-th call of source `armed` throws (0: never). */
enum class source { copy_engine, eviction, placement, allocation, count };
struct fault_plan {
  std::size_t calls[static_cast<int>(source::count)]{};
  source armed = source::copy_engine;
  std::size_t at = 0;
  std::size_t fired = 0;
  void tick(source s) {
    const auto n = ++calls[static_cast<int>(s)];
    if (s == armed && n == at) {
      ++fired;
      throw injected_fault();
    }
  }
};
fault_plan* plan = nullptr;  // the run's plan (tests run one at a time)
void tick(source s) {
  if (plan) plan->tick(s);
}

/** A copy engine that fails when told to, before doing anything. */
class faulty_copier {
 public:
  void copy(void* d, const void* s, std::size_t n, copy_direction dir) {
    tick(source::copy_engine);
    inner_.copy(d, s, n, dir);
  }
  host_copy_handle copy_async(void* d, const void* s, std::size_t n, copy_direction dir) {
    tick(source::copy_engine);
    return inner_.copy_async(d, s, n, dir);
  }
  host_copy_handle zero_async(void* d, std::size_t n) {
    tick(source::copy_engine);
    return inner_.zero_async(d, n);
  }
  void order_after(const host_copy_handle& h, copy_direction d) {
    tick(source::copy_engine);
    inner_.order_after(h, d);
  }
  void synchronize() { inner_.synchronize(); }
  [[nodiscard]] copy_stats stats() const { return inner_.stats(); }
  [[nodiscard]] host_copy_handle record(host_stream s) const noexcept { return inner_.record(s); }

 private:
  host_copy_engine inner_;
};
static_assert(CopyEngine<faulty_copier>);

/** A device space whose allocations fail (throw, as an allocator can) when told to. */
class faulty_space {
 public:
  static constexpr memory_kind kind = memory_kind::host;
  explicit faulty_space(std::size_t capacity) : inner_({.capacity = capacity}) {}
  void* allocate(std::size_t n, std::size_t a) {
    tick(source::allocation);
    return inner_.allocate(n, a);
  }
  void* try_allocate(std::size_t n, std::size_t a) {
    tick(source::allocation);
    return inner_.try_allocate(n, a);
  }
  void deallocate(void* p, std::size_t n, std::size_t a) noexcept { inner_.deallocate(p, n, a); }
  [[nodiscard]] std::size_t capacity() const { return inner_.capacity(); }
  [[nodiscard]] std::size_t used() const { return inner_.used(); }
  [[nodiscard]] space_usage usage() const { return inner_.usage(); }
  [[nodiscard]] std::string_view name() const { return "faulty device"; }

 private:
  simulated_device_space inner_;
};
static_assert(MemorySpace<faulty_space>);

struct faulty_eviction {
  static constexpr bool uses_trace = true;
  [[nodiscard]] std::size_t pick(std::span<const eviction_candidate> c) const {
    tick(source::eviction);
    return belady_eviction{}.pick(c);
  }
  [[nodiscard]] static constexpr std::string_view name() noexcept { return "faulty belady"; }
};
static_assert(EvictionStrategy<faulty_eviction>);

struct faulty_placement {
  [[nodiscard]] std::size_t chunk_budget(const placement_inputs& in) const {
    tick(source::placement);
    return auto_placement{}.chunk_budget(in);
  }
  [[nodiscard]] tier optimizer_tier(const placement_inputs& in, std::size_t c) const {
    tick(source::placement);
    return auto_placement{}.optimizer_tier(in, c);
  }
  [[nodiscard]] static constexpr std::string_view name() noexcept { return "faulty auto"; }
};
static_assert(PlacementPolicy<faulty_placement>);

}  // namespace

}  // namespace runtime_faults_test

template <>
inline constexpr bool chunkstar::can_access_v<chunkstar::host_exec, runtime_faults_test::faulty_space> = true;

namespace runtime_faults_test {

namespace {

using faulty_platform = platform<faulty_space, host_space, faulty_copier>;
using runtime_t = chunk_runtime<fixed_chunk_layout, faulty_placement, faulty_eviction, warmup_tracer,
                                single_process_communicator, faulty_platform>;

struct outcome {
  std::vector<float> params, momentum;
  std::uint64_t early_steps = 0;
  std::vector<double> losses;
  std::size_t faults = 0;
  std::size_t calls[static_cast<int>(source::count)]{};
};

/** Calls @p f until it does not throw an injected fault; after each fault the runtime must be
 *  consistent (nothing pinned outside open scopes, residency counters right). */
template <class F>
auto retry(runtime_t& rt, std::size_t& faults, F&& f) {
  for (;;) {
    try {
      return f();
    } catch (const injected_fault&) {
      ++faults;
      const auto v = rt.invariant_violations(/*sole_user=*/true);
      for (const auto& s : v) FAIL_CHECK(s);
    }
  }
}

/** A tanh MLP (L layers of width D) trained for `steps` with chunk_adam (clipping at
 *  @p max_grad_norm) under a device that holds about a third of the model data, so chunks move,
 *  prefetch and evict; with @p early, each step starts inside backward (chunk_adam::prepare). */
outcome train(fault_plan& fp, float max_grad_norm = 0.5f, bool early = false) {
  constexpr int L = 5, D = 16, B = 4, steps = 4;
  plan = &fp;
  struct reset_plan {
    ~reset_plan() { plan = nullptr; }
  } reset;
  outcome out;
  const std::size_t act = static_cast<std::size_t>(B * D) * sizeof(float);
  faulty_space dev(static_cast<std::size_t>(L + 3) * act + 7 * 512 * sizeof(float));  // 7 of the 20 chunks
  host_space host;
  faulty_copier copier;
  runtime_t rt(dev, host, copier, {.prefetch_depth = 2}, fixed_chunk_layout({.chunk_elems = 512, .align_elems = 32}));
  std::vector<param_id> w, b;
  for (int l = 0; l < L; ++l) {
    w.push_back(
        rt.register_param({"w" + std::to_string(l), {D, D}, dtype::f32, tensor_role::weight}, [l](std::span<float> v) {
          for (std::size_t i = 0; i < v.size(); ++i)
            v[i] = 0.3f * std::sin(0.7f * static_cast<float>(i) + static_cast<float>(l));
        }));
    b.push_back(rt.register_param({"b" + std::to_string(l), {D}, dtype::f32, tensor_role::bias}));
  }
  retry(rt, out.faults, [&] { rt.finalize(); });
  chunk_adam<> opt({.hyper = {.lr = 1e-2f, .weight_decay = 0.01f}, .max_grad_norm = max_grad_norm},
                   param_groups::with_default_decay(0.01f));
  const auto alloc = [&] {
    return static_cast<float*>(retry(rt, out.faults, [&] { return rt.allocate_non_model(act); }));
  };

  for (int step = 1; step <= steps; ++step) {
    if (early) (void)opt.prepare(rt, 1e-2f);
    std::vector<float*> h;
    for (int l = 0; l <= L; ++l) h.push_back(alloc());
    for (int i = 0; i < B * D; ++i) h[0][i] = std::cos(0.3f * static_cast<float>(i + step));
    for (int l = 0; l < L; ++l) {
      auto s = retry(rt, out.faults, [&] { return rt.forward("l" + std::to_string(l), {w[l], b[l]}); });
      const auto W = s.param<float>(w[l]);
      const auto bias = s.param<float>(b[l]);
      for (int n = 0; n < B; ++n)
        for (int o = 0; o < D; ++o) {
          float acc = bias[o];
          for (int i = 0; i < D; ++i) acc += W[o * D + i] * h[l][n * D + i];
          h[l + 1][n * D + o] = std::tanh(acc);
        }
    }
    float* dh = alloc();
    float* dprev = alloc();
    double loss = 0;
    for (int i = 0; i < B * D; ++i) {
      const float d = h[L][i] - 0.25f;
      loss += 0.5 * d * d;
      dh[i] = d / B;
    }
    out.losses.push_back(loss);
    for (int l = L - 1; l >= 0; --l) {
      auto s = retry(rt, out.faults, [&] { return rt.backward("l" + std::to_string(l), {w[l], b[l]}); });
      const auto W = s.param<float>(w[l]);
      auto gW = s.grad<float>(w[l]);
      auto gb = s.grad<float>(b[l]);
      for (int i = 0; i < B * D; ++i) dh[i] *= 1.0f - h[l + 1][i] * h[l + 1][i];
      for (int n = 0; n < B; ++n)
        for (int o = 0; o < D; ++o) {
          gb[o] += dh[n * D + o];
          for (int i = 0; i < D; ++i) gW[o * D + i] += dh[n * D + o] * h[l][n * D + i];
        }
      for (int n = 0; n < B; ++n)
        for (int i = 0; i < D; ++i) {
          float acc = 0;
          for (int o = 0; o < D; ++o) acc += W[o * D + i] * dh[n * D + o];
          dprev[n * D + i] = acc;
        }
      std::swap(dh, dprev);
    }
    rt.deallocate_non_model(dh, act);
    rt.deallocate_non_model(dprev, act);
    for (auto* p : h) rt.deallocate_non_model(p, act);
    const auto r = retry(rt, out.faults, [&] { return opt.step(rt, 1e-2f); });
    CHECK(r.stepped);
    CHECK(rt.invariant_violations(true).empty());
  }
  for (std::size_t t = 0; t < rt.params().size(); ++t) {
    std::vector<float> v(rt.params()[t].numel());
    rt.read_tensor(param_id{static_cast<std::uint32_t>(t)}, chunk_kind::param, v);
    out.params.insert(out.params.end(), v.begin(), v.end());
    rt.read_tensor(param_id{static_cast<std::uint32_t>(t)}, chunk_kind::momentum, v);
    out.momentum.insert(out.momentum.end(), v.begin(), v.end());
  }
  CHECK(rt.stats().bytes_to_host > 0);  // the budget made chunks move (so faults hit real moves)
  if (early) out.early_steps = rt.stats().early_steps;
  for (int s = 0; s < static_cast<int>(source::count); ++s) out.calls[s] = fp.calls[s];
  return out;
}

}  // namespace

TEST_CASE(
    "a throw from the copy engine, the eviction, the placement or an allocation at any call: same bits after "
    "retrying") {
  fault_plan none;
  const outcome reference = train(none);
  REQUIRE(reference.faults == 0);
  const char* names[] = {"copy engine", "eviction", "placement", "allocation"};
  for (int s = 0; s < static_cast<int>(source::count); ++s) {
    const std::size_t total = reference.calls[s];
    CAPTURE(names[s]);
    CAPTURE(total);
    REQUIRE(total > 0);
    // Every call for small counts, an even spread (including the last) for large ones.
    const std::size_t stride = std::max<std::size_t>(1, total / 60);
    std::size_t fired = 0;
    for (std::size_t at = 1; at <= total; at += (at + stride > total && at != total) ? total - at : stride) {
      CAPTURE(at);
      fault_plan fp;
      fp.armed = static_cast<source>(s);
      fp.at = at;
      const outcome o = train(fp);
      fired += fp.fired;
      CHECK(o.losses == reference.losses);
      CHECK(o.params == reference.params);
      CHECK(o.momentum == reference.momentum);
    }
    CHECK(fired > 0);
  }
}

TEST_CASE(
    "with the step inside backward (no clipping, and clipping that never bites), a throw at any call: the bits of "
    "the run without prepare()") {
  for (const float max_norm : {0.0f, 1e6f}) {
    CAPTURE(max_norm);
    fault_plan none;
    const outcome reference = train(none, max_norm, false);
    fault_plan none_early;
    const outcome early = train(none_early, max_norm, true);
    REQUIRE(early.early_steps > 0);
    CHECK(early.params == reference.params);
    CHECK(early.momentum == reference.momentum);
    for (int s = 0; s < static_cast<int>(source::count); ++s) {
      const std::size_t total = none_early.calls[s];
      CAPTURE(s);
      const std::size_t stride = std::max<std::size_t>(1, total / 30);
      std::size_t fired = 0;
      for (std::size_t at = 1; at <= total; at += stride) {
        CAPTURE(at);
        fault_plan fp;
        fp.armed = static_cast<source>(s);
        fp.at = at;
        const outcome o = train(fp, max_norm, true);
        fired += fp.fired;
        CHECK(o.losses == reference.losses);
        CHECK(o.params == reference.params);
        CHECK(o.momentum == reference.momentum);
      }
      CHECK(fired > 0);
    }
  }
}

TEST_CASE("a throw from inside the optimizer's update: step() called again finishes it, each chunk updated once") {
  // Fail the update of the third chunk index once, then retry the step.
  simulated_device_space dev({.capacity = 1 << 22});
  host_space host;
  host_copy_engine copier;
  chunk_runtime<fixed_chunk_layout> rt(dev, host, copier, {},
                                       fixed_chunk_layout({.chunk_elems = 64, .align_elems = 32}));
  std::vector<param_id> ids;
  for (int i = 0; i < 5; ++i)
    ids.push_back(rt.register_param({"t" + std::to_string(i), {64}, dtype::f32, tensor_role::weight}));
  rt.finalize();
  for (auto id : ids) {
    auto s = rt.backward("t", {id});
    for (float& g : s.grad<float>(id)) g = 1.0f;
  }
  int calls = 0;
  auto update = [&](const step_chunk& c) {
    if (++calls == 3) throw injected_fault();
    for (auto t : c.tensors)
      for (std::size_t i = 0; i < c.slots[t].numel; ++i) static_cast<float*>(c.param)[c.slots[t].offset + i] += 1.0f;
  };
  CHECK_THROWS_AS(rt.step(update), injected_fault);
  CHECK(rt.step_in_progress());
  CHECK(rt.invariant_violations().empty());
  rt.step(update);
  CHECK(!rt.step_in_progress());
  for (auto id : ids) {
    std::vector<float> v(64);
    rt.read_tensor(id, chunk_kind::param, v);
    CHECK(v[0] == 1.0f);  // exactly one update each
    CHECK(rt.where({chunk_kind::grad, static_cast<std::uint32_t>(id.value)}) == tier::free);
  }
}

}  // namespace runtime_faults_test
