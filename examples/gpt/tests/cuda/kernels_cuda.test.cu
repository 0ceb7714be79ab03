// SPDX-License-Identifier: Apache-2.0
// Every CUDA layer against the CPU float path (itself checked against finite differences in
// tests/kernels.test.cpp). Without a GPU the shared main exits 77 (skipped).
#include "kernels_cpu.hpp"
#include "kernels_cuda.cuh"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace kernels_cuda_test {

namespace {

// Both paths are FP32 but sum in different orders (warp trees, cuBLAS tiles vs sequential loops
// and OpenBLAS tiles); for reductions of K <= 4*96 terms the difference is ~sqrt(K) u ~ 1e-6 of
// the largest value and at worst K u ~ 2e-5. 1e-4 of the tensor's largest entry bounds that and is
// still far below what an indexing or formula error gives (errors of order the values).
constexpr double rel_tol = 1e-4;

#define CUDA_OK(expr) REQUIRE_MESSAGE((expr) == cudaSuccess, #expr)

template <class T>
struct device_buffer {
  T* ptr = nullptr;
  std::size_t n = 0;
  explicit device_buffer(std::size_t count) : n(count) {
    CUDA_OK(cudaMalloc(&ptr, std::max<std::size_t>(n, 1) * sizeof(T)));
  }
  explicit device_buffer(const std::vector<T>& v) : device_buffer(v.size()) { upload(v); }
  ~device_buffer() { cudaFree(ptr); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  void upload(const std::vector<T>& v) { CUDA_OK(cudaMemcpy(ptr, v.data(), n * sizeof(T), cudaMemcpyHostToDevice)); }
  std::vector<T> download() const {
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaGetLastError());
    std::vector<T> v(n);
    CUDA_OK(cudaMemcpy(v.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
};

struct cublas {
  cublasHandle_t h = nullptr;
  cublas() { REQUIRE(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS); }
  ~cublas() { cublasDestroy(h); }
  cublas(const cublas&) = delete;
  cublas& operator=(const cublas&) = delete;
};

std::vector<float> randn(std::size_t n, std::mt19937_64& g, float sd = 1.0f, float mean = 0.0f) {
  std::normal_distribution<float> d(mean, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

std::vector<int> random_tokens(std::size_t n, int vocab, std::mt19937_64& g) {
  std::uniform_int_distribution<int> d(0, vocab - 1);
  std::vector<int> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

void check_close(const std::string& what, const std::vector<float>& cpu, const std::vector<float>& gpu) {
  REQUIRE(cpu.size() == gpu.size());
  double scale = 0, err = 0;
  for (std::size_t i = 0; i < cpu.size(); ++i) {
    scale = std::max(scale, std::abs(static_cast<double>(cpu[i])));
    err = std::max(err, std::abs(static_cast<double>(cpu[i]) - gpu[i]));
  }
  INFO(what << ": max |cpu| " << scale << ", max |cpu - gpu| " << err);
  CHECK(err <= rel_tol * scale + 1e-30);
}

// Shapes: T not a multiple of 32 and C not a multiple of the warp so every strided loop has a
// ragged end; hs = 32; V = 256 as in the model.
constexpr std::size_t B = 2, T = 37, C = 96, NH = 3, V = 256, N = B * T;

}  // namespace

TEST_CASE("cuda encoder matches the CPU") {
  std::mt19937_64 g(1);
  const auto tokens = random_tokens(N, 7, g);  // few distinct tokens: many positions share a row
  const auto wte = randn(V * C, g), wpe = randn(T * C, g), dout = randn(N * C, g);
  const auto dwte0 = randn(V * C, g), dwpe0 = randn(T * C, g);
  std::vector<float> out(N * C), dwte = dwte0, dwpe = dwpe0;
  gpt::cpu::encoder_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
  gpt::cpu::encoder_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C);
  device_buffer<int> d_tok(tokens);
  device_buffer<float> d_wte(wte), d_wpe(wpe), d_out(N * C), d_dout(dout), d_dwte(dwte0), d_dwpe(dwpe0);
  gpt::cuda::encoder_forward(d_out.ptr, d_tok.ptr, d_wte.ptr, d_wpe.ptr, B, T, C);
  gpt::cuda::encoder_backward(d_dwte.ptr, d_dwpe.ptr, d_dout.ptr, d_tok.ptr, B, T, C);
  check_close("out", out, d_out.download());
  check_close("dwte", dwte, d_dwte.download());
  check_close("dwpe", dwpe, d_dwpe.download());
}

TEST_CASE("cuda layernorm matches the CPU") {
  std::mt19937_64 g(2);
  const auto x = randn(N * C, g, 2.0f, 3.0f), w = randn(C, g, 0.5f, 1.0f), b = randn(C, g), dout = randn(N * C, g);
  const auto dx0 = randn(N * C, g), dw0 = randn(C, g), db0 = randn(C, g);
  std::vector<float> out(N * C), mean(N), rstd(N), dx = dx0, dw = dw0, db = db0;
  gpt::cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
  gpt::cpu::layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), mean.data(),
                               rstd.data(), N, C);
  device_buffer<float> d_x(x), d_w(w), d_b(b), d_dout(dout), d_out(N * C), d_mean(N), d_rstd(N), d_dx(dx0), d_dw(dw0),
      d_db(db0);
  gpt::cuda::layernorm_forward(d_out.ptr, d_mean.ptr, d_rstd.ptr, d_x.ptr, d_w.ptr, d_b.ptr, N, C);
  gpt::cuda::layernorm_backward(d_dx.ptr, d_dw.ptr, d_db.ptr, d_dout.ptr, d_x.ptr, d_w.ptr, d_mean.ptr, d_rstd.ptr, N,
                                C);
  check_close("out", out, d_out.download());
  check_close("mean", mean, d_mean.download());
  check_close("rstd", rstd, d_rstd.download());
  check_close("dx", dx, d_dx.download());
  check_close("dw", dw, d_dw.download());
  check_close("db", db, d_db.download());
}

TEST_CASE("cuda matmul matches the CPU, with and without bias") {
  cublas h;
  for (bool with_bias : {true, false}) {
    std::mt19937_64 g(with_bias ? 3 : 4);
    const std::size_t OC = 3 * C;
    const auto x = randn(N * C, g), W = randn(OC * C, g, 0.1f), bias = randn(OC, g), dout = randn(N * OC, g);
    const auto dx0 = randn(N * C, g), dW0 = randn(OC * C, g), db0 = randn(OC, g);
    std::vector<float> out(N * OC), dx = dx0, dW = dW0, db = db0;
    gpt::cpu::matmul_forward(out.data(), x.data(), W.data(), with_bias ? bias.data() : nullptr, N, C, OC);
    gpt::cpu::matmul_backward(dx.data(), dW.data(), with_bias ? db.data() : nullptr, dout.data(), x.data(), W.data(), N,
                              C, OC);
    device_buffer<float> d_x(x), d_W(W), d_bias(bias), d_dout(dout), d_out(N * OC), d_dx(dx0), d_dW(dW0), d_db(db0);
    gpt::cuda::matmul_forward(h.h, d_out.ptr, d_x.ptr, d_W.ptr, with_bias ? d_bias.ptr : nullptr, N, C, OC);
    gpt::cuda::matmul_backward(h.h, d_dx.ptr, d_dW.ptr, with_bias ? d_db.ptr : nullptr, d_dout.ptr, d_x.ptr, d_W.ptr, N,
                               C, OC);
    INFO("bias: " << with_bias);
    check_close("out", out, d_out.download());
    check_close("dx", dx, d_dx.download());
    check_close("dW", dW, d_dW.download());
    check_close("dbias", db, d_db.download());
  }
}

TEST_CASE("cuda attention matches the CPU and repeats bit for bit") {
  cublas h;
  std::mt19937_64 g(5);
  const auto qkv = randn(N * 3 * C, g), dout = randn(N * C, g), dqkv0 = randn(N * 3 * C, g);
  std::vector<float> out(N * C), att(B * NH * T * T), dqkv = dqkv0, scratch(B * NH * T);
  gpt::cpu::attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);
  gpt::cpu::attention_backward(dqkv.data(), scratch.data(), dout.data(), qkv.data(), att.data(), B, T, C, NH);
  device_buffer<float> d_qkv(qkv), d_dout(dout), d_out(N * C), d_att(B * NH * T * T), d_dqkv(dqkv0),
      d_scratch(gpt::cuda::attention_scratch_elements(B, T, C, NH));
  const auto w = gpt::cuda::bind_attention_scratch(d_scratch.ptr, B, T, C);
  gpt::cuda::attention_forward(h.h, d_out.ptr, d_att.ptr, d_qkv.ptr, w, B, T, C, NH);
  gpt::cuda::attention_backward(h.h, d_dqkv.ptr, d_dout.ptr, d_qkv.ptr, d_att.ptr, w, B, T, C, NH);
  const auto g_out = d_out.download(), g_att = d_att.download(), g_dqkv = d_dqkv.download();
  check_close("out", out, g_out);
  check_close("att", att, g_att);
  check_close("dqkv", dqkv, g_dqkv);
  // again from the same inputs: no atomics, so the same bits
  d_dqkv.upload(dqkv0);
  gpt::cuda::attention_forward(h.h, d_out.ptr, d_att.ptr, d_qkv.ptr, w, B, T, C, NH);
  gpt::cuda::attention_backward(h.h, d_dqkv.ptr, d_dout.ptr, d_qkv.ptr, d_att.ptr, w, B, T, C, NH);
  const auto again = d_dqkv.download();
  CHECK(std::memcmp(again.data(), g_dqkv.data(), again.size() * sizeof(float)) == 0);
}

TEST_CASE("cuda gelu and residual match the CPU") {
  std::mt19937_64 g(6);
  const std::size_t n = 4 * N * C;
  const auto x = randn(n, g, 2.5f), y = randn(n, g), dout = randn(n, g), dx0 = randn(n, g), dy0 = randn(n, g);
  std::vector<float> gout(n), dx = dx0, rout(n), da = dx0, db = dy0;
  gpt::cpu::gelu_forward(gout.data(), x.data(), n);
  gpt::cpu::gelu_backward(dx.data(), x.data(), dout.data(), n);
  gpt::cpu::residual_forward(rout.data(), x.data(), y.data(), n);
  gpt::cpu::residual_backward(da.data(), db.data(), dout.data(), n);
  device_buffer<float> d_x(x), d_y(y), d_dout(dout), d_gout(n), d_dx(dx0), d_rout(n), d_da(dx0), d_db(dy0);
  gpt::cuda::gelu_forward(d_gout.ptr, d_x.ptr, n);
  gpt::cuda::gelu_backward(d_dx.ptr, d_x.ptr, d_dout.ptr, n);
  gpt::cuda::residual_forward(d_rout.ptr, d_x.ptr, d_y.ptr, n);
  gpt::cuda::residual_backward(d_da.ptr, d_db.ptr, d_dout.ptr, n);
  check_close("gelu", gout, d_gout.download());
  check_close("dgelu", dx, d_dx.download());
  check_close("residual", rout, d_rout.download());
  check_close("da", da, d_da.download());
  check_close("db", db, d_db.download());
}

TEST_CASE("cuda softmax + cross-entropy matches the CPU") {
  std::mt19937_64 g(7);
  const auto logits = randn(N * V, g, 3.0f), dl0 = randn(N * V, g);
  const auto targets = random_tokens(N, static_cast<int>(V), g);
  const float dloss = 1.0f / N;
  std::vector<float> probs(N * V), losses(N), dl = dl0;
  gpt::cpu::softmax_crossentropy_forward(probs.data(), losses.data(), logits.data(), targets.data(), N, V);
  gpt::cpu::softmax_crossentropy_backward(dl.data(), probs.data(), targets.data(), dloss, N, V);
  device_buffer<int> d_t(targets);
  device_buffer<float> d_logits(logits), d_probs(N * V), d_losses(N), d_dl(dl0);
  gpt::cuda::softmax_crossentropy_forward(d_probs.ptr, d_losses.ptr, d_logits.ptr, d_t.ptr, N, V);
  gpt::cuda::softmax_crossentropy_backward(d_dl.ptr, d_probs.ptr, d_t.ptr, dloss, N, V);
  check_close("probs", probs, d_probs.download());
  check_close("losses", losses, d_losses.download());
  check_close("dlogits", dl, d_dl.download());
}

}  // namespace kernels_cuda_test
