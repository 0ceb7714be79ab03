// SPDX-License-Identifier: Apache-2.0
// The GPT trainer's model over chunkstar: same bits whatever the budget and eviction policy, for
// fp32 and bf16, and the same losses as the plain model with flat arrays.
#include "chunked_gpt.hpp"
#include "chunked_setup.hpp"
#include "data.hpp"
#include "support/runtimes.hpp"

#include <chunkstar/eviction/lru.hpp>
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/placement/static_placement.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>

#include <doctest/doctest.h>

#include <vector>

using namespace chunkstar;

namespace trainer_test {

namespace {

using gpt::testing::run_result;

gpt::gpt_config tiny() { return gpt::parse_preset("tiny"); }

template <class Runtime>
run_result train(dtype type, double budget_fraction, typename Runtime::placement_type placement = {}, int steps = 3) {
  const gpt::testing::chunked_setup setup(type, {2, 32});
  simulated_device_space dev({.capacity = setup.capacity<gpt::cpu_backend>(budget_fraction, 64u << 10)});
  host_space host;
  host_copy_engine copier;
  Runtime rt(dev, host, copier, {.param_type = type}, setup.layout, placement);
  gpt::chunked_gpt<Runtime> model(rt, setup.c, setup.shape, 42);
  model.finalize();
  chunk_adam<> opt({.hyper = {.weight_decay = 0.1f}, .max_grad_norm = 1.0f}, param_groups::with_default_decay(0.1f));
  const run_result r = gpt::testing::train_steps(rt, model, opt, setup.shape, {.steps = steps, .micro_batches = 2});
  CHECK(r.skipped == 0);
  CHECK(dev.usage().peak <= dev.capacity());
  return r;
}

using resident_rt = chunk_runtime<fixed_chunk_layout, static_placement>;
using belady_rt = chunk_runtime<fixed_chunk_layout, auto_placement, belady_eviction>;
using lru_rt = chunk_runtime<fixed_chunk_layout, auto_placement, lru_eviction>;

}  // namespace

TEST_CASE("trainer: same bits with everything resident and with 25% of the model data on the device") {
  for (dtype type : {dtype::f32, dtype::bf16}) {
    CAPTURE(dtype_name(type));
    const auto reference = train<resident_rt>(type, 1.0, static_placement::all_device());
    CHECK(reference.stats.bytes_to_host == 0);
    CHECK(reference.losses[2] < reference.losses[0]);
    for (double fraction : {0.25, 0.15}) {  // bf16 params + grads are exactly 25% of its model data
      CAPTURE(fraction);
      const auto belady = train<belady_rt>(type, fraction);
      const auto lru = train<lru_rt>(type, fraction);
      CHECK(belady.stats.bytes_to_host > 0);  // model data really left the device
      if (fraction < 0.2) CHECK(belady.stats.evictions > 0);
      CHECK(belady.stats.peak_device_chunk_bytes < reference.stats.peak_device_chunk_bytes);
      CHECK(belady.losses == reference.losses);
      CHECK(lru.losses == reference.losses);
      CHECK(belady.params == reference.params);
      CHECK(lru.params == reference.params);
      CHECK(belady.stats.bytes_moved() <= lru.stats.bytes_moved());
    }
  }
}

TEST_CASE("trainer: the chunked model computes what the plain model computes") {
  const gpt::gpt_config c = tiny();
  const auto data = gpt::load_text("", 32);
  std::vector<int> tokens(64), targets(64);
  gpt::fill_batch(data.train, 1, gpt::train_key(1, 0), 2, 32, tokens.data(), targets.data());
  gpt::gpt_reference<float> plain(c, 2, 32);
  std::size_t index = 0;
  for (const auto& s : gpt::param_specs(c)) {
    gpt::init_tensor<float>(c, s, index, gpt::param_list(plain.params)[index], 42);
    ++index;
  }
  const double plain_loss = plain.forward(tokens.data(), targets.data());
  plain.backward(tokens.data(), targets.data());

  simulated_device_space dev({.capacity = 256u << 20});
  host_space host;
  host_copy_engine copier;
  resident_rt rt(dev, host, copier, {}, fixed_chunk_layout({.chunk_elems = 1 << 16}), static_placement::all_device());
  gpt::chunked_gpt<resident_rt> model(rt, c, {2, 32}, 42);
  model.finalize();
  CHECK(model.forward_backward(tokens.data(), targets.data()) == plain_loss);
  const auto grads = gpt::param_list(plain.grads);
  for (std::size_t t = 0; t < rt.params().size(); ++t) {
    std::vector<float> g(rt.params()[t].numel());
    rt.read_tensor(param_id{static_cast<std::uint32_t>(t)}, chunk_kind::grad, g);
    CHECK(std::equal(g.begin(), g.end(), grads[t]));
  }
}

}  // namespace trainer_test
