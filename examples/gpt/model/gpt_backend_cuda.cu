// SPDX-License-Identifier: Apache-2.0
// gpt::cuda_backend and gpt::cuda_adam_kernels (declared in gpt_backend_cuda.hpp): the GPT's
// stages composed from kernels_cuda.cuh exactly as gpt_model.hpp composes the CPU kernels, so the
// two paths compute the same mathematics in the same order of operations per stage.
#define GPT_CUBLAS_LAZY 1  // gpt::cuda::blas() is defined below, from a dlopen of libcublas
#include "gpt_backend_cuda.hpp"
#include "kernels_cuda.cuh"

#include <chunkstar/core/dtype.hpp>
#include <chunkstar/cuda/chunk_adam_kernels.cuh>
#include <chunkstar/cuda/cuda_error.hpp>
#include <chunkstar/cuda/stream.hpp>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include <dlfcn.h>

namespace gpt {

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw chunkstar::error(std::string("CUDA ") + what + " failed: " + cudaGetErrorString(e) +
                           " (is the GPU healthy and the device index right? CUDA_VISIBLE_DEVICES selects GPUs)");
}

/** cuBLAS's workspace for one handle: fixed, so every GEMM of a shape takes the same algorithm. */
constexpr std::size_t cublas_workspace_bytes = 32u << 20;

template <class T>
__global__ void widen_kernel(const T* src, float* dst, std::size_t n) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < n) dst[i] = static_cast<float>(src[i]);
}

/** dst = round(float(dst) + add): the same rounding (nearest even) as the host's narrow_from_float. */
template <class T>
__global__ void add_into_kernel(T* dst, const float* add, std::size_t n) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < n) dst[i] = T(static_cast<float>(dst[i]) + add[i]);
}

/** out = residual + (out + bias[column]): the CPU's order of the two additions. */
__global__ void bias_residual_kernel(float* out, const float* residual, const float* bias, std::size_t n,
                                     std::size_t C) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = residual[i] + (out[i] + bias[i % C]);
}

__global__ void fill_kernel(float* p, std::size_t n, float value) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < n) p[i] = value;
}

/** One thread per (token, channel). */
__global__ void embedding_shard_forward_kernel(float* out, const int* tokens, const float* shard, std::size_t v0,
                                               std::size_t vs, const float* wpe, std::size_t N, std::size_t Tn,
                                               std::size_t C) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= N * C) return;
  const std::size_t n = i / C, k = i % C, t = static_cast<std::size_t>(tokens[n]);
  if (t < v0 || t >= v0 + vs) return;
  out[i] = shard[(t - v0) * C + k] + wpe[(n % Tn) * C + k];
}

/** One thread per channel, tokens in order: each element's sum in the CPU's order. */
__global__ void embedding_shard_backward_kernel(float* g, const int* tokens, const float* dres, std::size_t v0,
                                                std::size_t vs, std::size_t N, std::size_t C) {
  const std::size_t k = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (k >= C) return;
  for (std::size_t n = 0; n < N; ++n) {
    const std::size_t t = static_cast<std::size_t>(tokens[n]);
    if (t >= v0 && t < v0 + vs) g[(t - v0) * C + k] += dres[n * C + k];
  }
}

/** One thread per (position, channel), tokens in order. */
__global__ void position_backward_kernel(float* g_wpe, const float* dres, std::size_t N, std::size_t Tn,
                                         std::size_t C) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= Tn * C) return;
  const std::size_t p = i / C, k = i % C;
  float acc = g_wpe[i];
  for (std::size_t n = p; n < N; n += Tn) acc += dres[n * C + k];
  g_wpe[i] = acc;
}

/** One thread per token: the online softmax's fold of one shard, columns in order. */
__global__ void head_shard_forward_kernel(float* mx, float* sum, float* zt, const float* z, const int* targets,
                                          std::size_t v0, std::size_t valid, std::size_t N, std::size_t vs) {
  const std::size_t n = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (n >= N) return;
  const float* row = z + n * vs;
  float m = mx[n];
  for (std::size_t v = 0; v < valid; ++v) m = fmaxf(m, row[v]);
  float acc = sum[n] * expf(mx[n] - m);
  for (std::size_t v = 0; v < valid; ++v) acc += expf(row[v] - m);
  mx[n] = m;
  sum[n] = acc;
  const std::size_t t = static_cast<std::size_t>(targets[n]);
  if (t >= v0 && t < v0 + valid) zt[n] = row[t - v0];
}

__global__ void head_losses_kernel(float* mx_lse, float* sum_losses, const float* zt, std::size_t N) {
  const std::size_t n = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (n >= N) return;
  const float m = mx_lse[n], l = logf(sum_losses[n]);
  mx_lse[n] = m + l;
  sum_losses[n] = l + (m - zt[n]);
}

/** One thread per (token, column). */
__global__ void head_shard_backward_kernel(float* z, const float* lse, const int* targets, float dloss, std::size_t v0,
                                           std::size_t valid, std::size_t N, std::size_t vs) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= N * vs) return;
  const std::size_t n = i / vs, v = i % vs;
  float d = v < valid ? dloss * expf(z[i] - lse[n]) : 0.0f;
  if (v < valid && static_cast<std::size_t>(targets[n]) == v0 + v) d -= dloss;
  z[i] = d;
}

}  // namespace

namespace cuda {
/** libcublas, loaded on first use and kept for the process: its soname is this toolkit's. */
const cublas_api& blas() {
  static cublas_api api{};
  static std::string failure;
  static std::once_flag once;
  std::call_once(once, [] {
    const std::string soname = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
    void* lib = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* why = dlerror();
      failure = "cannot load " + soname + " (" + (why ? why : "unknown") +
                "): install the CUDA toolkit's cuBLAS, or put its lib directory on LD_LIBRARY_PATH";
      return;
    }
    const auto take = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (!fn && failure.empty())
        failure = soname + " has no " + name + ": it is not the cuBLAS this trainer was built for";
    };
    take(api.create, "cublasCreate_v2");
    take(api.destroy, "cublasDestroy_v2");
    take(api.set_stream, "cublasSetStream_v2");
    take(api.set_math_mode, "cublasSetMathMode");
    take(api.set_atomics_mode, "cublasSetAtomicsMode");
    take(api.set_workspace, "cublasSetWorkspace_v2");
    take(api.sgemm, "cublasSgemm_v2");
    take(api.sgemm_strided_batched, "cublasSgemmStridedBatched");
  });
  if (!failure.empty()) throw chunkstar::error(failure);
  return api;
}
}  // namespace cuda

int cuda_device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

cuda_memory_info cuda_memory(int device) {
  const chunkstar::cuda::device_guard g(device);
  cuda_memory_info m;
  check(cudaMemGetInfo(&m.free, &m.total), "cudaMemGetInfo");
  return m;
}

std::string cuda_device_summary(int device) {
  cudaDeviceProp p{};
  check(cudaGetDeviceProperties(&p, device), "cudaGetDeviceProperties");
  const auto m = cuda_memory(device);
  const auto gib = [](std::size_t bytes) {
    char n[32];
    std::snprintf(n, sizeof n, "%.1f GiB", static_cast<double>(bytes) / (1u << 30));
    return std::string(n);
  };
  return std::string(p.name) + " (sm_" + std::to_string(p.major) + std::to_string(p.minor) + ", " +
         std::to_string(p.multiProcessorCount) + " SMs, " + gib(m.total) + ", " + gib(m.free) + " free)";
}

struct cuda_backend::state {
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  void* workspace = nullptr;
  std::vector<float> losses;          // the head's per-token losses, summed on the host
  cudaError_t pending = cudaSuccess;  // an error quiesce() could not throw

  explicit state(int d) : device(d) {
    const chunkstar::cuda::device_guard g(device);
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    try {
      const auto& api = cuda::blas();
      cuda::detail::check(api.create(&blas), "create");
      cuda::detail::check(api.set_stream(blas, stream), "set stream");
      cuda::detail::check(api.set_math_mode(blas, CUBLAS_PEDANTIC_MATH), "set math mode (pedantic: no TF32)");
      cuda::detail::check(api.set_atomics_mode(blas, CUBLAS_ATOMICS_NOT_ALLOWED), "set atomics mode");
      check(cudaMalloc(&workspace, cublas_workspace_bytes), "cudaMalloc (cuBLAS workspace)");
      cuda::detail::check(api.set_workspace(blas, workspace, cublas_workspace_bytes), "set workspace");
    } catch (...) {
      release();
      throw;
    }
  }
  ~state() { release(); }
  void release() noexcept {
    const chunkstar::cuda::device_guard g(device);
    if (stream) (void)cudaStreamSynchronize(stream);
    if (blas) (void)cuda::blas().destroy(blas);
    if (workspace) (void)cudaFree(workspace);
    if (stream) (void)cudaStreamDestroy(stream);
    blas = nullptr, workspace = nullptr, stream = nullptr;
  }
};

cuda_backend::cuda_backend() noexcept = default;
cuda_backend::cuda_backend(int device) : s_(std::make_unique<state>(device)) {}
cuda_backend::cuda_backend(cuda_backend&&) noexcept = default;
cuda_backend& cuda_backend::operator=(cuda_backend&&) noexcept = default;
cuda_backend::~cuda_backend() = default;

cudaStream_t cuda_backend::stream() const noexcept { return s_ ? s_->stream : nullptr; }
int cuda_backend::device() const noexcept { return s_ ? s_->device : -1; }

std::size_t cuda_backend::scratch_elems(const gpt_config& c, std::size_t B, std::size_t T) noexcept {
  return cuda::attention_scratch_elements(B, T, static_cast<std::size_t>(c.width), static_cast<std::size_t>(c.heads));
}

void cuda_backend::check_pending() {
  if (!s_) throw chunkstar::state_error("gpt::cuda_backend: used after being moved from; construct it with a device");
  if (s_->pending != cudaSuccess) check(std::exchange(s_->pending, cudaSuccess), "kernel (reported by a wait)");
}

void cuda_backend::quiesce() noexcept {
  if (!s_) return;
  const cudaError_t e = cudaStreamSynchronize(s_->stream);
  if (e != cudaSuccess && s_->pending == cudaSuccess) s_->pending = e;
}

void cuda_backend::to_compute(void* dst, const void* src, std::size_t bytes) {
  check_pending();
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s_->stream), "cudaMemcpyAsync (to the device)");
}

void cuda_backend::from_compute(void* dst, const void* src, std::size_t bytes) {
  check_pending();
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s_->stream), "cudaMemcpyAsync (from the device)");
  check(cudaStreamSynchronize(s_->stream), "cudaStreamSynchronize");
}

void cuda_backend::zero(float* p, std::size_t n) {
  check_pending();
  check(cudaMemsetAsync(p, 0, n * sizeof(float), s_->stream), "cudaMemsetAsync");
}

void cuda_backend::widen(const std::byte* src, chunkstar::dtype t, float* dst, std::size_t n) {
  check_pending();
  const unsigned grid = cuda::detail::grid_for(n);
  if (t == chunkstar::dtype::bf16)
    widen_kernel<<<grid, cuda::detail::block_size, 0, s_->stream>>>(reinterpret_cast<const chunkstar::bfloat16*>(src),
                                                                    dst, n);
  else if (t == chunkstar::dtype::f16)
    widen_kernel<<<grid, cuda::detail::block_size, 0, s_->stream>>>(reinterpret_cast<const chunkstar::float16*>(src),
                                                                    dst, n);
  else
    check(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, s_->stream),
          "cudaMemcpyAsync (widen)");
  check(cudaGetLastError(), "widen kernel launch");
}

void cuda_backend::add_into(std::byte* dst16, chunkstar::dtype t, const float* add, std::size_t n) {
  check_pending();
  const unsigned grid = cuda::detail::grid_for(n);
  if (t == chunkstar::dtype::bf16)
    add_into_kernel<<<grid, cuda::detail::block_size, 0, s_->stream>>>(reinterpret_cast<chunkstar::bfloat16*>(dst16),
                                                                       add, n);
  else if (t == chunkstar::dtype::f16)
    add_into_kernel<<<grid, cuda::detail::block_size, 0, s_->stream>>>(reinterpret_cast<chunkstar::float16*>(dst16),
                                                                       add, n);
  else add_into_kernel<<<grid, cuda::detail::block_size, 0, s_->stream>>>(reinterpret_cast<float*>(dst16), add, n);
  check(cudaGetLastError(), "gradient accumulation kernel launch");
}

void cuda_backend::embedding_forward(const gpt_config& c, std::size_t B, std::size_t T, const int* tokens,
                                     const float* wte, const float* wpe, float* out) {
  check_pending();
  cuda::encoder_forward(out, tokens, wte, wpe, B, T, static_cast<std::size_t>(c.width), s_->stream);
  check(cudaGetLastError(), "embedding kernel launch");
}

void cuda_backend::block_forward(const gpt_config& c, std::size_t B, std::size_t T, const block_params<float>& p,
                                 const float* x, const block_activations<float>& a, float* proj, float* scratch) {
  check_pending();
  const std::size_t N = B * T, C = c.width, NH = c.heads;
  cudaStream_t st = s_->stream;
  cublasHandle_t h = s_->blas;
  const auto w = cuda::bind_attention_scratch(scratch, B, T, C);
  cuda::layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, x, p.ln1_w, p.ln1_b, N, C, st);
  cuda::matmul_forward(h, a.qkv, a.ln1, p.qkv_w, p.qkv_b, N, C, 3 * C, st);
  cuda::attention_forward(h, a.atty, a.att, a.qkv, w, B, T, C, NH, st);
  cuda::matmul_forward(h, proj, a.atty, p.proj_w, p.proj_b, N, C, C, st);
  cuda::residual_forward(a.res2, x, proj, N * C, st);
  cuda::layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, p.ln2_w, p.ln2_b, N, C, st);
  cuda::matmul_forward(h, a.fch, a.ln2, p.fc_w, p.fc_b, N, C, 4 * C, st);
  cuda::gelu_forward(a.fch_gelu, a.fch, 4 * N * C, st);
  cuda::matmul_forward(h, proj, a.fch_gelu, p.fcproj_w, p.fcproj_b, N, 4 * C, C, st);
  cuda::residual_forward(a.res3, a.res2, proj, N * C, st);
  check(cudaGetLastError(), "block forward kernel launch");
}

double cuda_backend::head_forward(const gpt_config& c, std::size_t B, std::size_t T, const float* wte,
                                  const float* lnf_w, const float* lnf_b, const float* x,
                                  const head_activations<float>& a, const int* targets) {
  check_pending();
  const std::size_t N = B * T, C = c.width, V = c.vocab;
  cudaStream_t st = s_->stream;
  cuda::layernorm_forward(a.lnf, a.lnf_mean, a.lnf_rstd, x, lnf_w, lnf_b, N, C, st);
  cuda::matmul_forward(s_->blas, a.logits, a.lnf, wte, nullptr, N, C, V, st);
  cuda::softmax_crossentropy_forward(a.probs, a.losses, a.logits, targets, N, V, st);
  check(cudaGetLastError(), "head forward kernel launch");
  s_->losses.resize(N);
  from_compute(s_->losses.data(), a.losses, N * sizeof(float));
  return cpu::mean_loss(s_->losses.data(), N);
}

void cuda_backend::head_backward(const gpt_config& c, std::size_t B, std::size_t T, const float* wte,
                                 const float* lnf_w, const float* x, const head_activations<float>& a,
                                 const int* targets, float* g_wte, float* g_lnf_w, float* g_lnf_b,
                                 const backward_workspace<float>& w, float loss_scale) {
  check_pending();
  const std::size_t N = B * T, C = c.width, V = c.vocab;
  cudaStream_t st = s_->stream;
  zero(w.dlogits, N * V);
  cuda::softmax_crossentropy_backward(w.dlogits, a.probs, targets, loss_scale / static_cast<float>(N), N, V, st);
  zero(w.dln, N * C);
  cuda::matmul_backward(s_->blas, w.dln, g_wte, nullptr, w.dlogits, a.lnf, wte, N, C, V, st);
  zero(w.dres, N * C);
  cuda::layernorm_backward(w.dres, g_lnf_w, g_lnf_b, w.dln, x, lnf_w, a.lnf_mean, a.lnf_rstd, N, C, st);
  check(cudaGetLastError(), "head backward kernel launch");
}

void cuda_backend::block_backward(const gpt_config& c, std::size_t B, std::size_t T, const block_params<float>& p,
                                  const block_params<float>& g, const float* x, const block_activations<float>& a,
                                  const backward_workspace<float>& w, float* scratch) {
  check_pending();
  const std::size_t N = B * T, C = c.width, NH = c.heads;
  cudaStream_t st = s_->stream;
  cublasHandle_t h = s_->blas;
  // MLP branch
  zero(w.dfch_gelu, 4 * N * C);
  cuda::matmul_backward(h, w.dfch_gelu, g.fcproj_w, g.fcproj_b, w.dres, a.fch_gelu, p.fcproj_w, N, 4 * C, C, st);
  zero(w.dfch, 4 * N * C);
  cuda::gelu_backward(w.dfch, a.fch, w.dfch_gelu, 4 * N * C, st);
  zero(w.dln, N * C);
  cuda::matmul_backward(h, w.dln, g.fc_w, g.fc_b, w.dfch, a.ln2, p.fc_w, N, C, 4 * C, st);
  cuda::layernorm_backward(w.dres, g.ln2_w, g.ln2_b, w.dln, a.res2, p.ln2_w, a.ln2_mean, a.ln2_rstd, N, C, st);
  // attention branch
  zero(w.datty, N * C);
  cuda::matmul_backward(h, w.datty, g.proj_w, g.proj_b, w.dres, a.atty, p.proj_w, N, C, C, st);
  zero(w.dqkv, 3 * N * C);
  cuda::attention_backward(h, w.dqkv, w.datty, a.qkv, a.att, cuda::bind_attention_scratch(scratch, B, T, C), B, T, C,
                           NH, st);
  zero(w.dln, N * C);
  cuda::matmul_backward(h, w.dln, g.qkv_w, g.qkv_b, w.dqkv, a.ln1, p.qkv_w, N, C, 3 * C, st);
  cuda::layernorm_backward(w.dres, g.ln1_w, g.ln1_b, w.dln, x, p.ln1_w, a.ln1_mean, a.ln1_rstd, N, C, st);
  check(cudaGetLastError(), "block backward kernel launch");
}

void cuda_backend::embedding_backward(const gpt_config& c, std::size_t B, std::size_t T, const int* tokens,
                                      float* g_wte, float* g_wpe, const backward_workspace<float>& w) {
  check_pending();
  cuda::encoder_backward(g_wte, g_wpe, w.dres, tokens, B, T, static_cast<std::size_t>(c.width), s_->stream);
  check(cudaGetLastError(), "embedding backward kernel launch");
}

float* cuda_backend::allocate(std::size_t n) {
  check_pending();
  const chunkstar::cuda::device_guard g(s_->device);
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, n * sizeof(float));
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw chunkstar::error("gpt::cuda_backend: cudaMalloc of " + std::to_string(n * sizeof(float)) + " bytes failed (" +
                           cudaGetErrorString(e) + "): lower the micro-batch or the device budget");
  }
  return static_cast<float*>(p);
}

void cuda_backend::deallocate(float* p, std::size_t) noexcept {
  if (!p || !s_) return;
  quiesce();
  const chunkstar::cuda::device_guard g(s_->device);
  (void)cudaFree(p);
}

void cuda_backend::copy(float* dst, const float* src, std::size_t n) {
  check_pending();
  check(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, s_->stream),
        "cudaMemcpyAsync (device copy)");
}

void cuda_backend::add(float* acc, const float* x, std::size_t n) {
  check_pending();
  add_into_kernel<<<cuda::detail::grid_for(n), cuda::detail::block_size, 0, s_->stream>>>(acc, x, n);  // fp32: acc += x
  check(cudaGetLastError(), "add kernel launch");
}

void cuda_backend::bias_residual(float* out, const float* residual, const float* bias, std::size_t rows,
                                 std::size_t C) {
  check_pending();
  bias_residual_kernel<<<cuda::detail::grid_for(rows * C), cuda::detail::block_size, 0, s_->stream>>>(
      out, residual, bias, rows * C, C);
  check(cudaGetLastError(), "bias residual kernel launch");
}

void cuda_backend::add_column_sums(float* out, const float* in, std::size_t rows, std::size_t cols) {
  check_pending();
  cuda::detail::add_column_sums_kernel<<<cuda::detail::grid_for(cols), cuda::detail::block_size, 0, s_->stream>>>(
      out, in, static_cast<int>(rows), static_cast<int>(cols));
  check(cudaGetLastError(), "column sums kernel launch");
}

void cuda_backend::layernorm_forward(float* out, float* mean, float* rstd, const float* x, const float* w,
                                     const float* b, std::size_t N, std::size_t C) {
  check_pending();
  cuda::layernorm_forward(out, mean, rstd, x, w, b, N, C, s_->stream);
  check(cudaGetLastError(), "layernorm kernel launch");
}

void cuda_backend::layernorm_backward(float* dx, float* dw, float* db, const float* dout, const float* x,
                                      const float* w, const float* mean, const float* rstd, std::size_t N,
                                      std::size_t C) {
  check_pending();
  cuda::layernorm_backward(dx, dw, db, dout, x, w, mean, rstd, N, C, s_->stream);
  check(cudaGetLastError(), "layernorm backward kernel launch");
}

void cuda_backend::matmul_forward(float* out, const float* x, const float* w, const float* bias, std::size_t N,
                                  std::size_t C, std::size_t OC) {
  check_pending();
  cuda::matmul_forward(s_->blas, out, x, w, bias, N, C, OC, s_->stream);
  check(cudaGetLastError(), "matmul kernel launch");
}

void cuda_backend::matmul_backward(float* dx, float* dw, float* dbias, const float* dout, const float* x,
                                   const float* w, std::size_t N, std::size_t C, std::size_t OC) {
  check_pending();
  cuda::matmul_backward(s_->blas, dx, dw, dbias, dout, x, w, N, C, OC, s_->stream);
  check(cudaGetLastError(), "matmul backward kernel launch");
}

std::size_t cuda_backend::attention_scratch_elems(std::size_t B, std::size_t T, std::size_t C,
                                                  std::size_t NH) noexcept {
  return cuda::attention_scratch_elements(B, T, C, NH);
}

void cuda_backend::attention_forward(float* out, float* att, const float* qkv, std::size_t B, std::size_t T,
                                     std::size_t C, std::size_t NH, float* scratch) {
  check_pending();
  cuda::attention_forward(s_->blas, out, att, qkv, cuda::bind_attention_scratch(scratch, B, T, C), B, T, C, NH,
                          s_->stream);
  check(cudaGetLastError(), "attention kernel launch");
}

void cuda_backend::attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att, std::size_t B,
                                      std::size_t T, std::size_t C, std::size_t NH, float* scratch) {
  check_pending();
  cuda::attention_backward(s_->blas, dqkv, dout, qkv, att, cuda::bind_attention_scratch(scratch, B, T, C), B, T, C, NH,
                           s_->stream);
  check(cudaGetLastError(), "attention backward kernel launch");
}

void cuda_backend::gelu_forward(float* out, const float* x, std::size_t n) {
  check_pending();
  cuda::gelu_forward(out, x, n, s_->stream);
  check(cudaGetLastError(), "gelu kernel launch");
}

void cuda_backend::gelu_backward(float* dx, const float* x, const float* dout, std::size_t n) {
  check_pending();
  cuda::gelu_backward(dx, x, dout, n, s_->stream);
  check(cudaGetLastError(), "gelu backward kernel launch");
}

void cuda_backend::fill(float* p, std::size_t n, float value) {
  check_pending();
  fill_kernel<<<cuda::detail::grid_for(n), cuda::detail::block_size, 0, s_->stream>>>(p, n, value);
  check(cudaGetLastError(), "fill kernel launch");
}

void cuda_backend::embedding_shard_forward(float* out, const int* tokens, const float* shard, std::size_t v0,
                                           std::size_t vs, const float* wpe, std::size_t N, std::size_t Tn,
                                           std::size_t C) {
  check_pending();
  embedding_shard_forward_kernel<<<cuda::detail::grid_for(N * C), cuda::detail::block_size, 0, s_->stream>>>(
      out, tokens, shard, v0, vs, wpe, N, Tn, C);
  check(cudaGetLastError(), "embedding shard kernel launch");
}

void cuda_backend::embedding_shard_backward(float* g, const int* tokens, const float* dres, std::size_t v0,
                                            std::size_t vs, std::size_t N, std::size_t C) {
  check_pending();
  embedding_shard_backward_kernel<<<cuda::detail::grid_for(C), cuda::detail::block_size, 0, s_->stream>>>(
      g, tokens, dres, v0, vs, N, C);
  check(cudaGetLastError(), "embedding shard backward kernel launch");
}

void cuda_backend::position_backward(float* g_wpe, const float* dres, std::size_t N, std::size_t Tn, std::size_t C) {
  check_pending();
  position_backward_kernel<<<cuda::detail::grid_for(Tn * C), cuda::detail::block_size, 0, s_->stream>>>(g_wpe, dres, N,
                                                                                                        Tn, C);
  check(cudaGetLastError(), "position backward kernel launch");
}

void cuda_backend::head_shard_forward(float* mx, float* sum, float* zt, const float* z, const int* targets,
                                      std::size_t v0, std::size_t valid, std::size_t N, std::size_t vs) {
  check_pending();
  head_shard_forward_kernel<<<cuda::detail::grid_for(N), cuda::detail::block_size, 0, s_->stream>>>(
      mx, sum, zt, z, targets, v0, valid, N, vs);
  check(cudaGetLastError(), "head shard kernel launch");
}

void cuda_backend::head_losses(float* mx_lse, float* sum_losses, const float* zt, std::size_t N) {
  check_pending();
  head_losses_kernel<<<cuda::detail::grid_for(N), cuda::detail::block_size, 0, s_->stream>>>(mx_lse, sum_losses, zt, N);
  check(cudaGetLastError(), "head losses kernel launch");
}

void cuda_backend::head_shard_backward(float* z, const float* lse, const int* targets, float dloss, std::size_t v0,
                                       std::size_t valid, std::size_t N, std::size_t vs) {
  check_pending();
  head_shard_backward_kernel<<<cuda::detail::grid_for(N * vs), cuda::detail::block_size, 0, s_->stream>>>(
      z, lse, targets, dloss, v0, valid, N, vs);
  check(cudaGetLastError(), "head shard backward kernel launch");
}

chunkstar::grad_stats cuda_adam_kernels::scan(const void* grad, chunkstar::dtype t, std::size_t count, float scale,
                                              int threads) {
  return chunkstar::cuda::device_adam_kernels::scan(grad, t, count, scale, threads);
}

void cuda_adam_kernels::adam(const chunkstar::adam_chunk& c, const chunkstar::adam_hyper& h,
                             const chunkstar::adam_step_args& a) {
  chunkstar::cuda::device_adam_kernels::adam(c, h, a);
}

void cuda_adam_kernels::adam_async(const chunkstar::adam_chunk& c, const chunkstar::adam_hyper& h,
                                   const chunkstar::adam_step_args& a) {
  chunkstar::cuda::device_adam_kernels::adam_async(c, h, a);
}

cudaStream_t cuda_adam_kernels::stream() noexcept { return chunkstar::cuda::device_adam_kernels::stream(); }

}  // namespace gpt
