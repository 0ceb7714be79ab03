// SPDX-License-Identifier: Apache-2.0
// Built and run with clang++ by the package_clang test (tests/package/clang_check.cmake), with
// -Wall -Wextra -Werror, once with the default flags (the AVX2 and AVX-512 kernels then exist only
// through chunkstar's target regions: the run-time dispatch under clang) and once with
// -march=native where clang accepts it. Every path the CPU can run must give the portable bits.
// It keeps clang-only breakage fixed: the simplest construction of the runtime, with every policy
// defaulted, copy-list-initializes its defaulted `Layout layout = {}` parameter, which clang
// rejected while the layouts' only constructor was explicit ("chosen constructor is explicit in
// copy-initialization"; GCC accepts it).
#include <chunkstar/chunkstar.hpp>

#include <cstdio>
#include <string>
#include <vector>

int main() {
  using namespace chunkstar;
  {  // every ISA path the CPU supports, against the portable one
    constexpr std::size_t n = 4099;
    std::vector<float> ref;
    for (cpu_isa isa : {cpu_isa::portable, cpu_isa::avx2, cpu_isa::avx512}) {
      if (!cpu_isa_supported(isa)) continue;
      const scoped_cpu_isa forced(isa);
      std::vector<float> master(n), m(n, 0.0f), v(n, 0.0f), g(n);
      std::vector<bfloat16> p(n);
      for (std::size_t i = 0; i < n; ++i)
        master[i] = 0.001f * static_cast<float>(i % 101), g[i] = 0.01f * static_cast<float>(i % 17) - 0.08f;
      adam_update<float, bfloat16>(master, m, v, std::span<const float>(g), std::span<bfloat16>(p), {.lr = 1e-2f},
                                   {.step = 2});
      const double sq = sum_of_squares<float>(std::span<const float>(g));
      master.push_back(static_cast<float>(sq));
      if (ref.empty()) ref = master;
      else if (master != ref) {
        std::printf("FAIL: the %s path differs from the portable one\n", std::string(cpu_isa_name(isa)).c_str());
        return 1;
      }
    }
  }
  simulated_device_space device({.capacity = std::size_t{64} << 20});
  host_space host;
  host_copy_engine copier;
  patrickstar_runtime rt(device, host, copier);
  // The other layout too: a fixed_chunk_layout defaulted the same way (never finalized here: its
  // default chunk is 32 Mi elements).
  chunk_runtime<fixed_chunk_layout> fixed_rt(device, host, copier);
  (void)fixed_rt;

  std::vector<param_id> layers;
  for (int l = 0; l < 4; ++l)
    layers.push_back(rt.register_param({"layer" + std::to_string(l), {64, 64}, dtype::f32, tensor_role::weight},
                                       [](std::span<float> w) {
                                         for (float& x : w) x = 0.5f;
                                       }));
  rt.finalize();
  chunk_adam<> adam({.max_grad_norm = 1.0f});
  for (int step = 0; step < 2; ++step) {
    for (auto w : layers) {
      auto s = rt.forward(rt.spec(w).name, {w});
      (void)s.param<float>(w);
    }
    for (auto it = layers.rbegin(); it != layers.rend(); ++it) {
      auto s = rt.backward(rt.spec(*it).name, {*it});
      for (float& g : s.grad<float>(*it)) g += 0.25f;
    }
    adam.step(rt, 1e-2f);
  }
  auto s = rt.forward(rt.spec(layers[0]).name, {layers[0]});
  const float w0 = s.param<float>(layers[0])[0];
  std::printf("clang consumer: flags' isa %s, kernels %s, layer0[0] = %g\n",
              std::string(cpu_isa_name(native_cpu_isa)).c_str(), cpu_isa_report().c_str(), static_cast<double>(w0));
  if (!(w0 < 0.5f)) {
    std::printf("FAIL: two Adam steps on positive gradients did not lower the weights\n");
    return 1;
  }
  std::printf("clang consumer OK\n");
  return 0;
}
