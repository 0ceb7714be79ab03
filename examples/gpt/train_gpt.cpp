// SPDX-License-Identifier: Apache-2.0
// train_gpt: a byte-level GPT trained with all of its model data in chunkstar.
//
// Read it top to bottom: options, data, memory plan, model, optimizer, one training loop for every
// mode, the summary. The memory plan, the runtime, the model and the optimizer of a run are its
// session's (chunked_session.hpp: one process or ZeRO; rtp_session.hpp: RTP). With
// --device cuda (or auto on a machine with a GPU) the chunks live on a CUDA device and in pinned
// host memory, the layers run as CUDA kernels and cuBLAS GEMMs, and chunks placed on the device are
// stepped there. Otherwise the device is simulated on the CPU (host memory with a hard capacity), so
// the run shows what chunkstar does on a GPU whose memory is smaller than the model's data: chunks
// move, evictions happen, and the loss falls exactly as it would with everything resident (same bits).
//
// Everything that can be checked is checked before any work starts (`prepare`): options, the data
// file, the checkpoint to resume and its configuration, the output paths, and the memory the run
// needs (cli/run_plan.hpp). A fatal error prints one message and ends the process at once, with an
// exit code that says what kind of failure it was (cli/exit_handling.hpp, `--help`).
#include "chunked_session.hpp"
#include "data.hpp"
#include "rtp_session.hpp"
#include "run_plan.hpp"
#include "train_cli.hpp"
#include "trainer_runtimes.hpp"
#if GPT_HAS_NCCL
#include "gpt_nccl.hpp"
#endif
#if GPT_HAS_CUDA_BACKEND
#include <chunkstar/cuda/host_stager.hpp>
#endif

#include <chunkstar/comm/communicator_ref.hpp>
#include <chunkstar/comm/staged_communicator.hpp>
#include <chunkstar/config.hpp>
#if CHUNKSTAR_HAS_MPI()
#include <chunkstar/mpi/mpi_communicator.hpp>
#endif
#include <chunkstar/optim/lr_schedule.hpp>
#include <chunkstar/placement/static_placement.hpp>

#include <CLI/CLI.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace chunkstar;
using gpt::train_options;

namespace {

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
    throw gpt::output_error(e.what());
  }
  std::printf("timeline written to %s (open it in https://ui.perfetto.dev)\n", o.trace.c_str());
}

// ------------------------------------------------------------------------------------------------
// The training run: one loop for every mode, over a session that holds the run's memory, runtime,
// model and optimizer (chunked_session.hpp, rtp_session.hpp).
template <class Session>
int train(const train_options& o, const gpt::run_plan& plan, typename Session::placement_type placement,
          communicator_ref comm) {
  const int ranks = comm.size();
  const auto average = [&](double x) {  // over the ranks (each computed the same-sized slice)
    comm.allreduce(std::span<double>(&x, 1), reduce_op::sum);
    return x / ranks;
  };
  Session s(o, plan, placement, comm);  // the memory plan, admitted; the runtime, the model, AdamW
  const gpt::batch_shape shape = s.shape();
  const std::size_t first =
      shape.batch * static_cast<std::size_t>(comm.rank());  // this rank's slice of the global batch
  const std::size_t N = shape.batch * shape.seq;
  std::vector<int> tokens(N), targets(N);
  const auto batch = [&](const std::vector<std::uint8_t>& text, std::uint64_t key) {
    gpt::fill_batch(text, o.seed, key, shape.batch, shape.seq, tokens.data(), targets.data(), first);
  };
  const auto validation_loss = [&] {
    double sum = 0;
    for (std::int64_t b = 0; b < o.val_batches; ++b) {
      batch(plan.data.val, static_cast<std::uint64_t>(b));
      sum += s.eval_loss(tokens.data(), targets.data());
    }
    return average(sum / static_cast<double>(o.val_batches));
  };
  const auto save = [&](std::int64_t step) {
    try {
      s.save(step);
    } catch (const chunkstar::error& e) {
      throw gpt::output_error(std::string("saving the checkpoint of step ") + std::to_string(step) +
                              " failed (the previous checkpoint in '" + o.save + "', if any, is intact): " + e.what());
    }
    std::printf("saved checkpoint to %s (step %lld)\n", o.save.c_str(), static_cast<long long>(step));
  };
  // Warm-up then cosine (or constant); each rank's gradients are of its slice's mean loss, summed
  // over the ranks N times the global batch's, so the step averages over accum x N micro-batches.
  const warmup_cosine cosine = gpt::cosine_schedule(o);
  const auto lr_at = [&](std::int64_t step) { return o.schedule == "constant" ? o.lr : cosine(step); };
  const int micro_batches = static_cast<int>(o.accum) * ranks;

  using clock = std::chrono::steady_clock;
  const auto run_start = clock::now();
  double first_loss = 0, last_loss = 0;
  std::optional<double> last_val;
  std::int64_t skipped = 0;
  for (std::int64_t step = plan.first_step; step <= plan.last_step; ++step) {
    const auto t0 = clock::now();
    s.begin_step();
    const float lr = lr_at(step);
    s.prepare_step(lr, micro_batches);
    double loss = 0;
    for (int micro = 0; micro < o.accum; ++micro) {
      batch(plan.data.train, gpt::train_key(step, micro));
      loss += s.forward_backward(tokens.data(), targets.data()) / static_cast<double>(o.accum);
    }
    loss = average(loss);
    const gpt::step_outcome r = s.step(lr, micro_batches);
    skipped += r.stepped ? 0 : 1;
    const double dt = std::chrono::duration<double>(clock::now() - t0).count();
    if (step == plan.first_step) first_loss = loss;
    last_loss = loss;
    char norm[16] = "     -";  // not computed: nothing needed it
    if (!std::isnan(r.grad_norm)) std::snprintf(norm, sizeof norm, "%6.3f", r.grad_norm);
    std::printf("step %5lld/%lld | loss %.6f | %7.0f tok/s | lr %.2e | norm %s%s | %s\n", static_cast<long long>(step),
                static_cast<long long>(o.steps), loss,
                static_cast<double>(N * static_cast<std::size_t>(micro_batches)) / dt, static_cast<double>(lr), norm,
                r.stepped ? "" : " (skipped: overflow)", s.step_report().c_str());
    std::fflush(stdout);  // a line per step as it happens, also into a pipe or a file (tail -f, mpirun)
    if (o.val_every > 0 && (step % o.val_every == 0 || step == plan.last_step)) {
      last_val = validation_loss();
      std::printf("validation loss %.6f at step %lld\n", *last_val, static_cast<long long>(step));
    }
    if (!o.save.empty() && ((o.save_every > 0 && step % o.save_every == 0) || step == plan.last_step)) save(step);
    if (step == o.sleep_after) {  // the device is free for another job meanwhile
      const gpt::asleep_memory m = s.sleep();
      double most[2] = {static_cast<double>(m.model_bytes), static_cast<double>(m.device_used)};  // over the ranks
      comm.allreduce(std::span<double>(most, 2), reduce_op::max);
      std::printf(
          "asleep after step %lld: model data on the device %s, device memory in use %s (the most on a rank); "
          "waking in %g s\n",
          static_cast<long long>(step), chunkstar::format_bytes(static_cast<std::size_t>(most[0])).c_str(),
          chunkstar::format_bytes(static_cast<std::size_t>(most[1])).c_str(), o.sleep_for);
      std::fflush(stdout);
      std::this_thread::sleep_for(std::chrono::duration<double>(o.sleep_for));
      s.wake();
    }
    std::fflush(stdout);
  }

  // Summary, and a sample from the model (rank 0's probabilities on every rank: every rank picks the same).
  const double total = std::chrono::duration<double>(clock::now() - run_start).count();
  char val[32] = "none";
  if (last_val) std::snprintf(val, sizeof val, "%.4f", *last_val);
  std::printf("\nsummary: %lld steps in %.1f s, loss %.4f -> %.4f, validation %s, %lld skipped\n",
              static_cast<long long>(plan.last_step - plan.first_step + 1), total, first_loss, last_loss, val,
              static_cast<long long>(skipped));
  s.print_summary();
  if (o.sample > 0) print_sample(o, [&](std::span<const int> text) { return s.next_token_probs(text); });
  if (comm.rank() == 0) write_trace(o, s.runtime());
  return gpt::exit_ok;
}

/** RTP with shards of @p T, under the --policy's runtime. */
template <class T, class Platform>
int rtp_with_policy(const train_options& o, const gpt::run_plan& plan, communicator_ref comm) {
  using runtimes = gpt::trainer_runtimes<Platform>;
  if (o.policy == "patrickstar") return train<gpt::rtp_session<typename runtimes::belady, T>>(o, plan, {}, comm);
  if (o.policy == "lru") return train<gpt::rtp_session<typename runtimes::lru, T>>(o, plan, {}, comm);
  if (o.policy == "resident")
    return train<gpt::rtp_session<typename runtimes::fixed, T>>(o, plan, static_placement::all_device(), comm);
  return train<gpt::rtp_session<typename runtimes::fixed, T>>(o, plan, static_placement::all_host(),
                                                              comm);  // "offload" (validated)
}

template <class Scaler, class Platform>
int with_policy(const train_options& o, const gpt::run_plan& plan, communicator_ref comm) {
  using runtimes = gpt::trainer_runtimes<Platform>;  // compiled in trainer_runtimes*.cpp
  if (o.parallel == "rtp") {
    const dtype t = gpt::precision_type(o.precision);
    if (t == dtype::f32) return rtp_with_policy<float, Platform>(o, plan, comm);
    if constexpr (gpt::platform_parts<Platform>::backend::host_memory) {
      if (t == dtype::bf16) return rtp_with_policy<chunkstar::bfloat16, Platform>(o, plan, comm);
      return rtp_with_policy<chunkstar::float16, Platform>(o, plan, comm);
    } else {
      throw config_error("--precision " + o.precision +
                         " with --parallel rtp runs on the CPU backend only for now: the GPU backend has no 16-bit "
                         "kernels for the rotations' buffers (docs/rtp.md); use --precision fp32, or --device sim");
    }
  }
  if (o.policy == "patrickstar")
    return train<gpt::chunked_session<typename runtimes::belady, Scaler>>(o, plan, {}, comm);
  if (o.policy == "lru") return train<gpt::chunked_session<typename runtimes::lru, Scaler>>(o, plan, {}, comm);
  if (o.policy == "resident")
    return train<gpt::chunked_session<typename runtimes::fixed, Scaler>>(o, plan, static_placement::all_device(), comm);
  return train<gpt::chunked_session<typename runtimes::fixed, Scaler>>(o, plan, static_placement::all_host(), comm);
}

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

/** Trains on the platform the plan chose, with its loss scaler, over @p comm. */
int on_platform(const train_options& o, const gpt::run_plan& plan, communicator_ref comm) {
#if GPT_HAS_CUDA_BACKEND
  if (plan.device.cuda) {
    if (cudaSetDevice(plan.device.gpu) != cudaSuccess)  // for the default stream's device Adam, and cuBLAS
      throw config_error("--device cuda: cannot select GPU " + std::to_string(plan.device.gpu) +
                         " (is it visible? CUDA_VISIBLE_DEVICES)");
    return gpt::precision_type(o.precision) == dtype::f16
               ? with_policy<dynamic_loss_scaler, cuda::cuda_platform>(o, plan, comm)
               : with_policy<static_loss_scaler, cuda::cuda_platform>(o, plan, comm);
  }
#endif
  return gpt::precision_type(o.precision) == dtype::f16
             ? with_policy<dynamic_loss_scaler, simulated_platform>(o, plan, comm)
             : with_policy<static_loss_scaler, simulated_platform>(o, plan, comm);
}

int run(const train_options& o, communicator_ref comm, gpt::node_place node) {
  return gpt::run_guarded(o, [&](const char*& phase) {
    const gpt::run_plan plan = gpt::prepare(o, comm.size(), node);
    phase = "comparing the ranks' options";
    // Before any collective that depends on them: ranks given different options stop here, all of
    // them, naming the option, instead of diverging silently, crashing in MPI or hanging.
    require_agreement(comm, gpt::rank_agreement(plan.record, o, plan.first_step, plan.transport, plan.device),
                      "train_gpt");
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
  });
}

}  // namespace

int main(int argc, char** argv) {
  gpt::tune_openmp_waiting(argv);
  train_options o;
  CLI::App app{"train_gpt: a byte-level GPT whose model data lives in chunkstar chunks"};
  gpt::add_train_options(app, o);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::fprintf(stderr, "error: %s\n(train_gpt --help lists the options)\n", e.what());
    return gpt::exit_bad_input;
  }
  // --parallel zero, replicated or rtp: one process per rank under mpirun; only rank 0 prints progress.
  single_process_communicator one;
  if (o.parallel == "none") {  // under mpirun -np N, N copies would train alone and write the same files
    try {
      gpt::validate_ranks(o, gpt::launched_processes([](const char* name) { return std::getenv(name); }));
    } catch (const config_error& e) {
      gpt::fatal(gpt::exit_bad_input, e.what());
    }
  }
#if CHUNKSTAR_HAS_MPI()
  std::optional<mpi_session> session;
  std::optional<mpi_communicator> world;
  if (o.parallel != "none") {
    try {
      session.emplace(&argc, &argv);
      world.emplace(MPI_COMM_WORLD, mpi_options{.check_sequence = o.sequence_check});
    } catch (const config_error& e) {  // the ranks were given different --no-sequence-check
      gpt::fatal(gpt::exit_bad_input, e.what());
    } catch (const chunkstar::error& e) {
      gpt::fatal(gpt::exit_internal, "cannot start MPI for --parallel " + o.parallel + ": " + e.what());
    }
    gpt::process_rank = world->rank();
    if (gpt::process_rank != 0 && !std::freopen("/dev/null", "w", stdout))
      gpt::fatal(gpt::exit_io, "cannot silence the output of rank " + std::to_string(gpt::process_rank));
    const auto t0 = std::chrono::steady_clock::now();
    const int rc = run(o, *world, node_place());
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // What checking every collective's kind, size and order across the ranks cost (on in every build).
    const sequence_check_stats check = world->sequence_check();
    if (rc == 0 && check.calls > 0)
      std::printf(
          "collective-sequence check: %llu collectives, %.3f s of %.3f s (%.2f%% of the run, waits for slower ranks "
          "included)\n",
          static_cast<unsigned long long>(check.calls), check.seconds, wall, 100.0 * check.seconds / wall);
    std::fflush(stdout);
    return rc;
  }
#else
  if (o.parallel != "none")
    gpt::fatal(gpt::exit_bad_input,
               "--parallel " + o.parallel +
                   " needs MPI, and this build of train_gpt has none: install an MPI (libopenmpi-dev) and rebuild");
#endif
  return run(o, one, {});
}
