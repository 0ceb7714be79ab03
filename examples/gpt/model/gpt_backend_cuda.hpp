// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `gpt::cuda_backend`: chunked_gpt's layers on a GPU — the CUDA kernels of kernels_cuda.cuh
 *         and cuBLAS on one non-blocking stream — and `gpt::cuda_adam_kernels`, chunk_adam's device
 *         step. Declared here for the host compiler; defined in gpt_backend_cuda.cu (nvcc), which the
 *         `gpt_backend_cuda` library builds, so a trainer compiled by g++ or clang can use them.
 *
 *  Determinism: cuBLAS runs in FP32 (no TF32: CUBLAS_DEFAULT_MATH is not allowed to down-convert,
 *  pedantic math), with atomics disallowed and a fixed workspace owned by the backend, so a GEMM picks
 *  the same algorithm every call and a run repeats bit for bit on the same GPU whatever the chunk
 *  budget, eviction policy or prefetch depth: the kernels see the same values at the same addresses'
 *  offsets, and nothing they compute depends on where a chunk lives or when it arrived.
 */
#pragma once

#include "gpt_backend.hpp"

#include <chunkstar/runtime/chunk_adam.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <string>

namespace gpt {

/** @brief GPUs the CUDA runtime sees (0 when there is no driver or no device). Never throws. */
int cuda_device_count() noexcept;

/** @brief "NVIDIA H200 (sm_90, 139.8 GiB, 138.9 GiB free)" for @p device. */
std::string cuda_device_summary(int device);

/** @brief Free and total memory of @p device, in bytes (cudaMemGetInfo). */
struct cuda_memory_info {
  std::size_t free = 0, total = 0;
};
cuda_memory_info cuda_memory(int device);

/** @brief The layers on CUDA device @p device (see gpt_backend.hpp for the contract). Move-only. */
class cuda_backend {
 public:
  using stream_type = cudaStream_t;
  static constexpr bool host_memory = false;

  /** An empty backend (no stream): only to be assigned to. */
  cuda_backend() noexcept;
  explicit cuda_backend(int device);
  cuda_backend(cuda_backend&&) noexcept;
  cuda_backend& operator=(cuda_backend&&) noexcept;
  ~cuda_backend();

  [[nodiscard]] cudaStream_t stream() const noexcept;
  [[nodiscard]] int device() const noexcept;
  /** Attention's per-head copies of q, k, v and y and their gradients, and d(att). */
  static std::size_t scratch_elems(const gpt_config& c, std::size_t B, std::size_t T) noexcept;

  /** Waits for the stream. Never throws: an error is kept and thrown by the next call that can. */
  void quiesce() noexcept;
  void to_compute(void* dst, const void* src, std::size_t bytes);
  void from_compute(void* dst, const void* src, std::size_t bytes);
  void zero(float* p, std::size_t n);
  void widen(const std::byte* src, chunkstar::dtype t, float* dst, std::size_t n);
  void add_into(std::byte* dst16, chunkstar::dtype t, const float* add, std::size_t n);

  void embedding_forward(const gpt_config& c, std::size_t B, std::size_t T, const int* tokens, const float* wte,
                         const float* wpe, float* out);
  void block_forward(const gpt_config& c, std::size_t B, std::size_t T, const block_params<float>& p, const float* x,
                     const block_activations<float>& a, float* proj, float* scratch);
  /** Waits for the losses and returns their mean, summed on the host in the CPU trainer's order. */
  double head_forward(const gpt_config& c, std::size_t B, std::size_t T, const float* wte, const float* lnf_w,
                      const float* lnf_b, const float* x, const head_activations<float>& h, const int* targets);
  void head_backward(const gpt_config& c, std::size_t B, std::size_t T, const float* wte, const float* lnf_w,
                     const float* x, const head_activations<float>& h, const int* targets, float* g_wte, float* g_lnf_w,
                     float* g_lnf_b, const backward_workspace<float>& w, float loss_scale);
  void block_backward(const gpt_config& c, std::size_t B, std::size_t T, const block_params<float>& p,
                      const block_params<float>& g, const float* x, const block_activations<float>& a,
                      const backward_workspace<float>& w, float* scratch);
  void embedding_backward(const gpt_config& c, std::size_t B, std::size_t T, const int* tokens, float* g_wte,
                          float* g_wpe, const backward_workspace<float>& w);

  // The layers one by one (LayerBackend, gpt_backend.hpp), on the stream; rtp_block's sub-layers.
  /** cudaMalloc (the stream is not involved); a failure is a chunkstar::error naming the size. */
  [[nodiscard]] float* allocate(std::size_t n);
  /** Waits for the stream, then cudaFree. Never throws. */
  void deallocate(float* p, std::size_t n) noexcept;
  void copy(float* dst, const float* src, std::size_t n);
  void add(float* acc, const float* x, std::size_t n);
  void bias_residual(float* out, const float* residual, const float* bias, std::size_t rows, std::size_t C);
  void add_column_sums(float* out, const float* in, std::size_t rows, std::size_t cols);
  void layernorm_forward(float* out, float* mean, float* rstd, const float* x, const float* w, const float* b,
                         std::size_t N, std::size_t C);
  void layernorm_backward(float* dx, float* dw, float* db, const float* dout, const float* x, const float* w,
                          const float* mean, const float* rstd, std::size_t N, std::size_t C);
  void matmul_forward(float* out, const float* x, const float* w, const float* bias, std::size_t N, std::size_t C,
                      std::size_t OC);
  void matmul_backward(float* dx, float* dw, float* dbias, const float* dout, const float* x, const float* w,
                       std::size_t N, std::size_t C, std::size_t OC);
  /** Per-head copies of q, k, v and y, their gradients and d(att), as scratch_elems. */
  static std::size_t attention_scratch_elems(std::size_t B, std::size_t T, std::size_t C, std::size_t NH) noexcept;
  void attention_forward(float* out, float* att, const float* qkv, std::size_t B, std::size_t T, std::size_t C,
                         std::size_t NH, float* scratch);
  void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att, std::size_t B,
                          std::size_t T, std::size_t C, std::size_t NH, float* scratch);
  void gelu_forward(float* out, const float* x, std::size_t n);
  void gelu_backward(float* dx, const float* x, const float* dout, std::size_t n);

  // The tied embedding and head on vocabulary shards (RtpBackend): cpu_backend says what each does.
  // Every element has one writer that adds in the CPU's order (tokens ascending), so the embedding
  // gradients are the CPU's bits; the head's exponentials are the device's own.
  void fill(float* p, std::size_t n, float value);
  void embedding_shard_forward(float* out, const int* tokens, const float* shard, std::size_t v0, std::size_t vs,
                               const float* wpe, std::size_t N, std::size_t Tn, std::size_t C);
  void embedding_shard_backward(float* g, const int* tokens, const float* dres, std::size_t v0, std::size_t vs,
                                std::size_t N, std::size_t C);
  void position_backward(float* g_wpe, const float* dres, std::size_t N, std::size_t Tn, std::size_t C);
  void head_shard_forward(float* mx, float* sum, float* zt, const float* z, const int* targets, std::size_t v0,
                          std::size_t valid, std::size_t N, std::size_t vs);
  void head_losses(float* mx_lse, float* sum_losses, const float* zt, std::size_t N);
  void head_shard_backward(float* z, const float* lse, const int* targets, float dloss, std::size_t v0,
                           std::size_t valid, std::size_t N, std::size_t vs);

 private:
  struct state;
  void check_pending();  // throws the error quiesce() kept, if any
  std::unique_ptr<state> s_;
};

static_assert(RtpBackend<cuda_backend>);

/** @brief `chunk_adam<Scaler, cuda_adam_kernels>` steps chunks placed on the device with the CUDA
 *  Adam kernel (chunkstar/cuda/chunk_adam_kernels.cuh), asynchronously; chunks placed on the host
 *  take the SIMD host kernel, on pinned memory, while the device ones run. */
struct cuda_adam_kernels {
  static chunkstar::grad_stats scan(const void* grad, chunkstar::dtype t, std::size_t count, float scale, int threads);
  static void adam(const chunkstar::adam_chunk& c, const chunkstar::adam_hyper& h, const chunkstar::adam_step_args& a);
  /** Returns before the step finishes, on stream(): device steps overlap the host steps after them. */
  static void adam_async(const chunkstar::adam_chunk& c, const chunkstar::adam_hyper& h,
                         const chunkstar::adam_step_args& a);
  static cudaStream_t stream() noexcept;
};

}  // namespace gpt
