// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `rtp::chunk_shard_store`: a rank's RTP shards kept in that rank's chunk runtime — weights,
 *         gradients and Adam moments in chunks that the placement puts on the device or the host
 *         under a device budget, the optimizer step local and run where each chunk is placed.
 *
 *  The interface is rtp/shard_store.hpp's. Each shard segment is registered as one tensor of the
 *  runtime, of the store's element type @p T (so weight decay follows its role), a model stage opens one scope on its shards
 *  (the tracer learns the order and the placement and Belady plan from it, as for any model), the
 *  transit buffers and activations the model asks for are non-model memory on the compute tier,
 *  and `step` is `chunk_adam` over the runtime with the global norm summed the model's way
 *  (`chunk_adam_options::global_sum_sq`). The runtime's own communicator is a one-rank one: RTP
 *  communicates in the model's rotations, not in the runtime. `prepare` before a step's
 *  micro-batches lets the host-stepped chunks' updates start inside the last backward, each once
 *  its gradient is final (a shard's sum has come home, a replica's all-reduced sum is added), the
 *  step's bits either way (chunk_adam::prepare).
 *
 *  On a device platform (CUDA) the spans a scope hands out are device memory: `Ops` copies a shard
 *  into a transit buffer and adds a gradient sum into the chunk on the stream the model's kernels
 *  run on, each stage closes its scope with that stream (the runtime orders later moves of its
 *  chunks after the work: the stream contract), and `Kernels` steps the chunks placed on the
 *  device there (e.g. `cuda::device_adam_kernels`), those placed on the host with the SIMD kernel.
 *  The defaults are the host platform's: loops, and the host kernel.
 *
 *  **Mixed precision.** With @p T a 16-bit type (`bfloat16`, `float16`) the runtime holds 16-bit
 *  weights and gradients and fp32 masters and moments (`param_type` bf16 or f16): `load(k,
 *  span<T>)` copies the 16-bit weights a rotation carries (half the bytes), `add_grad(k,
 *  span<const T>)` adds a 16-bit sum into the 16-bit gradient (rounded once per add), and the float
 *  forms widen and round (replicas, whose working copies and gradients are float). `step` updates
 *  the masters and rounds the weights from them; with fp16 the default `Scaler` is the dynamic loss
 *  scaler, whose overflow is agreed across the model's ranks through the same global sum as the
 *  norm (an inf anywhere is an inf everywhere: every rank skips). `read` and `write` of the weights
 *  use the fp32 masters (and `write` sets both).
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/tensor_spec.hpp>
#include <chunkstar/memory/copy_engine.hpp>
#include <chunkstar/rtp/buffer_ops.hpp>
#include <chunkstar/rtp/shard_store.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>

#include <cstddef>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace chunkstar::rtp {

/** @brief How a chunk shard store moves floats between a scope's chunks and the model's buffers,
 *  both compute-tier memory: `copy(dst, src, n)`, `add(acc, x, n)` (acc += x in index order), and
 *  `stream()`, where that work and the model's kernels run (the scopes close with it). */
template <class O, class Runtime>
concept ShardOps = std::copy_constructible<O> && requires(O& o, float* p, const float* c, std::size_t n) {
  o.copy(p, c, n);
  o.add(p, c, n);
  { o.stream() } -> std::convertible_to<typename Runtime::stream_type>;
};

/** @brief What a 16-bit store's `Ops` also do on shards of @p T: copy and add 16-bit buffers, widen
 *  them to float, and add float sums into them (rtp/buffer_ops.hpp's `WideningOps`). */
template <class O, class T>
concept ShardWideningOps = requires(O& o, float* f, const float* cf, T* p, const T* c, std::size_t n) {
  o.copy(p, c, n);
  o.add(p, c, n);
  o.widen(f, c, n);
  o.accumulate(p, cf, n);
};

/** @brief Host memory: the rotation's host buffer operations, done when they return. */
struct host_shard_ops : host_buffer_ops<float> {
  [[nodiscard]] host_stream stream() const noexcept { return {}; }
};

/** @brief The loss scaler a store of @p T steps with by default: dynamic for fp16, none otherwise. */
template <shard_element T>
using default_shard_scaler = std::conditional_t<std::is_same_v<T, float16>, dynamic_loss_scaler, static_loss_scaler>;

/** @brief The shards of one rank in the chunk runtime @p Runtime (held by reference; register
 *  nothing else in it), moved by @p Ops, stepped by @p Kernels where placed on the device. See the
 *  file comment. */
template <class Runtime, ShardOps<Runtime> Ops = host_shard_ops, class Kernels = host_adam_kernels,
          shard_element T = float, class Scaler = default_shard_scaler<T>>
requires(std::is_same_v<T, float> || ShardWideningOps<Ops, T>) class chunk_shard_store {
 public:
  using element_type = T;  ///< the working weights' type, which the model's rotations carry

  /** @brief A store over @p rt, which must not be finalized yet and must hold parameters of @p T
   *  (`config_error` otherwise); @p ops moves them on the compute tier; @p scaler scales the loss
   *  (fp16). Adam's hyper-parameters and clipping come with each `step`, as for every ShardStore. */
  explicit chunk_shard_store(Runtime& rt, Ops ops = Ops{}, Scaler scaler = Scaler{})
      : rt_(rt), ops_(std::move(ops)), scaler_(std::move(scaler)) {
    if (rt.options().param_type != dtype_of_v<T>)
      throw config_error("rtp::chunk_shard_store: the runtime holds " +
                         std::string(dtype_name(rt.options().param_type)) + " parameters but the store's shards are " +
                         std::string(dtype_name(dtype_of_v<T>)) + ": build the runtime with param_type " +
                         std::string(dtype_name(dtype_of_v<T>)) + " (or the store for its type)");
  }
  chunk_shard_store(const chunk_shard_store&) = delete;
  chunk_shard_store& operator=(const chunk_shard_store&) = delete;

  std::size_t add_shard(std::size_t elems, std::vector<shard_segment> segments, bool counted_in_norm = true) {
    check_segments(elems, segments);
    std::vector<param_id> ids;
    for (const auto& s : segments) {
      ids.push_back(rt_.register_param({s.name, {static_cast<std::int64_t>(s.elems)}, dtype_of_v<T>, s.role}));
      const std::size_t t = ids.back().value;
      if (counted_.size() <= t) counted_.resize(t + 1, true);
      counted_[t] = counted_in_norm;
      all_counted_ = all_counted_ && counted_in_norm;
    }
    shards_.push_back({std::move(segments), std::move(ids)});
    return shards_.size() - 1;
  }
  void finalize() { rt_.finalize(); }

  template <class F>
  void stage(std::string_view name, bool backward, std::span<const std::size_t> shards, F&& f) {
    std::vector<param_id> ids;
    for (const std::size_t k : shards) ids.insert(ids.end(), shards_.at(k).ids.begin(), shards_.at(k).ids.end());
    auto s = backward ? rt_.backward(name, std::move(ids)) : rt_.forward(name, std::move(ids));
    scope_ = &s;
    struct reset {
      typename Runtime::scope*& p;
      ~reset() { p = nullptr; }
    } r{scope_};
    f();
    s.close(ops_.stream());  // the stage's work may still run there: later moves of its chunks wait for it
  }
  /** @brief Shard @p k's weights into @p dst as float (widened from 16-bit ones). */
  void load(std::size_t k, std::span<float> dst) {
    const auto& sh = in_stage(k, "load");
    for (std::size_t i = 0; i < sh.ids.size(); ++i) {
      const auto w = scope_->template param<T>(sh.ids[i]);
      if constexpr (std::is_same_v<T, float>) ops_.copy(dst.data() + sh.segments[i].offset, w.data(), w.size());
      else ops_.widen(dst.data() + sh.segments[i].offset, w.data(), w.size());
    }
  }
  /** @brief Shard @p k's 16-bit weights into @p dst as they are (what a rotation carries). */
  void load(std::size_t k, std::span<T> dst) requires(!std::is_same_v<T, float>) {
    const auto& sh = in_stage(k, "load");
    for (std::size_t i = 0; i < sh.ids.size(); ++i) {
      const auto w = scope_->template param<T>(sh.ids[i]);
      ops_.copy(dst.data() + sh.segments[i].offset, w.data(), w.size());
    }
  }
  /** @brief Adds the float sum @p g into shard @p k's gradient (rounded once per element when 16-bit). */
  void add_grad(std::size_t k, std::span<const float> g) {
    const auto& sh = in_stage(k, "add_grad");
    for (std::size_t i = 0; i < sh.ids.size(); ++i) {
      const auto acc = scope_->template grad<T>(sh.ids[i]);
      if constexpr (std::is_same_v<T, float>) ops_.add(acc.data(), g.data() + sh.segments[i].offset, acc.size());
      else ops_.accumulate(acc.data(), g.data() + sh.segments[i].offset, acc.size());
    }
  }
  /** @brief Adds a 16-bit sum (a rotation's) into shard @p k's 16-bit gradient. */
  void add_grad(std::size_t k, std::span<const T> g) requires(!std::is_same_v<T, float>) {
    const auto& sh = in_stage(k, "add_grad");
    for (std::size_t i = 0; i < sh.ids.size(); ++i) {
      const auto acc = scope_->template grad<T>(sh.ids[i]);
      ops_.add(acc.data(), g.data() + sh.segments[i].offset, acc.size());
    }
  }

  void zero_grad() { rt_.zero_grad(); }

  /** @brief Before a step's micro-batches: lets each host-stepped chunk's update start inside the
   *  last backward, once the trace says its gradient is final (chunk_adam::prepare: speculative,
   *  kept or undone and redone by `step`, the plain step's bits either way). `step` must follow
   *  with the same hyper-parameters, @p micro_batches and @p max_norm (`state_error` otherwise,
   *  before anything changes). Returns whether they were armed (chunk_adam::prepare's answer; the
   *  first iteration, without a trace, starts none). Not collective: every rank steps its own shards. */
  bool prepare(const adam_hyper& base, const param_groups& groups, int micro_batches, float max_norm) {
    optimizer(base, groups, max_norm);
    prepared_ = opt_->prepare(rt_, base.lr, micro_batches);
    return prepared_;
  }

  shard_step_result step(const adam_hyper& base, const param_groups& groups, int micro_batches, float max_norm,
                         const std::function<double(double)>& global_sum_sq) {
    sum_sq_ = global_sum_sq;  // read by the optimizer's hook during this step only
    optimizer(base, groups, max_norm);
    const auto r = opt_->step(rt_, base.lr, micro_batches);
    prepared_ = false;
    return {.grad_norm = r.grad_norm,
            .clip_coefficient = r.clip_coefficient,
            .grad_scale = 1.0f / (r.loss_scale * static_cast<float>(micro_batches)) * r.clip_coefficient,
            .stepped = r.stepped,
            .early_steps = r.early_steps,
            .early_redone = r.early_redone};
  }
  /** @brief What to multiply the loss by before a backward (fp16's dynamic scale; 1 otherwise). */
  [[nodiscard]] float loss_scale() const { return opt_ ? opt_->loss_scale() : scaler_.scale(); }
  /** @brief The loss scaler (to restore a checkpoint's scale). */
  [[nodiscard]] Scaler& scaler() noexcept { return opt_ ? opt_->scaler() : scaler_; }
  [[nodiscard]] std::int64_t step_count() const noexcept { return opt_ ? opt_->step_count() : restored_; }
  void restore_step_count(std::int64_t n) {
    restored_ = n;
    if (opt_) opt_->restore_step_count(n);
  }

  /** @brief List @p kind of shard @p k as float; the weights are the fp32 masters when 16-bit. */
  void read(std::size_t k, chunk_kind kind, std::span<float> out) const {
    const auto& sh = shards_.at(k);
    const chunk_kind list = kind == chunk_kind::param && rt_.has_list(chunk_kind::master) ? chunk_kind::master : kind;
    for (std::size_t i = 0; i < sh.ids.size(); ++i)
      rt_.read_tensor(sh.ids[i], list, out.subspan(sh.segments[i].offset, sh.segments[i].elems));
  }
  /** @brief Sets list @p kind of shard @p k; the weights' 16-bit copy and fp32 master both. */
  void write(std::size_t k, chunk_kind kind, std::span<const float> in) {
    const auto& sh = shards_.at(k);
    for (std::size_t i = 0; i < sh.ids.size(); ++i) {
      const auto v = in.subspan(sh.segments[i].offset, sh.segments[i].elems);
      rt_.write_tensor(sh.ids[i], kind, v);
      if (kind == chunk_kind::param && rt_.has_list(chunk_kind::master))
        rt_.write_tensor(sh.ids[i], chunk_kind::master, v);
    }
  }

  /** @brief @p n zeroed floats of non-model memory on the runtime's compute tier (as the
   *  `ShardStore` contract asks: transit buffers rely on it), zeroed by its copy engine. */
  [[nodiscard]] float* allocate(std::size_t n) {
    auto* p = static_cast<float*>(rt_.allocate_non_model(n * sizeof(float)));
    try {
      rt_.copy_engine().zero_async(p, n * sizeof(float)).wait();
    } catch (...) {
      rt_.deallocate_non_model(p, n * sizeof(float));
      throw;
    }
    return p;
  }
  void deallocate(float* p, std::size_t n) noexcept { rt_.deallocate_non_model(p, n * sizeof(float)); }
  [[nodiscard]] auto untraced() { return rt_.untraced(); }
  /** @brief The runtime's sleep: every chunk off the device (`chunk_runtime::sleep`). */
  void sleep() { rt_.sleep(); }
  void wake() { rt_.wake(); }
  [[nodiscard]] bool asleep() const noexcept { return rt_.asleep(); }

  /** @brief Bytes of model data in the runtime (its chunks, all lists). */
  [[nodiscard]] std::size_t bytes() const noexcept { return rt_.model_bytes(); }
  [[nodiscard]] std::size_t shards() const noexcept { return shards_.size(); }
  [[nodiscard]] Runtime& runtime() noexcept { return rt_; }

 private:
  struct shard {
    std::vector<shard_segment> segments;
    std::vector<param_id> ids;
  };
  const shard& in_stage(std::size_t k, const char* what) const {
    if (!scope_)
      throw state_error(std::string("rtp::chunk_shard_store::") + what +
                        " outside a stage: call it from inside stage(...)");
    return shards_.at(k);
  }

  /** The optimizer for these hyper-parameters (its lr aside) and clipping: rebuilt when they change
   *  (the step count and the loss scale carry over), never between prepare() and its step. */
  void optimizer(const adam_hyper& h, const param_groups& groups, float max_norm) {
    if (opt_ && max_norm == max_norm_ && same_hyper(h, hyper_)) return;
    if (prepared_)
      throw state_error(
          "rtp::chunk_shard_store::step with other hyper-parameters or clipping than prepare()'s, whose updates "
          "started inside backward: pass step() what prepare() was given");
    const std::int64_t steps = opt_ ? opt_->step_count() : restored_;
    if (opt_) scaler_ = opt_->scaler();  // the loss scale carries over
    opt_.emplace(
        chunk_adam_options{
            .hyper = h,
            .max_grad_norm = max_norm,
            .report_norm = false,
            .global_sum_sq = [this](double local) { return sum_sq_ ? sum_sq_(local) : local; },
            .counts_in_norm = all_counted_ ? std::function<bool(std::size_t)>()
                                           : [this](std::size_t t) { return t >= counted_.size() || counted_[t]; }},
        groups, scaler_);
    opt_->restore_step_count(steps);
    max_norm_ = max_norm;
    hyper_ = h;
  }

  static bool same_hyper(const adam_hyper& a, const adam_hyper& b) noexcept {
    return a.beta1 == b.beta1 && a.beta2 == b.beta2 && a.eps == b.eps && a.weight_decay == b.weight_decay &&
           a.mode == b.mode;
  }

  Runtime& rt_;
  adam_hyper hyper_;  // the optimizer's (its lr aside)
  Ops ops_;
  std::vector<shard> shards_;
  typename Runtime::scope* scope_ = nullptr;
  Scaler scaler_;  // until the optimizer exists, and while it is rebuilt
  std::optional<chunk_adam<Scaler, Kernels>> opt_;
  std::function<double(double)> sum_sq_;
  std::vector<bool> counted_;  // by parameter: in this store's sum of squares (add_shard's counted_in_norm)
  bool all_counted_ = true;    // then the optimizer scans by chunk, as for any runtime
  float max_norm_ = 0;
  std::int64_t restored_ = 0;
  bool prepared_ = false;  // prepare() armed early updates that the next step() decides
};

}  // namespace chunkstar::rtp
