// SPDX-License-Identifier: Apache-2.0
// The tiny GPT as chunked_gpt's tests lay it out: one batch shape, chunks the size of the largest
// tensor, and device capacities that hold a backend's non-model memory plus a share of the model data.
#pragma once

#include "chunked_gpt.hpp"

#include <chunkstar/layout/fixed_chunk_layout.hpp>

#include <algorithm>
#include <cstddef>

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
    return non_model_bytes<Backend>(c, shape, type) + slack + static_cast<std::size_t>(fraction * static_cast<double>(model_bytes));
  }
};

}  // namespace gpt::testing
