// SPDX-License-Identifier: Apache-2.0
// A train_gpt run under --parallel rtp: Rotated Tensor Parallelism (rtp_gpt.hpp). Each rank trains
// on its slice of the global batch and owns 1/N of every sharded layer (weights, gradient, Adam
// moments) in its own chunk runtime, under its device budget like any chunkstar model; the shards
// rotate round the ring of ranks. The same options, data, schedule and checkpoints as the other
// modes; losses agree with them within fp32 rounding (the ring adds in its own order). On a GPU the
// layers, the rotations' buffers and the chunks placed on the device are there, and the shards
// rotate over NCCL or MPI through pinned host buffers (--comm). With --disk-dir each rank's
// runtime spills to its own disk file, as a ZeRO rank's does. Driven by train_gpt.cpp's loop
// through the same calls as chunked_session.hpp.
#pragma once

#include "chunked_session.hpp"  // step_outcome
#include "exit_handling.hpp"
#include "rtp_checkpoint.hpp"
#include "rtp_gpt.hpp"
#include "run_plan.hpp"
#include "trainer_platform.hpp"

#include <chunkstar/checkpoint/runtime_checkpoint.hpp>
#include <chunkstar/comm/communicator_ref.hpp>
#include <chunkstar/comm/single_process.hpp>
#include <chunkstar/rtp/chunk_shard_store.hpp>
#include <chunkstar/runtime/memory_plan.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace gpt {

/** RTP with shards of @p T: fp32, or 16-bit weights and gradients with fp32 masters and moments
 *  (--precision bf16 | fp16: half the ring's bytes; fp16 with dynamic loss scaling). */
template <class Runtime, class T = float>
class rtp_session {
  using parts = platform_parts<typename Runtime::platform_type>;
  using backend_type = typename parts::backend;
  using store_type = rtp::chunk_shard_store<Runtime, backend_buffer_ops<backend_type>, typename parts::adam_kernels, T>;
  using model_type = rtp_gpt<communicator_ref, store_type, backend_type>;

 public:
  using placement_type = typename Runtime::placement_type;

  rtp_session(const train_options& o, const run_plan& plan, typename Runtime::placement_type placement,
              communicator_ref comm)
      : o_(o), plan_(plan), comm_(comm), ranks_(comm.size()), overlap_(overlap_step(o, plan.device.cuda)), one_ref_(one_) {
    const gpt_config& cfg = plan.cfg;
    std::printf("device: %s%s (%s)\n", parts::describe(plan.device.gpu).c_str(),
                plan.device.cuda ? "" : ", one per rank", plan.device.why.c_str());
    std::printf("data: %s, %zu train / %zu validation bytes\n", plan.data.source.c_str(), plan.data.train.size(),
                plan.data.val.size());
    std::printf("parallel: RTP over %d rank%s%s, %lld sequences each of the global batch of %lld; %s shards rotate%s\n",
                ranks_, ranks_ > 1 ? "s" : "",
                plan.transport.why.empty() ? "" : (" (" + plan.transport.why + ")").c_str(),
                static_cast<long long>(o.batch / ranks_), static_cast<long long>(o.batch), o.precision.c_str(),
                std::is_same_v<T, float> ? "" : " (fp32 masters and Adam moments stay with their owner)");
    shape_ = {static_cast<std::size_t>(o.batch / ranks_), static_cast<std::size_t>(o.seq)};

    // This rank's shards in chunks (all four lists), beside the activations and the rotations'
    // transit buffers (non-model memory on the device), sized before anything is built.
    const auto layout = make_layout(o, cfg);
    const auto scopes = model_type::stage_scopes(cfg, ranks_, comm.rank());
    const memory_plan need = plan_memory(
        model_type::shard_tensors(cfg, ranks_, comm.rank()), layout, {.param_type = dtype_of_v<T>}, 1, scopes,
        passes_non_model(
            scopes, model_type::compute_tier_bytes(cfg, ranks_, shape_.batch, shape_.seq) + activation_slack_bytes));
    const std::size_t model_bytes = need.model_bytes, act = need.non_model_bytes;
    const std::size_t device_free = shared_device_free<parts>(plan.device, comm);
    device_capacity_ = device_budget_bytes(
        o, {.non_model = act, .model = model_bytes, .device_free = device_free, .floor = need.device_floor()});
    require_within_free(device_capacity_, device_free);
    host_capacity_ = bytes_option("--host-budget", o.host_budget);
    // With --disk-dir each rank's runtime spills to its own file, as a ZeRO rank's does.
    const bool with_disk = !o.disk_dir.empty();
    disk_capacity_ =
        with_disk ? disk_budget_bytes(o, model_bytes, 2 * (8 + 4) * need.chunks.chunk_elems * sizeof(float)) : 0;
    require_admitted(need, {.device = device_capacity_, .host = host_capacity_, .disk = disk_capacity_});
    if (o.policy == "resident" && device_capacity_ < act + model_bytes)
      throw config_error(
          "--policy resident keeps all of this rank's shards on the device, which needs --device-budget of at least " +
          format_bytes(act + model_bytes) + ", not " + format_bytes(device_capacity_) +
          ": raise it (or leave it 'auto'), or use --policy patrickstar to move chunks");
    const std::size_t in_memory =
        with_disk ? std::min(model_bytes, host_capacity_ == SIZE_MAX ? model_bytes : host_capacity_ + device_capacity_)
                  : model_bytes;
    check_memory(host_memory_need(in_memory, act, device_capacity_, device_free == 0));
    open_memory(memory_, disk_, o, plan.device.gpu, device_capacity_, host_capacity_, disk_capacity_);
    backend_.emplace(memory_->make_backend());
    // The runtime's communicator is a one-rank one: RTP talks in the model's rotations.
    rt_.emplace(memory_->device, memory_->host, memory_->copier, one_ref_,
                runtime_options{.param_type = dtype_of_v<T>,
                                .prefetch_depth = static_cast<std::size_t>(o.prefetch),
                                .timeline = !o.trace.empty(),
                                .scopes_ahead = scopes_ahead_of(o)},
                layout, placement);
    if (disk_) rt_->attach_disk(disk_->tier());
    rt_->require_admitted(need);
    // fp16: the first loss scale as the chunked modes' (initial_scale_for: accum x ranks micro-batches).
    if constexpr (std::is_same_v<T, float16>)
      store_.emplace(*rt_, backend_buffer_ops<backend_type>{&*backend_},
                     dynamic_loss_scaler({.init_scale = initial_scale_for(static_cast<int>(o.accum) * ranks_)}));
    else store_.emplace(*rt_, backend_buffer_ops<backend_type>{&*backend_});
    model_.emplace(comm_, *store_, cfg, shape_.batch, shape_.seq, &*backend_);  // held by reference: the member
    model_->init(o.seed);
    std::printf("%s\n", cpu_summary().c_str());
    std::printf("model: %d layers, width %d, %d heads, context %d: %zu parameters\n", cfg.layers, cfg.width, cfg.heads,
                cfg.context, param_count(cfg));
    std::printf(
        "memory per rank: model data %s of the whole %s (its shards in %zu chunks of %zu elements, and the replicas); "
        "device budget %s (activations %s, rotation buffers %s), host budget %s%s\n",
        format_bytes(model_->model_bytes()).c_str(), format_bytes(whole_bytes()).c_str(), rt_->plan().num_chunks,
        rt_->plan().chunk_elems, format_bytes(device_capacity_).c_str(),
        format_bytes(model_->activation_bytes()).c_str(), format_bytes(model_->transient_bytes()).c_str(),
        host_capacity_ == SIZE_MAX ? "unlimited" : format_bytes(host_capacity_).c_str(),
        model_bytes + act > device_capacity_ ? " -- the shards do not fit on the device: chunks will move" : "");
    if (disk_) std::printf("disk tier: %s\n", disk_->describe().c_str());
    if (plan.resume) {
      rtp_load_view<communicator_ref, store_type, backend_type> view(*model_);
      require_same_save(plan.resume_entries, load_checkpoint(view, o.resume), o.resume);
      model_->restore_step_count(plan.resume->optimizer_steps);
      if constexpr (std::is_same_v<T, float16>)
        if (plan.resume->loss_scale) store_->scaler().restore(*plan.resume->loss_scale, plan.resume->clean_steps);
      std::printf("resumed from %s at step %lld\n", o.resume.c_str(), static_cast<long long>(plan.resume->step));
    }
  }

  [[nodiscard]] batch_shape shape() const noexcept { return shape_; }

  /** Forward and backward of one micro-batch of this rank's slice; gradients accumulate until the step. */
  /** Before the step's micro-batches: with --overlap-step, each host-stepped chunk of this rank's
   *  shards may start its update inside the last backward, once its gradient sum has come home
   *  (rtp::sharded_model::prepare_step). */
  void prepare_step(float lr, int micro_batches) {
    if (overlap_) (void)model_->prepare_step(hyper(lr), param_groups::with_default_decay(o_.weight_decay), micro_batches, o_.clip);
  }
  double forward_backward(const int* tokens, const int* targets) {
    const double loss = model_->forward(tokens, targets);
    model_->backward(tokens, targets, model_->loss_scale());
    return loss;
  }
  /** AdamW over @p micro_batches micro-batches' gradients, clipped by --clip (the norm then reported). */
  step_outcome step(float lr, int micro_batches) {
    const auto r = model_->step(hyper(lr), param_groups::with_default_decay(o_.weight_decay), micro_batches, o_.clip);
    step_bytes_ = comm_.stats().bytes_sent - sent_;
    return {r.stepped, o_.clip > 0 || !r.stepped ? r.grad_norm : std::numeric_limits<double>::quiet_NaN()};
  }
  double eval_loss(const int* tokens, const int* targets) {
    return model_->loss(tokens, targets);
  }  // untraced: not training
  std::vector<float> next_token_probs(std::span<const int> text) { return model_->next_token_probs(text); }
  void save(std::int64_t step) {
    rtp_save_view<communicator_ref, store_type, backend_type> view(*model_, comm_);
    std::optional<float> scale;
    std::int64_t clean = 0;
    if constexpr (std::is_same_v<T, float16>) scale = store_->scaler().scale(), clean = store_->scaler().clean_steps();
    save_checkpoint(view, o_.save, save_record(plan_.record, o_, step, model_->optimizer_steps(), scale, clean));
  }

  /** The model's buffers freed and every chunk off the device until `wake` (rtp_gpt::sleep). */
  asleep_memory sleep() {
    model_->sleep();
    return {rt_->device_chunk_bytes(), memory_->device.used()};
  }
  void wake() { model_->wake(); }

  void begin_step() {
    sent_ = comm_.stats().bytes_sent;
    before_ = rt_->stats();
  }
  std::string step_report() {
    const runtime_stats& s = rt_->stats();
    char stall[32];
    std::snprintf(stall, sizeof stall, "%.1f", 1e3 * (s.stall_s - before_.stall_s));
    std::string line = "sent " + format_bytes(step_bytes_) + " | device " + format_bytes(memory_->device.usage().peak) +
                       " / " + format_bytes(device_capacity_) + " | moved " +
                       format_bytes(s.bytes_moved() - before_.bytes_moved()) + " | stall " + stall + " ms";
    return end_step_line(std::move(line), disk_, *rt_, before_, memory_->device);
  }

  /** The run's summary after the common line: rank 0's chunk traffic, then the largest rank's memory
   *  and the bytes it sent beside the theory. */
  void print_summary() {
    const runtime_stats& s = rt_->stats();
    std::printf(
        "chunks (rank 0): %s to device, %s to host, %llu loads (%llu ahead of use), %llu evictions, %llu offloads, "
        "stall %.2f s; "
        "optimizer steps on device %llu, on host %llu (%llu inside backward)\n",
        format_bytes(s.bytes_to_device).c_str(), format_bytes(s.bytes_to_host).c_str(), ull(s.loads), ull(s.prefetches),
        ull(s.evictions), ull(s.offloads), s.stall_s, ull(s.device_steps), ull(s.host_steps), ull(s.early_steps));
    if (disk_) print_disk_summary(s, host_capacity_, disk_capacity_);
    double peaks[] = {static_cast<double>(model_->model_bytes()), static_cast<double>(model_->transient_bytes()),
                      static_cast<double>(s.peak_device_bytes)};
    comm_.allreduce(std::span<double>(peaks), reduce_op::max);
    // The theory counts the ring's shards and the replicas' all-reduces; the step adds the clipping
    // norm's all-reduce (8 bytes) and --accum multiplies the passes.
    std::printf(
        "per rank (largest): model data %s (1/%d of the whole %s, plus replicas), rotation buffers %s (largest shard "
        "%s), "
        "device %s; rank 0 sent %s in the last training iteration (theory for one micro-batch %s)\n",
        format_bytes(static_cast<std::size_t>(peaks[0])).c_str(), ranks_, format_bytes(whole_bytes()).c_str(),
        format_bytes(static_cast<std::size_t>(peaks[1])).c_str(), format_bytes(model_->largest_shard_bytes()).c_str(),
        format_bytes(static_cast<std::size_t>(peaks[2])).c_str(), format_bytes(step_bytes_).c_str(),
        format_bytes(model_->iteration_bytes_theory()).c_str());
  }
  Runtime& runtime() noexcept { return *rt_; }

 private:
  static unsigned long long ull(std::uint64_t x) noexcept { return static_cast<unsigned long long>(x); }
  adam_hyper hyper(float lr) const { return {.lr = lr, .beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = o_.weight_decay}; }
  /** Weights, gradients and two Adam moments of the whole model, fp32. */
  std::size_t whole_bytes() const { return 16 * param_count(plan_.cfg); }

  const train_options& o_;
  const run_plan& plan_;
  communicator_ref comm_;
  int ranks_;
  bool overlap_;  // --overlap-step: the optimizer step inside backward
  single_process_communicator one_;
  communicator_ref one_ref_;
  std::size_t device_capacity_ = 0, host_capacity_ = 0, disk_capacity_ = 0;
  batch_shape shape_{};
  std::optional<parts> memory_;
  std::optional<owned_disk_tier> disk_;
  std::optional<backend_type> backend_;
  std::optional<Runtime> rt_;
  std::optional<store_type> store_;
  std::optional<model_type> model_;
  runtime_stats before_{};
  std::uint64_t sent_ = 0, step_bytes_ = 0;  // sent by this rank in the last training iteration
};

}  // namespace gpt
