// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `replicated_gradients`: plain data parallelism over a chunk runtime — every rank holds all
 *         the model data, computes the gradients of its own micro-batch, and the gradient chunks
 *         are all-reduced (summed in rank order, so every rank holds the same bits) before the
 *         step. Each chunk's all-reduce starts, asynchronously, as soon as its gradient is final
 *         (the trace says no later backward scope of the iteration adds to it), so communication
 *         overlaps the rest of backward.
 *
 *  With the runtime built with `runtime_options::gradients = gradient_mode::replicated`,
 *  `chunk_adam` then takes the local norm as the global one (every rank holds the summed
 *  gradients), and N ranks step exactly as one process that sums the N micro-batches' gradients in
 *  rank order. Each gradient chunk is all-reduced where it is, or, for a communicator that takes
 *  device memory (NCCL: `takes_device_memory_v`), loaded to the compute tier first. Each completed
 *  all-reduce is reported to the runtime (`gradient_reduced`), where a step started inside backward
 *  (chunk_adam::prepare) waits for it.
 */
#pragma once

#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/core/error.hpp>
#include <chunkstar/core/chunk_kind.hpp>
#include <chunkstar/core/moment_kind.hpp>
#include <chunkstar/core/tier.hpp>
#include <chunkstar/core/gradient_mode.hpp>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

namespace chunkstar {

/** @brief Knobs of `replicated_gradients`. */
struct replicated_gradients_options {
  std::size_t max_in_flight = 4;  ///< most all-reduces outstanding (each pins its gradient chunk on its tier)
};

/** @brief Gradient all-reduce for replicated data parallelism over runtime @p Runtime. Call
 *  `after_backward()` after every backward scope closes and `synchronize()` before the optimizer
 *  step. Every rank must make the same calls (they issue the same collectives in the same order).
 *  After a throw (a failed collective: `communication_error`), the gradients are not valid; end the
 *  iteration (`rt.end_iteration()`) and stop, as the ranks no longer agree. */
template <class Runtime>
class replicated_gradients {
 public:
  explicit replicated_gradients(Runtime& rt, replicated_gradients_options options = {}) : rt_(rt), options_(options) {
    if (rt.gradients() != gradient_mode::replicated)
      throw config_error(
          "replicated_gradients needs a runtime built with runtime_options::gradients = gradient_mode::replicated, "
          "so that the optimizer takes the summed gradients' norm as the global one");
    if (options_.max_in_flight == 0)
      throw config_error("replicated_gradients_options::max_in_flight must be at least 1");
  }
  replicated_gradients(const replicated_gradients&) = delete;
  replicated_gradients& operator=(const replicated_gradients&) = delete;
  ~replicated_gradients() { drain_quietly(); }

  /** @brief Starts the all-reduce of every gradient chunk whose gradient is final now (with a
   *  trace: its next use is the step or the next iteration). Without a trace (the first
   *  iteration, a divergence) it starts nothing: `synchronize()` does it all. */
  void after_backward() {
    retire_completed();
    const auto& tracer = rt_.tracer();
    if (!tracer.ready()) return;
    const std::size_t m = tracer.current_moment(), n = tracer.num_moments();
    started_.resize(rt_.plan().num_chunks, false);
    for (std::uint32_t c = 0; c < rt_.plan().num_chunks; ++c) {
      if (started_[c] || rt_.where({chunk_kind::grad, c}) == tier::free) continue;
      const std::size_t d = tracer.next_use({chunk_kind::grad, c}, m);
      if (d != never && m + d < n && tracer.kind_of(m + d) != moment_kind::optimizer)
        continue;  // more backward to come
      start(c);
    }
  }

  /** @brief All-reduces the gradient chunks not started yet, in chunk order, and waits for every
   *  one: afterwards every rank holds the rank-order sum of all ranks' gradients. */
  void synchronize() {
    started_.resize(rt_.plan().num_chunks, false);
    for (std::uint32_t c = 0; c < rt_.plan().num_chunks; ++c)
      if (!started_[c] && rt_.where({chunk_kind::grad, c}) != tier::free) start(c);
    while (!in_flight_.empty()) retire_oldest();
    started_.assign(started_.size(), false);
  }

  /** @brief All-reduces started so far in this iteration (for tests and overlap reports). */
  [[nodiscard]] std::size_t started() const noexcept {
    std::size_t k = 0;
    for (bool s : started_) k += s;
    return k;
  }

 private:
  struct reduction {
    std::uint32_t chunk = 0;
    typename Runtime::store_type::held_payload hold;  // pins the chunk until the collective finished
    comm_handle done;
  };

  void start(std::uint32_t c) {
    while (in_flight_.size() >= options_.max_in_flight) retire_oldest();
    auto hold = takes_device_memory_v<typename Runtime::communicator_type> ? rt_.hold_gradient_on_device(c)
                                                                           : rt_.hold_gradient(c);
    comm_handle h = rt_.communicator().allreduce_async(hold.data, hold.elems, hold.type, reduce_op::sum);
    in_flight_.push_back({c, std::move(hold), std::move(h)});
    started_[c] = true;
  }
  void retire_oldest() {
    auto r = std::move(in_flight_.front());
    in_flight_.pop_front();
    r.done.wait();
    // Summed over the ranks: a step started inside backward (chunk_adam::prepare) may take it.
    if constexpr (requires { rt_.gradient_reduced(r.chunk); }) rt_.gradient_reduced(r.chunk);
  }
  /** Retires the all-reduces that have completed, in the order started (never waits). */
  void retire_completed() {
    while (!in_flight_.empty() && in_flight_.front().done.ready()) retire_oldest();
  }
  void drain_quietly() noexcept {
    while (!in_flight_.empty()) {
      try {
        retire_oldest();
      } catch (...) {  // destructor: the failure was (or will be) reported by the collective's peers
      }
    }
  }

  Runtime& rt_;
  replicated_gradients_options options_;
  std::vector<bool> started_;
  std::deque<reduction> in_flight_;
};

}  // namespace chunkstar
