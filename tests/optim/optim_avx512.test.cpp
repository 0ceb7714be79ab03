// SPDX-License-Identifier: Apache-2.0
// The AVX-512 Adam path from a translation unit built with -mavx512f (through the
// chunkstar::isa_avx512 helper target, see optim_isa.cmake): the helper still works, and such a TU
// gets the same bits as the portable path. Every build compiles the AVX-512 path (run-time
// dispatch); this one runs only on CPUs with AVX-512F.
#include <chunkstar/optim/adam.hpp>

#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

using namespace chunkstar;

namespace optim_avx512_test {

#if CHUNKSTAR_ISA_DISPATCH
namespace {
template <class G, class P>
void compare_with_portable() {
  constexpr std::size_t n = 70001;
  std::mt19937 rng(9);
  std::normal_distribution<float> d(0.0f, 0.5f);
  std::vector<float> master(n), m(n, 0.0f), v(n, 0.0f);
  for (auto& x : master) x = d(rng);
  std::vector<G> g(n);
  std::vector<P> p(n), p2(n);
  auto master2 = master, m2 = m, v2 = v;
  for (std::int64_t t = 1; t <= 4; ++t) {
    for (auto& x : g) x = from_float<G>(d(rng));
    const adam_hyper h{.lr = 1e-2f, .weight_decay = 0.1f, .mode = t % 2 ? adam_mode::adamw : adam_mode::adam};
    adam_update_isa<cpu_isa::avx512, G, P>(master, m, v, std::span<const G>(g), std::span<P>(p), h, {.step = t});
    adam_update_isa<cpu_isa::portable, G, P>(master2, m2, v2, std::span<const G>(g), std::span<P>(p2), h, {.step = t});
  }
  CHECK(std::memcmp(master.data(), master2.data(), n * 4) == 0);
  CHECK(std::memcmp(m.data(), m2.data(), n * 4) == 0);
  CHECK(std::memcmp(v.data(), v2.data(), n * 4) == 0);
  CHECK(std::memcmp(p.data(), p2.data(), n * sizeof(P)) == 0);
}
}  // namespace
#endif

TEST_CASE("AVX-512 Adam is bit-identical to the portable path") {
#if CHUNKSTAR_ISA_DISPATCH
  if (!cpu_isa_supported(cpu_isa::avx512)) {
    std::printf("SKIPPED: this CPU has no AVX-512F (the AVX-512 path was compiled, not run)\n");
    std::exit(77);
  }
  compare_with_portable<float, float16>();
  compare_with_portable<float16, float16>();
  compare_with_portable<bfloat16, bfloat16>();
  compare_with_portable<float, bfloat16>();
#else
  std::printf("SKIPPED: this build has no AVX-512 path (CHUNKSTAR_ISA_DISPATCH is 0)\n");
  std::exit(77);
#endif
}

}  // namespace optim_avx512_test
