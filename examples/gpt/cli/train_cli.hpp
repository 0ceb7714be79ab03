// SPDX-License-Identifier: Apache-2.0
// train_gpt's command line: every option, its help text and the exit codes; and the one
// process-level setting the trainer makes before anything runs (how OpenMP's threads wait).
#pragma once

#include "exit_handling.hpp"
#include "train_options.hpp"

#include <CLI/CLI.hpp>

#include <cstdlib>

#include <unistd.h>

namespace gpt {

/** Registers every option of @p o with @p app; a later occurrence overrides an earlier one (so
 *  `run.sh --steps 10` works). */
inline void add_train_options(CLI::App& app, train_options& o) {
  app.footer(exit_codes_help);
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
  app.add_option("--device", o.device,
                 "cuda (a GPU), sim (the simulated device) or auto: CUDA when a GPU is visible, else simulated");
  app.add_option("--device-budget", o.device_budget,
                 "Device memory for chunks and activations: a size (256MiB), a share of the model data (50%: "
                 "activations + half the "
                 "model data), or 'auto' = a GPU's free memory; on the simulated device activations + 40% of the model "
                 "data (all of "
                 "it with --policy resident)");
  app.add_option("--host-budget", o.host_budget, "Host memory for chunks, e.g. 4GiB, or 'unlimited'");
  app.add_option("--link-bandwidth", o.link_bandwidth,
                 "Modelled host<->device bandwidth per second, e.g. 8GiB (0: memcpy speed)");
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
  app.add_option(
      "--parallel", o.parallel,
      "none; zero: under mpirun -np N, shard the model data over the N ranks (ZeRO); replicated: every rank holds "
      "the whole model and the gradients are all-reduced (plain data parallelism); rtp: each rank owns 1/N of "
      "every layer and the shards rotate round the ranks (RTP, fp32); --batch stays the global batch");
  app.add_option("--comm", o.comm,
                 "--parallel zero or rtp: how ranks talk. auto: on GPUs NCCL when every rank has a GPU of its own, "
                 "else MPI through "
                 "pinned host buffers; on the simulated device MPI. nccl, staged (MPI through host buffers: ranks "
                 "sharing a GPU, no "
                 "NCCL), or mpi (host memory: the simulated device)");
  app.add_flag("--keep-gathered", o.keep_gathered,
               "--parallel zero: keep gathered parameters from forward to backward (more memory, fewer gathers)");
  app.add_flag(
      "--memory-saving", o.memory_saving,
      "--parallel zero: gather and reduce chunk by chunk (broadcast from and reduce to the owner) instead of in groups "
      "of N: "
      "less device memory, more collectives (PatrickStar's MSC). Without it the group mode, unless only this mode fits "
      "the budgets: then this one, and the run says so");
  app.add_flag("!--no-sequence-check", o.sequence_check,
               "--parallel zero or rtp: skip the check that every rank makes the same collective call before each one "
               "(on by default: "
               "a divergence is then an error naming both calls instead of a hang; its cost is printed at the end, "
               "docs/zero.md)");
  app.add_option(
      "--disk-dir", o.disk_dir,
      "A third tier on local disk: a preallocated file in this directory holds the chunks the device and host budgets "
      "cannot (model data beyond device + host memory); the host budget (--host-budget) then bounds host memory");
  app.add_option("--disk-budget", o.disk_budget,
                 "Size of the disk tier's file, e.g. 64GiB (auto: the whole model data, this rank's share with "
                 "--parallel zero, and a margin)");
  app.add_option("--disk-engine", o.disk_engine,
                 "uring, pool (pread/pwrite threads) or auto: io_uring where the kernel allows it");
  app.add_flag("--disk-verify", o.disk_verify,
               "Checksum (CRC32C) every chunk written to disk and verify it when read back");
  app.add_option("--scopes-ahead", o.scopes_ahead,
                 "How many scopes closed on the compute stream may still be running when the next opens (with "
                 "--device cuda; the simulated device's work is done when a scope closes): 0 waits for each scope's "
                 "kernels before the next scope's moves and early steps are decided, unbounded never waits (the host "
                 "then decides an iteration ahead of the GPU). Default 1: docs/performance.md, \"The host ahead of "
                 "the device\". The same bits at every value");
  app.add_option("--overlap-step", o.overlap_step,
                 "Start each host-stepped chunk's optimizer step inside backward, once its gradient is final "
                 "(speculative where clipping or fp16 could undo it; the same bits either way): on, off, or auto "
                 "(on with --device cuda, where backward's kernels leave the host idle, with or without "
                 "--disk-dir; off on the simulated device, where backward and the step share the same cores: "
                 "measured in docs/performance.md). "
                 "Every mode: one process, --parallel zero (each rank steps its own chunks once reduced to it), "
                 "--parallel replicated (each chunk once its all-reduce has completed) and --parallel rtp (each "
                 "rank its shards once their gradient sums have come home)");
  app.add_option("--sleep-after", o.sleep_after,
                 "After this step, put the training state to sleep (every chunk off the device, its buffers freed: "
                 "the device for another job) for --sleep-for seconds, then wake it and go on with the same bits "
                 "(0: never)");
  app.add_option("--sleep-for", o.sleep_for, "Seconds to sleep with --sleep-after");
}

/** How long an idle OpenMP thread spins before it sleeps (GOMP_SPINCOUNT rounds of a pause loop;
 *  libgomp's default is 300,000, about 3 ms). Every kernel and GEMM runs on the OpenMP threads (one
 *  pool: the BLAS is single-threaded, kernels_cpu.hpp), so between a step's hundreds of parallel
 *  loops a short spin saves the wake-up, while a long one takes the core from whichever thread has
 *  the work when cores are shared (the copy engine's, another process's). Measured on 2 cores,
 *  `mini`, side by side (tokens/s): quiet, 3000 rounds 4,243-4,294 vs the default 3,438-4,338 and
 *  passive 3,570-3,663; beside one busy thread, 969-1,767 vs 516-947 and 1,219-1,344. */
inline constexpr const char* openmp_spin_count = "3000";

/** libgomp reads GOMP_SPINCOUNT only when it loads, before main: so train_gpt sets it and
 *  restarts itself once, unless GOMP_SPINCOUNT or OMP_WAIT_POLICY is set already (the user's
 *  choice wins). No result depends on it. */
inline void tune_openmp_waiting(char** argv) {
#if defined(_OPENMP) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
  if (std::getenv("GOMP_SPINCOUNT") != nullptr || std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  if (setenv("GOMP_SPINCOUNT", openmp_spin_count, 1) != 0) return;
  execv("/proc/self/exe", argv);  // returns only if it failed: then run with libgomp's defaults
#else
  (void)argv;
#endif
}

}  // namespace gpt
