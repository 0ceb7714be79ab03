// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief What bench_e2e and bench_scale share: the GPT trainer over chunkstar assembled once (model,
 *         runtime, AdamW), sizing helpers, timing, JSON and gnuplot plumbing.
 */
#pragma once

#include "chunked_gpt.hpp"
#include "data.hpp"

#include "../bench_report.hpp"

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/units.hpp>
#include <chunkstar/layout/searched_chunk_layout.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

namespace e2e {

using namespace chunkstar;

/** @brief The settings every trainer in these benchmarks uses: AdamW, weight decay 0.1 except on
 *  biases and norms, global-norm clipping at 1.0 (train_gpt's defaults, constant learning rate). */
inline constexpr float learning_rate = 1e-3f;
inline constexpr float weight_decay = 0.1f;
inline constexpr float max_grad_norm = 1.0f;
inline constexpr std::uint64_t model_seed = 42;  ///< parameter initialisation
inline constexpr std::uint64_t data_seed = 1;    ///< batch selection

/** @brief Process-wide settings both programs apply first thing in main().
 *
 *  OMP_WAIT_POLICY=PASSIVE: the GPT kernels mix OpenMP loops and OpenBLAS (pthread) GEMMs; OpenMP's
 *  idle workers spin by default and starve the BLAS threads on a 2-core machine. Set before any
 *  OpenMP region runs (the runtime reads it once); an explicit setting in the environment wins.
 *
 *  mallopt: the simulated device and the activations allocate from the C heap. Keeping freed blocks
 *  in the process (as a device's caching allocator does) stops every iteration from paying fresh
 *  page faults for its activations and moved chunks, CPU time no real device spends. Applies to
 *  the plain trainer too (it allocates once, so it does not care). */
inline void configure_process() {
  setenv("OMP_WAIT_POLICY", "PASSIVE", 0);
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

using clock = std::chrono::steady_clock;
inline double seconds_since(clock::time_point t0) { return std::chrono::duration<double>(clock::now() - t0).count(); }

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/** @brief Peak non-model bytes on the compute tier for one fp32 micro-batch of [B, T]: the forward
 *  activations, the backward workspace and allocation slack (train_gpt sizes its device the same way). */
inline std::size_t activation_bytes(const gpt::gpt_config& c, std::size_t B, std::size_t T) {
  const auto s = gpt::compute_activation_sizes(c, B, T);
  return (s.forward_total() + s.workspace) * sizeof(float) + 64 * 1024;
}

/** @brief Largest parameter tensor of @p c, in elements. */
inline std::size_t largest_tensor(const gpt::gpt_config& c) {
  std::size_t n = 0;
  for (const auto& s : gpt::param_specs(c)) n = std::max(n, s.numel());
  return n;
}

/** @brief train_gpt's default layout: the size with least waste between the largest tensor and 4x
 *  it, so a stage spans a few chunks and there is something to move. */
inline searched_chunk_layout trainer_layout(const gpt::gpt_config& c) {
  const std::size_t align = 32, lo = (largest_tensor(c) + align - 1) / align * align;
  return searched_chunk_layout(
      {.min_chunk_elems = lo, .max_chunk_elems = 4 * lo, .step_elems = align, .align_elems = align});
}

/** @brief Model data (bytes over every chunk list) that a runtime with @p layout holds for @p c. */
template <class Layout>
std::size_t model_bytes(const Layout& layout, const gpt::gpt_config& c, dtype type = dtype::f32) {
  std::size_t b = 0;
  for (const auto& l : make_chunk_lists(layout.plan(gpt::param_specs(c, type)), {.param_type = type}))
    if (!l.aliases_param) b += l.chunk_bytes * l.num_chunks;
  return b;
}

/** @brief The memory a chunk trainer runs on: a simulated device, the host, the (modelled) link. */
struct trainer_memory {
  std::size_t device_capacity = 0;
  std::size_t host_capacity = SIZE_MAX;
  copy_model link{};
};

/** @brief The GPT trainer over chunkstar: spaces, runtime, model and optimizer, as train_gpt
 *  assembles them (fp32, one micro-batch per step). Build it on the heap: the runtime holds
 *  references to the spaces. */
template <class Runtime>
class chunk_trainer {
 public:
  chunk_trainer(const gpt::gpt_config& c, gpt::batch_shape shape, const trainer_memory& mem, runtime_options ro,
                typename Runtime::layout_type layout, typename Runtime::placement_type placement)
      : device_({.capacity = mem.device_capacity, .link = mem.link, .name = "device"}),
        host_({.capacity = mem.host_capacity}),
        copier_(mem.link),
        rt_(device_, host_, copier_, ro, std::move(layout), std::move(placement)),
        model_(rt_, c, shape, model_seed),
        opt_({.hyper = {.weight_decay = weight_decay}, .max_grad_norm = max_grad_norm},
             param_groups::with_default_decay(weight_decay)) {
    model_.finalize();
  }

  /** @brief One training iteration (forward, backward, AdamW step); returns the loss. */
  double step(const int* tokens, const int* targets) {
    const double loss = model_.forward_backward(tokens, targets);
    if (!opt_.step(rt_, learning_rate).stepped) throw state_error("chunk_trainer: an fp32 step was skipped (overflow)");
    return loss;
  }

  [[nodiscard]] Runtime& runtime() noexcept { return rt_; }
  [[nodiscard]] simulated_device_space& device() noexcept { return device_; }
  [[nodiscard]] host_space& host() noexcept { return host_; }

 private:
  simulated_device_space device_;
  host_space host_;
  host_copy_engine copier_;
  Runtime rt_;
  gpt::chunked_gpt<Runtime> model_;
  chunk_adam<> opt_;
};

/** @brief The batches of the embedded corpus: step s uses fill_batch(train, data_seed, train_key(s, 0)). */
class batches {
 public:
  batches(std::size_t B, std::size_t T) : B_(B), T_(T), data_(gpt::load_text("", T)), tokens_(B * T), targets_(B * T) {}
  void load(std::int64_t step) {
    gpt::fill_batch(data_.train, data_seed, gpt::train_key(step, 0), B_, T_, tokens_.data(), targets_.data());
  }
  [[nodiscard]] const int* tokens() const noexcept { return tokens_.data(); }
  [[nodiscard]] const int* targets() const noexcept { return targets_.data(); }

 private:
  std::size_t B_, T_;
  gpt::text_data data_;
  std::vector<int> tokens_, targets_;
};

using bench::json_record;
using bench::run_gnuplot;
using bench::write_json;

/** @brief "12.3 MiB"-style, for tables. */
inline std::string mib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", bytes / 1048576.0);
  return buf;
}

}  // namespace e2e
