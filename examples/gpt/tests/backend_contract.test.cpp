// SPDX-License-Identifier: Apache-2.0
// chunked_gpt's side of the stream contract, checked on the CPU with test doubles, so that a GPU
// run only has to check what needs the hardware (gpt_backend.hpp states the contract):
//  * a backend whose kernels "run" on a numbered stream of the scripted platform (the CPU kernels
//    compute at once, but the engine treats the work as unfinished until the backend waits for it:
//    quiesce completes the stream), and whose compute tier is not host memory (tokens are copied
//    in, probabilities out, as on a GPU);
//  * a runtime that refuses to free compute-tier memory while kernels issued since the last wait
//    may still read it.
// Checked: every scope closes with the backend's stream, once (the runtime orders its chunks'
// moves after that work); no buffer is freed under running kernels; the backend's scratch lives
// from the forward through the backward; and the losses and weights are the CPU backend's bit for
// bit, at any budget and policy.
#include "chunked_gpt.hpp"
#include "chunked_setup.hpp"
#include "data.hpp"
#include "support/runtimes.hpp"
#include "support/scripted_copy_engine.hpp"

#include <chunkstar/eviction/lru.hpp>
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/placement/static_placement.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>

#include <doctest/doctest.h>

#include <set>
#include <vector>

using namespace chunkstar;

namespace backend_contract_test {
using chunkstar::testing::scripted_copy_engine;
using chunkstar::testing::scripted_op_kind;
using chunkstar::testing::scripted_platform;
using chunkstar::testing::scripted_stream;

namespace {

/** What the scripted backend saw. */
struct backend_log {
  scripted_copy_engine* engine = nullptr;
  bool forget_waits = false;  // a faulty backend: quiesce returns without waiting
  bool in_flight = false;     // kernels issued since the last wait
  std::size_t kernels = 0, waits = 0;
  std::size_t frees_under_kernels = 0;  // set by the checked runtime
  std::set<const float*> forward_scratch, backward_scratch;
};

/** The CPU kernels, run on a scripted stream. */
struct scripted_backend {
  using stream_type = scripted_stream;
  static constexpr bool host_memory = false;
  static constexpr int stream_id = 7;
  backend_log* log = nullptr;
  gpt::cpu_backend cpu;

  [[nodiscard]] stream_type stream() const noexcept { return {stream_id}; }
  static std::size_t scratch_elems(const gpt::gpt_config& c, std::size_t B, std::size_t T) noexcept {
    return B * T * static_cast<std::size_t>(c.width);  // some scratch, to check where it lives
  }
  void quiesce() noexcept {
    ++log->waits;
    if (log->forget_waits) return;
    log->engine->complete_stream(stream());
    log->in_flight = false;
  }
  void issued() {
    ++log->kernels;
    log->in_flight = true;
  }
  void to_compute(void* d, const void* s, std::size_t n) { issued(), cpu.to_compute(d, s, n); }
  void from_compute(void* d, const void* s, std::size_t n) {
    cpu.from_compute(d, s, n);
    quiesce();  // returns once the bytes arrived: after the kernels before it
  }
  void zero(float* p, std::size_t n) { issued(), cpu.zero(p, n); }
  void widen(const std::byte* s, dtype t, float* d, std::size_t n) { issued(), cpu.widen(s, t, d, n); }
  void add_into(std::byte* d, dtype t, const float* a, std::size_t n) { issued(), cpu.add_into(d, t, a, n); }
  void embedding_forward(const gpt::gpt_config& c, std::size_t B, std::size_t T, const int* tok, const float* wte,
                         const float* wpe, float* out) {
    issued(), cpu.embedding_forward(c, B, T, tok, wte, wpe, out);
  }
  void block_forward(const gpt::gpt_config& c, std::size_t B, std::size_t T, const gpt::block_params<float>& p,
                     const float* x, const gpt::block_activations<float>& a, float* proj, float* scratch) {
    log->forward_scratch.insert(scratch);
    issued(), cpu.block_forward(c, B, T, p, x, a, proj, scratch);
  }
  double head_forward(const gpt::gpt_config& c, std::size_t B, std::size_t T, const float* wte, const float* lw,
                      const float* lb, const float* x, const gpt::head_activations<float>& h, const int* tg) {
    issued();
    const double loss = cpu.head_forward(c, B, T, wte, lw, lb, x, h, tg);
    quiesce();  // reading the losses waits for the stream
    return loss;
  }
  void head_backward(const gpt::gpt_config& c, std::size_t B, std::size_t T, const float* wte, const float* lw,
                     const float* x, const gpt::head_activations<float>& h, const int* tg, float* gw, float* glw,
                     float* glb, const gpt::backward_workspace<float>& w, float scale) {
    issued(), cpu.head_backward(c, B, T, wte, lw, x, h, tg, gw, glw, glb, w, scale);
  }
  void block_backward(const gpt::gpt_config& c, std::size_t B, std::size_t T, const gpt::block_params<float>& p,
                      const gpt::block_params<float>& g, const float* x, const gpt::block_activations<float>& a,
                      const gpt::backward_workspace<float>& w, float* scratch) {
    log->backward_scratch.insert(scratch);
    issued(), cpu.block_backward(c, B, T, p, g, x, a, w, scratch);
  }
  void embedding_backward(const gpt::gpt_config& c, std::size_t B, std::size_t T, const int* tok, float* gw, float* gp,
                          const gpt::backward_workspace<float>& w) {
    issued(), cpu.embedding_backward(c, B, T, tok, gw, gp, w);
  }
};
static_assert(gpt::GptBackend<scripted_backend>);

/** A runtime that counts frees of compute-tier memory while the backend's kernels may still run. */
template <class Placement, class Eviction>
struct checked_runtime : chunk_runtime<fixed_chunk_layout, Placement, Eviction, warmup_tracer,
                                       single_process_communicator, scripted_platform> {
  using base = chunk_runtime<fixed_chunk_layout, Placement, Eviction, warmup_tracer, single_process_communicator,
                             scripted_platform>;
  using base::base;
  backend_log* log = nullptr;
  void deallocate_non_model(void* p, std::size_t bytes, std::size_t alignment = 64) noexcept {
    if (log->in_flight) ++log->frees_under_kernels;
    base::deallocate_non_model(p, bytes, alignment);
  }
};

using gpt::testing::run_result;

constexpr int steps = 3;

/** The run every variant makes: three steps, validation, sampling; the parameters read back. */
template <class Runtime, class Backend, class Memory>
run_result train(Runtime& rt, Backend backend, Memory& dev, const gpt::gpt_config& c, gpt::batch_shape shape) {
  gpt::chunked_gpt<Runtime, Backend> model(rt, c, shape, 42, std::move(backend));
  model.finalize();
  chunk_adam<> opt({.hyper = {.weight_decay = 0.1f}, .max_grad_norm = 1.0f}, param_groups::with_default_decay(0.1f));
  const run_result r = gpt::testing::train_steps(rt, model, opt, shape, {.steps = steps, .probs = true});
  CHECK(r.skipped == 0);
  CHECK(dev.usage().peak <= dev.capacity());
  return r;
}

/** The shape these tests train, and a device capacity for a share of its model data. */
struct setup : gpt::testing::chunked_setup {
  explicit setup(dtype type) : chunked_setup(type, {2, 32}) {}
  std::size_t capacity(double fraction) const { return chunked_setup::capacity<scripted_backend>(fraction, 64u << 10); }
};

/** The reference: the CPU backend on the simulated platform, everything resident. */
run_result reference(dtype type) {
  const setup s(type);
  simulated_device_space dev({.capacity = s.capacity(1.0)});
  host_space host;
  host_copy_engine copier;
  chunk_runtime<fixed_chunk_layout, static_placement> rt(dev, host, copier, {.param_type = type}, s.layout,
                                                         static_placement::all_device());
  return train(rt, gpt::cpu_backend{}, dev, s.c, s.shape);
}

template <class Placement, class Eviction>
run_result scripted(dtype type, double fraction, Placement placement, backend_log& log) {
  const setup s(type);
  simulated_device_space dev({.capacity = s.capacity(fraction)});
  host_space host;
  scripted_copy_engine engine;
  log.engine = &engine;
  checked_runtime<Placement, Eviction> rt(dev, host, engine, {.param_type = type, .prefetch_depth = 2}, s.layout,
                                          placement);
  rt.log = &log;
  auto r = train(rt, scripted_backend{.log = &log, .cpu = {}}, dev, s.c, s.shape);
  // Every scope closed with the backend's stream: per training step 2 L + 4 scopes (embedding,
  // blocks, head, then back), for the evaluation L + 2 and for sampling L + 2 more.
  const auto records = engine.ops_of(scripted_op_kind::record);
  const std::size_t L = static_cast<std::size_t>(s.c.layers);
  CHECK(records.size() == steps * (2 * L + 4) + 2 * (L + 2));
  for (const auto& op : records) CHECK(op.stream == scripted_backend::stream_id);
  return r;
}

}  // namespace

TEST_CASE(
    "backend contract: scopes close on the backend's stream, no buffer is freed under running kernels, same bits") {
  for (dtype type : {dtype::f32, dtype::bf16}) {
    CAPTURE(type);
    const auto ref = reference(type);
    struct variant {
      const char* name;
      double fraction;
    };
    for (const variant v : {variant{"resident", 1.0}, variant{"belady 30%", 0.3}, variant{"lru 30%", 0.3}}) {
      CAPTURE(v.name);
      backend_log log;
      run_result got;
      if (std::string(v.name) == "resident")
        got = scripted<static_placement, belady_eviction>(type, v.fraction, static_placement::all_device(), log);
      else if (std::string(v.name) == "lru 30%")
        got = scripted<auto_placement, lru_eviction>(type, v.fraction, auto_placement{}, log);
      else got = scripted<auto_placement, belady_eviction>(type, v.fraction, auto_placement{}, log);
      CHECK(got.losses == ref.losses);
      CHECK(got.params == ref.params);
      if (v.fraction < 1) CHECK(got.stats.bytes_moved() > 0);  // the budget really moves chunks
      CHECK(log.frees_under_kernels == 0);
      CHECK(log.waits > 0);
      CHECK(log.kernels > 0);
      // One scratch per forward, kept through its backward: the blocks of a backward use the
      // scratch their forward used.
      CHECK(log.forward_scratch.size() >= 1);
      for (const float* p : log.backward_scratch) CHECK(log.forward_scratch.count(p) == 1);
    }
  }
}

TEST_CASE("backend contract: the check has teeth: a backend that does not wait before a free is caught") {
  backend_log log;
  log.forget_waits = true;
  (void)scripted<static_placement, belady_eviction>(dtype::f32, 1.0, static_placement::all_device(), log);
  CHECK(log.frees_under_kernels > 0);
}

}  // namespace backend_contract_test
