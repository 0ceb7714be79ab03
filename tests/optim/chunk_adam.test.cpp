// SPDX-License-Identifier: Apache-2.0
// chunk_adam over the runtime: float64 reference, same bits across placements, overflow skipping,
// clipping, parameter groups, gradient accumulation.
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/placement/static_placement.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>

#include "support/runtimes.hpp"
#include "support/scripted_copy_engine.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <vector>

using namespace chunkstar;

namespace chunk_adam_test {

namespace {

using rt_static = chunk_runtime<fixed_chunk_layout, static_placement>;

struct setup {
  simulated_device_space dev{{.capacity = 1 << 22}};
  host_space host;
  host_copy_engine copier;
  rt_static rt;
  std::vector<param_id> ids;
  setup(dtype t, static_placement p)
      : rt(dev, host, copier, {.param_type = t}, fixed_chunk_layout({.chunk_elems = 1024, .align_elems = 32}), p) {
    const std::int64_t sizes[] = {300, 37, 700, 5};
    const tensor_role roles[] = {tensor_role::weight, tensor_role::bias, tensor_role::weight, tensor_role::norm};
    for (int i = 0; i < 4; ++i)
      ids.push_back(rt.register_param({"t" + std::to_string(i), {sizes[i]}, t, roles[i]}, [i](std::span<float> v) {
        for (std::size_t k = 0; k < v.size(); ++k)
          v[k] = std::sin(0.1f * static_cast<float>(k) + static_cast<float>(i));
      }));
    rt.finalize();
  }
  // Gradient of element k of tensor i at step s (micro-batch mb): deterministic, varied signs.
  static float grad_value(int i, std::size_t k, int s, int mb) {
    return std::cos(0.37f * static_cast<float>(k) + static_cast<float>(i + 3 * s + 7 * mb)) * 0.5f;
  }
  template <class T>
  void backward(int s, int mb, float scale, bool inject_inf = false) {
    for (int i = 0; i < 4; ++i) {
      auto sc = rt.backward("t" + std::to_string(i), {ids[static_cast<std::size_t>(i)]});
      auto g = sc.template grad<T>(ids[static_cast<std::size_t>(i)]);
      for (std::size_t k = 0; k < g.size(); ++k) g[k] = from_float<T>(to_float(g[k]) + grad_value(i, k, s, mb) * scale);
      if (inject_inf && i == 2) g[5] = from_float<T>(std::numeric_limits<float>::infinity());
    }
  }
  std::vector<float> values(chunk_kind k = chunk_kind::param) {
    std::vector<float> all;
    for (auto id : ids) {
      std::vector<float> v(rt.spec(id).numel());
      rt.read_tensor(id, k, v);
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  }
};

}  // namespace

TEST_CASE("chunk_adam matches a float64 AdamW reference and is placement-independent") {
  constexpr int steps = 5, accum = 2;
  const float lr = 1e-2f, wd = 0.1f, max_norm = 0.5f;
  std::vector<std::vector<float>> results;
  for (auto placement :
       {static_placement::all_device(), static_placement::all_host(), static_placement::fraction(0.5)}) {
    setup s(dtype::f32, placement);
    chunk_adam<> opt({.hyper = {.weight_decay = wd}, .max_grad_norm = max_norm}, param_groups::with_default_decay(wd));
    for (int st = 0; st < steps; ++st) {
      for (int mb = 0; mb < accum; ++mb) s.backward<float>(st, mb, 1.0f);
      const auto r = opt.step(s.rt, lr, accum);
      CHECK(r.stepped);
    }
    results.push_back(s.values());
  }
  CHECK(results[0] == results[1]);  // bitwise, whatever tier ran the step
  CHECK(results[0] == results[2]);

  // Independent float64 reference: averaged micro-batch grads, global-norm clip, AdamW with no decay
  // on bias/norm. Tolerance: float32 Adam vs double over 5 steps, relative ~1e-6 per op; 2e-5 absolute
  // on values of order 1 leaves margin for the sqrt/division rounding.
  const std::int64_t sizes[] = {300, 37, 700, 5};
  const bool decays[] = {true, false, true, false};
  std::vector<std::vector<double>> p(4), m(4), v(4);
  for (int i = 0; i < 4; ++i) {
    p[i].resize(static_cast<std::size_t>(sizes[i]));
    m[i].assign(p[i].size(), 0.0);
    v[i].assign(p[i].size(), 0.0);
    for (std::size_t k = 0; k < p[i].size(); ++k)
      p[i][k] = std::sin(0.1f * static_cast<float>(k) + static_cast<float>(i));
  }
  for (int st = 0; st < steps; ++st) {
    std::vector<std::vector<double>> g(4);
    double sq = 0;
    for (int i = 0; i < 4; ++i) {
      g[i].assign(p[i].size(), 0.0);
      for (std::size_t k = 0; k < g[i].size(); ++k) {
        for (int mb = 0; mb < accum; ++mb) g[i][k] += setup::grad_value(i, k, st, mb);
        g[i][k] /= accum;
        sq += g[i][k] * g[i][k];
      }
    }
    const double coef = std::min(1.0, max_norm / (std::sqrt(sq) + 1e-6));
    const double t = st + 1, b1 = 0.9, b2 = 0.999;
    for (int i = 0; i < 4; ++i)
      for (std::size_t k = 0; k < g[i].size(); ++k) {
        const double gk = g[i][k] * coef;
        m[i][k] = b1 * m[i][k] + (1 - b1) * gk;
        v[i][k] = b2 * v[i][k] + (1 - b2) * gk * gk;
        if (decays[i]) p[i][k] *= 1 - static_cast<double>(lr) * wd;
        p[i][k] -= lr * (m[i][k] / (1 - std::pow(b1, t))) / (std::sqrt(v[i][k] / (1 - std::pow(b2, t))) + 1e-8);
      }
  }
  std::size_t at = 0;
  for (int i = 0; i < 4; ++i)
    for (double x : p[i]) CHECK(std::abs(results[0][at++] - x) < 2e-5);
}

TEST_CASE("bf16 params: fp32 master drives the update, same bits across placements") {
  std::vector<std::vector<float>> params, masters;
  for (auto placement : {static_placement::all_device(), static_placement::all_host()}) {
    setup s(dtype::bf16, placement);
    chunk_adam<> opt({.max_grad_norm = 1.0f});
    for (int st = 0; st < 3; ++st) {
      s.backward<bfloat16>(st, 0, 1.0f);
      CHECK(opt.step(s.rt, 1e-2f).stepped);
    }
    params.push_back(s.values());
    masters.push_back(s.values(chunk_kind::master));
    for (std::size_t k = 0; k < params.back().size(); ++k)  // param = bf16(master)
      CHECK(params.back()[k] == to_float(bfloat16(masters.back()[k])));
  }
  CHECK(params[0] == params[1]);
  CHECK(masters[0] == masters[1]);
}

TEST_CASE("fp16 overflow: the step is skipped, gradients dropped, the scale backs off") {
  setup s(dtype::f16, static_placement::all_device());
  chunk_adam<dynamic_loss_scaler> opt({}, param_groups::with_default_decay(0.0f),
                                      dynamic_loss_scaler({.init_scale = 1024.0f, .growth_interval = 2}));
  const auto before = s.values();
  s.backward<float16>(0, 0, opt.loss_scale(), /*inject_inf=*/true);
  auto r = opt.step(s.rt, 1e-2f);
  CHECK_FALSE(r.stepped);
  CHECK(std::isinf(r.grad_norm));
  CHECK(opt.loss_scale() == 512.0f);
  CHECK(opt.step_count() == 0);
  CHECK(s.values() == before);
  CHECK(s.rt.where({chunk_kind::grad, 0}) == tier::free);  // dropped
  // A clean step runs; the scale is divided out exactly (powers of two).
  s.backward<float16>(0, 0, opt.loss_scale());
  r = opt.step(s.rt, 1e-2f);
  CHECK(r.stepped);
  CHECK(opt.step_count() == 1);
  CHECK(s.values() != before);
  s.backward<float16>(1, 0, opt.loss_scale());
  CHECK(opt.step(s.rt, 1e-2f).stepped);
  CHECK(opt.loss_scale() == 1024.0f);  // grew after growth_interval clean steps
}

TEST_CASE("clipping reports the global norm of the averaged, unscaled gradients") {
  setup s(dtype::f32, static_placement::all_device());
  chunk_adam<> opt({.max_grad_norm = 0.01f});
  double sq = 0;
  for (int i = 0; i < 4; ++i)
    for (std::size_t k = 0; k < s.rt.spec(s.ids[static_cast<std::size_t>(i)]).numel(); ++k)
      sq += std::pow(static_cast<double>(setup::grad_value(i, k, 0, 0)) * 4.0 / 4.0, 2);
  s.backward<float>(0, 0, 4.0f);  // as if the loss had been scaled by 4 ...
  const auto r = opt.step(s.rt, 1e-3f, /*micro_batches=*/1);
  // ... a static scaler of 1 does not divide it out: the norm is that of 4 * g
  CHECK(r.grad_norm == doctest::Approx(4.0 * std::sqrt(sq)).epsilon(1e-6));
  CHECK(r.clip_coefficient == doctest::Approx(0.01 / (4.0 * std::sqrt(sq))).epsilon(1e-5));
  CHECK_THROWS_AS(chunk_adam<>({.max_grad_norm = -1.0f}), config_error);
}

TEST_CASE("global_sum_sq: the trainer's global sum replaces the runtime's, for norm and clipping alike") {
  setup s(dtype::f32, static_placement::all_device());
  double seen = -1;
  // As a rank of a model partitioned outside the runtime: three more ranks with the same share.
  chunk_adam<> opt({.max_grad_norm = 0.01f, .global_sum_sq = [&](double local) { return 4 * (seen = local); }});
  setup ref(dtype::f32, static_placement::all_device());
  chunk_adam<> plain({.max_grad_norm = 0.01f});
  s.backward<float>(0, 0, 1.0f);
  ref.backward<float>(0, 0, 1.0f);
  const auto r = opt.step(s.rt, 1e-3f), p = plain.step(ref.rt, 1e-3f);
  CHECK(seen == doctest::Approx(p.grad_norm * p.grad_norm).epsilon(1e-12));
  CHECK(r.grad_norm == doctest::Approx(2 * p.grad_norm).epsilon(1e-12));
  CHECK(r.clip_coefficient == doctest::Approx(0.01 / (2 * p.grad_norm)).epsilon(1e-5));
}

TEST_CASE("without clipping, a dynamic scaler or report_norm the norm scan is skipped; the step is the same") {
  for (auto placement : {static_placement::all_device(), static_placement::all_host()}) {
    std::vector<std::vector<float>> results;
    for (bool report : {true, false}) {
      setup s(dtype::f32, placement);
      chunk_adam<> opt({.hyper = {.weight_decay = 0.1f}, .report_norm = report});
      for (int st = 0; st < 3; ++st) {
        s.backward<float>(st, 0, 1.0f);
        const auto r = opt.step(s.rt, 1e-2f);
        CHECK(r.stepped);
        CHECK(r.clip_coefficient == 1.0f);
        if (report) CHECK(std::isfinite(r.grad_norm));
        else CHECK(std::isnan(r.grad_norm));  // not computed
      }
      results.push_back(s.values());
    }
    CHECK(results[0] == results[1]);
  }
  // Clipping needs the norm, so it is computed whatever report_norm says.
  setup s(dtype::f32, static_placement::all_device());
  chunk_adam<> clip({.max_grad_norm = 0.5f, .report_norm = false});
  s.backward<float>(0, 0, 1.0f);
  CHECK(std::isfinite(clip.step(s.rt, 1e-2f).grad_norm));
  // So does a dynamic scaler (its overflow flag comes from the same scan).
  setup h(dtype::f16, static_placement::all_device());
  chunk_adam<dynamic_loss_scaler> fp16({.report_norm = false});
  h.backward<float16>(0, 0, fp16.loss_scale(), /*inject_inf=*/true);
  const auto r = fp16.step(h.rt, 1e-2f);
  CHECK_FALSE(r.stepped);
  CHECK(std::isinf(r.grad_norm));
}

// Asynchronous device steps (the CUDA kernels' adam_async): the optimizer pass records the update's
// stream after each device chunk and goes on, so the host steps of the chunks after it run while it
// does; a gradient is freed once its step is done; the step ends with every update done. Checked on
// a device the host must not read (like a GPU's: the runtime moves everything through the copy
// engine) with the scripted engine, whose user work stays unfinished until something waits for it.
namespace {

struct opaque_device_space : simulated_device_space {
  using simulated_device_space::simulated_device_space;
};
using opaque_platform = platform<opaque_device_space, host_space, chunkstar::testing::scripted_copy_engine,
                                 chunkstar::testing::scripted_stream>;

/** Device kernels whose Adam "runs" on scripted stream 5 (the math happens at the call: the memory
 *  is host memory underneath). */
struct async_device_kernels {
  static grad_stats scan(const void* g, dtype t, std::size_t n, float scale, int threads) {
    return host_adam_kernels::scan(g, t, n, scale, threads);
  }
  static void adam(const adam_chunk&, const adam_hyper&, const adam_step_args&) {
    FAIL("the synchronous device step ran");
  }
  static void adam_async(const adam_chunk& c, const adam_hyper& h, const adam_step_args& a) {
    ++calls;
    host_adam_kernels::adam(c, h, a);
  }
  static chunkstar::testing::scripted_stream stream() { return {5}; }
  static inline int calls = 0;
};

template <class T>
void check_async_steps(dtype t) {
  constexpr int steps = 3;
  setup ref(t, static_placement{0.5});
  chunk_adam<> ref_opt({.hyper = {.lr = 1e-2f, .weight_decay = 0.1f}});
  for (int s = 0; s < steps; ++s) {
    ref.backward<T>(s, 0, 1.0f);
    REQUIRE(ref_opt.step(ref.rt, 1e-2f).stepped);
  }

  using rt_async = chunk_runtime<fixed_chunk_layout, static_placement, belady_eviction, warmup_tracer,
                                 single_process_communicator, opaque_platform>;
  opaque_device_space dev({.capacity = 1 << 22});
  host_space host;
  chunkstar::testing::scripted_copy_engine engine;
  rt_async rt(dev, host, engine, {.param_type = t}, fixed_chunk_layout({.chunk_elems = 1024, .align_elems = 32}),
              static_placement{0.5});
  std::vector<param_id> ids;
  for (const auto& spec : ref.rt.params()) {
    const int i = static_cast<int>(ids.size());
    ids.push_back(rt.register_param(spec, [i](std::span<float> v) {
      for (std::size_t k = 0; k < v.size(); ++k) v[k] = std::sin(0.1f * static_cast<float>(k) + static_cast<float>(i));
    }));
  }
  rt.finalize();
  // When the runtime first waits for a device update in each step, how many host steps it had done.
  int pass = 0;
  std::vector<std::pair<int, std::uint64_t>> waits;  // (pass, host steps done by then)
  engine.on_stall = [&](std::uint64_t id) {
    for (const auto& h : engine.user_handles({5}))
      if (h.id() == id && (waits.empty() || waits.back().first != pass))
        waits.emplace_back(pass, rt.stats().host_steps);
  };
  async_device_kernels::calls = 0;
  chunk_adam<static_loss_scaler, async_device_kernels> opt({.hyper = {.lr = 1e-2f, .weight_decay = 0.1f}});
  for (pass = 0; pass < steps; ++pass) {
    for (std::size_t i = 0; i < ids.size(); ++i) {
      auto sc = rt.backward("t" + std::to_string(i), {ids[i]});
      auto g = sc.template grad<T>(ids[i]);  // device memory the test may touch: host memory underneath
      for (std::size_t k = 0; k < g.size(); ++k)
        g[k] = from_float<T>(to_float(g[k]) + setup::grad_value(static_cast<int>(i), k, pass, 0));
    }
    REQUIRE(opt.step(rt, 1e-2f).stepped);
    for (const auto& h : engine.user_handles({5})) CHECK(h.ready());  // the step ends with every update done
  }
  CHECK(async_device_kernels::calls > 0);
  const auto host_per_pass = rt.stats().host_steps / steps;
  REQUIRE(host_per_pass > 0);
  REQUIRE(rt.stats().device_steps > 0);
  REQUIRE(waits.size() == static_cast<std::size_t>(steps));
  for (const auto& [p, host_done] : waits) {
    CAPTURE(p);
    CHECK(host_done == (static_cast<std::uint64_t>(p) + 1) * host_per_pass);  // not waited for before the host steps
  }
  for (std::size_t i = 0; i < ids.size(); ++i) {
    CAPTURE(i);
    std::vector<float> got(rt.spec(ids[i]).numel()), want(got.size());
    rt.read_tensor(ids[i], chunk_kind::param, got);
    ref.rt.read_tensor(ref.ids[i], chunk_kind::param, want);
    CHECK(got == want);
  }
}

}  // namespace

TEST_CASE(
    "Asynchronous device steps overlap the host steps after them, free each gradient once its step is done, and end "
    "the step done; same bits") {
  check_async_steps<float>(dtype::f32);
  check_async_steps<bfloat16>(dtype::bf16);
}

namespace {

// The opaque device above (memory the host cannot address, to the runtime: a GPU's; host memory
// underneath, so the test may write gradients through a scope's spans), with the plain engine.
using opaque_host_platform = platform<opaque_device_space, host_space, host_copy_engine>;
using rt_opaque = chunk_runtime<fixed_chunk_layout, static_placement, belady_eviction, warmup_tracer,
                                single_process_communicator, opaque_host_platform>;
static_assert(!rt_opaque::store_type::device_is_host_accessible);

/** Device kernels for the opaque device: the host's code under another type (its memory is the host's). */
struct opaque_device_kernels {
  static grad_stats scan(const void* g, dtype t, std::size_t n, float scale, int threads) {
    return host_adam_kernels::scan(g, t, n, scale, threads);
  }
  static void adam(const adam_chunk& c, const adam_hyper& h, const adam_step_args& a) {
    host_adam_kernels::adam(c, h, a);
  }
};

static_assert(!chunk_adam<>::can_step<rt_opaque>);  // and so step() does not compile (compile_fail/)
static_assert(chunk_adam<static_loss_scaler, opaque_device_kernels>::can_step<rt_opaque>);
static_assert(chunk_adam<>::can_step<rt_static>);  // the simulated device: the host addresses it
using device_adam = chunk_adam<static_loss_scaler, opaque_device_kernels>;

/** Two steps of a two-tensor model on the opaque device, every step placed per @p p; the weights after. */
std::vector<float> two_steps(static_placement p, float clip) {
  opaque_device_space dev({.capacity = 1 << 22});
  host_space host;
  host_copy_engine copier;
  rt_opaque rt(dev, host, copier, {}, fixed_chunk_layout({.chunk_elems = 1024, .align_elems = 32}), p);
  std::vector<param_id> ids;
  for (int i = 0; i < 2; ++i)
    ids.push_back(
        rt.register_param({"t" + std::to_string(i), {700}, dtype::f32, tensor_role::weight}, [i](std::span<float> v) {
          for (std::size_t k = 0; k < v.size(); ++k) v[k] = 0.01f * float(k % 17 + static_cast<std::size_t>(i));
        }));
  rt.finalize();
  device_adam adam({.max_grad_norm = clip});
  for (int s = 0; s < 2; ++s) {
    for (auto id : ids) (void)rt.forward(rt.spec(id).name, {id});
    for (auto id : ids) {
      auto sc = rt.backward(rt.spec(id).name, {id});
      for (float& g : sc.grad<float>(id)) g += 0.1f * float(s + 1);
    }
    REQUIRE(adam.step(rt, 1e-2f).stepped);
  }
  std::vector<float> all;
  for (auto id : ids) {
    std::vector<float> v(700);
    rt.read_tensor(id, chunk_kind::param, v);
    all.insert(all.end(), v.begin(), v.end());
  }
  return all;
}

}  // namespace

TEST_CASE(
    "chunk_adam on a device the host cannot address: only with the platform's device kernels (can_step; host "
    "kernels do not compile there), which step the device-placed chunks with the host-placed ones' bits") {
  for (const float clip : {0.0f, 1.0f}) {
    CAPTURE(clip);
    const auto on_device = two_steps(static_placement::all_device(), clip);
    const auto on_host = two_steps(static_placement::all_host(), clip);
    CHECK(on_device == on_host);
    CHECK(on_device != two_steps(static_placement::all_host(), clip == 0.0f ? 1e-3f : 0.0f));
  }
}

}  // namespace chunk_adam_test
