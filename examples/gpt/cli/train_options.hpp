// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief train_gpt's options, and every check on them that can run before any work starts: ranges
 *         of numbers (nothing wraps or overflows), names, the model's shape, the schedule, and the
 *         memory the run will need against what this machine and process may have.
 *
 *  A check that fails throws `chunkstar::config_error` naming the option and what to do; the
 *  trainer turns that into exit code 2 before it reads data or allocates model memory.
 */
#pragma once

#include "gpt_model.hpp"
#include "model_config.hpp"

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/units.hpp>
#include <chunkstar/optim/lr_schedule.hpp>
#include <chunkstar/runtime/memory_plan.hpp>
#include <chunkstar/runtime/runtime_options.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <string>
#include <vector>

namespace gpt {

/** @brief The process exit codes train_gpt documents (`--help`). */
enum exit_code : int {
  exit_ok = 0,
  exit_internal = 1,       ///< a bug: an internal state error or an unexpected exception
  exit_bad_input = 2,      ///< an option, the --data file, or the checkpoint to --resume
  exit_out_of_memory = 3,  ///< a memory space, the host, or a resource limit (ulimit -v, threads)
  exit_io = 4,             ///< writing an output (checkpoint, timeline) failed while running
};

/** @brief Every option of train_gpt, as parsed (signed, so that "-1" arrives as -1 and is refused
 *  rather than wrapping into a huge unsigned value). */
struct train_options {
  std::string data;  // empty: the embedded corpus
  std::string preset = "mini";
  std::int64_t layers = 0, width = 0, heads = 0, context = 0;  // 0: from the preset
  std::int64_t batch = 4, seq = 64;
  std::int64_t accum = 1;
  std::int64_t steps = 200;
  std::int64_t stop_after = 0;  // stop early at this step (the schedule still spans --steps)
  std::string precision = "fp32";
  std::string policy = "patrickstar";
  std::string device = "auto";  // cuda, sim (the simulated device), or auto: CUDA when there is a GPU
  std::string device_budget = "auto", host_budget = "unlimited", link_bandwidth = "0";
  double device_fraction = 0.4;  // --device-budget auto: activations + this share of the model data
  std::int64_t chunk_elems = 0;  // 0: searched between the largest tensor and 4x it
  std::int64_t prefetch = 2;
  float lr = 3e-3f, min_lr = 3e-4f, weight_decay = 0.1f, clip = 1.0f;
  std::int64_t warmup = -1;  // -1: min(20, steps / 10)
  std::string schedule = "cosine";
  std::uint64_t seed = 1337;
  std::int64_t val_every = 50, val_batches = 8;
  std::string save, resume, trace;
  std::int64_t save_every = 0;
  std::int64_t sample = 200;
  std::vector<std::string> allow_change;  // --allow-change: configuration a resume may change
  std::string parallel = "none";     // none; zero: shard the model data over MPI ranks; rtp: rotated tensor parallelism
  std::string comm = "auto";         // how ranks talk: auto, mpi, nccl, staged (MPI through host staging buffers)
  bool keep_gathered = false;        // --parallel zero: keep gathered parameters from forward to backward
  bool memory_saving = false;        // --parallel zero: chunk by chunk (PatrickStar's MSC), no group buffers
  bool sequence_check = true;        // --parallel: check every collective's kind and size across the ranks first
  std::string disk_dir;              // a third tier on disk in this directory (empty: none)
  std::string disk_budget = "auto";  // its size; auto: all of the model data and room for the reads in flight
  std::string disk_engine = "auto";  // uring, pool (pread/pwrite threads) or auto: io_uring where the kernel allows it
  bool disk_verify = false;          // checksum every chunk written to disk and verify it when read back
  std::string overlap_step = "auto";  // the optimizer step inside backward (chunk_adam::prepare): on, off, auto
  std::string scopes_ahead = "1";     // scopes the host may queue ahead of the device's work: N or unbounded
  std::int64_t sleep_after = 0;       // put the training state to sleep after this step (0: never)
  double sleep_for = 1.0;             // for this many seconds
};

/** @brief Largest values the numeric options accept (far beyond any useful run, well inside every
 *  type they flow into: the batch key keeps 16 bits for the micro-batch, 47 for the step). */
struct option_limits {
  static constexpr std::int64_t batch = 1 << 20;
  static constexpr std::int64_t accum = (1 << 16) - 1;
  static constexpr std::int64_t steps = std::int64_t{1} << 40;
  static constexpr std::int64_t prefetch = 1024;
  static constexpr std::int64_t chunk_elems = std::int64_t{1} << 36;
  static constexpr std::int64_t sample = 1 << 20;
  static constexpr std::int64_t val_batches = 1 << 20;
};

namespace detail {
inline std::string number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}
[[noreturn]] inline void bad_option(const std::string& option, const std::string& why) {
  throw chunkstar::config_error(option + " " + why);
}
inline void require_range(const char* option, std::int64_t v, std::int64_t lo, std::int64_t hi,
                          const std::string& hint = {}) {
  if (v < lo || v > hi)
    bad_option(option, std::to_string(v) + " is out of range: use a value from " + std::to_string(lo) + " to " +
                           std::to_string(hi) + (hint.empty() ? "" : " (" + hint + ")"));
}
inline void require_finite(const char* option, double v, double lo, bool lo_open = false) {
  if (!std::isfinite(v) || v < lo || (lo_open && v == lo))
    bad_option(option, number(v) + " must be a finite number " + (lo_open ? "above " : "at least ") + number(lo));
}
template <std::size_t N>
void require_one_of(const char* option, const std::string& v, const char* const (&names)[N]) {
  std::string list;
  for (const char* n : names) {
    if (v == n) return;
    list += (list.empty() ? "" : ", ") + std::string(n);
  }
  bad_option(option, "'" + v + "' is not one of: " + list);
}
}  // namespace detail

/** @brief "unlimited" or a byte size ("64MiB", "1.5GiB", "1000000"); config_error naming @p option otherwise. */
inline std::size_t bytes_option(const std::string& option, const std::string& value) {
  if (value == "unlimited") return SIZE_MAX;
  const auto b = chunkstar::parse_bytes(value);
  if (!b) detail::bad_option(option, "'" + value + "' is not a size: write e.g. 64MiB, 1.5GiB or 1000000");
  return *b;
}

/** @brief --device-budget: "auto", a share of the model data ("50%": the compute tier's non-model
 *  memory plus half of the model data), or a size. */
struct budget_value {
  enum kind_t { automatic, share, bytes } kind = automatic;
  double fraction = 0;   ///< share: of the model data, in (0, 1]
  std::size_t size = 0;  ///< bytes
};
inline budget_value budget_option(const std::string& value) {
  if (value == "auto") return {};
  if (!value.empty() && value.back() == '%') {
    const std::string number = value.substr(0, value.size() - 1);
    char* end = nullptr;
    const double pct = std::strtod(number.c_str(), &end);
    if (number.empty() || end != number.c_str() + number.size() || !std::isfinite(pct) || pct <= 0 || pct > 100)
      detail::bad_option(
          "--device-budget",
          "'" + value + "' is not a share of the model data: write a percentage above 0 and at most 100, e.g. 50%");
    return {.kind = budget_value::share, .fraction = pct / 100};
  }
  const std::size_t b = bytes_option("--device-budget", value);
  if (b == SIZE_MAX)
    detail::bad_option("--device-budget", "cannot be unlimited: a device has a size; write e.g. 4GiB, 50% or auto");
  return {.kind = budget_value::bytes, .size = b};
}

/** @brief What the device budget is made of, for device_budget_bytes(). */
struct budget_inputs {
  std::size_t non_model = 0;    ///< activations, workspace, staging of one micro-batch
  std::size_t collective = 0;   ///< ZeRO's gather and reduce buffers at their peak
  std::size_t model = 0;        ///< this rank's model data
  std::size_t device_free = 0;  ///< a real device's free memory now; 0 on the simulated device
  std::size_t floor = 0;        ///< the least device the run can use (memory_plan::device_floor); 0: unknown
};

/** @brief Memory a real device keeps beside the budget (CUDA context growth, cuBLAS, allocation
 *  granularity): 1/16 of the free memory plus 256 MiB. */
inline std::size_t device_reserve(std::size_t device_free) noexcept {
  return device_free / 16 + (std::size_t{256} << 20);
}

/** @brief The device budget in bytes. `auto`: on a real device its free memory less the reserve;
 *  on the simulated device the non-model memory + collective buffers + all of the model data with
 *  --policy resident, else + --device-fraction of it, so that chunks move. A share: non-model +
 *  collective + that share of the model data. Pure. */
inline std::size_t device_budget_bytes(const train_options& o, const budget_inputs& in) {
  const budget_value v = budget_option(o.device_budget);
  const std::size_t base = in.non_model + in.collective;
  const auto share = [&](double f) { return base + static_cast<std::size_t>(f * static_cast<double>(in.model)); };
  switch (v.kind) {
    case budget_value::bytes: return v.size;
    case budget_value::share: return share(v.fraction);
    case budget_value::automatic: break;
  }
  if (in.device_free > 0)
    return in.device_free > device_reserve(in.device_free) ? in.device_free - device_reserve(in.device_free) : 0;
  return o.policy == "resident" ? base + in.model : std::max(share(o.device_fraction), in.floor);
}

/** @brief Throws `config_error` unless the run of plan @p need fits budgets @p b
 *  (`chunkstar::admit`): each tier's shortfall in bytes, and the options that would fix it. */
inline void require_admitted(const chunkstar::memory_plan& need, const chunkstar::tier_budgets& b) {
  const chunkstar::admission a = chunkstar::admit(need, b);
  if (a.fits()) return;
  std::string fix;
  if (a.device_short > 0)
    fix += "raise --device-budget by " + chunkstar::format_bytes(a.device_short) +
           ", lower --batch or --seq, or set a smaller --chunk-elems";
  if (a.host_short > 0)
    fix += std::string(fix.empty() ? "" : "; and ") + "give --host-budget at least " +
           chunkstar::format_bytes(need.host_floor_with_disk()) + " for the disk tier";
  if (a.total_short > 0)
    fix += std::string(fix.empty() ? "" : "; and ") + "give --host-budget" + (b.disk > 0 ? " or --disk-budget " : " ") +
           chunkstar::format_bytes(a.total_short) + " more" + (b.disk > 0 ? "" : ", or add a disk tier (--disk-dir)") +
           ", or train a smaller model";
  throw chunkstar::config_error("the memory this run needs does not fit its budgets: " + a.message +
                                " In options: " + fix + ".");
}

/** @brief Which device a run trains on, and why (the trainer's first line says it). */
struct device_choice {
  bool cuda = false;
  int gpu = 0;      ///< this rank's CUDA device ordinal
  int sharing = 1;  ///< ranks of this node on that GPU (they split its free memory)
  std::string why;
};

/** @brief This rank's place in its node: under mpirun, rank k of a node takes GPU k mod (GPUs). */
struct node_place {
  int local_rank = 0;
  int local_ranks = 1;
};

/** @brief --device resolved against this build (@p cuda_built: train_gpt has the CUDA backend) and
 *  this machine (@p cuda_devices GPUs visible; @p node: this rank's place on it). `auto` takes a
 *  GPU when there is one and the mode runs there; `cuda` that cannot run is a config_error saying
 *  what is missing. Node-local rank k takes GPU k mod @p cuda_devices. Pure. */
inline device_choice resolve_device(const train_options& o, bool cuda_built, int cuda_devices, node_place node = {}) {
  const char* missing =
      !cuda_built ? "this train_gpt was built without the CUDA backend (configure with the CUDA toolkit installed)"
      : cuda_devices <= 0 ? "no CUDA device is visible (nvidia-smi lists none, or CUDA_VISIBLE_DEVICES hides them)"
                          : nullptr;
  if (o.device == "sim") return {.why = "--device sim"};
  if (missing) {
    if (o.device == "cuda")
      detail::bad_option("--device", std::string("cuda: ") + missing + "; use --device sim or auto");
    return {.why = std::string("--device auto: ") + missing};
  }
  const int gpu = node.local_rank % cuda_devices;
  const int sharing = (node.local_ranks - gpu + cuda_devices - 1) / cuda_devices;
  std::string why = "--device " + o.device + ": GPU " + std::to_string(gpu) + " of " + std::to_string(cuda_devices);
  if (sharing > 1) why += ", shared by " + std::to_string(sharing) + " ranks of this node";
  return {.cuda = true, .gpu = gpu, .sharing = sharing, .why = why};
}

/** @brief How the ranks of --parallel talk (--comm), and why. */
struct transport_choice {
  enum kind_t { host, nccl, staged } kind = host;  ///< host: MPI on host memory (or one process)
  std::string why;
};

/** @brief --comm resolved against the device (@p d) and this build (@p nccl_built). `auto`: for ZeRO
 *  and RTP on GPUs NCCL when every rank has a GPU of its own, else MPI through pinned host buffers
 *  (NCCL puts one rank of a communicator per GPU); on the simulated device MPI on host memory.
 *  `staged` on the simulated device runs the staging path on the CPU. Pure. */
inline transport_choice resolve_transport(const train_options& o, const device_choice& d, bool nccl_built) {
  const auto bad = [&](const std::string& why) { detail::bad_option("--comm", o.comm + ": " + why); };
  if (o.parallel == "none") {
    if (o.comm != "auto" && o.comm != "mpi")
      bad("applies to --parallel zero, replicated and rtp (one process talks to no one); drop it or use --comm auto");
    return {transport_choice::host, ""};
  }
  if (!d.cuda) {
    if (o.comm == "nccl") bad("NCCL needs --device cuda; on the simulated device use --comm mpi or staged");
    if (o.comm == "staged") return {transport_choice::staged, "MPI through host staging buffers (--comm staged)"};
    return {transport_choice::host, "MPI"};
  }
  if (o.comm == "mpi")
    bad(std::string("MPI here takes host memory, and ") +
        (o.parallel == "rtp"          ? "RTP's rotating shards"
         : o.parallel == "replicated" ? "the gradient chunks it all-reduces"
                                      : "ZeRO's buffers") +
        " are on the GPU: use --comm nccl or staged (MPI through pinned host buffers)");
  const char* no_nccl = !nccl_built     ? "this train_gpt was built without NCCL"
                        : d.sharing > 1 ? "NCCL puts one rank of a communicator per GPU, and this GPU is shared"
                                        : nullptr;
  if (o.comm == "nccl") {
    if (no_nccl) bad(std::string(no_nccl) + "; use --comm staged, or run at most one rank per GPU");
    return {transport_choice::nccl, "NCCL (--comm nccl)"};
  }
  if (o.comm == "staged") return {transport_choice::staged, "MPI through pinned host buffers (--comm staged)"};
  if (no_nccl)
    return {transport_choice::staged, std::string("MPI through pinned host buffers (--comm auto: ") + no_nccl + ")"};
  return {transport_choice::nccl, "NCCL (--comm auto: one rank per GPU)"};
}

/** @brief The parameter dtype of --precision. */
inline chunkstar::dtype precision_type(const std::string& p) {
  if (p == "fp32") return chunkstar::dtype::f32;
  if (p == "bf16") return chunkstar::dtype::bf16;
  if (p == "fp16") return chunkstar::dtype::f16;
  detail::bad_option("--precision", "'" + p + "' is not one of: fp32, bf16, fp16");
}

/** @brief The model shape: the preset with the --layers/--width/--heads/--context overrides,
 *  validated (bounds included). */
inline gpt_config model_config(const train_options& o) {
  gpt_config c = parse_preset(o.preset);
  const auto take = [](const char* option, std::int64_t v, int& field, std::int64_t hi) {
    if (v == 0) return;
    detail::require_range(option, v, 1, hi, "0 keeps the preset's value");
    field = static_cast<int>(v);
  };
  take("--layers", o.layers, c.layers, max_layers);
  take("--width", o.width, c.width, max_dimension);
  take("--heads", o.heads, c.heads, max_dimension);
  take("--context", o.context, c.context, max_dimension);
  validate(c);
  return c;
}

/** @brief Warm-up steps: --warmup, or by default min(20, steps / 10), so a short run leaves warm-up. */
inline std::int64_t warmup_steps(const train_options& o) {
  return o.warmup >= 0 ? o.warmup : std::min<std::int64_t>(20, o.steps / 10);
}

/** @brief The learning-rate schedule of the options (validated by the caller). */
inline chunkstar::warmup_cosine cosine_schedule(const train_options& o) {
  return {.peak = o.lr, .min = o.min_lr, .warmup_steps = warmup_steps(o), .total_steps = o.steps};
}

/** @brief How many processes a launcher started this one among: mpirun or mpiexec of Open MPI,
 *  MPICH or MVAPICH, from the variables they set (1 when there are none). @p env looks a variable
 *  up (std::getenv). Pure. */
template <class Env>
int launched_processes(Env env) {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"}) {
    const char* v = env(name);
    if (v == nullptr) continue;
    const long n = std::strtol(v, nullptr, 10);
    if (n > 0) return n > 1 << 24 ? 1 << 24 : static_cast<int>(n);
  }
  return 1;
}

/** @brief --scopes-ahead as runtime_options::scopes_ahead: a count (0 to 1024) or unbounded.
 *  @throws chunkstar::config_error naming the option otherwise. */
inline std::size_t scopes_ahead_of(const train_options& o) {
  if (o.scopes_ahead == "unbounded") return chunkstar::unbounded_scopes_ahead;
  std::size_t n = 0;
  const char* end = o.scopes_ahead.data() + o.scopes_ahead.size();
  const auto [p, ec] = std::from_chars(o.scopes_ahead.data(), end, n);
  if (o.scopes_ahead.empty() || ec != std::errc{} || p != end || n > 1024)
    detail::bad_option("--scopes-ahead", "'" + o.scopes_ahead +
                                             "' is neither a count of scopes from 0 to 1024 nor 'unbounded' (1, the "
                                             "default, lets the host queue one scope ahead of the device)");
  return n;
}

/** @brief Throws config_error unless the global --batch splits evenly over @p ranks ranks, and
 *  unless several ranks (processes a launcher started, for --parallel none) have a mode to share. */
inline void validate_ranks(const train_options& o, int ranks) {
  if (o.parallel == "none" && ranks > 1)
    detail::bad_option("--parallel",
                       "none on " + std::to_string(ranks) +
                           " MPI ranks: every rank would train the same model alone and write the same outputs; "
                           "use --parallel zero, replicated or rtp, or run one process without mpirun");
  if (ranks > 1 && o.batch % ranks != 0) {
    std::string valid;
    for (int n = 1; n <= ranks; ++n)
      if (o.batch % n == 0) valid += (valid.empty() ? "" : ", ") + std::to_string(n);
    detail::bad_option("--batch", std::to_string(o.batch) + " (the global batch) does not split evenly over " +
                                      std::to_string(ranks) + " ranks: use a multiple of " + std::to_string(ranks) +
                                      ", or run on " + valid + " ranks");
  }
}

/** @brief Checks every option against its range and the others, throwing config_error naming the
 *  first that is wrong. Pure: touches no file and allocates nothing big. */
inline void validate_options(const train_options& o, const gpt_config& cfg) {
  using detail::require_range;
  require_range("--batch", o.batch, 1, option_limits::batch);
  require_range("--seq", o.seq, 1, cfg.context, "the longest sequence is the model's context; raise it with --context");
  (void)compute_activation_sizes(cfg, static_cast<std::size_t>(o.batch), static_cast<std::size_t>(o.seq));
  require_range("--accum", o.accum, 1, option_limits::accum);
  require_range("--steps", o.steps, 1, option_limits::steps);
  require_range("--stop-after", o.stop_after, 0, o.steps, "0 runs all --steps");
  require_range("--prefetch", o.prefetch, 0, option_limits::prefetch, "0 turns prefetch off");
  require_range("--chunk-elems", o.chunk_elems, 0, option_limits::chunk_elems, "0 searches a size");
  require_range("--val-every", o.val_every, 0, option_limits::steps, "0 never validates");
  if (o.val_every > 0)
    require_range("--val-batches", o.val_batches, 1, option_limits::val_batches, "with --val-every 0 it is unused");
  require_range("--save-every", o.save_every, 0, option_limits::steps, "0 saves only at the end");
  require_range("--sample", o.sample, 0, option_limits::sample, "0 generates nothing");
  require_range("--sleep-after", o.sleep_after, 0, o.steps, "0 never sleeps");
  detail::require_finite("--sleep-for", o.sleep_for, 0.0);
  if (o.save_every > 0 && o.save.empty())
    detail::bad_option("--save-every", "needs --save DIR to say where checkpoints go");
  detail::require_one_of("--policy", o.policy, {"patrickstar", "lru", "resident", "offload"});
  detail::require_one_of("--schedule", o.schedule, {"cosine", "constant"});
  detail::require_one_of("--parallel", o.parallel, {"none", "zero", "replicated", "rtp"});
  detail::require_one_of("--overlap-step", o.overlap_step, {"auto", "on", "off"});
  (void)scopes_ahead_of(o);                                  // N or unbounded
  if (o.parallel == "none" || o.parallel == "replicated") {  // ZeRO's options: nothing is gathered here
    const auto zero_only = [&](const char* option) {
      detail::bad_option(option, "applies to --parallel zero (it decides how ZeRO gathers), not to --parallel " +
                                     o.parallel + ", where every rank holds the whole model: drop it");
    };
    if (o.keep_gathered) zero_only("--keep-gathered");
    if (o.memory_saving) zero_only("--memory-saving");
  }
  if (o.parallel == "rtp") {
    // RTP does not gather chunks: ZeRO's options do not apply.
    const auto not_with_rtp = [](const char* option) {
      detail::bad_option(option,
                         "does not apply to --parallel rtp, whose shards rotate instead of being gathered "
                         "(docs/rtp.md); drop it");
    };
    if (o.keep_gathered) not_with_rtp("--keep-gathered");
    if (o.memory_saving) not_with_rtp("--memory-saving");
  }
  (void)precision_type(o.precision);
  detail::require_finite("--lr", o.lr, 0.0, true);
  detail::require_finite("--weight-decay", o.weight_decay, 0.0);
  detail::require_finite("--clip", o.clip, 0.0);
  if (o.schedule == "cosine") {
    detail::require_finite("--min-lr", o.min_lr, 0.0);
    if (o.min_lr > o.lr)
      detail::bad_option("--min-lr", detail::number(o.min_lr) + " is above --lr " + detail::number(o.lr) +
                                         ": the cosine decays from --lr down to --min-lr");
    if (o.warmup != -1)
      require_range("--warmup", o.warmup, 0, o.steps, "warm-up is part of --steps; -1 picks min(20, steps / 10)");
    cosine_schedule(o).validate();
  }
  (void)bytes_option("--host-budget", o.host_budget);
  (void)bytes_option("--link-bandwidth", o.link_bandwidth);
  detail::require_one_of("--device", o.device, {"auto", "cuda", "sim"});
  detail::require_one_of("--comm", o.comm, {"auto", "mpi", "nccl", "staged"});
  if (o.device_budget != "auto") (void)budget_option(o.device_budget);
  if (o.device == "cuda" && bytes_option("--link-bandwidth", o.link_bandwidth) != 0)
    detail::bad_option(
        "--link-bandwidth",
        o.link_bandwidth +
            " models the simulated device's link; with --device cuda the real link moves the chunks: drop it");
  if (!o.trace.empty() && o.trace == o.save) detail::bad_option("--trace", "and --save name the same path");
  detail::require_one_of("--disk-engine", o.disk_engine, {"auto", "uring", "pool"});
  if (o.disk_dir.empty()) {
    const auto needs_dir = [](const char* option, const std::string& v) {
      detail::bad_option(option,
                         v + " configures the disk tier, which needs --disk-dir DIR (a directory for its file)");
    };
    if (o.disk_budget != "auto") needs_dir("--disk-budget", o.disk_budget);
    if (o.disk_engine != "auto") needs_dir("--disk-engine", o.disk_engine);
    if (o.disk_verify) needs_dir("--disk-verify", "it");
  } else {
    if (o.disk_budget != "auto" && bytes_option("--disk-budget", o.disk_budget) == SIZE_MAX)
      detail::bad_option("--disk-budget",
                         "cannot be unlimited: the tier's file is preallocated; write e.g. 4GiB, or auto");
  }
}

/** @brief --disk-budget in bytes: a size, or auto = all of @p model_bytes plus @p reserve (the
 *  chunks a read or write in flight holds twice). */
/** --overlap-step: whether host-stepped chunks' updates start inside backward. auto: on with a CUDA
 *  device (backward's kernels leave the host's cores idle), with a disk tier too; off on the
 *  simulated device (backward and the step share the cores). Measured: docs/performance.md. */
inline bool overlap_step(const train_options& o, bool cuda) {
  return o.overlap_step == "on" || (o.overlap_step == "auto" && cuda);
}

inline std::size_t disk_budget_bytes(const train_options& o, std::size_t model_bytes, std::size_t reserve) {
  return o.disk_budget == "auto" ? model_bytes + reserve : bytes_option("--disk-budget", o.disk_budget);
}

}  // namespace gpt
