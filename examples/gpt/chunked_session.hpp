// SPDX-License-Identifier: Apache-2.0
// A train_gpt run of the chunked GPT on one chunk runtime per rank: one process, or ZeRO
// (--parallel zero: 1/N of the model data on each rank). Sized from the library's memory plan and
// admitted before anything is built; then the runtime, the model and AdamW, resumed if asked. The
// trainer's loop (train_gpt.cpp) drives it through the same calls as an RTP run (rtp_session.hpp).
#pragma once

#include "chunked_gpt.hpp"
#include "exit_handling.hpp"
#include "run_plan.hpp"
#include "trainer_platform.hpp"

#include <chunkstar/checkpoint/runtime_checkpoint.hpp>
#include <chunkstar/comm/communicator_ref.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>
#include <chunkstar/runtime/memory_plan.hpp>
#include <chunkstar/zero/replicated_gradients.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace gpt {

/** What one optimizer step did: whether it stepped (a 16-bit overflow skips it) and the gradient
 *  norm (NaN when nothing needed it). */
struct step_outcome {
  bool stepped = true;
  double grad_norm = 0;
};

/** What stays on the device while the training state sleeps (`--sleep-after`): model data in
 *  chunks, and every byte in use in the device space (0 and 0 when nothing else holds any). */
struct asleep_memory {
  std::size_t model_bytes = 0;
  std::size_t device_used = 0;
};

template <class Runtime, class Scaler>
class chunked_session {
  using parts = platform_parts<typename Runtime::platform_type>;

 public:
  using placement_type = typename Runtime::placement_type;

  chunked_session(const train_options& o, const run_plan& plan, typename Runtime::placement_type placement,
                  communicator_ref comm)
      : o_(o),
        plan_(plan),
        comm_(comm),
        ranks_(comm.size()),
        overlap_(overlap_step(o, plan.device.cuda)) {
    const gpt_config& cfg = plan.cfg;
    std::printf("device: %s (%s)\n", parts::describe(plan.device.gpu).c_str(), plan.device.why.c_str());
    std::printf("data: %s, %zu train / %zu validation bytes\n", plan.data.source.c_str(), plan.data.train.size(),
                plan.data.val.size());
    if (ranks_ > 1)
      std::printf("parallel: %s over %d MPI ranks (%s), %lld sequences each of the global batch of %lld\n",
                  o.parallel == "zero" ? "ZeRO" : "replicated data parallelism", ranks_, plan.transport.why.c_str(),
                  static_cast<long long>(o.batch / ranks_), static_cast<long long>(o.batch));

    // What this rank's runtime will hold (its share of the model data under ZeRO, and ZeRO's
    // gather and reduce buffers at their peak), from the library's planner, before anything exists.
    const dtype type = precision_type(o.precision);
    const auto layout = make_layout(o, cfg);
    const auto specs = param_specs(cfg, type);
    runtime_options ro{.param_type = type,
                       .prefetch_depth = static_cast<std::size_t>(o.prefetch),
                       .timeline = !o.trace.empty(),
                       .scopes_ahead = scopes_ahead_of(o),
                       .gradients = o.parallel == "replicated" ? gradient_mode::replicated : gradient_mode::local,
                       .sharding = {.enabled = o.parallel == "zero",
                                    .keep_gathered = o.keep_gathered,
                                    .memory_saving = o.memory_saving,
                                    .micro_batches = static_cast<int>(o.accum)}};
    const batch_shape whole{static_cast<std::size_t>(o.batch), static_cast<std::size_t>(o.seq)};
    act_ = non_model_bytes<typename parts::backend>(cfg, whole, type) + activation_slack_bytes;
    const auto scopes = forward_scopes(cfg);
    // The activations moment by moment as the model allocates them (backward frees them block by
    // block), so the plan admits what the run holds at each moment rather than the peak throughout.
    auto profile = non_model_profile<typename parts::backend>(cfg, whole, type);
    for (std::size_t m = 0; m + 1 < profile.size(); ++m) profile[m] += activation_slack_bytes;
    memory_plan need = plan_memory(specs, layout, ro, ranks_, scopes, profile);
    const std::size_t model_bytes = need.model_bytes_per_rank;
    // A real device's automatic budget is its free memory; the simulated device's holds all of the
    // model data (this rank's share under ZeRO) with --policy resident, and a share of it otherwise.
    const std::size_t device_free = shared_device_free<parts>(plan.device, comm);
    device_capacity_ = device_budget_bytes(o, {.non_model = act_,
                                               .collective = need.collective_bytes,
                                               .model = model_bytes,
                                               .device_free = device_free,
                                               .floor = need.device_floor()});
    require_within_free(device_capacity_, device_free);
    host_capacity_ = bytes_option("--host-budget", o.host_budget);
    const bool with_disk = !o.disk_dir.empty();
    const std::size_t largest_chunk = need.chunks.chunk_elems * sizeof(float);
    disk_capacity_ = with_disk ? disk_budget_bytes(o, model_bytes, 2 * (8 + 4) * largest_chunk) : 0;
    // ZeRO's mode: the group mode unless only the memory-saving mode fits these budgets (then it,
    // said here); admitted before anything is built.
    const tier_budgets budgets{.device = device_capacity_, .host = host_capacity_, .disk = disk_capacity_};
    if (const auto choice = choose_sharding(specs, layout, ro, ranks_, scopes, profile, budgets); choice.switched) {
      std::printf("ZeRO: the memory-saving mode (as --memory-saving), because %s\n", choice.why.c_str());
      ro = choice.options;
      need = choice.plan;
    }
    const std::size_t collective = need.collective_bytes;
    if (o.policy == "resident" && device_capacity_ < act_ + collective + model_bytes)
      throw config_error(
          "--policy resident keeps all model data on the device, which needs --device-budget of at least " +
          format_bytes(act_ + collective + model_bytes) + " (activations " + format_bytes(act_) + " + model data " +
          format_bytes(model_bytes) + (collective ? " + ZeRO buffers " + format_bytes(collective) : std::string()) +
          "), not " + format_bytes(device_capacity_) +
          ": raise it (or leave it 'auto'), or use --policy patrickstar to move chunks");
    require_admitted(need, budgets);
    // With a disk tier only what the device and the host budgets hold is in memory.
    const std::size_t in_memory =
        with_disk ? std::min(model_bytes, host_capacity_ == SIZE_MAX ? model_bytes : host_capacity_ + device_capacity_)
                  : model_bytes;
    check_memory(host_memory_need(in_memory + collective, act_, device_capacity_, device_free == 0));
    open_memory(memory_, disk_, o, plan.device.gpu, device_capacity_, host_capacity_, disk_capacity_);

    // The runtime and the model: every parameter registered in execution order.
    rt_.emplace(memory_->device, memory_->host, memory_->copier, comm_, ro, layout,
                placement);  // held by reference: the member
    if (disk_) rt_->attach_disk(disk_->tier());
    rt_->require_admitted(need);  // the runtime's own spaces take the plan, before the first step
    shape_ = {static_cast<std::size_t>(o.batch / ranks_), static_cast<std::size_t>(o.seq)};
    model_.emplace(*rt_, cfg, shape_, o.seed, memory_->make_backend());
    model_->finalize();
    if (o.parallel == "replicated") {
      dp_.emplace(*rt_);  // after finalize: the gradient chunks exist
      // Each backward scope's final gradients start their all-reduce while the next scopes compute.
      model_->after_backward_scope = [this] { dp_->after_backward(); };
    }
    print_memory(model_bytes);

    // AdamW, no decay on biases and norms, global-norm clipping. Without clipping (--clip 0) in
    // fp32 or bf16 nothing needs the gradient norm: its scan, a read of every gradient chunk, is
    // skipped (report_norm) and the log shows "norm -".
    // fp16: the first scale leaves the gradient summed over accum x N micro-batches the headroom
    // one micro-batch has at 65536, so a split over ranks overflows as one process does.
    Scaler scaler{};
    if constexpr (std::is_same_v<Scaler, dynamic_loss_scaler>)
      scaler = dynamic_loss_scaler({.init_scale = initial_scale_for(static_cast<int>(o.accum) * ranks_)});
    opt_.emplace(chunk_adam_options{.hyper = {.beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = o.weight_decay},
                                    .max_grad_norm = o.clip,
                                    .report_norm = false},
                 param_groups::with_default_decay(o.weight_decay), std::move(scaler));
    if (plan.resume) {  // its configuration and state were checked by prepare()
      require_same_save(plan.resume_entries, load_checkpoint(*rt_, o.resume), o.resume);
      opt_->restore_step_count(plan.resume->optimizer_steps);
      if constexpr (std::is_same_v<Scaler, dynamic_loss_scaler>)
        if (plan.resume->loss_scale) opt_->scaler().restore(*plan.resume->loss_scale, plan.resume->clean_steps);
      std::printf("resumed from %s at step %lld\n", o.resume.c_str(), static_cast<long long>(plan.resume->step));
    }
  }

  [[nodiscard]] batch_shape shape() const noexcept { return shape_; }

  /** Before the step's micro-batches: with --overlap-step, each host-stepped chunk's update may
   *  start inside the last backward (chunk_adam::prepare; one process, ZeRO's ranks each its own chunks, replicated
   *  ranks each chunk once its all-reduce has completed). */
  void prepare_step(float lr, int micro_batches) {
    if (overlap_) (void)opt_->prepare(*rt_, lr, micro_batches);
  }
  /** Forward and backward of one micro-batch of this rank's slice; gradients add up to the step. */
  double forward_backward(const int* tokens, const int* targets) {
    const double loss = model_->forward_backward(tokens, targets, opt_->loss_scale());
    if (dp_) dp_->after_backward();  // the last scope's (its hook ran before the device was idle)
    return loss;
  }
  /** The step over @p micro_batches micro-batches' gradients (accum x N: each rank's are of its
   *  slice's mean loss, their sum N times the global batch's). */
  step_outcome step(float lr, int micro_batches) {
    if (dp_) dp_->synchronize();  // every gradient summed over the ranks, in rank order
    const auto r = opt_->step(*rt_, lr, micro_batches);
    return {r.stepped, r.grad_norm};
  }
  /** The loss on a validation batch: evaluation is not part of the training trace. */
  double eval_loss(const int* tokens, const int* targets) {
    auto eval = rt_->untraced();
    return model_->loss(tokens, targets);
  }
  std::vector<float> next_token_probs(std::span<const int> text) {
    auto gen = rt_->untraced();
    return model_->next_token_probs(text);
  }
  void save(std::int64_t step) {
    std::optional<float> scale;
    std::int64_t clean = 0;
    if constexpr (std::is_same_v<Scaler, dynamic_loss_scaler>) {
      scale = opt_->loss_scale();
      clean = opt_->scaler().clean_steps();
    }
    const auto record = save_record(plan_.record, o_, step, opt_->step_count(), scale, clean);
    if (!dp_) return save_checkpoint(*rt_, o_.save, record);
    // Replicated ranks hold the same bits: rank 0 writes them, and every rank learns whether it failed.
    std::string failed;
    if (comm_.rank() == 0) {
      try {
        save_checkpoint(*rt_, o_.save, record);
      } catch (const chunkstar::error& e) {
        failed = e.what();
      }
    }
    double bad = failed.empty() ? 0.0 : 1.0;
    comm_.allreduce(std::span<double>(&bad, 1), reduce_op::max);
    if (bad != 0.0)
      throw checkpoint_error(failed.empty() ? "saving the checkpoint failed on rank 0 (it reports why)" : failed);
  }

  /** Every chunk off the device until `wake` (chunk_runtime::sleep). */
  asleep_memory sleep() {
    rt_->sleep();
    return {rt_->device_chunk_bytes(), memory_->device.used()};
  }
  void wake() { rt_->wake(); }

  /** A step's line, after the loss: what the tiers held and moved since `begin_step`. */
  void begin_step() { before_ = rt_->stats(); }
  std::string step_report() {
    const runtime_stats& s = rt_->stats();
    std::string line = "device " + format_bytes(memory_->device.usage().peak) + " / " + format_bytes(device_capacity_) +
                       " | host " + format_bytes(rt_->host_chunk_bytes()) + " | moved " +
                       format_bytes(s.bytes_moved() - before_.bytes_moved()) + " | stall " +
                       one_decimal(1e3 * (s.stall_s - before_.stall_s)) + " ms";
    return end_step_line(std::move(line), disk_, *rt_, before_, memory_->device);
  }

  /** The run's summary after the common line: what the runtime did, per tier and per rank. */
  void print_summary() {
    const runtime_stats& s = rt_->stats();
    std::printf(
        "chunks: %s to device, %s to host, %llu loads (%llu ahead of use, %llu of those used), %llu evictions, "
        "%llu offloads, stall %.2f s; optimizer steps on device %llu, on host %llu (%llu inside backward)\n",
        format_bytes(s.bytes_to_device).c_str(), format_bytes(s.bytes_to_host).c_str(), ull(s.loads), ull(s.prefetches),
        ull(s.prefetch_hits), ull(s.evictions), ull(s.offloads), s.stall_s, ull(s.device_steps), ull(s.host_steps),
        ull(s.early_steps));
    if (disk_) print_disk_summary(s, host_capacity_, disk_capacity_);
    std::printf("peaks over the run: device %s of %s (chunks %s, non-model %s); trace divergences %zu\n",
                format_bytes(s.peak_device_bytes).c_str(), format_bytes(device_capacity_).c_str(),
                format_bytes(s.peak_device_chunk_bytes).c_str(), format_bytes(s.peak_non_model_bytes).c_str(),
                rt_->tracer().stats().divergences);
    if (ranks_ > 1) {  // the largest over the ranks
      double peaks[] = {static_cast<double>(s.peak_model_bytes), static_cast<double>(s.peak_collective_bytes),
                        static_cast<double>(s.peak_device_bytes)};
      comm_.allreduce(std::span<double>(peaks), reduce_op::max);
      std::printf(
          "per rank (largest): model data %s (share %s + gather/reduce buffers %s), device %s; "
          "%llu gathers, %llu reductions, %s sent by rank 0\n",
          format_bytes(static_cast<std::size_t>(peaks[0])).c_str(),
          format_bytes(rt_->model_bytes() / static_cast<std::size_t>(ranks_)).c_str(),
          format_bytes(static_cast<std::size_t>(peaks[1])).c_str(),
          format_bytes(static_cast<std::size_t>(peaks[2])).c_str(), ull(s.gathers), ull(s.reductions),
          format_bytes(comm_.stats().bytes_sent).c_str());
    }
  }
  Runtime& runtime() noexcept { return *rt_; }

 private:
  static unsigned long long ull(std::uint64_t x) noexcept { return static_cast<unsigned long long>(x); }
  static std::string one_decimal(double x) {
    char b[32];
    std::snprintf(b, sizeof b, "%.1f", x);
    return b;
  }
  std::string host_budget() const { return host_capacity_ == SIZE_MAX ? "unlimited" : format_bytes(host_capacity_); }
  void print_memory(std::size_t model_bytes) const {
    const Runtime& rt = *rt_;
    std::printf("%s\n", cpu_summary().c_str());
    std::printf("model: %d layers, width %d, %d heads, context %d: %zu parameters\n", plan_.cfg.layers, plan_.cfg.width,
                plan_.cfg.heads, plan_.cfg.context, param_count(plan_.cfg));
    std::printf(
        "memory: model data %s in %zu chunks of %zu elements (waste %.1f%%)%s; device budget %s "
        "(activations %s), host budget %s%s\n",
        format_bytes(rt.model_bytes()).c_str(), rt.plan().num_chunks, rt.plan().chunk_elems,
        100.0 * rt.plan().waste_fraction(),
        ranks_ > 1 ? (", " + format_bytes(rt.model_bytes() / static_cast<std::size_t>(ranks_)) + " per rank").c_str()
                   : "",
        format_bytes(device_capacity_).c_str(), format_bytes(act_).c_str(), host_budget().c_str(),
        model_bytes > device_capacity_ ? " -- the model data does not fit on the device: chunks will move" : "");
    if (disk_)
      std::printf("disk tier: %s%s\n", disk_->describe().c_str(),
                  host_capacity_ != SIZE_MAX && model_bytes > host_capacity_ + (device_capacity_ - act_)
                      ? " -- the model data exceeds device and host together: the disk holds the rest"
                      : "");
  }

  const train_options& o_;
  const run_plan& plan_;
  communicator_ref comm_;
  int ranks_;
  bool overlap_;  // --overlap-step: the optimizer step inside backward
  std::size_t act_ = 0, device_capacity_ = 0, host_capacity_ = 0, disk_capacity_ = 0;
  batch_shape shape_{};
  std::optional<parts> memory_;
  std::optional<owned_disk_tier> disk_;
  std::optional<Runtime> rt_;
  std::optional<chunked_gpt<Runtime, typename parts::backend>> model_;
  std::optional<chunk_adam<Scaler, typename parts::adam_kernels>> opt_;
  std::optional<replicated_gradients<Runtime>> dp_;  // --parallel replicated
  runtime_stats before_{};
};

}  // namespace gpt
