// SPDX-License-Identifier: Apache-2.0
// A CPU-only consumer compiled for this machine's ISA (chunkstar::isa_native: -march=native) with
// -Wall -Wextra -Werror, built by the package_native test (tests/package/native/). The SIMD Adam
// kernels are header-only, so these are the flags they are compiled with here: the program checks
// that the fast path was chosen where the CPU has it, that it gives the portable path's bits, and
// runs a small Adam step through the runtime, then saves and loads it as a checkpoint.
#include <chunkstar/chunkstar.hpp>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <unistd.h>

namespace {

int failures = 0;
void check(bool ok, const char* what) {
  if (!ok) {
    std::printf("FAIL: %s\n", what);
    ++failures;
  }
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// One Adam step of native_cpu_isa against the portable path, on an odd length (vector body + tail).
template <class G, class P>
void compare_with_portable(const char* what) {
  using namespace chunkstar;
  constexpr std::size_t n = 4099;
  std::vector<float> master(n), m(n), v(n);
  std::vector<G> grad(n);
  for (std::size_t i = 0; i < n; ++i) {
    master[i] = 0.01f * static_cast<float>(i % 97) - 0.4f;
    m[i] = 0.001f * static_cast<float>(i % 13);
    v[i] = 0.0001f * static_cast<float>(i % 7);
    grad[i] = from_float<G>(std::sin(static_cast<float>(i)) * 0.5f);
  }
  auto master2 = master, m2 = m, v2 = v;
  std::vector<P> out(n), out2(n);
  const adam_hyper h{.lr = 1e-2f, .weight_decay = 0.01f};
  const adam_step_args a{.step = 3, .grad_scale = 0.5f};
  adam_update<G, P>(master, m, v, std::span<const G>(grad), std::span<P>(out), h, a);
  adam_update_isa<cpu_isa::portable, G, P>(master2, m2, v2, std::span<const G>(grad), std::span<P>(out2), h, a);
  check(same_bits(master, master2) && same_bits(m, m2) && same_bits(v, v2) && same_bits(out, out2), what);
  const grad_stats s = scan_gradients<G>(std::span<const G>(grad), 2.0f);
  check(s.all_finite && s.sum_sq > 0, "scan_gradients");
}

}  // namespace

int main() {
  using namespace chunkstar;

#if defined(__x86_64__) || defined(__i386__)
  // -march=native must reach the kernels: on a CPU with AVX2+FMA+F16C they may not stay portable.
  __builtin_cpu_init();
  const bool cpu_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool cpu_avx512 = __builtin_cpu_supports("avx512f");
  check(!cpu_avx2 || native_cpu_isa != cpu_isa::portable, "-march=native on an AVX2 CPU chose the portable path");
  check(!cpu_avx512 || native_cpu_isa == cpu_isa::avx512, "-march=native on an AVX-512F CPU did not choose avx512");
#endif
  // The kernels choose at run time, whatever this TU's flags: the CPU's widest path.
  check(active_cpu_isa() == detected_cpu_isa(), "the kernels run the CPU's widest ISA");
  check(native_cpu_isa != cpu_isa::avx512 || active_cpu_isa() == cpu_isa::avx512,
        "an AVX-512 TU runs the AVX-512 kernels");

  compare_with_portable<float, float>("f32 grads, f32 params: SIMD == portable");
  compare_with_portable<bfloat16, bfloat16>("bf16 grads, bf16 params: SIMD == portable");
  compare_with_portable<float16, float16>("f16 grads, f16 params: SIMD == portable");
  compare_with_portable<float, bfloat16>("f32 grads, bf16 params: SIMD == portable");

  // A small Adam step through the runtime, as the README snippet does it (the default layout: one
  // chunk of 1 Mi elements, 4 MiB per list).
  simulated_device_space device({.capacity = std::size_t{64} << 20});
  host_space host;
  host_copy_engine copier;
  patrickstar_runtime rt(device, host, copier);
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
  {
    auto s = rt.forward(rt.spec(layers[0]).name, {layers[0]});
    const auto w = s.param<float>(layers[0]);
    check(std::isfinite(w[0]) && w[0] < 0.5f, "two Adam steps on positive gradients lowered the weights");
  }

  // A checkpoint saved and loaded into a fresh runtime: instantiates the safetensors writer and
  // reader under this consumer's -O3 -Wall -Wextra -Werror (GCC 12 once warned inside them).
  {
    const auto dir = std::filesystem::temp_directory_path() / ("chunkstar_native_ck_" + std::to_string(::getpid()));
    save_checkpoint(rt, dir);
    simulated_device_space device2({.capacity = std::size_t{64} << 20});
    patrickstar_runtime back(device2, host, copier);
    for (int l = 0; l < 4; ++l)
      (void)back.register_param({"layer" + std::to_string(l), {64, 64}, dtype::f32, tensor_role::weight},
                                [](std::span<float> w) {
                                  for (float& x : w) x = 0.0f;
                                });
    back.finalize();
    (void)load_checkpoint(back, dir);
    std::filesystem::remove_all(dir);
    auto a = rt.forward(rt.spec(layers[3]).name, {layers[3]});
    auto b = back.forward(back.spec(layers[3]).name, {layers[3]});
    const auto wa = a.param<float>(layers[3]);
    const auto wb = b.param<float>(layers[3]);
    check(std::memcmp(wa.data(), wb.data(), wa.size_bytes()) == 0,
          "a checkpoint saved and loaded gives the same weights");
  }

  std::printf("isa: %s (kernels: %s)\n", std::string(cpu_isa_name(native_cpu_isa)).c_str(), cpu_isa_report().c_str());
  if (failures == 0) std::printf("native consumer OK\n");
  return failures == 0 ? 0 : 1;
}
