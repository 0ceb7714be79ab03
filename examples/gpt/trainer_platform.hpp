// SPDX-License-Identifier: Apache-2.0
// The trainer's platforms: a run's memory spaces, copy engine, kernels and device Adam (the
// simulated device or a CUDA device), the disk tier (--disk-dir), and what they report.
#pragma once

#include "chunked_gpt.hpp"
#include "train_options.hpp"
#if GPT_HAS_CUDA_BACKEND
#include "gpt_backend_cuda.hpp"

#include <chunkstar/cuda/cuda_platform.hpp>
#endif

#include <chunkstar/comm/communicator_ref.hpp>
#include <chunkstar/config.hpp>
#include <chunkstar/core/cpu_isa.hpp>
#include <chunkstar/disk/disk_copy_engine.hpp>
#include <chunkstar/disk/disk_tier.hpp>
#include <chunkstar/disk/owned_disk_tier.hpp>
#if CHUNKSTAR_HAS_URING()
#include <chunkstar/disk/uring_copy_engine.hpp>
#endif
#include <chunkstar/memory/platform.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <span>
#include <string>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace gpt {

using namespace chunkstar;

/** Latency of one copy on the modelled link (--link-bandwidth): a PCIe transfer's setup cost. */
inline constexpr double modelled_copy_latency_s = 10e-6;
/** Bytes of alignment slack the activation estimate adds (each buffer is 64-byte aligned). */
inline constexpr std::size_t activation_slack_bytes = 64 * 1024;

template <class Platform>
struct platform_parts;

/** The simulated device: host memory with a hard capacity and an optional modelled link. */
template <>
struct platform_parts<simulated_platform> {
  using backend = cpu_backend;
  using adam_kernels = host_adam_kernels;
  simulated_device_space device;
  host_space host;
  host_copy_engine copier;
  // Large blocks are charged in 2 MiB pages; with a disk tier, whose host budget counts chunk bytes,
  // every block is charged what it asks for instead.
  platform_parts(int /*gpu*/, std::size_t device_capacity, std::size_t host_capacity, copy_model link,
                 bool exact_host = false)
      : device({.capacity = device_capacity, .link = link, .name = "device"}),
        host({.capacity = host_capacity,
              .large_block_threshold = exact_host ? SIZE_MAX : host_space_options{}.large_block_threshold}),
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
  using backend = cuda_backend;
  using adam_kernels = cuda_adam_kernels;
  int gpu;
  cuda::device_space device;
  cuda::pinned_host_space host;
  cuda::cuda_copy_engine copier;
  platform_parts(int g, std::size_t device_capacity, std::size_t host_capacity, copy_model, bool = false)
      : gpu(g), device({.device = g, .capacity = device_capacity}), host({.capacity = host_capacity}), copier(g) {}
  backend make_backend() { return cuda_backend(gpu); }
  static std::size_t device_free_bytes(int g) { return cuda_memory(g).free; }
  static std::string describe(int g) { return cuda_device_summary(g); }
};
#endif

/** The disk tier of --disk-dir sized @p capacity, or none; a directory that cannot hold it is the
 *  option's fault (exit 2), found before any step. */
inline void open_disk(std::optional<owned_disk_tier>& disk, const train_options& o, std::size_t capacity) {
  if (o.disk_dir.empty()) return;
  try {
    disk.emplace(disk_space_options{.directory = o.disk_dir, .capacity = capacity},
                 disk_engine_kind_named(o.disk_engine), disk_copy_engine_options{.verify_checksums = o.disk_verify});
  } catch (const config_error& e) {  // io_uring asked for where there is none: the option's fault
    throw config_error("--disk-engine " + o.disk_engine + ": " + e.what());
  } catch (const io_error& e) {
    throw config_error("--disk-dir '" + o.disk_dir + "' cannot hold the disk tier's " + format_bytes(capacity) + ": " +
                       e.what());
  }
}

/** A step line's disk part: what the disk holds, and what moved to and from it since @p before. */
template <class Runtime>
std::string disk_step_report(const Runtime& rt, const runtime_stats& before) {
  const runtime_stats& s = rt.stats();
  return " | disk " + format_bytes(rt.disk_chunk_bytes()) + ", moved " +
         format_bytes(s.disk_bytes_moved() - before.disk_bytes_moved()) + ", stall " +
         std::to_string(static_cast<long long>(1e3 * (s.disk_stall_s - before.disk_stall_s))) + " ms";
}

/** The run's memory at these budgets: the platform's spaces (with a modelled link when
 *  --link-bandwidth asks) and the disk tier of --disk-dir, if any. The BLAS's buffers come first: under
 *  ulimit -v it never waits for room. */
template <class Parts>
void open_memory(std::optional<Parts>& memory, std::optional<owned_disk_tier>& disk, const train_options& o, int gpu,
                 std::size_t device_capacity, std::size_t host_capacity, std::size_t disk_capacity) {
  cpu::blas_warm_up();
  const double bandwidth = static_cast<double>(bytes_option("--link-bandwidth", o.link_bandwidth));
  const copy_model link{.bandwidth_bytes_per_s = bandwidth, .latency_s = bandwidth > 0 ? modelled_copy_latency_s : 0.0};
  memory.emplace(gpu, device_capacity, host_capacity, link, !o.disk_dir.empty());
  open_disk(disk, o, disk_capacity);
}

/** A step line's end: the disk's part, when there is a disk tier; the device's peak then starts
 *  again for the next step. */
template <class Runtime, class Device>
std::string end_step_line(std::string line, const std::optional<owned_disk_tier>& disk, const Runtime& rt,
                          const runtime_stats& before, Device& device) {
  if (disk) line += disk_step_report(rt, before);
  device.reset_peak();
  return line;
}

/** The summary's disk line. */
inline void print_disk_summary(const runtime_stats& s, std::size_t host_capacity, std::size_t disk_capacity) {
  std::printf(
      "disk: %s written, %s read (%llu reads, %llu ahead of use), stall %.2f s; peaks: host chunks %s of %s, disk "
      "chunks %s of %s\n",
      format_bytes(s.bytes_to_disk).c_str(), format_bytes(s.bytes_from_disk).c_str(),
      static_cast<unsigned long long>(s.disk_reads), static_cast<unsigned long long>(s.disk_prefetches), s.disk_stall_s,
      format_bytes(s.peak_host_chunk_bytes).c_str(),
      host_capacity == SIZE_MAX ? "unlimited" : format_bytes(host_capacity).c_str(),
      format_bytes(s.peak_disk_chunk_bytes).c_str(), format_bytes(disk_capacity).c_str());
}

/** A GPU's free memory (0 on the simulated device), split between the ranks that share it; the
 *  least any rank saw, after every rank has looked (the allreduce), so no rank's budget counts
 *  memory another has taken since. */
template <class Parts>
std::size_t shared_device_free(const device_choice& device, communicator_ref comm) {
  std::size_t bytes = Parts::device_free_bytes(device.gpu) / static_cast<std::size_t>(device.sharing);
  if (comm.size() > 1 && device.cuda) {
    double seen = static_cast<double>(bytes);
    comm.allreduce(std::span<double>(&seen, 1), reduce_op::min);
    bytes = static_cast<std::size_t>(seen);
  }
  return bytes;
}

/** A device budget above a GPU's free memory is refused before anything is built. */
inline void require_within_free(std::size_t device_capacity, std::size_t device_free) {
  if (device_free > 0 && device_capacity > device_free)
    throw config_error("--device-budget " + format_bytes(device_capacity) + " is more than the GPU's free memory (" +
                       format_bytes(device_free) + "): lower it, or leave it 'auto'");
}

/** One line on the CPU side of the run: the kernels' ISA and the threads. */
inline std::string cpu_summary() {
  std::string s = "cpu: kernels " + cpu_isa_report();
#if defined(_OPENMP)
  s +=
      "; " + std::to_string(omp_get_max_threads()) + " OpenMP threads run every kernel and GEMM (BLAS single-threaded)";
  if (const char* spin = std::getenv("GOMP_SPINCOUNT")) s += std::string("; GOMP_SPINCOUNT=") + spin;
  if (const char* policy = std::getenv("OMP_WAIT_POLICY")) s += std::string("; OMP_WAIT_POLICY=") + policy;
#endif
  return s;
}

}  // namespace gpt
