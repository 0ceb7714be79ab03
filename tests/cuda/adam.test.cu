// SPDX-License-Identifier: Apache-2.0
// Device Adam/AdamW and gradient checks against the host kernels. Skips (exit 77) without a GPU.
#include <chunkstar/cuda/adam.cuh>
#include <chunkstar/optim/grad_check.hpp>

#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

// Inside namespace chunkstar rather than `using namespace chunkstar`: with the using-directive,
// `cuda` is ambiguous (chunkstar::cuda vs CCCL's ::cuda) in the stub code nvcc generates.
namespace chunkstar {
namespace adam_test {

void ok(cudaError_t e) { REQUIRE_MESSAGE(e == cudaSuccess, cudaGetErrorString(e)); }

template <class T>
struct dev_buf {
  T* p = nullptr;
  std::size_t n = 0;
  explicit dev_buf(const std::vector<T>& h) : n(h.size()) {
    ok(cudaMalloc(reinterpret_cast<void**>(&p), (n ? n : 1) * sizeof(T)));
    if (n) ok(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~dev_buf() { cudaFree(p); }
  std::vector<T> get() const {
    std::vector<T> h(n);
    if (n) ok(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

template <class G, class P>
void compare(std::size_t n, std::size_t offset) {
  std::mt19937 rng(17);
  std::normal_distribution<float> d(0.0f, 0.3f);
  std::vector<float> master(n + offset), m(n + offset, 0.0f), v(n + offset, 0.0f);
  for (auto& x : master) x = d(rng);
  std::vector<G> g(n + offset);
  const bool write = !std::is_same_v<P, float>;
  std::vector<P> p(n + offset);
  dev_buf<float> dmaster(master), dm(m), dv(v);
  dev_buf<P> dp(p);
  for (std::int64_t t = 1; t <= 6; ++t) {
    for (auto& x : g) x = from_float<G>(d(rng));
    dev_buf<G> dg(g);
    const adam_hyper h{.lr = 2e-3f, .weight_decay = 0.05f, .mode = t % 2 ? adam_mode::adamw : adam_mode::adam};
    const adam_step_args a{.step = t, .grad_scale = 0.75f};
    auto sub = [&](auto* base) { return std::span(base + offset, n); };
    adam_update_isa<cpu_isa::portable, G, P>(sub(master.data()), sub(m.data()), sub(v.data()),
                                             std::span<const G>(g.data() + offset, n),
                                             write ? sub(p.data()) : std::span<P>{}, h, a);
    cuda::adam_update_device<G, P>(sub(dmaster.p), sub(dm.p), sub(dv.p), std::span<const G>(dg.p + offset, n),
                                   write ? sub(dp.p) : std::span<P>{}, h, a, nullptr);
    ok(cudaDeviceSynchronize());
  }
  // Tolerance zero: the device kernel runs the host's sequence of IEEE operations, each correctly
  // rounded (__fmaf_rn, __fmul_rn, __fdiv_rn, __fsqrt_rn, RNE conversions), on the same per-call
  // constants, so every element must match bit for bit.
  CHECK(std::memcmp(dmaster.get().data(), master.data(), master.size() * 4) == 0);
  CHECK(std::memcmp(dm.get().data(), m.data(), m.size() * 4) == 0);
  CHECK(std::memcmp(dv.get().data(), v.data(), v.size() * 4) == 0);
  CHECK(std::memcmp(dp.get().data(), p.data(), p.size() * sizeof(P)) == 0);
}

}  // namespace adam_test
using namespace adam_test;

TEST_CASE_TEMPLATE("device Adam matches the host kernel", G, float, float16, bfloat16) {
  compare<G, float>(1 << 20, 0);    // vectorised loads
  compare<G, float16>(100003, 0);   // vectorised with a tail
  compare<G, bfloat16>(100003, 1);  // misaligned: scalar path
}

TEST_CASE("adam_step_device dispatches like adam_step_host") {
  const std::size_t n = 4099;
  std::vector<float> master(n, 0.5f), m(n, 0.0f), v(n, 0.0f);
  std::vector<float16> g(n, float16(0.25f)), p(n);
  dev_buf<float> dmaster(master), dm(m), dv(v);
  dev_buf<float16> dg(g), dp(p);
  adam_step_host({.master = master.data(),
                  .m = m.data(),
                  .v = v.data(),
                  .count = n,
                  .grad = g.data(),
                  .grad_type = dtype::f16,
                  .param = p.data(),
                  .param_type = dtype::f16},
                 {.lr = 0.01f}, {.step = 1});
  cuda::adam_step_device({.master = dmaster.p,
                          .m = dm.p,
                          .v = dv.p,
                          .count = n,
                          .grad = dg.p,
                          .grad_type = dtype::f16,
                          .param = dp.p,
                          .param_type = dtype::f16},
                         {.lr = 0.01f}, {.step = 1}, nullptr);
  ok(cudaDeviceSynchronize());
  CHECK(dmaster.get() == master);
  CHECK(dp.get() == p);
}

TEST_CASE_TEMPLATE("device gradient checks match the host", G, float, float16, bfloat16) {
  const std::size_t n = 3000017;
  std::mt19937 rng(5);
  std::normal_distribution<float> d(0.0f, 2.0f);
  std::vector<G> g(n);
  for (auto& x : g) x = from_float<G>(d(rng));
  dev_buf<G> dg(g);
  std::vector<double> zero(1, 0.0);
  dev_buf<double> dsum(zero);
  cuda::sum_of_squares_device<G>(std::span<const G>(dg.p, n), 0.5f, dsum.p, nullptr);
  const double host = sum_of_squares<G>(g, 0.5f);
  // Different association of n positive double terms: within n * 2^-53 relative.
  CHECK(std::abs(dsum.get()[0] - host) <= host * double(n) * std::ldexp(1.0, -53));
  CHECK(cuda::all_finite_device<G>(std::span<const G>(dg.p, n), nullptr));
  g[n - 2] = from_float<G>(std::numeric_limits<float>::quiet_NaN());
  dev_buf<G> dbad(g);
  CHECK_FALSE(cuda::all_finite_device<G>(std::span<const G>(dbad.p, n), nullptr));
}

}  // namespace chunkstar
