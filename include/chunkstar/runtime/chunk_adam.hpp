// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `chunk_adam`: mixed-precision Adam/AdamW over a chunk runtime — one fused scan of the
 *         gradients (overflow flag and norm), global-norm clipping across ranks, loss scaling, then
 *         each chunk's step on the tier the placement chose, with per-role parameter groups.
 */
#pragma once

#include <chunkstar/comm/rank_agreement.hpp>
#include <chunkstar/comm/step_agreement.hpp>
#include <chunkstar/optim/adam.hpp>
#include <chunkstar/optim/clip.hpp>
#include <chunkstar/optim/grad_check.hpp>
#include <chunkstar/optim/loss_scaler.hpp>
#include <chunkstar/optim/param_groups.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>
#include <chunkstar/runtime/early_step_plan.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace chunkstar {

/** @brief The kernels a chunk_adam runs on chunks that live on the host or on a host-accessible
 *  device (the simulated device). A CUDA platform supplies its own with the same two members, and
 *  may add `adam_async` (returns before the step finishes) with the `stream()` it runs on: device
 *  steps then overlap the host steps of the chunks after them (optimizer_pass.hpp). */
struct host_adam_kernels {
  /** @brief Overflow flag and sum of (g * scale)^2 over @p count gradients of type @p t at @p grad. */
  static grad_stats scan(const void* grad, dtype t, std::size_t count, float scale, int threads) {
    return optim_detail::with_element_type(t, [&](auto g) {
      using G = decltype(g);
      return scan_gradients<G>({static_cast<const G*>(grad), count}, scale, threads);
    });
  }
  /** @brief One tensor's Adam(W) step. */
  static void adam(const adam_chunk& c, const adam_hyper& h, const adam_step_args& a) { adam_step_host(c, h, a); }
};

/** @brief Numeric knobs of chunk_adam. */
struct chunk_adam_options {
  adam_hyper hyper{};          ///< base hyper-parameters; `lr` is replaced by each step's value
  float max_grad_norm = 0.0f;  ///< global-norm clipping threshold; 0 turns clipping off
  int threads = 0;             ///< host threads per kernel call (0: OpenMP's default)
  /** Compute grad_norm even when nothing else needs it. Clipping and a dynamic loss scaler (its
   *  overflow flag) always do; without them, false skips that read of every gradient chunk, and
   *  grad_norm is reported as NaN (not computed). */
  bool report_norm = true;
  /** When set, the global sum of squared (unscaled, averaged) gradients is
   *  `global_sum_sq(this rank's sum)` instead of the runtime's own rule: for a runtime that holds
   *  one rank's share of a model partitioned outside it (RTP's shards, with replicas kept
   *  elsewhere), the trainer adds what the runtime does not see and sums over its ranks. Every
   *  rank's step must call it alike if it communicates. */
  std::function<double(double)> global_sum_sq{};
  /** When set, only the tensors (by parameter index) for which it returns true count in this
   *  rank's sum, scanned tensor by tensor: a tensor held alike by every rank (an RTP replica)
   *  counts on one rank only, so the global norm counts it once. Unset: every tensor, by chunk. */
  std::function<bool(std::size_t)> counts_in_norm{};
  /** Most bytes prepare() keeps to undo speculative steps (each chunk's fp32 master, moments and
   *  16-bit parameters, where clipping or a dynamic loss scale could undo them); chunks beyond it
   *  step after backward as usual. */
  std::size_t early_step_bytes = std::numeric_limits<std::size_t>::max();
  /** Host threads of each update prepare() starts inside backward (0: the runtime's choice per
   *  update, early_update_threads: every hardware thread once the step has begun or where the last
   *  iteration's updates needed them, all but one otherwise, so the thread that queues the
   *  device's work keeps a core while the worker keeps up; measured in docs/performance.md, "The
   *  step inside backward"). Adam is elementwise: the bits do not depend on it. */
  int early_step_threads = 0;
};

/** @brief What one call to chunk_adam::step did. */
struct optimizer_step_result {
  bool stepped = false;  ///< false: skipped (overflow), gradients dropped
  /// global norm of the unscaled, averaged gradients (inf on overflow; NaN when not computed, see
  /// chunk_adam_options::report_norm)
  double grad_norm = 0.0;
  float clip_coefficient = 1;   ///< factor the gradients were multiplied by
  float loss_scale = 1;         ///< scale the gradients carried
  std::size_t early_steps = 0;  ///< chunks stepped inside backward (prepare()), kept or redone
  bool early_redone = false;    ///< those were undone and stepped again (the norm clipped), or undone (skipped)
  /// host updates of this step carried over to the next forward (below a disk tier, no room for
  /// their lists at the step: chunk_runtime::carried_steps), kept exactly as this step's
  std::size_t carried_steps = 0;
};

/** @brief Adam/AdamW with loss scaling, clipping and parameter groups, over any chunk_runtime.
 *  @tparam Scaler   LossScaler: `dynamic_loss_scaler` for fp16, `static_loss_scaler` otherwise.
 *  @tparam Kernels  where chunks on the compute tier are stepped (host_adam_kernels on CPU platforms). */
template <LossScaler Scaler = static_loss_scaler, class Kernels = host_adam_kernels>
class chunk_adam {
 public:
  explicit chunk_adam(chunk_adam_options options = {}, param_groups groups = param_groups::with_default_decay(0.0f),
                      Scaler scaler = Scaler{})
      : options_(options), groups_(std::move(groups)), scaler_(std::move(scaler)) {
    if (options_.max_grad_norm < 0 || !std::isfinite(options_.max_grad_norm))
      throw config_error("chunk_adam: max_grad_norm must be >= 0 and finite (0 disables clipping), got " +
                         std::to_string(options_.max_grad_norm));
  }

  /** @brief The factor to multiply the loss by before backward. */
  [[nodiscard]] float loss_scale() const { return scaler_.scale(); }
  /** @brief Steps applied so far (the bias-correction count; skipped steps do not count). */
  [[nodiscard]] std::int64_t step_count() const noexcept { return steps_; }
  /** @brief Restores the step count from a checkpoint. */
  void restore_step_count(std::int64_t steps) {
    if (steps < 0)
      throw checkpoint_error("chunk_adam: negative step count " + std::to_string(steps) + " in checkpoint");
    steps_ = steps;
  }
  [[nodiscard]] Scaler& scaler() noexcept { return scaler_; }
  [[nodiscard]] const param_groups& groups() const noexcept { return groups_; }
  [[nodiscard]] const chunk_adam_options& options() const noexcept { return options_; }

  /** @brief What every rank must agree on (require_agreement) for steps of @p micro_batches: the
   *  hyper-parameters, clipping, whether the norm is scanned (a collective when sharded), the loss
   *  scaler, the parameter groups and the step count. The first step() checks it across the
   *  runtime's ranks, so ranks given different optimizer options fail together with the field named. */
  [[nodiscard]] std::vector<config_field> configuration(int micro_batches = 1) const {
    const adam_hyper& h = options_.hyper;
    std::vector<config_field> f = {
        {"adam", std::string(h.mode == adam_mode::adamw ? "AdamW" : "Adam") + ", beta1 " + config_value(h.beta1) +
                     ", beta2 " + config_value(h.beta2) + ", eps " + config_value(h.eps) + ", weight_decay " +
                     config_value(h.weight_decay)},
        {"max_grad_norm", config_value(options_.max_grad_norm)},
        {"report_norm", config_value(options_.report_norm)},
        {"global_sum_sq", options_.global_sum_sq ? "set" : "unset"},
        {"loss scaler", std::string(std::is_same_v<Scaler, static_loss_scaler> ? "static" : "dynamic") + ", scale " +
                            config_value(scaler_.scale())},
        {"micro_batches", std::to_string(micro_batches)},
        {"step count", std::to_string(steps_)},
    };
    for (std::size_t r = 0; r < param_groups::role_count; ++r) {
      const auto role = static_cast<tensor_role>(r);
      const param_group& g = groups_.group_for(role);
      f.push_back({"group of " + std::string(role_name(role)), "'" + g.name + "' weight_decay " +
                                                                   config_value(g.weight_decay) + ", lr x " +
                                                                   config_value(g.lr_multiplier)});
    }
    return f;
  }

  /** @brief Lets each host-stepped chunk's update start inside backward, as soon as the trace says
   *  nothing in this iteration uses its gradient or weights again, instead of after backward
   *  (the runtime's arm_early_steps; which chunks and when: early_step_plan.hpp). Call it before
   *  the backward of the step's last micro-batch, with the @p lr and @p micro_batches step() will
   *  get. The early update assumes clip coefficient 1 and no overflow; where clipping or a dynamic
   *  loss scale could say otherwise it first keeps the chunk's fp32 master, moments and 16-bit
   *  weights (`early_step_bytes` at most) and step() then keeps the update (coefficient 1) or
   *  undoes and redoes it with the true coefficient (or undoes it: an overflow skips the step).
   *  Either way every chunk ends with the bits of the step without prepare(). Returns false, and
   *  does nothing, where the runtime cannot (a model partitioned outside it: every chunk then
   *  steps in step(); under ZeRO each rank steps its own chunks early, once reduced to it, and with
   *  replicated gradients every chunk once its all-reduce has completed) or where the last step
   *  clipped or overflowed (speculation_advised: this one likely will too); in the first iteration
   *  (no trace yet) nothing starts early. Not collective: one rank may prepare and another not
   *  (the same bits). Every prepare() must be followed by step(), or the
   *  iteration abandoned (abandon(), the runtime's zero_grad() and end_iteration(): the early
   *  updates are undone where they were kept; otherwise they stand). */
  template <class Runtime>
  bool prepare(Runtime& rt, float lr, int micro_batches = 1) {
    if (micro_batches < 1)
      throw config_error("chunk_adam::prepare: micro_batches must be >= 1, got " + std::to_string(micro_batches));
    require_kernels_for<Runtime>();
    if (pending_)
      throw state_error("chunk_adam::prepare while a step that threw is unfinished: call step() again first");
    if constexpr (requires { rt.require_no_early_steps_pending("chunk_adam::prepare"); })
      rt.require_no_early_steps_pending("chunk_adam::prepare");
    early_.reset();
    if constexpr (!requires { rt.arm_early_steps(early_steps{}); }) {
      return false;
    } else {
      const bool can_undo = options_.max_grad_norm > 0 || !std::is_same_v<Scaler, static_loss_scaler>;
      if (!speculation_advised(can_undo, last_clipped_, last_skipped_)) return false;
      speculation sp;
      sp.lr = lr;
      sp.micro_batches = micro_batches;
      sp.base = options_.hyper;
      sp.base.lr = lr;
      sp.args = {.step = steps_ + 1,
                 .grad_scale = 1.0f / (scaler_.scale() * static_cast<float>(micro_batches)),
                 .threads = options_.early_step_threads > 0 ? options_.early_step_threads
                                                            : early_update_threads(std::thread::hardware_concurrency(),
                                                                                   0, 0, false, early_load::unknown)};
      const std::size_t elems = rt.plan().chunk_elems, ps = dtype_size(rt.options().param_type);
      std::size_t per_chunk = 0;
      if (can_undo) {
        for (auto k : {chunk_kind::master, chunk_kind::momentum, chunk_kind::variance})
          if (rt.has_list(k)) per_chunk += elems * sizeof(float);
        per_chunk += elems * ps;  // the weights: fp32 ones are the master, 16-bit ones are kept too
      }
      if (can_undo) sp.kept = std::make_shared<kept_state>(rt.plan().num_chunks);
      // Where nothing can undo an update it is the gradient's last reader: the norm's scan of the
      // chunk runs first, in the update (the step's own function and threads: the same bits), and
      // the runtime frees the gradient once the update is joined (early_steps::spends_gradient).
      const bool spends = !can_undo && !options_.counts_in_norm;
      if (spends && options_.report_norm) sp.sums = std::make_shared<std::vector<double>>(rt.plan().num_chunks, 0.0);
      early_ = sp;
      // Self-contained: an update kept as it is may still run while the next forward starts,
      // after step() has returned (the runtime joins it before anything reads its chunk).
      early_steps e{
          .update =
              [groups = groups_, base = sp.base, args = sp.args, kept = sp.kept, sums = sp.sums,
               scan_threads = options_.threads, chosen = options_.early_step_threads > 0](const step_chunk& c) {
                if (sums)  // the step's scan's threads: the same bits as the norm without prepare()
                  (*sums)[c.index] =
                      host_adam_kernels::scan(c.grad, c.param_type, c.elems, args.grad_scale, scan_threads).sum_sq;
                if (kept) keep(*kept, c);
                adam_step_args a = args;
                if (!chosen && c.threads > 0) a.threads = c.threads;  // the runtime's choice for this update
                update_chunk<Runtime>(groups, c, base, a);
              },
          .undo = {},
          .kept_bytes_per_chunk = per_chunk,
          .kept_budget = options_.early_step_bytes,
          .spends_gradient = spends};
      if (can_undo) e.undo = [kept = sp.kept](const step_chunk& c) { restore(*kept, c); };
      if (!rt.arm_early_steps(std::move(e))) {
        early_.reset();
        return false;
      }
      return true;
    }
  }

  /** @brief One optimizer step at learning rate @p lr. Gradients were accumulated over
   *  @p micro_batches backward passes of a loss multiplied by loss_scale(); they are averaged,
   *  unscaled and clipped inside the fused update. On overflow the step is skipped, the gradients
   *  dropped and the iteration ended. The global norm: the local gradients' norm, summed over ranks
   *  when the runtime's gradients are sharded (`gradient_mode::sharded`: a collective), taken as it
   *  is when they are local or replicated (every rank holds the same sum).
   *  After a throw (no room, a failed copy...), call step() again with the same arguments: it
   *  finishes that step with the norm, clip and scale already decided, so every chunk is updated
   *  exactly once; `abandon()` forgets it instead. */
  template <class Runtime>
  optimizer_step_result step(Runtime& rt, float lr, int micro_batches = 1) {
    require_kernels_for<Runtime>();
    // Updates started early with other arguments that nothing kept to undo: refused before anything
    // changes, so step() with prepare()'s arguments still takes this step.
    const bool early_refused =
        !pending_ && early_ && !early_->kept && (early_->lr != lr || early_->micro_batches != micro_batches);
    const auto refuse_early = [&] {
      return state_error("chunk_adam::step(lr " + config_value(lr) + ", micro_batches " +
                         std::to_string(micro_batches) + ") after prepare(lr " + config_value(early_->lr) +
                         ", micro_batches " + std::to_string(early_->micro_batches) +
                         "), whose updates started inside backward and cannot be undone: pass step() the lr and "
                         "micro-batches given to prepare()");
    };
    if (!agreed_) {  // before the step's first collective: ranks configured differently stop here, all of them
      require_agreement(rt.communicator(), configuration(micro_batches), "chunk_adam::step");
      agreed_ = true;
    }
    // Every step's arguments, and whether this rank refuses them, compared across data-parallel
    // ranks before the first collective or check that could stop one rank alone: ranks that would
    // step differently all stop here, before anything is updated (the configuration is compared
    // once, above).
    if (const int world = rt.communicator().size(); !pending_ && world > 1 && rt.gradients() != gradient_mode::local) {
      try {
        step_agreement("chunk_adam::step",
                       {{"lr", lr},
                        {"micro_batches", static_cast<double>(micro_batches)},
                        {"the step's number", static_cast<double>(steps_ + 1)},
                        {"loss scale", scaler_.scale()},
                        {"prepare() matching (1) or not (0)", early_refused ? 0.0 : 1.0}},
                       rt.communicator().rank(), world)
            .run(rt.communicator());
      } catch (const config_error&) {
        if (early_refused) throw refuse_early();  // this rank's own reason
        throw;
      }
    }
    if (micro_batches < 1)
      throw config_error("chunk_adam::step: micro_batches must be >= 1, got " + std::to_string(micro_batches));
    if constexpr (requires { rt.options().sharding; }) {
      // micro_batches counts every rank's (docs/zero.md); each rank's own must not exceed what the
      // runtime was told, or ZeRO's first iteration would reduce after each instead of the last.
      const auto& sh = rt.options().sharding;
      const int world = rt.communicator().size();
      if (sh.enabled && micro_batches > sh.micro_batches * world)
        throw config_error(
            "chunk_adam::step: " + std::to_string(micro_batches) + " micro-batches over " + std::to_string(world) +
            " ranks, but the runtime was built with runtime_options::sharding.micro_batches " +
            std::to_string(sh.micro_batches) + ": set it to the micro-batches each rank accumulates per step (" +
            std::to_string((micro_batches + world - 1) / world) +
            "), so ZeRO's first iteration reduces each gradient once, after the last, as later ones do");
    }
    if (early_refused) throw refuse_early();
    if (!pending_) {
      optimizer_step_result r;
      r.loss_scale = scaler_.scale();
      const float unscale = 1.0f / (r.loss_scale * static_cast<float>(micro_batches));
      // The scan reads every gradient chunk: skipped when nothing reads the norm or the overflow flag.
      const bool scan =
          options_.report_norm || options_.max_grad_norm > 0 || !std::is_same_v<Scaler, static_loss_scaler>;
      double sum_sq = 0.0;
      if (scan) {
        // Per chunk, then summed in chunk order, so the total has the same bits however the chunks
        // are spread over ranks: sharded ranks hold disjoint chunks, and the allreduce of their
        // per-chunk sums (zeros elsewhere) is exact. One collective gives both answers: a rank with
        // inf/NaN makes the global sum non-finite.
        std::vector<double> per_chunk(rt.plan().num_chunks, 0.0);
        std::vector<char> scanned(rt.plan().num_chunks, 0);
        rt.for_each_grad_chunk([&](const step_chunk& c) {
          scanned[c.index] = 1;
          if (!options_.counts_in_norm) {
            per_chunk[c.index] = scan_chunk<Runtime>(c.grad, c.param_type, c.elems, unscale, c.where).sum_sq;
            return;
          }
          const std::size_t ps = dtype_size(c.param_type);
          for (const std::size_t t : c.tensors)
            if (c.slots[t].numel > 0 && options_.counts_in_norm(t))
              per_chunk[c.index] += scan_chunk<Runtime>(static_cast<const std::byte*>(c.grad) + c.slots[t].offset * ps,
                                                        c.param_type, c.slots[t].numel, unscale, c.where)
                                        .sum_sq;
        });
        // A chunk stepped early whose gradient the update spent: its sum, taken in the update (the
        // runtime frees the gradient only once the update is joined, so it is written by then).
        if constexpr (requires { rt.stepped_early(); })
          if (early_ && early_->sums)
            for (const std::uint32_t c : rt.stepped_early())
              if (!scanned[c]) per_chunk[c] = (*early_->sums)[c];
        if (rt.gradients() == gradient_mode::sharded && !options_.global_sum_sq)
          rt.communicator().allreduce(std::span<double>(per_chunk), reduce_op::sum);
        for (double x : per_chunk) sum_sq += x;
        if (options_.global_sum_sq) sum_sq = options_.global_sum_sq(sum_sq);
      }
      r.grad_norm = scan ? std::sqrt(sum_sq) : std::numeric_limits<double>::quiet_NaN();
      const bool overflow = scan && !std::isfinite(sum_sq);
      if constexpr (requires { rt.stepped_early(); }) r.early_steps = rt.stepped_early().size();
      if (!scaler_.update(overflow)) {
        if constexpr (requires { rt.undo_early_steps(); })
          if (r.early_steps > 0) rt.undo_early_steps();  // what the speculation changed goes back
        r.early_redone = r.early_steps > 0;
        early_.reset();
        last_skipped_ = true;
        rt.zero_grad();
        rt.end_iteration();
        return r;
      }
      if (options_.max_grad_norm > 0) r.clip_coefficient = clip_coefficient(sum_sq, options_.max_grad_norm).coefficient;
      adam_hyper base = options_.hyper;
      base.lr = lr;
      pending_ = pending{
          r, base, {.step = steps_ + 1, .grad_scale = unscale * r.clip_coefficient, .threads = options_.threads}};
      // The early updates stand where they are exactly this step's: coefficient 1, the same lr and
      // micro-batches; otherwise they are undone and stepped again (bit for bit the plain step), and
      // the chunks still due are not started (nor carried over, below a disk tier) with prepare()'s
      // arguments: the pass steps them with the step's own, even when none started inside backward.
      const bool same = early_ && r.clip_coefficient == 1.0f && early_->lr == lr && early_->args.step == steps_ + 1 &&
                        early_->micro_batches == micro_batches && early_->args.grad_scale == pending_->args.grad_scale;
      pending_->early = early_ && !same ? early_outcome::redo : early_outcome::keep;
      pending_->result.early_redone = r.early_steps > 0 && !same;
    }
    const pending p = *pending_;
    using stream_type = typename Runtime::stream_type;
    const auto update = [&](const step_chunk& c) -> std::optional<stream_type> {
      update_chunk<Runtime>(groups_, c, p.base, p.args);
      // Asynchronous device kernels: the update still runs on their stream; the pass orders the
      // chunk's next moves after it and goes on (host steps of the next chunks overlap it).
      if constexpr (asynchronous<Runtime>)
        if (c.where != tier::host) return Kernels::stream();
      return std::nullopt;
    };
    if constexpr (requires { rt.step_with(update, p.early); }) rt.step_with(update, p.early);
    else rt.step(update);
    pending_.reset();
    early_.reset();
    ++steps_;
    last_clipped_ = p.result.clip_coefficient != 1.0f;
    last_skipped_ = false;
    optimizer_step_result r = p.result;
    r.stepped = true;
    if constexpr (requires { rt.carried_steps(); }) r.carried_steps = rt.carried_steps().size();
    return r;
  }

  /** @brief Forgets a step that threw part-way (see step()); the runtime's own progress is dropped
   *  by its end_iteration(). */
  void abandon() noexcept {
    pending_.reset();
    early_.reset();
  }

  /** @brief Whether these kernels can step @p Runtime's chunks: the host's only where the host
   *  addresses the device (the simulated one); a GPU's device needs the platform's kernels
   *  (`cuda::device_adam_kernels`), since gradients and device-stepped chunks live there. step()
   *  and prepare() refuse to compile otherwise. */
  template <class Runtime>
  static constexpr bool can_step =
      can_access_v<host_exec, typename Runtime::device_space_type> || !std::is_same_v<Kernels, host_adam_kernels>;

 private:
  template <class Runtime>
  static constexpr bool device_on_host = can_access_v<host_exec, typename Runtime::device_space_type>;
  template <class Runtime>
  static constexpr void require_kernels_for() {
    static_assert(can_step<Runtime>,
                  "chunk_adam<Scaler, host_adam_kernels> over a runtime whose device the host cannot address (a "
                  "GPU's): the gradient scan and the device-placed steps read device memory there; use the platform's "
                  "device kernels, chunk_adam<Scaler, cuda::device_adam_kernels> "
                  "(chunkstar/cuda/chunk_adam_kernels.cuh, compiled by nvcc)");
  }

  template <class Runtime>
  grad_stats scan_chunk(const void* g, dtype t, std::size_t n, float scale, tier where) const {
    if (where == tier::host || device_on_host<Runtime>)
      return host_adam_kernels::scan(g, t, n, scale, options_.threads);
    return Kernels::scan(g, t, n, scale, options_.threads);
  }
  /** Kernels whose device step returns before it finishes, on `Kernels::stream()` (a stream of
   *  the runtime's platform): `adam_async` and `stream`. */
  template <class Runtime>
  static constexpr bool asynchronous =
      !device_on_host<Runtime> && requires(const adam_chunk& a, const adam_hyper& h, const adam_step_args& s) {
    Kernels::adam_async(a, h, s);
    { Kernels::stream() } -> std::convertible_to<typename Runtime::stream_type>;
  };
  template <class Runtime>
  static void run_adam(const adam_chunk& a, const adam_hyper& h, const adam_step_args& args, tier where) {
    if (where == tier::host || device_on_host<Runtime>) host_adam_kernels::adam(a, h, args);
    else if constexpr (asynchronous<Runtime>) Kernels::adam_async(a, h, args);
    else Kernels::adam(a, h, args);
  }

  /** One chunk's Adam(W) update, tensor by tensor, on the tier it is on. */
  template <class Runtime>
  static void update_chunk(const param_groups& groups, const step_chunk& c, const adam_hyper& base,
                           const adam_step_args& args) {
    const std::size_t ps = dtype_size(c.param_type);
    for (auto t : c.tensors) {
      const tensor_slot& sl = c.slots[t];
      if (sl.numel == 0) continue;
      adam_chunk a;
      a.count = sl.numel;
      a.m = c.momentum + sl.offset;
      a.v = c.variance + sl.offset;
      a.grad = static_cast<const std::byte*>(c.grad) + sl.offset * ps;
      a.grad_type = c.param_type;
      a.param_type = c.param_type;
      if (c.master) {  // 16-bit params: fp32 master updated, param rewritten from it
        a.master = c.master + sl.offset;
        a.param = static_cast<std::byte*>(c.param) + sl.offset * ps;
      } else {  // fp32 params are their own master
        a.master = static_cast<float*>(c.param) + sl.offset;
      }
      run_adam<Runtime>(a, groups.hyper_for(c.specs[t], base), args, c.where);
    }
  }

  /** Per chunk index: what an early update changed, kept to undo it (empty: nothing kept). Each
   *  update writes its own chunk's entry only, so the worker and this thread never share one. */
  using kept_state = std::vector<std::vector<std::byte>>;

  /** The lists an early update changes, in order: weights, master, moments (those present). */
  static std::vector<std::span<std::byte>> changed(const step_chunk& c) {
    std::vector<std::span<std::byte>> v;
    v.emplace_back(static_cast<std::byte*>(c.param), c.elems * dtype_size(c.param_type));
    for (float* p : {c.master, c.momentum, c.variance})
      if (p) v.emplace_back(reinterpret_cast<std::byte*>(p), c.elems * sizeof(float));
    return v;
  }
  /** Keeps what chunk @p c's early update will change (its lists are on the host). */
  static void keep(kept_state& kept, const step_chunk& c) {
    auto& bytes = kept.at(c.index);
    bytes.clear();
    for (auto s : changed(c)) bytes.insert(bytes.end(), s.begin(), s.end());
  }
  /** Puts back what keep() kept for chunk @p c. */
  static void restore(kept_state& kept, const step_chunk& c) {
    auto& bytes = kept.at(c.index);
    if (bytes.empty())
      throw state_error("chunk_adam: chunk " + std::to_string(c.index) + " has no kept state to undo its early step");
    const std::byte* from = bytes.data();
    for (auto s : changed(c)) {
      std::copy(from, from + s.size(), s.begin());
      from += s.size();
    }
    bytes = {};
  }

  /** What prepare() stepped early with, and what it kept to undo it. */
  struct speculation {
    float lr = 0;
    int micro_batches = 1;
    adam_hyper base;
    adam_step_args args;
    std::shared_ptr<kept_state> kept;  // null: nothing could undo it, nothing is kept
    /// Per chunk index: the norm's sum of an update that spent its gradient (null: none do)
    std::shared_ptr<std::vector<double>> sums;
  };

  /** A step decided (norm, clip, scale) whose update has not finished. */
  struct pending {
    optimizer_step_result result;
    adam_hyper base;
    adam_step_args args;
    early_outcome early = early_outcome::keep;
  };

  chunk_adam_options options_;
  param_groups groups_;
  Scaler scaler_;
  bool agreed_ = false;  // the ranks agreed on configuration() (the first step)
  std::int64_t steps_ = 0;
  std::optional<pending> pending_;
  std::optional<speculation> early_;
  bool last_clipped_ = false, last_skipped_ = false;  // the last step's outcome (speculation_advised)
};

}  // namespace chunkstar
