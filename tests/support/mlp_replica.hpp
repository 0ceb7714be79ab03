// SPDX-License-Identifier: Apache-2.0
// A tanh MLP for multi-rank tests: one rank's (or a reference's) spaces, runtime and parameters,
// and a forward/backward of micro-batch `mb` of step `step` whose data depend on both, so N ranks
// each computing their own micro-batch can be compared with one process computing all of them.
#pragma once

#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>

#include "runtimes.hpp"

#include <cmath>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace chunkstar::testing {

inline constexpr int mlp_layers = 4, mlp_width = 12, mlp_batch = 3;
inline constexpr std::size_t mlp_chunk_elems = 256;
/** Bytes of one chunk, and of the activations forward_backward keeps at its peak (for budgets). */
inline constexpr std::size_t mlp_chunk_bytes = mlp_chunk_elems * sizeof(float),
                             mlp_act_bytes = 12 * mlp_batch * mlp_width * sizeof(float);

/** The optimizer the multi-rank tests step with: AdamW, clipping that is active, one thread. */
inline chunk_adam<> mlp_adam() {
  return chunk_adam<>({.hyper = {.lr = 2e-2f, .weight_decay = 0.01f}, .max_grad_norm = 0.05f, .threads = 1});
}

template <class Comm, class Placement = auto_placement, class Eviction = belady_eviction, class P = simulated_platform>
using mlp_runtime = chunk_runtime<fixed_chunk_layout, Placement, Eviction, warmup_tracer, Comm, P>;

/** One rank's (or the reference's) model: spaces, runtime, parameters, with the placement and
 *  eviction policies given (default-constructed), on platform P. */
template <class Comm, class Placement = auto_placement, class Eviction = belady_eviction, class P = simulated_platform>
struct mlp_replica {
  using runtime_type = mlp_runtime<Comm, Placement, Eviction, P>;
  typename P::device_space dev;
  host_space host;
  typename P::copy_engine copier;
  runtime_type rt;
  std::vector<param_id> w, b;
  /** When set, each backward scope is handed to it with the gradients it wrote, to close (on a
   *  stream, say: the stream contract); otherwise it closes as the host work is done. */
  std::function<void(typename runtime_type::scope&, std::span<float> gW, std::span<float> gb)> close_backward;

  template <class... CommArg>
  mlp_replica(runtime_options options, std::size_t capacity, CommArg&... comm)
      : mlp_replica(options, capacity, host_space_options{}, {}, comm...) {}

  /** With a host space of @p host_options, and @p before_finalize called on the runtime just
   *  before finalize() (to attach a disk tier, say). */
  template <class... CommArg>
  mlp_replica(runtime_options options, std::size_t capacity, host_space_options host_options,
              const std::function<void(runtime_type&)>& before_finalize, CommArg&... comm)
      : dev({.capacity = capacity}),
        host(host_options),
        rt(dev, host, copier, comm..., options,
           fixed_chunk_layout({.chunk_elems = mlp_chunk_elems, .align_elems = 32})) {
    for (int l = 0; l < mlp_layers; ++l) {
      w.push_back(rt.register_param({"w" + std::to_string(l), {mlp_width, mlp_width}, dtype::f32, tensor_role::weight},
                                    [l](std::span<float> v) {
                                      for (std::size_t i = 0; i < v.size(); ++i)
                                        v[i] = 0.4f * std::sin(0.9f * static_cast<float>(i) + static_cast<float>(l));
                                    }));
      b.push_back(rt.register_param({"b" + std::to_string(l), {mlp_width}, dtype::f32, tensor_role::bias}));
    }
    if (before_finalize) before_finalize(rt);
    rt.finalize();
  }

  /** Forward and backward of micro-batch @p mb of step @p step; @p after_backward runs after each
   *  backward scope closes, @p after_forward after each forward one. @return the micro-batch's
   *  loss, sum((y - t)^2) / (2 batch). */
  template <class After, class AfterForward = void (*)()>
  float forward_backward(
      int step, int mb, After&& after_backward, AfterForward&& after_forward = [] {}) {
    const std::size_t act = mlp_batch * mlp_width * sizeof(float);
    std::vector<non_model_buffer<float, runtime_type>> h;
    for (int l = 0; l <= mlp_layers; ++l) h.push_back(rt.template allocate_buffer<float>(mlp_batch * mlp_width));
    for (int i = 0; i < mlp_batch * mlp_width; ++i)
      h[0].data()[i] =
          std::cos(0.21f * static_cast<float>(i) + 1.7f * static_cast<float>(mb) + static_cast<float>(step));
    for (int l = 0; l < mlp_layers; ++l) {
      auto s = rt.forward("l" + std::to_string(l), {w[l], b[l]});
      const auto W = s.template param<float>(w[l]);
      const auto bias = s.template param<float>(b[l]);
      for (int n = 0; n < mlp_batch; ++n)
        for (int o = 0; o < mlp_width; ++o) {
          float acc = bias[o];
          for (int i = 0; i < mlp_width; ++i) acc += W[o * mlp_width + i] * h[l].data()[n * mlp_width + i];
          h[l + 1].data()[n * mlp_width + o] = std::tanh(acc);
        }
      s.close();
      after_forward();
    }
    auto dh = rt.template allocate_buffer<float>(mlp_batch * mlp_width),
         dprev = rt.template allocate_buffer<float>(mlp_batch * mlp_width);
    float loss = 0;
    for (int i = 0; i < mlp_batch * mlp_width; ++i) {
      const float e = h[mlp_layers].data()[i] - 0.1f * static_cast<float>(mb);
      loss += e * e;
      dh.data()[i] = e / mlp_batch;
    }
    for (int l = mlp_layers - 1; l >= 0; --l) {
      {
        auto s = rt.backward("l" + std::to_string(l), {w[l], b[l]});
        const auto W = s.template param<float>(w[l]);
        auto gW = s.template grad<float>(w[l]);
        auto gb = s.template grad<float>(b[l]);
        for (int i = 0; i < mlp_batch * mlp_width; ++i) dh.data()[i] *= 1.0f - h[l + 1].data()[i] * h[l + 1].data()[i];
        for (int n = 0; n < mlp_batch; ++n)
          for (int o = 0; o < mlp_width; ++o) {
            gb[o] += dh.data()[n * mlp_width + o];
            for (int i = 0; i < mlp_width; ++i)
              gW[o * mlp_width + i] += dh.data()[n * mlp_width + o] * h[l].data()[n * mlp_width + i];
          }
        for (int n = 0; n < mlp_batch; ++n)
          for (int i = 0; i < mlp_width; ++i) {
            float acc = 0;
            for (int o = 0; o < mlp_width; ++o) acc += W[o * mlp_width + i] * dh.data()[n * mlp_width + o];
            dprev.data()[n * mlp_width + i] = acc;
          }
        std::swap(dh, dprev);
        if (close_backward) close_backward(s, gW, gb);
      }
      after_backward();
    }
    (void)act;
    return loss / (2 * mlp_batch);
  }

  std::vector<float> all(chunk_kind k) const {
    std::vector<float> out;
    for (std::size_t t = 0; t < rt.params().size(); ++t) {
      std::vector<float> v(rt.params()[t].numel());
      rt.read_tensor(param_id{static_cast<std::uint32_t>(t)}, k, v);
      out.insert(out.end(), v.begin(), v.end());
    }
    return out;
  }

  /** This rank's own tensors of list @p k (under ZeRO, those whose chunk is not remote), in
   *  registration order. */
  std::vector<float> owned(chunk_kind k) const {
    std::vector<float> out;
    for (std::size_t t = 0; t < rt.params().size(); ++t) {
      if (!rt.shards().owns(rt.plan().slots[t].chunk)) continue;  // a gathered chunk is on the device
      std::vector<float> v(rt.params()[t].numel());
      rt.read_tensor(param_id{static_cast<std::uint32_t>(t)}, k, v);
      out.insert(out.end(), v.begin(), v.end());
    }
    return out;
  }
  /** The inverse of all(): writes every tensor of list @p k from @p values, in registration order. */
  void write_all(chunk_kind k, std::span<const float> values) {
    std::size_t at = 0;
    for (std::size_t t = 0; t < rt.params().size(); ++t) {
      const std::size_t n = rt.params()[t].numel();
      rt.write_tensor(param_id{static_cast<std::uint32_t>(t)}, k, values.subspan(at, n));
      at += n;
    }
  }
};

}  // namespace chunkstar::testing
