// SPDX-License-Identifier: Apache-2.0
// quickstart: chunkstar in one page, no GPU needed.
//
// A small MLP learns to halve its input. Every parameter, gradient and Adam moment lives in
// chunkstar's chunks; the simulated "device" holds the activations plus only a third of the model
// data, so the runtime moves chunks between device and host every step. The same training with
// everything resident must give exactly the same weights (the same-bits guarantee).
//
// usage: quickstart [--quiet]
#include <chunkstar/chunkstar.hpp>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

using namespace chunkstar;

namespace {

constexpr int layers = 6, width = 64, batch = 16, steps = 40;
constexpr float learning_rate = 3e-3f;
constexpr double device_share = 0.33;  // of the model data, beside the activations

struct result {
  std::vector<float> weights;
  float first_loss = 0, last_loss = 0;
  runtime_stats stats;
  std::size_t model_bytes = 0, device_bytes = 0;
};

/** Trains the MLP with a device of activations + @p share of the model data. */
result train(double share) {
  const std::size_t act_bytes = batch * width * sizeof(float), activations = (layers + 3) * act_bytes;
  std::vector<tensor_spec> specs;
  for (int l = 0; l < layers; ++l) {
    specs.push_back({"l" + std::to_string(l) + ".w", {width, width}, dtype::f32, tensor_role::weight});
    specs.push_back({"l" + std::to_string(l) + ".b", {width}, dtype::f32, tensor_role::bias});
  }
  // Model data is known before any memory exists, so the device can be sized from it.
  const std::size_t model = estimate_model_bytes(specs, searched_chunk_layout());
  simulated_device_space device(
      {.capacity = activations + static_cast<std::size_t>(share * static_cast<double>(model))});
  host_space host;
  host_copy_engine copier;
  patrickstar_runtime rt(device, host, copier);
  std::vector<param_id> w, b;
  for (int l = 0; l < layers; ++l) {
    w.push_back(rt.register_param(specs[2 * l], [l](std::span<float> v) {
      for (std::size_t i = 0; i < v.size(); ++i)
        v[i] = 0.15f * std::sin(1.3f * static_cast<float>(i) + static_cast<float>(l));
    }));
    b.push_back(rt.register_param(specs[2 * l + 1]));
  }
  rt.finalize();
  chunk_adam<> adam({.max_grad_norm = 1.0f});

  result r;
  for (int step = 0; step < steps; ++step) {
    // Forward: h[l+1] = tanh(W_l h[l] + b_l); activations come from the runtime, so it budgets them.
    std::vector<non_model_buffer<float, patrickstar_runtime>> h;
    for (int l = 0; l <= layers; ++l) h.push_back(rt.allocate_buffer<float>(batch * width));
    for (int i = 0; i < batch * width; ++i) h[0].data()[i] = std::cos(0.37f * static_cast<float>(i));
    for (int l = 0; l < layers; ++l) {
      auto s = rt.forward("layer" + std::to_string(l), {w[l], b[l]});  // resident on the device here
      const auto W = s.param<float>(w[l]);
      const auto bias = s.param<float>(b[l]);
      for (int n = 0; n < batch; ++n)
        for (int o = 0; o < width; ++o) {
          float acc = bias[o];
          for (int i = 0; i < width; ++i) acc += W[o * width + i] * h[l].data()[n * width + i];
          h[l + 1].data()[n * width + o] = std::tanh(acc);
        }
    }
    // Loss: mean squared distance to a fixed target; then backward in reverse, accumulating (+=).
    auto dh = rt.allocate_buffer<float>(batch * width), dprev = rt.allocate_buffer<float>(batch * width);
    float loss = 0;
    for (int i = 0; i < batch * width; ++i) {
      const float d = h[layers].data()[i] - 0.5f * h[0].data()[i];  // learn to halve the input
      loss += d * d / (batch * width);
      dh.data()[i] = 2 * d / (batch * width);
    }
    for (int l = layers - 1; l >= 0; --l) {
      auto s = rt.backward("layer" + std::to_string(l), {w[l], b[l]});
      const auto W = s.param<float>(w[l]);
      auto gW = s.grad<float>(w[l]);
      auto gb = s.grad<float>(b[l]);
      for (int i = 0; i < batch * width; ++i) dh.data()[i] *= 1 - h[l + 1].data()[i] * h[l + 1].data()[i];
      for (int n = 0; n < batch; ++n)
        for (int o = 0; o < width; ++o) {
          const float g = dh.data()[n * width + o];
          gb[o] += g;
          for (int i = 0; i < width; ++i) gW[o * width + i] += g * h[l].data()[n * width + i];
        }
      for (int n = 0; n < batch; ++n)
        for (int i = 0; i < width; ++i) {
          float acc = 0;
          for (int o = 0; o < width; ++o) acc += W[o * width + i] * dh.data()[n * width + o];
          dprev.data()[n * width + i] = acc;
        }
      std::swap(dh, dprev);
    }
    adam.step(rt, learning_rate);  // each chunk's step runs where the placement put its state
    (step == 0 ? r.first_loss : r.last_loss) = loss;
  }
  for (auto id : w) {
    std::vector<float> v(rt.spec(id).numel());
    rt.read_tensor(id, chunk_kind::param, v);
    r.weights.insert(r.weights.end(), v.begin(), v.end());
  }
  r.stats = rt.stats();
  r.model_bytes = rt.model_bytes();
  r.device_bytes = device.capacity();
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const bool quiet = argc > 1 && std::strcmp(argv[1], "--quiet") == 0;
  const result offloaded = train(device_share);
  const result resident = train(1.0);
  const auto& s = offloaded.stats;
  if (!quiet) {
    std::printf("model data %s on a device of %s: %s moved in %llu loads (%llu ahead, %llu hits) and %llu evictions\n",
                format_bytes(offloaded.model_bytes).c_str(), format_bytes(offloaded.device_bytes).c_str(),
                format_bytes(s.bytes_moved()).c_str(), static_cast<unsigned long long>(s.loads),
                static_cast<unsigned long long>(s.prefetches), static_cast<unsigned long long>(s.prefetch_hits),
                static_cast<unsigned long long>(s.evictions));
    std::printf("loss %.5f -> %.5f; device peak %s (chunks %s, activations %s)\n", offloaded.first_loss,
                offloaded.last_loss, format_bytes(s.peak_device_bytes).c_str(),
                format_bytes(s.peak_device_chunk_bytes).c_str(), format_bytes(s.peak_non_model_bytes).c_str());
  }
  const bool same = offloaded.weights == resident.weights;
  const bool learned = offloaded.last_loss < 0.1f * offloaded.first_loss;
  const bool moved = s.bytes_to_host > 0 && s.peak_device_bytes <= offloaded.device_bytes;
  std::printf(
      "quickstart: %s (same weights as all-resident: %s, loss down tenfold: %s, chunks moved within the device: %s)\n",
      same && learned && moved ? "OK" : "FAILED", same ? "yes" : "no", learned ? "yes" : "no", moved ? "yes" : "no");
  return same && learned && moved ? 0 : 1;
}
