// SPDX-License-Identifier: Apache-2.0
// train_gpt: a byte-level GPT trained with all of its model data in chunkstar.
//
// Read it top to bottom: options, data, memory, model, optimizer, then the training loop. With
// --device cuda (or auto on a machine with a GPU) the chunks live on a CUDA device and in pinned
// host memory, the layers run as CUDA kernels and cuBLAS GEMMs, and chunks placed on the device are
// stepped there. Otherwise the device is simulated on the CPU (host memory with a hard capacity), so
// the run shows what chunkstar does on a GPU whose memory is smaller than the model's data: chunks
// move, evictions happen, and the loss falls exactly as it would with everything resident (same bits).
//
// Everything that can be checked is checked before any work starts (`prepare`): options, the data
// file, the checkpoint to resume and its configuration, the output paths, and the memory the run
// needs. A fatal error prints one message and ends the process at once (`fatal`), with an exit code
// that says what kind of failure it was (train_options.hpp, `--help`).
#include "chunked_gpt.hpp"
#include "data.hpp"
#if GPT_HAS_CUDA_BACKEND
#include "gpt_backend_cuda.hpp"

#include <chunkstar/cuda/cuda_platform.hpp>
#include <chunkstar/cuda/host_stager.hpp>
#endif
#if GPT_HAS_NCCL
#include "gpt_nccl.hpp"
#endif
#include "preflight.hpp"
#include "rtp_checkpoint.hpp"
#include "rtp_gpt.hpp"
#include "run_record.hpp"
#include "train_options.hpp"
#include "trainer_runtimes.hpp"

#include <chunkstar/checkpoint/runtime_checkpoint.hpp>
#include <chunkstar/comm/communicator_ref.hpp>
#include <chunkstar/comm/staged_communicator.hpp>
#include <chunkstar/config.hpp>
#include <chunkstar/disk/disk_copy_engine.hpp>
#include <chunkstar/disk/disk_tier.hpp>
#if CHUNKSTAR_HAS_URING()
#include <chunkstar/disk/uring_copy_engine.hpp>
#endif
#if CHUNKSTAR_HAS_MPI()
#include <chunkstar/mpi/mpi_communicator.hpp>
#endif
#include <chunkstar/eviction/lru.hpp>
#include <chunkstar/optim/lr_schedule.hpp>
#include <chunkstar/placement/static_placement.hpp>
#include <chunkstar/rtp/chunk_shard_store.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>

#include <CLI/CLI.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <optional>
#include <random>
#include <string>
#include <system_error>

#include <unistd.h>

#if defined(_OPENMP)
#include <omp.h>
#endif

using namespace chunkstar;
using gpt::train_options;

namespace {

/** Bytes of alignment slack the activation estimate adds (each buffer is 64-byte aligned). */
constexpr std::size_t activation_slack_bytes = 64 * 1024;
/** Latency of one copy on the modelled link (--link-bandwidth): a PCIe transfer's setup cost. */
constexpr double modelled_copy_latency_s = 10e-6;

/** How long an idle OpenMP thread spins before it sleeps (GOMP_SPINCOUNT rounds of a pause loop;
 *  libgomp's default is 300,000, about 3 ms). Every kernel and GEMM runs on the OpenMP threads (one
 *  pool: the BLAS is single-threaded, kernels_cpu.hpp), so between a step's hundreds of parallel
 *  loops a short spin saves the wake-up, while a long one takes the core from whichever thread has
 *  the work when cores are shared (the copy engine's, another process's). Measured on 2 cores,
 *  `mini`, side by side (tokens/s): quiet, 3000 rounds 4,243-4,294 vs the default 3,438-4,338 and
 *  passive 3,570-3,663; beside one busy thread, 969-1,767 vs 516-947 and 1,219-1,344. */
constexpr const char* openmp_spin_count = "3000";

/** libgomp reads GOMP_SPINCOUNT only when it loads, before main: so train_gpt sets it and
 *  restarts itself once, unless GOMP_SPINCOUNT or OMP_WAIT_POLICY is set already (the user's
 *  choice wins). No result depends on it. */
void tune_openmp_waiting(char** argv) {
#if defined(_OPENMP) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
  if (std::getenv("GOMP_SPINCOUNT") != nullptr || std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  if (setenv("GOMP_SPINCOUNT", openmp_spin_count, 1) != 0) return;
  execv("/proc/self/exe", argv);  // returns only if it failed: then run with libgomp's defaults
#else
  (void)argv;
#endif
}

/** One line on the CPU side of the run: the kernels' ISA and the threads. */
std::string cpu_summary() {
  std::string s = "cpu: kernels " + cpu_isa_report();
#if defined(_OPENMP)
  s += "; " + std::to_string(omp_get_max_threads()) + " OpenMP threads run every kernel and GEMM (BLAS single-threaded)";
  if (const char* spin = std::getenv("GOMP_SPINCOUNT")) s += std::string("; GOMP_SPINCOUNT=") + spin;
  if (const char* policy = std::getenv("OMP_WAIT_POLICY")) s += std::string("; OMP_WAIT_POLICY=") + policy;
#endif
  return s;
}

/** Writing an output failed while the run was under way (exit code 4: the input was fine). */
struct output_error : chunkstar::error {
  using chunkstar::error::error;
};

/** The chunk layout: a fixed size if asked, else the searched layout's default, which fits its
 *  bounds to the tensors (from the largest tensor to 4x it, so a stage spans a few chunks). */
searched_chunk_layout make_layout(const train_options& o, const gpt::gpt_config& cfg) {
  if (o.chunk_elems == 0) return searched_chunk_layout();
  std::size_t largest = 0;
  for (const auto& s : gpt::param_specs(cfg)) largest = std::max(largest, s.numel());
  const std::size_t align = 32, lo = (largest + align - 1) / align * align;
  const std::size_t c = (static_cast<std::size_t>(o.chunk_elems) + align - 1) / align * align;
  if (c < lo)
    throw config_error("--chunk-elems " + std::to_string(o.chunk_elems) + " is smaller than the largest tensor (" +
                       std::to_string(largest) + " elements), and a tensor never straddles chunks: use at least " +
                       std::to_string(lo) + ", or 0 to search a size");
  return searched_chunk_layout({.min_chunk_elems = c, .max_chunk_elems = c, .step_elems = align, .align_elems = align});
}

/** Peak non-model bytes on the compute tier for one micro-batch (activations, workspace, staging). */
template <class Backend>
std::size_t activation_bytes(const gpt::gpt_config& cfg, const train_options& o) {
  const gpt::batch_shape shape{static_cast<std::size_t>(o.batch), static_cast<std::size_t>(o.seq)};
  return gpt::non_model_bytes<Backend>(cfg, shape, gpt::precision_type(o.precision)) + activation_slack_bytes;
}

// ------------------------------------------------------------------------------------------------
// The platforms a run can take: its memory spaces, copy engine, kernels and device Adam.
template <class Platform>
struct platform_parts;

/** The simulated device: host memory with a hard capacity and an optional modelled link. */
template <>
struct platform_parts<simulated_platform> {
  using backend = gpt::cpu_backend;
  using adam_kernels = host_adam_kernels;
  simulated_device_space device;
  host_space host;
  host_copy_engine copier;
  // Large blocks are charged in 2 MiB pages; with a disk tier, whose host budget counts chunk bytes,
  // every block is charged what it asks for instead.
  platform_parts(int /*gpu*/, std::size_t device_capacity, std::size_t host_capacity, copy_model link, bool exact_host = false)
      : device({.capacity = device_capacity, .link = link, .name = "device"}),
        host({.capacity = host_capacity, .large_block_threshold = exact_host ? SIZE_MAX : host_space_options{}.large_block_threshold}),
        copier(link) {}
  backend make_backend() { return {}; }
  static std::size_t device_free_bytes(int /*gpu*/) { return 0; }
  static std::string describe(int /*gpu*/) { return "simulated (host memory with a hard capacity)"; }
};

#if GPT_HAS_CUDA_BACKEND
/** A CUDA device (this rank's) and pinned host memory; copies on the engine's streams, kernels on
 *  the backend's. */
template <>
struct platform_parts<cuda::cuda_platform> {
  using backend = gpt::cuda_backend;
  using adam_kernels = gpt::cuda_adam_kernels;
  int gpu;
  cuda::device_space device;
  cuda::pinned_host_space host;
  cuda::cuda_copy_engine copier;
  platform_parts(int g, std::size_t device_capacity, std::size_t host_capacity, copy_model, bool = false)
      : gpu(g), device({.device = g, .capacity = device_capacity}), host({.capacity = host_capacity}), copier(g) {}
  backend make_backend() { return gpt::cuda_backend(gpu); }
  static std::size_t device_free_bytes(int g) { return gpt::cuda_memory(g).free; }
  static std::string describe(int g) { return gpt::cuda_device_summary(g); }
};
#endif

/** The third tier (--disk-dir): a preallocated file and the engine that moves chunks between it and
 *  host memory, io_uring where the kernel allows it (--disk-engine auto), else pread/pwrite threads. */
struct disk_parts {
  disk_space space;
  std::optional<disk_copy_engine> pool;
#if CHUNKSTAR_HAS_URING()
  std::optional<uring_copy_engine> uring;
#endif
  disk_parts(const train_options& o, std::size_t capacity) : space({.directory = o.disk_dir, .capacity = capacity}) {
    disk_copy_engine_options eo;
    eo.verify_checksums = o.disk_verify;
#if CHUNKSTAR_HAS_URING()
    if (o.disk_engine == "uring" || (o.disk_engine == "auto" && io_uring_available())) {
      try {
        uring.emplace(space, eo);
        return;
      } catch (const io_uring_unavailable& e) {
        if (o.disk_engine == "uring") throw config_error(std::string("--disk-engine uring: ") + e.what() + "; use --disk-engine pool");
      }
    }
#else
    if (o.disk_engine == "uring") throw config_error("--disk-engine uring: this build has no io_uring (install liburing-dev and rebuild); use --disk-engine pool");
#endif
    pool.emplace(space, eo);
  }
  [[nodiscard]] disk_tier tier() {
#if CHUNKSTAR_HAS_URING()
    if (uring) return {space, *uring};
#endif
    return {space, *pool};
  }
  [[nodiscard]] std::string describe() const {
    return format_bytes(space.capacity()) + " in a file without a name in " + space.options().directory + ", " + (pool ? "pread/pwrite threads" : "io_uring") +
           (space.direct() ? ", O_DIRECT" : ", buffered (" + space.note() + ")");
  }
};

// ------------------------------------------------------------------------------------------------
// Before any work: what this run is, every input checked.
struct run_plan {
  gpt::device_choice device;  // where the layers run
  gpt::transport_choice transport;  // how the ranks talk
  gpt::gpt_config cfg;
  gpt::text_data data;
  std::vector<gpt::record_field> record;  // the configuration a checkpoint stores
  std::optional<gpt::resume_state> resume;
  chunkstar::checkpoint_extra resume_entries;  // what resume was parsed from; the load must find the same
  std::int64_t first_step = 1, last_step = 0;
};

#if GPT_HAS_CUDA_BACKEND
constexpr bool cuda_built = true;
#else
constexpr bool cuda_built = false;
#endif
#if GPT_HAS_NCCL
constexpr bool nccl_built = true;
#else
constexpr bool nccl_built = false;
#endif

/** GPUs visible to this process; not asked when --device sim says none are wanted. */
int visible_gpus(const train_options& o) {
#if GPT_HAS_CUDA_BACKEND
  if (o.device != "sim") return gpt::cuda_device_count();
#endif
  (void)o;
  return 0;
}

run_plan prepare(const train_options& o, int ranks, gpt::node_place node) {
  run_plan p;
  p.cfg = gpt::model_config(o);
  gpt::validate_options(o, p.cfg);
  gpt::validate_ranks(o, ranks);
  p.device = gpt::resolve_device(o, cuda_built, visible_gpus(o), node);
  p.transport = gpt::resolve_transport(o, p.device, nccl_built);
  gpt::validate_allow_change(o.allow_change);
  if (!o.allow_change.empty() && o.resume.empty()) throw config_error("--allow-change applies only with --resume DIR");
  // Bytes per parameter (16 in every precision) before any layout is planned for an absurd shape.
  const double data_bytes = 16.0 * static_cast<double>(gpt::param_count(p.cfg));
  gpt::check_memory({.model_data = data_bytes > 1.8e19 ? SIZE_MAX : static_cast<std::size_t>(data_bytes)});

  p.data = gpt::load_text(o.data, static_cast<std::size_t>(o.seq));
  p.record = gpt::run_record(o, p.cfg, gpt::data_checksum(p.data.train, p.data.val));
  p.last_step = o.stop_after > 0 ? o.stop_after : o.steps;
  if (!o.resume.empty()) {
    p.resume_entries = read_checkpoint_extra(o.resume);
    gpt::check_resume_config(p.record, p.resume_entries, o.allow_change, o.resume);
    p.resume = gpt::parse_resume_state(p.resume_entries, o.resume);
    p.first_step = p.resume->step + 1;
    if (p.first_step > p.last_step)
      throw config_error("--resume '" + o.resume + "': the checkpoint completed step " + std::to_string(p.resume->step) +
                         " and this run ends at step " + std::to_string(p.last_step) +
                         (o.stop_after > 0 ? " (--stop-after)" : " (--steps)") +
                         ": nothing is left to train; raise --steps (with --allow-change steps) or --stop-after");
  }
  if (!o.save.empty()) check_checkpoint_target(o.save);
  if (!o.trace.empty()) gpt::probe_output_file("--trace", o.trace);
  return p;
}

/** Prints --sample bytes drawn from @p next_token_probs (a model's), after "The ". */
template <class Probs>
void print_sample(const train_options& o, Probs&& next_token_probs) {
  std::mt19937_64 rng(o.seed);
  std::vector<int> text{'T', 'h', 'e', ' '};
  for (std::int64_t i = 0; i < o.sample; ++i) {
    const auto probs = next_token_probs(std::span<const int>(text));
    std::discrete_distribution<int> pick(probs.begin(), probs.end());
    text.push_back(pick(rng));
  }
  std::string out;
  for (int t : text) out += (t == '\n' || (t >= 32 && t < 127)) ? static_cast<char>(t) : '?';
  std::printf("\nsample:\n%s\n", out.c_str());
}

/** Writes @p rt's timeline to --trace, if asked (an output_error if it cannot). */
template <class Runtime>
void write_trace(const train_options& o, Runtime& rt) {
  if (o.trace.empty()) return;
  try {
    rt.timeline_recorder().write_chrome_trace(o.trace);
  } catch (const chunkstar::error& e) {
    throw output_error(e.what());
  }
  std::printf("timeline written to %s (open it in https://ui.perfetto.dev)\n", o.trace.c_str());
}

/** A GPU's free memory (0 on the simulated device), split between the ranks that share it; the
 *  least any rank saw, after every rank has looked (the allreduce), so no rank's budget counts
 *  memory another has taken since. */
template <class Parts>
std::size_t shared_device_free(const run_plan& plan, communicator_ref comm) {
  std::size_t bytes = Parts::device_free_bytes(plan.device.gpu) / static_cast<std::size_t>(plan.device.sharing);
  if (comm.size() > 1 && plan.device.cuda) {
    double seen = static_cast<double>(bytes);
    comm.allreduce(std::span<double>(&seen, 1), reduce_op::min);
    bytes = static_cast<std::size_t>(seen);
  }
  return bytes;
}

/** A device budget above a GPU's free memory is refused before anything is built. */
void require_within_free(std::size_t device_capacity, std::size_t device_free) {
  if (device_free > 0 && device_capacity > device_free)
    throw config_error("--device-budget " + format_bytes(device_capacity) + " is more than the GPU's free memory (" +
                       format_bytes(device_free) + "): lower it, or leave it 'auto'");
}

// ------------------------------------------------------------------------------------------------
// The training run, for one runtime assembly and one loss scaler.
template <class Runtime, class Scaler>
int train(const train_options& o, const run_plan& plan, typename Runtime::placement_type placement, communicator_ref comm) {
  using parts = platform_parts<typename Runtime::platform_type>;
  const gpt::gpt_config& cfg = plan.cfg;
  const gpt::text_data& data = plan.data;  // bytes are tokens
  const int ranks = comm.size();  // --parallel zero: each rank its own slice of the global batch, 1/N of the model data
  const auto average = [&](double x) {  // over the ranks (each computed the same-sized slice)
    comm.allreduce(std::span<double>(&x, 1), reduce_op::sum);
    return x / ranks;
  };
  std::printf("device: %s (%s)\n", parts::describe(plan.device.gpu).c_str(), plan.device.why.c_str());
  std::printf("data: %s, %zu train / %zu validation bytes\n", data.source.c_str(), data.train.size(), data.val.size());
  if (ranks > 1)
    std::printf("parallel: ZeRO over %d MPI ranks (%s), %lld sequences each of the global batch of %lld\n", ranks,
                plan.transport.why.c_str(), static_cast<long long>(o.batch / ranks), static_cast<long long>(o.batch));

  // Memory: a simulated device with a hard capacity, the host, and the link between them.
  const dtype type = gpt::precision_type(o.precision);
  const auto layout = make_layout(o, cfg);
  // What this rank's runtime will hold (its share of the model data under ZeRO, and ZeRO's gather
  // and reduce buffers at their peak), from the library's planner, to size the budgets.
  const auto specs = gpt::param_specs(cfg, type);
  runtime_options ro{.param_type = type,
                     .prefetch_depth = static_cast<std::size_t>(o.prefetch),
                     .timeline = !o.trace.empty(),
                     .sharding = {.enabled = o.parallel == "zero",
                                  .keep_gathered = o.keep_gathered,
                                  .memory_saving = o.memory_saving,
                                  .micro_batches = static_cast<int>(o.accum)}};
  const std::size_t act = activation_bytes<typename parts::backend>(cfg, o);
  const auto scopes = gpt::forward_scopes(cfg);
  // The activations moment by moment as the model allocates them (backward frees them block by
  // block), so the plan admits what the run holds at each moment rather than the peak throughout.
  auto profile = gpt::non_model_profile<typename parts::backend>(cfg, {static_cast<std::size_t>(o.batch), static_cast<std::size_t>(o.seq)}, type);
  for (std::size_t m = 0; m + 1 < profile.size(); ++m) profile[m] += activation_slack_bytes;
  memory_plan need = plan_memory(specs, layout, ro, ranks, scopes, profile);
  const std::size_t model_bytes = need.model_bytes_per_rank;
  // A real device's automatic budget is its free memory; the simulated device's holds all of the
  // model data (this rank's share of it under ZeRO) with --policy resident, and a share of it
  // otherwise, so that chunks move.
  const bool resident = o.policy == "resident";
  const std::size_t device_free = shared_device_free<parts>(plan, comm);
  const std::size_t device_capacity = gpt::device_budget_bytes(
      o, {.non_model = act, .collective = need.collective_bytes, .model = model_bytes, .device_free = device_free, .floor = need.device_floor()});
  require_within_free(device_capacity, device_free);
  const std::size_t host_capacity = gpt::bytes_option("--host-budget", o.host_budget);
  const bool with_disk = !o.disk_dir.empty();
  const std::size_t largest_chunk = need.chunks.chunk_elems * sizeof(float);
  const std::size_t disk_capacity = with_disk ? gpt::disk_budget_bytes(o, model_bytes, 2 * (8 + 4) * largest_chunk) : 0;
  // ZeRO's mode: the group mode unless only the memory-saving mode fits these budgets (then it,
  // said here); admitted before anything is built: the device holds the floor, the tiers together
  // everything.
  const tier_budgets budgets{.device = device_capacity, .host = host_capacity, .disk = disk_capacity};
  if (const auto choice = choose_sharding(specs, layout, ro, ranks, scopes, profile, budgets);
      choice.switched) {
    std::printf("ZeRO: the memory-saving mode (as --memory-saving), because %s\n", choice.why.c_str());
    ro = choice.options;
    need = choice.plan;
  }
  const std::size_t collective = need.collective_bytes;
  if (resident && device_capacity < act + collective + model_bytes)
    throw config_error("--policy resident keeps all model data on the device, which needs --device-budget of at least " +
                       format_bytes(act + collective + model_bytes) + " (activations " + format_bytes(act) + " + model data " +
                       format_bytes(model_bytes) + (collective ? " + ZeRO buffers " + format_bytes(collective) : std::string()) +
                       "), not " + format_bytes(device_capacity) +
                       ": raise it (or leave it 'auto'), or use --policy patrickstar to move chunks");
  gpt::require_admitted(need, budgets);
  // With a disk tier only what the device and the host budgets hold is in memory.
  const std::size_t in_memory = with_disk ? std::min(model_bytes, host_capacity == SIZE_MAX ? model_bytes : host_capacity + device_capacity) : model_bytes;
  gpt::check_memory(gpt::host_memory_need(in_memory + collective, act, device_capacity, device_free == 0));
  gpt::cpu::blas_warm_up();  // the BLAS's buffers before the model data: under ulimit -v it never waits for room
  const double bandwidth = static_cast<double>(gpt::bytes_option("--link-bandwidth", o.link_bandwidth));
  const copy_model link{.bandwidth_bytes_per_s = bandwidth, .latency_s = bandwidth > 0 ? modelled_copy_latency_s : 0.0};
  parts memory(plan.device.gpu, device_capacity, host_capacity, link, with_disk);
  auto& device = memory.device;
  std::optional<disk_parts> disk;
  if (with_disk) {
    try {
      disk.emplace(o, disk_capacity);
    } catch (const io_error& e) {  // before any step: the option is what is wrong (exit 2), not a failing disk
      throw config_error("--disk-dir '" + o.disk_dir + "' cannot hold the disk tier's " + format_bytes(disk_capacity) + ": " + e.what());
    }
  }

  // The runtime and the model: every parameter registered in execution order.
  Runtime rt(device, memory.host, memory.copier, comm, ro, layout, placement);
  if (disk) rt.attach_disk(disk->tier());
  rt.require_admitted(need);  // the runtime's own spaces take the plan, before the first step
  const gpt::batch_shape shape{static_cast<std::size_t>(o.batch / ranks), static_cast<std::size_t>(o.seq)};
  const std::size_t first = shape.batch * static_cast<std::size_t>(comm.rank());  // this rank's slice of the global batch
  gpt::chunked_gpt<Runtime, typename parts::backend> model(rt, cfg, shape, o.seed, memory.make_backend());
  model.finalize();
  std::printf("%s\n", cpu_summary().c_str());
  std::printf("model: %d layers, width %d, %d heads, context %d: %zu parameters\n", cfg.layers, cfg.width, cfg.heads,
              cfg.context, gpt::param_count(cfg));
  std::printf("memory: model data %s in %zu chunks of %zu elements (waste %.1f%%)%s; device budget %s "
              "(activations %s), host budget %s%s\n",
              format_bytes(rt.model_bytes()).c_str(), rt.plan().num_chunks, rt.plan().chunk_elems,
              100.0 * rt.plan().waste_fraction(),
              ranks > 1 ? (", " + format_bytes(rt.model_bytes() / static_cast<std::size_t>(ranks)) + " per rank").c_str() : "",
              format_bytes(device_capacity).c_str(), format_bytes(act).c_str(),
              host_capacity == SIZE_MAX ? "unlimited" : format_bytes(host_capacity).c_str(),
              model_bytes > device_capacity ? " -- the model data does not fit on the device: chunks will move" : "");
  if (disk)
    std::printf("disk tier: %s%s\n", disk->describe().c_str(),
                host_capacity != SIZE_MAX && model_bytes > host_capacity + (device_capacity - act)
                    ? " -- the model data exceeds device and host together: the disk holds the rest"
                    : "");

  // Optimizer: AdamW, no decay on biases and norms, warm-up then cosine, global-norm clipping.
  // Without clipping (--clip 0) in fp32 or bf16 nothing needs the gradient norm: its scan, a read
  // of every gradient chunk, is skipped (report_norm) and the log shows "norm -".
  chunk_adam<Scaler, typename parts::adam_kernels> opt({.hyper = {.beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = o.weight_decay},
                          .max_grad_norm = o.clip, .report_norm = false},
                         param_groups::with_default_decay(o.weight_decay));
  const warmup_cosine cosine = gpt::cosine_schedule(o);
  auto lr_at = [&](std::int64_t step) { return o.schedule == "constant" ? o.lr : cosine(step); };

  if (plan.resume) {  // its configuration and state were checked by prepare()
    gpt::require_same_save(plan.resume_entries, load_checkpoint(rt, o.resume), o.resume);
    opt.restore_step_count(plan.resume->optimizer_steps);
    if constexpr (std::is_same_v<Scaler, dynamic_loss_scaler>)
      if (plan.resume->loss_scale) opt.scaler().restore(*plan.resume->loss_scale, plan.resume->clean_steps);
    std::printf("resumed from %s at step %lld\n", o.resume.c_str(), static_cast<long long>(plan.resume->step));
  }
  auto save = [&](std::int64_t step) {
    std::optional<float> scale;
    std::int64_t clean = 0;
    if constexpr (std::is_same_v<Scaler, dynamic_loss_scaler>) {
      scale = opt.loss_scale();
      clean = opt.scaler().clean_steps();
    }
    try {
      save_checkpoint(rt, o.save, gpt::save_record(plan.record, o, step, opt.step_count(), scale, clean));
    } catch (const chunkstar::error& e) {
      throw output_error(std::string("saving the checkpoint of step ") + std::to_string(step) + " failed (the previous checkpoint in '" +
                         o.save + "', if any, is intact): " + e.what());
    }
    std::printf("saved checkpoint to %s (step %lld)\n", o.save.c_str(), static_cast<long long>(step));
  };

  const std::size_t N = model.tokens_per_batch();
  std::vector<int> tokens(N), targets(N);
  auto validation_loss = [&] {
    auto eval = rt.untraced();  // evaluation is not part of the training trace
    double sum = 0;
    for (std::int64_t b = 0; b < o.val_batches; ++b) {
      gpt::fill_batch(data.val, o.seed, static_cast<std::uint64_t>(b), shape.batch, shape.seq, tokens.data(), targets.data(), first);
      sum += model.loss(tokens.data(), targets.data());
    }
    return average(sum / static_cast<double>(o.val_batches));
  };

  // The training loop.
  using clock = std::chrono::steady_clock;
  const auto run_start = clock::now();
  double first_loss = 0, last_loss = 0;
  std::optional<double> last_val;
  std::int64_t skipped = 0;
  for (std::int64_t step = plan.first_step; step <= plan.last_step; ++step) {
    const auto t0 = clock::now();
    const runtime_stats before = rt.stats();
    double loss = 0;
    for (int micro = 0; micro < o.accum; ++micro) {
      gpt::fill_batch(data.train, o.seed, gpt::train_key(step, micro), shape.batch, shape.seq, tokens.data(), targets.data(), first);
      loss += model.forward_backward(tokens.data(), targets.data(), opt.loss_scale()) / static_cast<double>(o.accum);
    }
    loss = average(loss);
    const float lr = lr_at(step);
    // Each rank's gradients are of its slice's mean loss; summed over ranks they are N times the
    // global batch's, so the step averages over accum x N micro-batches.
    const auto r = opt.step(rt, lr, static_cast<int>(o.accum) * ranks);
    skipped += r.stepped ? 0 : 1;
    const double dt = std::chrono::duration<double>(clock::now() - t0).count();
    const runtime_stats& s = rt.stats();
    if (step == plan.first_step) first_loss = loss;
    last_loss = loss;
    char norm[16] = "     -";  // not computed (see above)
    if (!std::isnan(r.grad_norm)) std::snprintf(norm, sizeof norm, "%6.3f", r.grad_norm);
    std::string disk_moved;
    if (disk)
      disk_moved = " | disk " + format_bytes(rt.disk_chunk_bytes()) + ", moved " + format_bytes(s.disk_bytes_moved() - before.disk_bytes_moved()) +
                   ", stall " + std::to_string(static_cast<long long>(1e3 * (s.disk_stall_s - before.disk_stall_s))) + " ms";
    std::printf("step %5lld/%lld | loss %.6f | %7.0f tok/s | lr %.2e | norm %s%s | device %s / %s | host %s | "
                "moved %s | stall %.1f ms%s\n",
                static_cast<long long>(step), static_cast<long long>(o.steps), loss,
                static_cast<double>(N * static_cast<std::size_t>(o.accum * ranks)) / dt, static_cast<double>(lr), norm,
                r.stepped ? "" : " (skipped: overflow)", format_bytes(device.usage().peak).c_str(),
                format_bytes(device_capacity).c_str(), format_bytes(rt.host_chunk_bytes()).c_str(),
                format_bytes(s.bytes_moved() - before.bytes_moved()).c_str(), 1e3 * (s.stall_s - before.stall_s), disk_moved.c_str());
    std::fflush(stdout);  // a line per step as it happens, also into a pipe or a file (tail -f, mpirun)
    device.reset_peak();
    if (o.val_every > 0 && (step % o.val_every == 0 || step == plan.last_step)) {
      last_val = validation_loss();
      std::printf("validation loss %.6f at step %lld\n", *last_val, static_cast<long long>(step));
    }
    if (!o.save.empty() && ((o.save_every > 0 && step % o.save_every == 0) || step == plan.last_step)) save(step);
    std::fflush(stdout);
  }

  // Summary, and a sample from the model.
  const double total = std::chrono::duration<double>(clock::now() - run_start).count();
  const runtime_stats& s = rt.stats();
  char val[32] = "none";
  if (last_val) std::snprintf(val, sizeof val, "%.4f", *last_val);
  std::printf("\nsummary: %lld steps in %.1f s, loss %.4f -> %.4f, validation %s, %lld skipped\n",
              static_cast<long long>(plan.last_step - plan.first_step + 1), total, first_loss, last_loss, val,
              static_cast<long long>(skipped));
  std::printf("chunks: %s to device, %s to host, %llu loads (%llu ahead of use, %llu of those used), %llu evictions, "
              "%llu offloads, stall %.2f s; optimizer steps on device %llu, on host %llu\n",
              format_bytes(s.bytes_to_device).c_str(), format_bytes(s.bytes_to_host).c_str(),
              static_cast<unsigned long long>(s.loads), static_cast<unsigned long long>(s.prefetches),
              static_cast<unsigned long long>(s.prefetch_hits), static_cast<unsigned long long>(s.evictions),
              static_cast<unsigned long long>(s.offloads), s.stall_s, static_cast<unsigned long long>(s.device_steps),
              static_cast<unsigned long long>(s.host_steps));
  if (disk)
    std::printf("disk: %s written, %s read (%llu reads, %llu ahead of use), stall %.2f s; peaks: host chunks %s of %s, disk chunks %s of %s\n",
                format_bytes(s.bytes_to_disk).c_str(), format_bytes(s.bytes_from_disk).c_str(),
                static_cast<unsigned long long>(s.disk_reads), static_cast<unsigned long long>(s.disk_prefetches), s.disk_stall_s,
                format_bytes(s.peak_host_chunk_bytes).c_str(), host_capacity == SIZE_MAX ? "unlimited" : format_bytes(host_capacity).c_str(),
                format_bytes(s.peak_disk_chunk_bytes).c_str(), format_bytes(disk_capacity).c_str());
  std::printf("peaks over the run: device %s of %s (chunks %s, non-model %s); trace divergences %zu\n",
              format_bytes(s.peak_device_bytes).c_str(), format_bytes(device_capacity).c_str(),
              format_bytes(s.peak_device_chunk_bytes).c_str(), format_bytes(s.peak_non_model_bytes).c_str(),
              rt.tracer().stats().divergences);
  if (ranks > 1) {  // the largest over the ranks
    double peaks[] = {static_cast<double>(s.peak_model_bytes), static_cast<double>(s.peak_collective_bytes),
                      static_cast<double>(s.peak_device_bytes)};
    comm.allreduce(std::span<double>(peaks), reduce_op::max);
    const auto cs = comm.stats();
    std::printf("per rank (largest): model data %s (share %s + gather/reduce buffers %s), device %s; "
                "%llu gathers, %llu reductions, %s sent by rank 0\n",
                format_bytes(static_cast<std::size_t>(peaks[0])).c_str(), format_bytes(rt.model_bytes() / static_cast<std::size_t>(ranks)).c_str(),
                format_bytes(static_cast<std::size_t>(peaks[1])).c_str(), format_bytes(static_cast<std::size_t>(peaks[2])).c_str(),
                static_cast<unsigned long long>(s.gathers), static_cast<unsigned long long>(s.reductions), format_bytes(cs.bytes_sent).c_str());
  }
  if (o.sample > 0) {
    auto gen = rt.untraced();
    print_sample(o, [&](std::span<const int> text) { return model.next_token_probs(text); });
  }
  if (comm.rank() == 0) write_trace(o, rt);
  return gpt::exit_ok;
}

// ------------------------------------------------------------------------------------------------
// --parallel rtp: Rotated Tensor Parallelism (rtp_gpt.hpp). Each rank trains on its slice of the
// global batch and owns 1/N of every sharded layer (weights, gradient, Adam moments) in its own chunk
// runtime, under its device budget like any chunkstar model; the shards rotate round the ring of
// ranks. The same options, data, schedule and checkpoints as the other modes; losses agree with
// them within fp32 rounding (the ring adds in its own order). On a GPU the layers, the rotations'
// buffers and the chunks placed on the device are there, and the shards rotate over NCCL or MPI
// through pinned host buffers (--comm).
template <class Runtime>
int train_rtp(const train_options& o, const run_plan& plan, typename Runtime::placement_type placement, communicator_ref comm) {
  using clock = std::chrono::steady_clock;
  using parts = platform_parts<typename Runtime::platform_type>;
  using backend_type = typename parts::backend;
  using store_type = rtp::chunk_shard_store<Runtime, gpt::backend_buffer_ops<backend_type>, typename parts::adam_kernels>;
  using model_type = gpt::rtp_gpt<communicator_ref, store_type, backend_type>;
  const gpt::gpt_config& cfg = plan.cfg;
  const gpt::text_data& data = plan.data;
  const int ranks = comm.size();
  const auto average = [&](double x) {
    comm.allreduce(std::span<double>(&x, 1), reduce_op::sum);
    return x / ranks;
  };
  std::printf("device: %s%s (%s)\n", parts::describe(plan.device.gpu).c_str(), plan.device.cuda ? "" : ", one per rank",
              plan.device.why.c_str());
  std::printf("data: %s, %zu train / %zu validation bytes\n", data.source.c_str(), data.train.size(), data.val.size());
  std::printf("parallel: RTP over %d rank%s%s, %lld sequences each of the global batch of %lld\n", ranks, ranks > 1 ? "s" : "",
              plan.transport.why.empty() ? "" : (" (" + plan.transport.why + ")").c_str(), static_cast<long long>(o.batch / ranks),
              static_cast<long long>(o.batch));
  const gpt::batch_shape shape{static_cast<std::size_t>(o.batch / ranks), static_cast<std::size_t>(o.seq)};
  const std::size_t first = shape.batch * static_cast<std::size_t>(comm.rank());

  // Memory: this rank's shards in chunks (all four lists), beside the activations and the rotations'
  // transit buffers (non-model memory on the device), sized before anything is built.
  const auto layout = make_layout(o, cfg);
  const auto scopes = model_type::stage_scopes(cfg, ranks, comm.rank());
  const memory_plan need = plan_memory(
      model_type::shard_tensors(cfg, ranks, comm.rank()), layout, {.param_type = dtype::f32}, 1, scopes,
      passes_non_model(scopes, model_type::compute_tier_bytes(cfg, ranks, shape.batch, shape.seq) + activation_slack_bytes));
  const std::size_t model_bytes = need.model_bytes, act = need.non_model_bytes;
  const bool resident = o.policy == "resident";
  const std::size_t device_free = shared_device_free<parts>(plan, comm);
  const std::size_t device_capacity =
      gpt::device_budget_bytes(o, {.non_model = act, .model = model_bytes, .device_free = device_free, .floor = need.device_floor()});
  require_within_free(device_capacity, device_free);
  const std::size_t host_capacity = gpt::bytes_option("--host-budget", o.host_budget);
  gpt::require_admitted(need, {.device = device_capacity, .host = host_capacity});
  if (resident && device_capacity < act + model_bytes)
    throw config_error("--policy resident keeps all of this rank's shards on the device, which needs --device-budget of at least " +
                       format_bytes(act + model_bytes) + ", not " + format_bytes(device_capacity) +
                       ": raise it (or leave it 'auto'), or use --policy patrickstar to move chunks");
  gpt::check_memory(gpt::host_memory_need(model_bytes, act, device_capacity, device_free == 0));
  gpt::cpu::blas_warm_up();  // the BLAS's buffers before the model data: under ulimit -v it never waits for room
  const double bandwidth = static_cast<double>(gpt::bytes_option("--link-bandwidth", o.link_bandwidth));
  const copy_model link{.bandwidth_bytes_per_s = bandwidth, .latency_s = bandwidth > 0 ? modelled_copy_latency_s : 0.0};
  parts memory(plan.device.gpu, device_capacity, host_capacity, link);
  auto& device = memory.device;
  backend_type backend = memory.make_backend();
  single_process_communicator one;  // the runtime's own: RTP talks in the model's rotations
  communicator_ref one_ref(one);
  Runtime rt(device, memory.host, memory.copier, one_ref,
             {.param_type = dtype::f32, .prefetch_depth = static_cast<std::size_t>(o.prefetch), .timeline = !o.trace.empty()}, layout,
             placement);
  rt.require_admitted(need);
  store_type store(rt, gpt::backend_buffer_ops<backend_type>{&backend});
  model_type model(comm, store, cfg, shape.batch, shape.seq, &backend);
  model.init(o.seed);
  const std::size_t whole = 16 * gpt::param_count(cfg);  // weights, gradients, two Adam moments, fp32
  std::printf("%s\n", cpu_summary().c_str());
  std::printf("model: %d layers, width %d, %d heads, context %d: %zu parameters\n", cfg.layers, cfg.width, cfg.heads,
              cfg.context, gpt::param_count(cfg));
  std::printf("memory per rank: model data %s of the whole %s (its shards in %zu chunks of %zu elements, and the replicas); "
              "device budget %s (activations %s, rotation buffers %s), host budget %s%s\n",
              format_bytes(model.model_bytes()).c_str(), format_bytes(whole).c_str(), rt.plan().num_chunks, rt.plan().chunk_elems,
              format_bytes(device_capacity).c_str(), format_bytes(model.activation_bytes()).c_str(),
              format_bytes(model.transient_bytes()).c_str(), host_capacity == SIZE_MAX ? "unlimited" : format_bytes(host_capacity).c_str(),
              model_bytes + act > device_capacity ? " -- the shards do not fit on the device: chunks will move" : "");

  const auto groups = param_groups::with_default_decay(o.weight_decay);
  const adam_hyper base{.beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = o.weight_decay};
  const warmup_cosine cosine = gpt::cosine_schedule(o);
  auto lr_at = [&](std::int64_t step) { return o.schedule == "constant" ? o.lr : cosine(step); };
  if (plan.resume) {
    gpt::rtp_load_view<communicator_ref, store_type, backend_type> view(model);
    gpt::require_same_save(plan.resume_entries, load_checkpoint(view, o.resume), o.resume);
    model.restore_step_count(plan.resume->optimizer_steps);
    std::printf("resumed from %s at step %lld\n", o.resume.c_str(), static_cast<long long>(plan.resume->step));
  }
  auto save = [&](std::int64_t step) {
    try {
      gpt::rtp_save_view<communicator_ref, store_type, backend_type> view(model, comm);
      save_checkpoint(view, o.save, gpt::save_record(plan.record, o, step, model.optimizer_steps(), std::nullopt, 0));
    } catch (const chunkstar::error& e) {
      throw output_error(std::string("saving the checkpoint of step ") + std::to_string(step) + " failed (the previous checkpoint in '" +
                         o.save + "', if any, is intact): " + e.what());
    }
    std::printf("saved checkpoint to %s (step %lld)\n", o.save.c_str(), static_cast<long long>(step));
  };

  const std::size_t N = model.tokens_per_batch();
  std::vector<int> tokens(N), targets(N);
  auto validation_loss = [&] {
    double sum = 0;
    for (std::int64_t b = 0; b < o.val_batches; ++b) {
      gpt::fill_batch(data.val, o.seed, static_cast<std::uint64_t>(b), shape.batch, shape.seq, tokens.data(), targets.data(), first);
      sum += model.loss(tokens.data(), targets.data());  // untraced: not part of the training iteration
    }
    return average(sum / static_cast<double>(o.val_batches));
  };
  const auto run_start = clock::now();
  double first_loss = 0, last_loss = 0;
  std::uint64_t step_bytes = 0;  // sent by this rank in the last training iteration
  std::optional<double> last_val;
  for (std::int64_t step = plan.first_step; step <= plan.last_step; ++step) {
    const auto t0 = clock::now();
    const auto sent = comm.stats().bytes_sent;
    const runtime_stats before = rt.stats();
    double loss = 0;
    for (int micro = 0; micro < o.accum; ++micro) {
      gpt::fill_batch(data.train, o.seed, gpt::train_key(step, micro), shape.batch, shape.seq, tokens.data(), targets.data(), first);
      loss += model.forward(tokens.data(), targets.data()) / static_cast<double>(o.accum);
      model.backward(tokens.data(), targets.data());  // gradients accumulate until the step
    }
    loss = average(loss);
    const float lr = lr_at(step);
    adam_hyper h = base;
    h.lr = lr;
    // Gradients are of the sum of the ranks' slice means: the step averages over accum x N micro-batches.
    const auto r = model.step(h, groups, static_cast<int>(o.accum) * ranks, o.clip);
    step_bytes = comm.stats().bytes_sent - sent;
    const double dt = std::chrono::duration<double>(clock::now() - t0).count();
    if (step == plan.first_step) first_loss = loss;
    last_loss = loss;
    const runtime_stats& s = rt.stats();
    char norm[16] = "     -";
    if (o.clip > 0) std::snprintf(norm, sizeof norm, "%6.3f", r.grad_norm);
    std::printf("step %5lld/%lld | loss %.6f | %7.0f tok/s | lr %.2e | norm %s | sent %s | device %s / %s | moved %s | "
                "stall %.1f ms\n",
                static_cast<long long>(step), static_cast<long long>(o.steps), loss,
                static_cast<double>(N * static_cast<std::size_t>(o.accum * ranks)) / dt, static_cast<double>(lr), norm,
                format_bytes(step_bytes).c_str(), format_bytes(device.usage().peak).c_str(), format_bytes(device_capacity).c_str(),
                format_bytes(s.bytes_moved() - before.bytes_moved()).c_str(), 1e3 * (s.stall_s - before.stall_s));
    std::fflush(stdout);  // a line per step as it happens, also into a pipe or a file (tail -f, mpirun)
    device.reset_peak();
    if (o.val_every > 0 && (step % o.val_every == 0 || step == plan.last_step)) {
      last_val = validation_loss();
      std::printf("validation loss %.6f at step %lld\n", *last_val, static_cast<long long>(step));
    }
    if (!o.save.empty() && ((o.save_every > 0 && step % o.save_every == 0) || step == plan.last_step)) save(step);
    std::fflush(stdout);
  }
  const double total = std::chrono::duration<double>(clock::now() - run_start).count();
  const runtime_stats& s = rt.stats();
  char val[32] = "none";
  if (last_val) std::snprintf(val, sizeof val, "%.4f", *last_val);
  std::printf("\nsummary: %lld steps in %.1f s, loss %.4f -> %.4f, validation %s, 0 skipped\n",
              static_cast<long long>(plan.last_step - plan.first_step + 1), total, first_loss, last_loss, val);
  std::printf("chunks (rank 0): %s to device, %s to host, %llu loads (%llu ahead of use), %llu evictions, %llu offloads, stall %.2f s; "
              "optimizer steps on device %llu, on host %llu\n",
              format_bytes(s.bytes_to_device).c_str(), format_bytes(s.bytes_to_host).c_str(), static_cast<unsigned long long>(s.loads),
              static_cast<unsigned long long>(s.prefetches), static_cast<unsigned long long>(s.evictions),
              static_cast<unsigned long long>(s.offloads), s.stall_s, static_cast<unsigned long long>(s.device_steps),
              static_cast<unsigned long long>(s.host_steps));
  double peaks[] = {static_cast<double>(model.model_bytes()), static_cast<double>(model.transient_bytes()),
                    static_cast<double>(s.peak_device_bytes)};
  comm.allreduce(std::span<double>(peaks), reduce_op::max);
  // The theory counts the ring's shards and the replicas' all-reduces; the step adds the clipping
  // norm's all-reduce (8 bytes) and --accum multiplies the passes.
  std::printf("per rank (largest): model data %s (1/%d of the whole %s, plus replicas), rotation buffers %s (largest shard %s), "
              "device %s; rank 0 sent %s in the last training iteration (theory for one micro-batch %s)\n",
              format_bytes(static_cast<std::size_t>(peaks[0])).c_str(), ranks, format_bytes(whole).c_str(),
              format_bytes(static_cast<std::size_t>(peaks[1])).c_str(), format_bytes(model.largest_shard_bytes()).c_str(),
              format_bytes(static_cast<std::size_t>(peaks[2])).c_str(), format_bytes(step_bytes).c_str(),
              format_bytes(model.iteration_bytes_theory()).c_str());
  // rank 0's probabilities on every rank: every rank picks the same
  if (o.sample > 0) print_sample(o, [&](std::span<const int> text) { return model.next_token_probs(text); });
  if (comm.rank() == 0) write_trace(o, rt);
  return gpt::exit_ok;
}

template <class Scaler, class Platform>
int with_policy(const train_options& o, const run_plan& plan, communicator_ref comm) {
  using runtimes = gpt::trainer_runtimes<Platform>;  // compiled in trainer_runtimes*.cpp
  if (o.policy == "patrickstar") return train<typename runtimes::belady, Scaler>(o, plan, {}, comm);
  if (o.policy == "lru") return train<typename runtimes::lru, Scaler>(o, plan, {}, comm);
  if (o.policy == "resident") return train<typename runtimes::fixed, Scaler>(o, plan, static_placement::all_device(), comm);
  return train<typename runtimes::fixed, Scaler>(o, plan, static_placement::all_host(), comm);  // "offload" (validated)
}

template <class Platform>
int rtp_with_policy(const train_options& o, const run_plan& plan, communicator_ref comm) {  // fp32 (validated): no loss scaler
  using runtimes = gpt::trainer_runtimes<Platform>;
  if (o.policy == "patrickstar") return train_rtp<typename runtimes::belady>(o, plan, {}, comm);
  if (o.policy == "lru") return train_rtp<typename runtimes::lru>(o, plan, {}, comm);
  if (o.policy == "resident") return train_rtp<typename runtimes::fixed>(o, plan, static_placement::all_device(), comm);
  return train_rtp<typename runtimes::fixed>(o, plan, static_placement::all_host(), comm);
}

int process_rank = 0;  // for messages: every rank of a parallel run prints its own errors

#if CHUNKSTAR_HAS_MPI()
/** This rank's place among the ranks of its node (those sharing memory with it), for its GPU. */
gpt::node_place node_place() {
  MPI_Comm node = MPI_COMM_NULL;
  if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) != MPI_SUCCESS) return {};
  gpt::node_place p;
  MPI_Comm_rank(node, &p.local_rank);
  MPI_Comm_size(node, &p.local_ranks);
  MPI_Comm_free(&node);
  return p;
}
#endif

/** Ends the process now with @p code after printing @p message: no destructor or atexit handler
 *  runs, so a BLAS worker stuck in its allocator (or any other thread) cannot keep a failed run
 *  alive. Checkpoints are written atomically, so nothing on disk is half-done. */
[[noreturn]] void fatal(int code, const std::string& message) {
  std::fflush(stdout);
  if (process_rank > 0) std::fprintf(stderr, "error (rank %d): %s\n", process_rank, message.c_str());
  else std::fprintf(stderr, "error: %s\n", message.c_str());
  std::fflush(stderr);
  std::_Exit(code);
}

/** Trains on the platform the plan chose, with its loss scaler, over @p comm. */
int on_platform(const train_options& o, const run_plan& plan, communicator_ref comm) {
#if GPT_HAS_CUDA_BACKEND
  if (plan.device.cuda) {
    if (cudaSetDevice(plan.device.gpu) != cudaSuccess)  // for the default stream's device Adam, and cuBLAS
      throw config_error("--device cuda: cannot select GPU " + std::to_string(plan.device.gpu) + " (is it visible? CUDA_VISIBLE_DEVICES)");
    if (o.parallel == "rtp") return rtp_with_policy<cuda::cuda_platform>(o, plan, comm);
    return gpt::precision_type(o.precision) == dtype::f16 ? with_policy<dynamic_loss_scaler, cuda::cuda_platform>(o, plan, comm)
                                                          : with_policy<static_loss_scaler, cuda::cuda_platform>(o, plan, comm);
  }
#endif
  if (o.parallel == "rtp") return rtp_with_policy<simulated_platform>(o, plan, comm);
  return gpt::precision_type(o.precision) == dtype::f16 ? with_policy<dynamic_loss_scaler, simulated_platform>(o, plan, comm)
                                                        : with_policy<static_loss_scaler, simulated_platform>(o, plan, comm);
}

int run(const train_options& o, communicator_ref comm, gpt::node_place node) {
  const char* phase = "checking the options";
  try {
    const run_plan plan = prepare(o, comm.size(), node);
    phase = "comparing the ranks' options";
    // Before any collective that depends on them: ranks given different options stop here, all of
    // them, naming the option, instead of diverging silently, crashing in MPI or hanging.
    require_agreement(comm, gpt::rank_agreement(plan.record, o, plan.first_step, plan.transport, plan.device), "train_gpt");
    phase = "connecting the ranks";
    // ZeRO and RTP on GPUs talk over NCCL, or over MPI through pinned host buffers (resolve_transport);
    // the staged path also runs on the simulated device (memcpy staging), to test it on a CPU.
    if (plan.transport.kind == gpt::transport_choice::staged) {
#if GPT_HAS_CUDA_BACKEND
      if (plan.device.cuda) {
        staged_communicator<communicator_ref, cuda::host_stager> staged(comm);
        phase = "training";
        return on_platform(o, plan, staged);
      }
#endif
      staged_communicator<communicator_ref> staged(comm);
      phase = "training";
      return on_platform(o, plan, staged);
    }
#if GPT_HAS_NCCL
    if (plan.transport.kind == gpt::transport_choice::nccl) {
      gpt::nccl_module nccl;
      const communicator_ref device_comm = nccl.connect(comm, plan.device.gpu);
      phase = "training";
      return on_platform(o, plan, device_comm);
    }
#endif
    phase = "training";
    return on_platform(o, plan, comm);
  } catch (const output_error& e) {
    fatal(gpt::exit_io, e.what());
  } catch (const out_of_memory_error& e) {
    const std::string what = e.what();  // the preflight's own message names the limit already
    fatal(gpt::exit_out_of_memory, std::string("out of memory while ") + phase +
                                       (what.find("ulimit -v") == std::string::npos ? gpt::address_space_note() : "") + ": " + what);
  } catch (const config_error& e) {
    fatal(gpt::exit_bad_input, e.what());
  } catch (const checkpoint_error& e) {  // the checkpoint to resume
    fatal(gpt::exit_bad_input, e.what());
  } catch (const io_error& e) {  // reading --data or a bad --disk-dir before training; the disk tier failing during it
    if (std::string_view(phase) == "training" && !o.disk_dir.empty())
      fatal(gpt::exit_io, std::string("the disk tier failed while training (chunks in memory are intact; the last checkpoint is too): ") + e.what());
    fatal(gpt::exit_bad_input, e.what());
  } catch (const communication_error& e) {
    fatal(gpt::exit_internal, std::string("communication between the ranks failed while ") + phase + ": " + e.what());
  } catch (const chunkstar::error& e) {
    fatal(gpt::exit_internal, std::string("internal error while ") + phase + " (please report it): " + e.what());
  } catch (const std::bad_alloc&) {
    fatal(gpt::exit_out_of_memory, std::string("out of host memory while ") + phase + gpt::address_space_note() +
                                       ": lower --batch, --seq or the model size, or raise the process's memory limit");
  } catch (const std::system_error& e) {
    const bool resource = e.code() == std::errc::resource_unavailable_try_again || e.code() == std::errc::not_enough_memory;
    fatal(resource ? gpt::exit_out_of_memory : gpt::exit_io,
          std::string(resource ? "out of resources while " : "a system call failed while ") + phase + ": " + e.what() +
              (resource ? " (a thread or buffer could not be created; check ulimit -v and ulimit -u)" : ""));
  } catch (const std::exception& e) {
    fatal(gpt::exit_internal, std::string("unexpected error while ") + phase + " (please report it): " + e.what());
  }
}

constexpr const char* exit_codes_help =
    "Exit status: 0 success; 1 internal error (a bug: please report it); 2 bad input (an option, the --data file, or the "
    "checkpoint to --resume: the message names it and what to do); 3 out of memory (a memory space, the host, or a "
    "resource limit such as ulimit -v; a memory report follows the message); 4 writing an output (--save, --trace) failed "
    "during the run.\n"
    "Checkpoints (--save DIR): written atomically into a temporary directory beside DIR and swapped into place, under an "
    "advisory lock on DIR.lock, so concurrent writers take turns and a crash leaves the previous checkpoint; DIR is "
    "replaced only if it is empty or a chunkstar checkpoint. Every option and output path is checked before training "
    "starts; --resume compares the checkpoint's configuration with the options and names each difference "
    "(--allow-change lets the listed ones change).";

}  // namespace

int main(int argc, char** argv) {
  tune_openmp_waiting(argv);
  train_options o;
  CLI::App app{"train_gpt: a byte-level GPT whose model data lives in chunkstar chunks"};
  app.footer(exit_codes_help);
  // A later occurrence of an option overrides an earlier one (so `run.sh --steps 10` works).
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--data", o.data, "Text file to train on (default: the embedded corpus)");
  app.add_option("--preset", o.preset, "Model preset: tiny, mini, small, gpt2, 350m, 760m, 1.3b");
  app.add_option("--layers", o.layers, "Override the preset's number of blocks");
  app.add_option("--width", o.width, "Override the preset's width (channels)");
  app.add_option("--heads", o.heads, "Override the preset's attention heads");
  app.add_option("--context", o.context, "Override the preset's context length");
  app.add_option("--batch", o.batch, "Micro-batch size (sequences)");
  app.add_option("--seq", o.seq, "Sequence length (<= context)");
  app.add_option("--accum", o.accum, "Micro-batches accumulated per optimizer step");
  app.add_option("--steps", o.steps, "Optimizer steps (the schedule's length)");
  app.add_option("--stop-after", o.stop_after, "Stop after this step (to be resumed later); 0: run all --steps");
  app.add_option("--precision", o.precision, "fp32, bf16 or fp16 (dynamic loss scaling)");
  app.add_option("--policy", o.policy, "patrickstar, lru, resident or offload");
  app.add_option("--device", o.device, "cuda (a GPU), sim (the simulated device) or auto: CUDA when a GPU is visible, else simulated");
  app.add_option("--device-budget", o.device_budget,
                 "Device memory for chunks and activations: a size (256MiB), a share of the model data (50%: activations + half the "
                 "model data), or 'auto' = a GPU's free memory; on the simulated device activations + 40% of the model data (all of "
                 "it with --policy resident)");
  app.add_option("--host-budget", o.host_budget, "Host memory for chunks, e.g. 4GiB, or 'unlimited'");
  app.add_option("--link-bandwidth", o.link_bandwidth, "Modelled host<->device bandwidth per second, e.g. 8GiB (0: memcpy speed)");
  app.add_option("--chunk-elems", o.chunk_elems, "Chunk size in elements (0: searched)");
  app.add_option("--prefetch", o.prefetch, "Most chunk loads in flight ahead of the next scope (0: prefetch off)");
  app.add_option("--lr", o.lr, "Peak learning rate");
  app.add_option("--min-lr", o.min_lr, "Final learning rate of the cosine schedule");
  app.add_option("--warmup", o.warmup, "Linear warm-up steps (-1: min(20, steps / 10))");
  app.add_option("--schedule", o.schedule, "cosine or constant");
  app.add_option("--weight-decay", o.weight_decay, "AdamW weight decay (not on biases and norms)");
  app.add_option("--clip", o.clip, "Global gradient-norm clipping threshold (0: off)");
  app.add_option("--seed", o.seed, "Seed for initialisation, batches and sampling");
  app.add_option("--val-every", o.val_every, "Validation every N steps (0: never)");
  app.add_option("--val-batches", o.val_batches, "Validation batches");
  app.add_option("--save", o.save, "Directory to save checkpoints to (at the end, and every --save-every steps)");
  app.add_option("--save-every", o.save_every, "Save every N steps");
  app.add_option("--resume", o.resume, "Checkpoint directory to resume from");
  app.add_option("--allow-change", o.allow_change,
                 "With --resume: options whose value may differ from the checkpoint's (comma-separated, or all): "
                 "data, seed, precision, batch, seq, accum, steps, schedule, lr, min-lr, warmup, weight-decay, clip")
      ->delimiter(',')
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option("--trace", o.trace, "Write a Chrome-trace timeline (JSON) of memory and transfers");
  app.add_option("--sample", o.sample, "Bytes to generate at the end (0: none)");
  app.add_option("--parallel", o.parallel,
                 "none; zero: under mpirun -np N, shard the model data over the N ranks (ZeRO); rtp: each rank owns 1/N of "
                 "every layer and the shards rotate round the ranks (RTP, fp32); --batch stays the global batch");
  app.add_option("--comm", o.comm,
                 "--parallel zero or rtp: how ranks talk. auto: on GPUs NCCL when every rank has a GPU of its own, else MPI through "
                 "pinned host buffers; on the simulated device MPI. nccl, staged (MPI through host buffers: ranks sharing a GPU, no "
                 "NCCL), or mpi (host memory: the simulated device)");
  app.add_flag("--keep-gathered", o.keep_gathered, "--parallel zero: keep gathered parameters from forward to backward (more memory, fewer gathers)");
  app.add_flag("--memory-saving", o.memory_saving,
               "--parallel zero: gather and reduce chunk by chunk (broadcast from and reduce to the owner) instead of in groups of N: "
               "less device memory, more collectives (PatrickStar's MSC). Without it the group mode, unless only this mode fits "
               "the budgets: then this one, and the run says so");
  app.add_flag("!--no-sequence-check", o.sequence_check,
               "--parallel zero or rtp: skip the check that every rank makes the same collective call before each one (on by default: "
               "a divergence is then an error naming both calls instead of a hang; its cost is printed at the end, docs/zero.md)");
  app.add_option("--disk-dir", o.disk_dir,
                 "A third tier on local disk: a preallocated file in this directory holds the chunks the device and host budgets "
                 "cannot (model data beyond device + host memory); the host budget (--host-budget) then bounds host memory");
  app.add_option("--disk-budget", o.disk_budget, "Size of the disk tier's file, e.g. 64GiB (auto: the whole model data, this rank's share with --parallel zero, and a margin)");
  app.add_option("--disk-engine", o.disk_engine, "uring, pool (pread/pwrite threads) or auto: io_uring where the kernel allows it");
  app.add_flag("--disk-verify", o.disk_verify, "Checksum (CRC32C) every chunk written to disk and verify it when read back");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::fprintf(stderr, "error: %s\n(train_gpt --help lists the options)\n", e.what());
    return gpt::exit_bad_input;
  }
  // --parallel zero or rtp: one process per rank under mpirun; only rank 0 prints progress.
  single_process_communicator one;
  if (o.parallel == "none") {  // under mpirun -np N, N copies would train alone and write the same files
    try {
      gpt::validate_ranks(o, gpt::launched_processes([](const char* name) { return std::getenv(name); }));
    } catch (const config_error& e) {
      fatal(gpt::exit_bad_input, e.what());
    }
  }
#if CHUNKSTAR_HAS_MPI()
  std::optional<mpi_session> session;
  std::optional<mpi_communicator> world;
  if (o.parallel == "zero" || o.parallel == "rtp") {
    try {
      session.emplace(&argc, &argv);
      world.emplace(MPI_COMM_WORLD, mpi_options{.check_sequence = o.sequence_check});
    } catch (const config_error& e) {  // the ranks were given different --no-sequence-check
      fatal(gpt::exit_bad_input, e.what());
    } catch (const chunkstar::error& e) {
      fatal(gpt::exit_internal, "cannot start MPI for --parallel " + o.parallel + ": " + e.what());
    }
    process_rank = world->rank();
    if (process_rank != 0 && !std::freopen("/dev/null", "w", stdout)) fatal(gpt::exit_io, "cannot silence the output of rank " + std::to_string(process_rank));
    const auto t0 = std::chrono::steady_clock::now();
    const int rc = run(o, *world, node_place());
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // What checking every collective's kind, size and order across the ranks cost (on in every build).
    const sequence_check_stats check = world->sequence_check();
    if (rc == 0 && check.calls > 0)
      std::printf("collective-sequence check: %llu collectives, %.3f s of %.3f s (%.2f%% of the run, waits for slower ranks included)\n",
                  static_cast<unsigned long long>(check.calls), check.seconds, wall, 100.0 * check.seconds / wall);
    std::fflush(stdout);
    return rc;
  }
#else
  if (o.parallel == "zero" || o.parallel == "rtp")
    fatal(gpt::exit_bad_input, "--parallel " + o.parallel + " needs MPI, and this build of train_gpt has none: install an MPI (libopenmpi-dev) and rebuild");
#endif
  return run(o, one, {});
}
