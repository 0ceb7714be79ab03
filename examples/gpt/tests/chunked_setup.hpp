// SPDX-License-Identifier: Apache-2.0
// The tiny GPT as chunked_gpt's tests lay it out — one batch shape, chunks the size of the largest
// tensor, device capacities that hold a backend's non-model memory plus a share of the model data —
// and the short training run whose results they compare (`train_steps`).
#pragma once

#include "chunked_gpt.hpp"
#include "data.hpp"

#include <chunkstar/layout/fixed_chunk_layout.hpp>

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

namespace gpt::testing {

struct chunked_setup {
  gpt_config c = parse_preset("tiny");
  chunkstar::dtype type;
  batch_shape shape;
  chunkstar::fixed_chunk_layout layout;
  std::size_t model_bytes = 0;  ///< every chunk list

  chunked_setup(chunkstar::dtype t, batch_shape s) : type(t), shape(s), layout(layout_for(c, t)) {
    for (const auto& l : chunkstar::make_chunk_lists(layout.plan(param_specs(c, type)), {.param_type = type}))
      model_bytes += l.chunk_bytes * l.num_chunks;
  }
  /** Chunks of the largest tensor's size. */
  static chunkstar::fixed_chunk_layout layout_for(const gpt_config& c, chunkstar::dtype type) {
    std::size_t largest = 0;
    for (const auto& s : param_specs(c, type)) largest = std::max(largest, s.numel());
    return chunkstar::fixed_chunk_layout({.chunk_elems = (largest + 31) / 32 * 32});
  }
  /** @p Backend's non-model bytes + @p slack + @p fraction of the model data. */
  template <class Backend>
  std::size_t capacity(double fraction, std::size_t slack) const {
    return non_model_bytes<Backend>(c, shape, type) + slack +
           static_cast<std::size_t>(fraction * static_cast<double>(model_bytes));
  }
};

/** What a test run of chunked_gpt leaves to compare: each step's loss, then the validation loss
 *  (and, when asked, next-token probabilities), every parameter read back, the runtime's counters,
 *  and how many steps an overflow skipped. */
struct run_result {
  std::vector<double> losses;
  std::vector<float> params;
  chunkstar::runtime_stats stats;
  int skipped = 0;
};

/** The run `train_steps` makes. */
struct train_spec {
  int steps = 3;
  int micro_batches = 1;  ///< accumulated per step
  bool probs = false;     ///< also the next-token probabilities after the validation batch's first five tokens
};

/** @p t.steps steps of @p opt (lr 3e-3) on @p model, each over `t.micro_batches` micro-batches of
 *  the embedded corpus; then one validation batch, untraced; then the parameters read back. */
template <class Runtime, class Model, class Optimizer>
run_result train_steps(Runtime& rt, Model& model, Optimizer& opt, batch_shape shape, train_spec t) {
  const auto data = load_text("", shape.seq);
  std::vector<int> tokens(model.tokens_per_batch()), targets(model.tokens_per_batch());
  run_result r;
  for (int step = 1; step <= t.steps; ++step) {
    double loss = 0;
    for (int micro = 0; micro < t.micro_batches; ++micro) {
      fill_batch(data.train, 1, train_key(step, micro), shape.batch, shape.seq, tokens.data(), targets.data());
      loss += model.forward_backward(tokens.data(), targets.data(), opt.loss_scale()) / t.micro_batches;
    }
    r.losses.push_back(loss);
    r.skipped += opt.step(rt, 3e-3f, t.micro_batches).stepped ? 0 : 1;
  }
  {
    auto eval = rt.untraced();
    fill_batch(data.val, 1, 0, shape.batch, shape.seq, tokens.data(), targets.data());
    r.losses.push_back(model.loss(tokens.data(), targets.data()));
    if (t.probs) {
      const auto probs = model.next_token_probs(std::span<const int>(tokens.data(), 5));
      r.losses.insert(r.losses.end(), probs.begin(), probs.end());
    }
  }
  for (std::size_t i = 0; i < rt.params().size(); ++i) {
    std::vector<float> v(rt.params()[i].numel());
    rt.read_tensor(chunkstar::param_id{static_cast<std::uint32_t>(i)}, chunkstar::chunk_kind::param, v);
    r.params.insert(r.params.end(), v.begin(), v.end());
  }
  r.stats = rt.stats();
  return r;
}

}  // namespace gpt::testing
