// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Where a rank keeps the shards it owns under RTP — weights, accumulated gradients and Adam
 *         moments — and `rtp::host_shard_store`, which keeps them in host memory.
 *
 *  A model under RTP (e.g. the GPT example's `rtp_gpt`) builds its rotations with `external_shard`
 *  and talks to a store through one small interface, so the same model runs with its shards in
 *  plain host vectors (`host_shard_store`) or in a chunk runtime under a device budget
 *  (`chunk_shard_store`, rtp/chunk_shard_store.hpp), with the same arithmetic:
 *
 *  - `add_shard(elems, segments, counted_in_norm = true)` before `finalize()`: one buffer of the
 *    model's data (a shard of a rotation, or a replica every rank holds alike), made of contiguous
 *    `shard_segment`s (each a run of one tensor of the model, with its role, which decides its
 *    weight decay). Returns the buffer's index. A buffer not `counted_in_norm` is stepped like
 *    the others but left out of this store's sum of squares (a replica counts on one rank only).
 *  - `stage(name, backward, shards, f)`: runs `f()` with @p shards accessible (a chunk runtime
 *    opens a scope on them, so the tracer sees the model's stages in order); inside it,
 *    `load(k, dst)` copies shard k's weights into a transit buffer and `add_grad(k, g)` adds a
 *    gradient sum into shard k's gradient (gradients accumulate until the step).
 *  - `step(hyper, groups, micro_batches, max_norm, global_sum_sq)`: one local Adam(W) step of
 *    every shard, gradients averaged over @p micro_batches and clipped by the global norm that
 *    `global_sum_sq(this store's sum of squares)` returns; zeroes the gradients (`zero_grad()`
 *    alone drops them). `step_count()` and `restore_step_count()` track the bias correction's t.
 *  - `read(k, kind, out)` and `write(k, kind, in)` outside stages: a list of shard k (weights,
 *    momentum, variance; gradients with `chunk_kind::grad`) whole, for initialisation and
 *    checkpoints.
 *  - `allocate(n)` / `deallocate(p, n)`: float buffers on the compute tier (transit buffers,
 *    activations), which a chunk runtime accounts as non-model memory.
 *  - `untraced()`: a guard for forward-only passes (evaluation, sampling) that are not part of the
 *    training iteration.
 *  - `sleep()`, `wake()`, `asleep()`: between stages, the store moves whatever model data it keeps
 *    on the compute tier elsewhere (a chunk runtime: off the device) and back; values unchanged.
 *    Stages and steps are refused while asleep; `read` and `write` work.
 *
 *  `basic_host_shard_store<Tier>` keeps the lists in host memory and its compute tier is `Tier`
 *  (`ComputeTier`): host memory by default (`host_shard_store`), or e.g. a GPU's, where `load`
 *  copies a shard up on the tier's stream and `add_grad` waits for the sum and copies it down.
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/tensor_spec.hpp>
#include <chunkstar/layout/chunk_layout.hpp>
#include <chunkstar/optim/adam.hpp>
#include <chunkstar/optim/clip.hpp>
#include <chunkstar/optim/param_groups.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace chunkstar::rtp {

/** @brief A contiguous run of one tensor inside a shard buffer. */
struct shard_segment {
  std::string name;        ///< unique per rank, e.g. "h0.attn.qkv.w@1" (the tensor, the shard)
  std::size_t offset = 0;  ///< first element in the shard buffer
  std::size_t elems = 0;   ///< elements
  tensor_role role = tensor_role::weight;
};

/** @brief What `step` did. */
struct shard_step_result {
  double grad_norm = std::numeric_limits<double>::quiet_NaN();  ///< global norm (NaN when not clipping)
  float clip_coefficient = 1;                                   ///< factor the gradients were multiplied by
  float grad_scale = 1;  ///< what every gradient was multiplied by (1 / micro-batches x clip)
  bool stepped = true;   ///< false: skipped (an fp16 overflow), the gradients dropped
  std::size_t early_steps = 0;  ///< this rank's chunk updates started inside backward (a prepared chunk store)
  bool early_redone = false;    ///< those were undone and stepped again (the norm clipped) or undone (skipped)
};

/** @brief The element type of a store's working weights, which its model's rotations carry:
 *  `S::element_type` where the store names one (a 16-bit `chunk_shard_store`), else float. */
template <class S>
struct store_element {
  using type = float;
};
template <class S>
requires requires { typename S::element_type; }
struct store_element<S> {
  using type = typename S::element_type;
};
template <class S>
using store_element_t = typename store_element<S>::type;

/** @brief Checks a shard's segments tile it: in order, contiguous, from 0 to @p elems. */
inline void check_segments(std::size_t elems, const std::vector<shard_segment>& segments) {
  std::size_t at = 0;
  for (const auto& s : segments) {
    if (s.offset != at || s.elems == 0)
      throw config_error("rtp shard store: segment '" + s.name + "' starts at " + std::to_string(s.offset) + " with " +
                         std::to_string(s.elems) + " elements, expected a non-empty run at " + std::to_string(at) +
                         ": a shard's segments must tile it in order");
    at += s.elems;
  }
  if (at != elems)
    throw config_error("rtp shard store: segments cover " + std::to_string(at) + " of the shard's " +
                       std::to_string(elems) + " elements");
}

/** @brief Where a rank keeps the buffers it owns under RTP: the interface the file comment
 *  describes (`add_shard`, `finalize`, `stage`, `load`, `add_grad`, `zero_grad`, `step`,
 *  `step_count`, `restore_step_count`, `read`, `write`, `allocate`, `deallocate`, `untraced`,
 *  `sleep`, `wake`, `asleep`).
 *  Models: `basic_host_shard_store` (below) and `chunk_shard_store` (rtp/chunk_shard_store.hpp);
 *  chunkstar/testing/shard_store_conformance.hpp checks a model's laws. */
template <class S>
concept ShardStore = requires(S& s, const S& cs, std::size_t k, std::size_t n, std::vector<shard_segment> segments,
                              std::string_view name, std::span<const std::size_t> shards, void (*body)(),
                              std::span<float> out, std::span<const float> in, const adam_hyper& hyper,
                              const param_groups& groups, int micro_batches, float max_norm,
                              const std::function<double(double)>& global_sum_sq, std::int64_t steps, chunk_kind kind,
                              float* p) {
  { s.add_shard(n, std::move(segments)) } -> std::same_as<std::size_t>;
  { s.add_shard(n, std::move(segments), false) } -> std::same_as<std::size_t>;
  s.finalize();
  s.stage(name, true, shards, body);
  s.load(k, out);
  s.add_grad(k, in);
  s.zero_grad();
  { s.step(hyper, groups, micro_batches, max_norm, global_sum_sq) } -> std::same_as<shard_step_result>;
  { cs.step_count() } -> std::convertible_to<std::int64_t>;
  s.restore_step_count(steps);
  cs.read(k, kind, out);
  s.write(k, kind, in);
  { s.allocate(n) } -> std::same_as<float*>;
  s.deallocate(p, n);
  s.untraced();
  s.sleep();
  s.wake();
  { cs.asleep() } -> std::convertible_to<bool>;
};

/** @brief Where a host shard store's compute-tier buffers live and how bytes move there:
 *  `allocate(n)` zeroed floats (or throws) and `deallocate(p, n)` (never throws; after the work
 *  using them), `to_compute(dst, src, bytes)` (ordered with the compute work, source read before
 *  it returns) and `from_compute(dst, src, bytes)` (returns once the bytes are there, after the
 *  work that wrote them). `host_memory`: whether compute-tier memory is host memory. */
template <class T>
concept ComputeTier = std::copy_constructible<T> && requires(T& t, std::size_t n, float* p, void* d, const void* c) {
  { T::host_memory } -> std::convertible_to<bool>;
  { t.allocate(n) } -> std::same_as<float*>;
  t.deallocate(p, n);
  t.to_compute(d, c, n);
  t.from_compute(d, c, n);
};

/** @brief The compute tier is host memory: new[], delete[] and memcpy. */
struct host_compute_tier {
  static constexpr bool host_memory = true;
  [[nodiscard]] float* allocate(std::size_t n) const { return new float[n](); }
  void deallocate(float* p, std::size_t) const noexcept { delete[] p; }
  void to_compute(void* dst, const void* src, std::size_t bytes) const noexcept { std::memcpy(dst, src, bytes); }
  void from_compute(void* dst, const void* src, std::size_t bytes) const noexcept { std::memcpy(dst, src, bytes); }
};

/** @brief A rank's shards in host memory, its compute-tier buffers on @p Tier (see the file
 *  comment for the interface). */
template <ComputeTier Tier = host_compute_tier>
class basic_host_shard_store {
 public:
  using element_type = float;  ///< fp32 shards (a 16-bit model keeps its shards in a chunk_shard_store)

  basic_host_shard_store() = default;
  explicit basic_host_shard_store(Tier tier) : tier_(std::move(tier)) {}

  std::size_t add_shard(std::size_t elems, std::vector<shard_segment> segments, bool counted_in_norm = true) {
    if (finalized_) throw state_error("host_shard_store::add_shard after finalize(): add every shard first");
    check_segments(elems, segments);
    shards_.push_back(
        {std::move(segments),
         {std::vector<float>(elems), std::vector<float>(elems), std::vector<float>(elems), std::vector<float>(elems)},
         counted_in_norm});
    return shards_.size() - 1;
  }
  void finalize() { finalized_ = true; }

  template <class F>
  void stage(std::string_view, bool, std::span<const std::size_t>, F&& f) {
    awake("stage");
    f();
  }
  void load(std::size_t k, std::span<float> dst) {
    const auto& w = list(k, chunk_kind::param);
    tier_.to_compute(dst.data(), w.data(), w.size() * sizeof(float));
  }
  void add_grad(std::size_t k, std::span<const float> g) {
    auto& acc = list(k, chunk_kind::grad);
    const float* sum = g.data();
    if constexpr (!Tier::host_memory) {
      staged_.resize(acc.size());
      tier_.from_compute(staged_.data(), g.data(), acc.size() * sizeof(float));
      sum = staged_.data();
    }
    for (std::size_t i = 0; i < acc.size(); ++i) acc[i] += sum[i];
  }
  void zero_grad() {
    for (auto& s : shards_) std::fill(s.lists[grad_slot].begin(), s.lists[grad_slot].end(), 0.0f);
  }

  shard_step_result step(const adam_hyper& base, const param_groups& groups, int micro_batches, float max_norm,
                         const std::function<double(double)>& global_sum_sq) {
    awake("step");
    if (micro_batches < 1) throw config_error("host_shard_store::step: micro_batches must be >= 1");
    shard_step_result r;
    const float unscale = 1.0f / static_cast<float>(micro_batches);  // as chunk_adam
    r.grad_scale = unscale;
    if (max_norm > 0.0f) {
      double sq = 0;
      for (const auto& s : shards_)
        for (const float x : s.counted ? std::span<const float>(s.lists[grad_slot]) : std::span<const float>()) {
          const double y = static_cast<double>(x * unscale);
          sq += y * y;
        }
      const auto clip = clip_coefficient(global_sum_sq ? global_sum_sq(sq) : sq, max_norm);
      r.grad_norm = clip.norm;
      r.clip_coefficient = clip.coefficient;
      r.grad_scale = unscale * clip.coefficient;
    }
    ++steps_;
    const adam_step_args args{.step = steps_, .grad_scale = r.grad_scale};
    for (auto& s : shards_) {
      auto& [w, g, m, v] = s.lists;
      for (const auto& seg : s.segments) {
        const auto h = groups.hyper_for(seg.role, base);
        const std::size_t o = seg.offset, n = seg.elems;
        adam_update(std::span<float>(w).subspan(o, n), std::span<float>(m).subspan(o, n),
                    std::span<float>(v).subspan(o, n), std::span<const float>(g).subspan(o, n), std::span<float>(), h,
                    args);
      }
      std::fill(g.begin(), g.end(), 0.0f);
    }
    return r;
  }
  [[nodiscard]] std::int64_t step_count() const noexcept { return steps_; }
  void restore_step_count(std::int64_t n) noexcept { steps_ = n; }

  void read(std::size_t k, chunk_kind kind, std::span<float> out) const {
    const auto& l = list(k, kind);
    std::copy(l.begin(), l.end(), out.begin());
  }
  void write(std::size_t k, chunk_kind kind, std::span<const float> in) {
    auto& l = list(k, kind);
    std::copy(in.begin(), in.end(), l.begin());
  }

  [[nodiscard]] float* allocate(std::size_t n) { return tier_.allocate(n); }
  void deallocate(float* p, std::size_t n) noexcept { tier_.deallocate(p, n); }
  [[nodiscard]] Tier& tier() noexcept { return tier_; }

  struct no_guard {
    ~no_guard() {}  // user-provided: a guard, even if it guards nothing here
  };
  [[nodiscard]] no_guard untraced() noexcept { return {}; }

  /** @brief Nothing of the model data is on the compute tier (the lists are host vectors): sleep
   *  only marks the store, and stages and steps are refused until `wake()`. */
  void sleep() {
    if (asleep_) throw state_error("host_shard_store::sleep while asleep: call wake() first");
    asleep_ = true;
  }
  void wake() {
    if (!asleep_) throw state_error("host_shard_store::wake while awake: call sleep() first");
    asleep_ = false;
  }
  [[nodiscard]] bool asleep() const noexcept { return asleep_; }

  /** @brief Bytes of model data held: four lists of every shard. */
  [[nodiscard]] std::size_t bytes() const noexcept {
    std::size_t n = 0;
    for (const auto& s : shards_) n += 4 * s.lists[0].size();
    return n * sizeof(float);
  }
  [[nodiscard]] std::size_t shards() const noexcept { return shards_.size(); }

 private:
  static constexpr std::size_t grad_slot = 1;
  static std::size_t slot(chunk_kind k) {
    switch (k) {
      case chunk_kind::param: return 0;
      case chunk_kind::grad: return 1;
      case chunk_kind::momentum: return 2;
      case chunk_kind::variance: return 3;
      default:
        throw config_error("host_shard_store: no fp32 master list (the weights are fp32 and are their own master)");
    }
  }
  void awake(const char* what) const {
    if (asleep_) throw state_error(std::string("host_shard_store::") + what + " while asleep: call wake() first");
  }
  std::vector<float>& list(std::size_t k, chunk_kind kind) { return shards_.at(k).lists[slot(kind)]; }
  const std::vector<float>& list(std::size_t k, chunk_kind kind) const { return shards_.at(k).lists[slot(kind)]; }

  struct shard {
    std::vector<shard_segment> segments;
    std::vector<float> lists[4];  // weights, gradient, momentum, variance
    bool counted = true;          // in this store's sum of squares
  };
  Tier tier_{};
  std::vector<shard> shards_;
  std::vector<float> staged_;  // a gradient sum copied down from a compute tier that is not host memory
  bool finalized_ = false;
  bool asleep_ = false;
  std::int64_t steps_ = 0;
};

/** @brief Shards and compute-tier buffers in host memory. */
using host_shard_store = basic_host_shard_store<>;
static_assert(ShardStore<host_shard_store>);

}  // namespace chunkstar::rtp
