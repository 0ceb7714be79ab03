// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Adam and AdamW over one chunk (or any contiguous range): fp32 master weights, momentum
 *         and variance updated in one fused pass that reads the gradient in its own dtype and
 *         writes the low-precision parameter copy.
 *
 *  Per element, in this order (every ISA, and the CUDA kernel in `chunkstar/cuda/adam.cuh`, run
 *  exactly these correctly rounded operations, so all paths give the same bits):
 *  @code
 *    g  = fma(l2, p, grad * grad_scale)        // l2 = weight_decay for adam, 0 for adamw
 *    m  = fma(beta1, m, (1 - beta1) * g)
 *    v  = fma(beta2, v, ((1 - beta2) * g) * g)
 *    d  = fma(sqrt(v), 1 / sqrt(1 - beta2^t), eps)
 *    p  = fma(-lr / (1 - beta1^t), m / d, p * decay)   // decay = 1 - lr * weight_decay for adamw, 1 for adam
 *    param_out = round_to<P>(p)
 *  @endcode
 *  The host kernel is compiled for every ISA of core/cpu_isa.hpp in every build (portable, AVX2,
 *  AVX-512F: optim/detail/adam_kernels.inc, once per target region) and adam_update runs the one
 *  active_cpu_isa() names, the widest this CPU has unless forced. OpenMP (when the includer
 *  compiles with -fopenmp) splits the range statically across threads. The update is element-wise,
 *  so the result does not depend on the thread count or the ISA.
 */
#pragma once

#include <chunkstar/core/dtype.hpp>
#include <chunkstar/core/error.hpp>
#include <chunkstar/core/detail/simd.hpp>
#include <chunkstar/optim/cpu_isa.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace chunkstar {

/** @brief How weight decay enters the update. */
enum class adam_mode : unsigned char {
  adam,   ///< L2 regularisation: weight_decay * p is added to the gradient (Kingma & Ba + L2)
  adamw,  ///< decoupled decay: p is multiplied by (1 - lr * weight_decay) (Loshchilov & Hutter)
};

/** @brief Hyper-parameters of one Adam(W) step. Plain values: they may change between steps
 *         (learning-rate schedules) and between parameter groups. */
struct adam_hyper {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  adam_mode mode = adam_mode::adamw;
};

/** @brief What changes every step besides the hyper-parameters. */
struct adam_step_args {
  std::int64_t step = 1;    ///< 1-based step count of this parameter's state, for bias correction
  float grad_scale = 1.0f;  ///< gradients are multiplied by this: 1/loss_scale * clip coefficient * 1/micro-batches
  int threads = 0;          ///< host threads for this call; 0 = OpenMP's default (ignored without OpenMP)
};

/** @brief The per-call constants of the update, computed once outside the element loop.
 *         Shared by the host and device kernels so that both use the same rounded values. */
struct adam_constants {
  float beta1, beta2, one_minus_beta1, one_minus_beta2;
  float eps;
  float l2;             ///< weight decay added to the gradient (adam mode), else 0
  float decay;          ///< multiplier of the parameter before the update (adamw mode), else 1
  float neg_step_size;  ///< -lr / (1 - beta1^t)
  float inv_sqrt_bc2;   ///< 1 / sqrt(1 - beta2^t)
  float grad_scale;
};

/** @brief Validates @p h and @p a and folds them into the per-call constants (bias corrections in
 *         double, then rounded once to float). Throws config_error on out-of-range values. */
inline adam_constants make_adam_constants(const adam_hyper& h, const adam_step_args& a) {
  auto bad = [](const std::string& what) { throw config_error("adam: " + what); };
  if (a.step < 1) bad("step must be >= 1 (it is 1-based, for bias correction), got " + std::to_string(a.step));
  if (!(h.beta1 >= 0.0f && h.beta1 < 1.0f) || !(h.beta2 >= 0.0f && h.beta2 < 1.0f))
    bad("beta1 and beta2 must lie in [0, 1), got " + std::to_string(h.beta1) + " and " + std::to_string(h.beta2));
  if (!(h.eps > 0.0f) || !std::isfinite(h.eps)) bad("eps must be positive and finite, got " + std::to_string(h.eps));
  if (!(h.lr >= 0.0f) || !std::isfinite(h.lr)) bad("lr must be >= 0 and finite, got " + std::to_string(h.lr));
  if (!(h.weight_decay >= 0.0f) || !std::isfinite(h.weight_decay))
    bad("weight_decay must be >= 0 and finite, got " + std::to_string(h.weight_decay));
  if (!std::isfinite(a.grad_scale))
    bad("grad_scale must be finite (skip the step on overflow instead), got " + std::to_string(a.grad_scale));
  const double t = static_cast<double>(a.step);
  const double bc1 = 1.0 - std::pow(static_cast<double>(h.beta1), t);
  const double bc2 = 1.0 - std::pow(static_cast<double>(h.beta2), t);
  adam_constants c{};
  c.beta1 = h.beta1;
  c.beta2 = h.beta2;
  c.one_minus_beta1 = static_cast<float>(1.0 - static_cast<double>(h.beta1));
  c.one_minus_beta2 = static_cast<float>(1.0 - static_cast<double>(h.beta2));
  c.eps = h.eps;
  c.l2 = h.mode == adam_mode::adam ? h.weight_decay : 0.0f;
  c.decay = h.mode == adam_mode::adamw
                ? static_cast<float>(1.0 - static_cast<double>(h.lr) * static_cast<double>(h.weight_decay))
                : 1.0f;
  // beta1 == 0 gives bc1 == 1; beta2 == 0 gives bc2 == 1; both positive otherwise since step >= 1.
  c.neg_step_size = static_cast<float>(-static_cast<double>(h.lr) / bc1);
  c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  c.grad_scale = a.grad_scale;
  return c;
}

namespace optim_detail {

template <class G, class P>
struct adam_ptrs {
  float* master;
  float* m;
  float* v;
  const G* grad;
  P* param;
};

/** Elements per scheduling block: a multiple of every vector width, large enough that OpenMP
 *  hands each thread long contiguous runs (good for the hardware prefetchers). */
inline constexpr std::size_t adam_block = 4096;
/** Below this many elements a call stays on the calling thread (a fork costs microseconds). */
inline constexpr std::size_t adam_parallel_min = 1 << 16;

/** The kernel of one ISA: `range<G, P, WriteParam>(ptrs, constants, begin, end)`, specialised once
 *  per ISA inside its target region by optim/detail/adam_kernels.inc. */
template <cpu_isa Isa>
struct adam_kernels;

/** Splits [0, n) into blocks and runs @p body(begin, end) on them, statically across threads. */
template <class Body>
void parallel_blocks(std::size_t n, std::size_t block, std::size_t parallel_min, int threads, Body&& body) {
  const auto nblocks = static_cast<std::int64_t>((n + block - 1) / block);
#if defined(_OPENMP)
  const int nt = threads > 0 ? threads : omp_get_max_threads();
  if (nt > 1 && n >= parallel_min && nblocks > 1) {
#pragma omp parallel for schedule(static) num_threads(nt)
    for (std::int64_t b = 0; b < nblocks; ++b) {
      const std::size_t begin = static_cast<std::size_t>(b) * block;
      body(begin, std::min(n, begin + block));
    }
    return;
  }
#else
  (void)threads;
  (void)parallel_min;
#endif
  if (nblocks > 0) body(std::size_t{0}, n);
}

}  // namespace optim_detail
}  // namespace chunkstar

#define CHUNKSTAR_SIMD_KERNELS <chunkstar/optim/detail/adam_kernels.inc>
#include <chunkstar/core/simd_foreach_isa.hpp>

namespace chunkstar {

/** @brief One Adam(W) step over a range, with an explicit ISA (tests compare ISAs; everyone else
 *         calls adam_update). See adam_update for the contract; also throws config_error when
 *         this CPU cannot run @p Isa (cpu_isa_supported). */
template <cpu_isa Isa, class G, class P>
requires is_element_type_v<G> && is_element_type_v<P>
void adam_update_isa(std::span<float> master, std::span<float> m, std::span<float> v, std::span<const G> grad,
                     std::span<P> param_out, const adam_hyper& hyper, const adam_step_args& args) {
  static_assert(cpu_isa_available_v<Isa>,
                "this ISA's kernels are not compiled into this build (CHUNKSTAR_ISA_DISPATCH)");
  if (!cpu_isa_supported(Isa))
    throw config_error("adam_update_isa: this CPU cannot run the " + std::string(cpu_isa_name(Isa)) + " kernels");
  const std::size_t n = master.size();
  if (m.size() != n || v.size() != n || grad.size() != n)
    throw config_error("adam_update: master, m, v and grad must have the same length (got " + std::to_string(n) + ", " +
                       std::to_string(m.size()) + ", " + std::to_string(v.size()) + ", " + std::to_string(grad.size()) +
                       "); pass the same chunk range of each list");
  if (!param_out.empty() && param_out.size() != n)
    throw config_error("adam_update: param_out must be empty (master is the parameter) or as long as master (" +
                       std::to_string(n) + "), got " + std::to_string(param_out.size()));
  const adam_constants c = make_adam_constants(hyper, args);
  const optim_detail::adam_ptrs<G, P> ptrs{master.data(), m.data(), v.data(), grad.data(), param_out.data()};
  auto run = [&](auto write_param) {
    optim_detail::parallel_blocks(
        n, optim_detail::adam_block, optim_detail::adam_parallel_min, args.threads, [&](std::size_t b, std::size_t e) {
          optim_detail::adam_kernels<Isa>::template range<G, P, decltype(write_param)::value>(ptrs, c, b, e);
        });
  };
  if (param_out.empty()) run(std::false_type{});
  else run(std::true_type{});
}

/** @brief One fused Adam(W) step over a range of a chunk, on the host.
 *
 *  @param master     fp32 master weights (updated in place); when the parameters are fp32 this IS
 *                    the parameter and @p param_out is empty
 *  @param m, v       first and second moments (updated in place)
 *  @param grad       gradients in their own dtype (fp32, fp16 or bf16), multiplied by args.grad_scale
 *  @param param_out  low-precision copy of the new parameters (round to nearest even), or empty
 *  All non-empty spans have the same length. Throws config_error on mismatched lengths or bad
 *  hyper-parameters. Runs the ISA active_cpu_isa() names (the widest this CPU has) and OpenMP
 *  threads; every ISA and thread count gives the same bits. */
template <class G, class P>
requires is_element_type_v<G> && is_element_type_v<P>
void adam_update(std::span<float> master, std::span<float> m, std::span<float> v, std::span<const G> grad,
                 std::span<P> param_out, const adam_hyper& hyper, const adam_step_args& args) {
  with_cpu_isa(active_cpu_isa(),
               [&](auto isa) { adam_update_isa<isa(), G, P>(master, m, v, grad, param_out, hyper, args); });
}

/** @brief The optimizer state of one chunk as raw pointers plus dtypes: what a runtime holds when
 *         the element types are only known at run time. The same struct feeds adam_step_host and
 *         (Tier 2) cuda::adam_step_device, so the runtime dispatches on where the state lives. */
struct adam_chunk {
  float* master = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  std::size_t count = 0;       ///< elements in each array
  const void* grad = nullptr;  ///< `count` elements of grad_type
  dtype grad_type = dtype::f32;
  void* param = nullptr;  ///< `count` elements of param_type, or null (master is the parameter)
  dtype param_type = dtype::f32;
};

namespace optim_detail {
template <class F>
decltype(auto) with_element_type(dtype t, F&& f) {
  switch (t) {
    case dtype::f32: return f(float{});
    case dtype::f16: return f(float16{});
    case dtype::bf16: return f(bfloat16{});
  }
  throw config_error("unknown dtype value " + std::to_string(static_cast<int>(t)) + "; use f32, f16 or bf16");
}
}  // namespace optim_detail

/** @brief Adam(W) step of one chunk whose state lives in host memory (dispatches on the dtypes). */
inline void adam_step_host(const adam_chunk& c, const adam_hyper& hyper, const adam_step_args& args) {
  optim_detail::with_element_type(c.grad_type, [&](auto g) {
    using G = decltype(g);
    const std::span<const G> grad(static_cast<const G*>(c.grad), c.count);
    optim_detail::with_element_type(c.param_type, [&](auto p) {
      using P = decltype(p);
      const std::span<P> out = c.param ? std::span<P>(static_cast<P*>(c.param), c.count) : std::span<P>{};
      adam_update<G, P>({c.master, c.count}, {c.m, c.count}, {c.v, c.count}, grad, out, hyper, args);
    });
  });
}

}  // namespace chunkstar
