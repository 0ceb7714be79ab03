// SPDX-License-Identifier: Apache-2.0
// A small layered model (tanh MLP, MSE loss, scalar Adam) trained through a chunk runtime, so tests
// can compare runs under different budgets and policies bit for bit.
#pragma once

#include <chunkstar/disk/disk_copy_engine.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>

#include "faulty_disk_engine.hpp"
#include "runtimes.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace chunkstar::testing {

struct toy_config {
  int layers = 8;
  int width = 32;
  int batch = 8;
  int steps = 4;
  std::size_t prefetch = 2;
  std::uint32_t seed = 7;
  std::size_t chunk_elems = 2048;
  // A disk tier when `disk_dir` is set: the host then holds `host_fraction` of the model data and
  // the disk the rest (with room to spare).
  std::string disk_dir;
  double host_fraction = 1.0;
  std::size_t disk_prefetch = 8;
  disk_copy_engine_options disk_engine{};
  test::faulty_disk_engine::faults disk_faults{};  // copies that fail or get corrupted
  int retries = 0;                           // a runtime call that throws io_error is made again, up to this many times
  std::function<void(disk_space&)> on_disk;  // called once the disk space exists
  bool timeline = false;                     // record a timeline (toy_result::trace)
};

struct toy_result {
  std::vector<float> params;  // every parameter, concatenated in registration order
  std::vector<float> losses;
  runtime_stats stats;
  std::size_t peak_device = 0;
  std::size_t capacity = 0;
  std::size_t model_bytes = 0;
  std::size_t host_capacity = 0;
  std::size_t peak_host = 0;                     // the host space's own peak
  copy_stats disk_engine;                        // what the disk engine moved
  std::vector<std::pair<chunk_id, tier>> tiers;  // where every chunk is at the end
  int retried = 0;                               // calls made again after an io_error
  std::string error;                             // what ended the run early (then params is empty)
  std::vector<std::string> violations;           // the runtime's bookkeeping after every retried failure
  std::string trace;                             // the Chrome trace, with toy_config::timeline
};

/** Trains the toy model with the runtime type RT on a simulated device whose capacity is the peak
 *  activation memory plus `budget_fraction` of the model data. */
template <class RT, class Placement = typename RT::placement_type>
toy_result train_toy(const toy_config& cfg, double budget_fraction, Placement placement = {}) {
  const int L = cfg.layers, D = cfg.width, B = cfg.batch;
  const std::size_t act_bytes = static_cast<std::size_t>(B * D) * sizeof(float);
  const std::size_t non_model_peak = static_cast<std::size_t>(L + 3) * act_bytes;

  auto register_all = [&](auto& rt, std::vector<param_id>& w, std::vector<param_id>& b) {
    std::mt19937 gen(cfg.seed);
    for (int l = 0; l < L; ++l) {
      std::normal_distribution<float> dist(0.0f, 1.0f / std::sqrt(static_cast<float>(D)));
      std::vector<float> init(static_cast<std::size_t>(D * D));
      for (auto& x : init) x = dist(gen);
      w.push_back(rt.register_param({"l" + std::to_string(l) + ".w", {D, D}, dtype::f32, tensor_role::weight},
                                    [init](std::span<float> v) { std::copy(init.begin(), init.end(), v.begin()); }));
      b.push_back(rt.register_param({"l" + std::to_string(l) + ".b", {D}, dtype::f32, tensor_role::bias}));
    }
  };
  const fixed_chunk_layout layout({.chunk_elems = cfg.chunk_elems, .align_elems = 32});

  // Model bytes, from a runtime that holds everything.
  std::size_t model_bytes = 0;
  {
    simulated_device_space big({.capacity = std::size_t{1} << 30});
    host_space h;
    host_copy_engine e;
    RT probe(big, h, e, {}, layout);
    std::vector<param_id> w, b;
    register_all(probe, w, b);
    probe.finalize();
    model_bytes = probe.model_bytes();
  }

  toy_result result;
  result.model_bytes = model_bytes;
  result.capacity = non_model_peak + static_cast<std::size_t>(budget_fraction * static_cast<double>(model_bytes));
  simulated_device_space dev({.capacity = result.capacity});
  const bool with_disk = !cfg.disk_dir.empty();
  result.host_capacity =
      with_disk ? static_cast<std::size_t>(cfg.host_fraction * static_cast<double>(model_bytes)) : SIZE_MAX;
  host_space host({.capacity = result.host_capacity});
  host_copy_engine copier;
  std::optional<disk_space> disk;
  std::optional<test::faulty_disk_engine> disk_io;
  if (with_disk) {
    disk.emplace(disk_space_options{.directory = cfg.disk_dir, .capacity = 2 * model_bytes, .name = "toy"});
    disk_io.emplace(*disk, cfg.disk_engine, cfg.disk_faults);
    if (cfg.on_disk) cfg.on_disk(*disk);
  }
  RT rt(dev, host, copier,
        {.prefetch_depth = cfg.prefetch, .disk_prefetch_depth = cfg.disk_prefetch, .timeline = cfg.timeline}, layout,
        placement);
  if (with_disk) rt.attach_disk(disk_tier(*disk, *disk_io));
  std::vector<param_id> w, b;
  register_all(rt, w, b);
  rt.finalize();

  // Fixed data: inputs x and targets y.
  std::mt19937 gen(cfg.seed + 1);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(B * D)), y(x.size());
  for (auto& v : x) v = u(gen);
  for (auto& v : y) v = 0.5f * u(gen);

  // A call that fails on an io_error is made again (the runtime leaves every chunk where it was).
  auto again = [&](auto&& f) -> decltype(auto) {
    for (int attempt = 0;; ++attempt) {
      try {
        return f();
      } catch (const io_error&) {
        if (attempt >= cfg.retries) throw;
        ++result.retried;
        for (auto& v : rt.invariant_violations()) result.violations.push_back(v);
      }
    }
  };
  try {
    for (int step = 1; step <= cfg.steps; ++step) {
      // Forward: h[l+1] = tanh(W_l h[l] + b_l), activations from the runtime's compute tier.
      // Activations, given back in this order before the step, or by the guard when a call throws.
      struct activations {
        RT& rt;
        std::size_t bytes;
        std::vector<void*> live;
        float* take(void* p) {
          live.push_back(p);
          return static_cast<float*>(p);
        }
        void release(void* p) {
          rt.deallocate_non_model(p, bytes);
          live.erase(std::find(live.begin(), live.end(), p));
        }
        ~activations() {
          for (void* p : live) rt.deallocate_non_model(p, bytes);
        }
      } acts{rt, act_bytes, {}};
      std::vector<float*> h(static_cast<std::size_t>(L + 1));
      for (auto& p : h) p = acts.take(again([&] { return rt.allocate_non_model(act_bytes); }));
      std::memcpy(h[0], x.data(), act_bytes);
      for (int l = 0; l < L; ++l) {
        auto s = again([&] {
          return rt.forward("layer" + std::to_string(l),
                            {w[static_cast<std::size_t>(l)], b[static_cast<std::size_t>(l)]});
        });
        const auto W = s.template param<float>(w[static_cast<std::size_t>(l)]);
        const auto bias = s.template param<float>(b[static_cast<std::size_t>(l)]);
        for (int n = 0; n < B; ++n)
          for (int o = 0; o < D; ++o) {
            float acc = bias[static_cast<std::size_t>(o)];
            for (int i = 0; i < D; ++i)
              acc += W[static_cast<std::size_t>(o * D + i)] * h[static_cast<std::size_t>(l)][n * D + i];
            h[static_cast<std::size_t>(l + 1)][n * D + o] = std::tanh(acc);
          }
      }
      float loss = 0;
      auto* dh = acts.take(again([&] { return rt.allocate_non_model(act_bytes); }));
      for (int i = 0; i < B * D; ++i) {
        const float d = h[static_cast<std::size_t>(L)][i] - y[static_cast<std::size_t>(i)];
        loss += 0.5f * d * d / static_cast<float>(B);
        dh[i] = d / static_cast<float>(B);
      }
      result.losses.push_back(loss);
      auto* dprev = acts.take(again([&] { return rt.allocate_non_model(act_bytes); }));
      for (int l = L - 1; l >= 0; --l) {
        auto s = again([&] {
          return rt.backward("layer" + std::to_string(l),
                             {w[static_cast<std::size_t>(l)], b[static_cast<std::size_t>(l)]});
        });
        const auto W = s.template param<float>(w[static_cast<std::size_t>(l)]);
        auto gW = s.template grad<float>(w[static_cast<std::size_t>(l)]);
        auto gb = s.template grad<float>(b[static_cast<std::size_t>(l)]);
        const float* out = h[static_cast<std::size_t>(l + 1)];
        const float* in = h[static_cast<std::size_t>(l)];
        for (int i = 0; i < B * D; ++i) dh[i] *= 1.0f - out[i] * out[i];  // through tanh
        for (int n = 0; n < B; ++n)
          for (int o = 0; o < D; ++o) {
            gb[static_cast<std::size_t>(o)] += dh[n * D + o];
            for (int i = 0; i < D; ++i) gW[static_cast<std::size_t>(o * D + i)] += dh[n * D + o] * in[n * D + i];
          }
        for (int n = 0; n < B; ++n)
          for (int i = 0; i < D; ++i) {
            float acc = 0;
            for (int o = 0; o < D; ++o) acc += W[static_cast<std::size_t>(o * D + i)] * dh[n * D + o];
            dprev[n * D + i] = acc;
          }
        std::swap(dh, dprev);
      }
      acts.release(dprev);
      acts.release(dh);
      for (auto* p : h) acts.release(p);

      // Scalar Adam over each chunk, wherever the placement put it.
      again([&] {
        rt.step([&](const step_chunk& c) {
          const float lr = 1e-2f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
          const float bc1 = 1.0f - std::pow(b1, static_cast<float>(step)),
                      bc2 = 1.0f - std::pow(b2, static_cast<float>(step));
          auto* p = static_cast<float*>(c.param);
          const auto* g = static_cast<const float*>(c.grad);
          for (auto t : c.tensors) {
            const auto& sl = c.slots[t];
            for (std::size_t i = sl.offset; i < sl.offset + sl.numel; ++i) {
              c.momentum[i] = b1 * c.momentum[i] + (1 - b1) * g[i];
              c.variance[i] = b2 * c.variance[i] + (1 - b2) * g[i] * g[i];
              p[i] -= lr * (c.momentum[i] / bc1) / (std::sqrt(c.variance[i] / bc2) + eps);
            }
          }
        });
      });
    }
  } catch (const std::exception& e) {
    result.error = e.what();
    result.stats = rt.stats();
    return result;
  }
  for (std::size_t t = 0; t < rt.params().size(); ++t) {
    std::vector<float> v(rt.params()[t].numel());
    again([&] { rt.read_tensor(param_id{static_cast<std::uint32_t>(t)}, chunk_kind::param, v); });
    result.params.insert(result.params.end(), v.begin(), v.end());
  }
  result.stats = rt.stats();
  result.peak_device = dev.usage().peak;
  result.peak_host = host.usage().peak;
  if (cfg.timeline) result.trace = rt.timeline_recorder().to_chrome_trace();
  for (auto k : {chunk_kind::param, chunk_kind::grad, chunk_kind::master, chunk_kind::momentum, chunk_kind::variance})
    if (rt.has_list(k))
      for (std::uint32_t c = 0; c < rt.plan().num_chunks; ++c) result.tiers.push_back({{k, c}, rt.where({k, c})});
  if (disk_io) {
    disk_io->synchronize();  // reads started ahead for the next iteration
    result.disk_engine = disk_io->stats();
  }
  return result;
}

}  // namespace chunkstar::testing
