// SPDX-License-Identifier: Apache-2.0
// bench_overlap: the optimizer step hidden behind backward (chunk_runtime::arm_early_steps, the
// mechanism under chunk_adam::prepare), measured with a modelled device and this machine's real
// host Adam.
//
// The model: --layers layers of one fp32 chunk each (--chunk-mib). The device is modelled: each
// forward scope "computes" for t, each backward scope for 2t, as time on a device stream that takes
// no CPU: the host queues the work and goes on, closing each scope on that stream as a trainer on
// CUDA does (modelled_copy_engine::compute and record), so the runtime's host-side work between
// scopes overlaps the device's as it would there; the host runs up to runtime_options::scopes_ahead
// scopes ahead (--scopes-ahead) and waits otherwise where the runtime does and at the iteration's
// end (sleeping with a tight timer: bench/modelled_wait.hpp); a step on the device takes its bytes
// at --hbm-gbs; early updates run on
// the threads the runtime chooses for each (early_update_threads, chunk_adam::prepare's default:
// all cores once the step has begun or where the last iteration's updates needed them, else all but
// one) or on --early-threads, the step after backward on all; copies take the modelled link's time
// (--link-gbs each way) and no CPU (modelled_copy_engine: no bytes move, the bits are the tests'
// business). The chunks of the last --fractions share of layers step on the host with
// the real SIMD Adam (threads: OpenMP's default). The compute per iteration is calibrated to the host
// Adam of every chunk (the balanced case, where hiding matters most), so compute = host Adam at a
// host fraction of 1. Each forward scope allocates its layer's activations (--activations of a
// chunk's bytes) from the runtime, freed by its backward scope; the device holds every param and
// grad chunk, the state of the chunks stepped there and the activations' peak, one chunk to spare
// (device_for): at a host fraction of 1 no chunk's state fits beside the activations, but the first
// --turn-chunks' fit at the step, once they are gone, and step there (split_placement's turn, as
// auto_placement's); that row runs again without the turn, in the same run.
//
// Per host fraction, in one run, rounds alternating the two modes (3 iterations counted each, after
// one that is not): the iteration with the step
// after backward (today's sequential pass) and with the early steps (each host chunk's update on
// the runtime's worker thread once the trace says its gradient is final); the host Adam the row
// is held against is the median of passes before the rounds and in each (measured in the same
// minutes as the iterations: this VM's memory bandwidth drifts within a run). Reported:
// iteration / max(compute, host Adam, link) for both (the link: the busier way's bytes per
// iteration, measured), and the practicality figure: the all-on-device iteration (host fraction 0,
// overlap off) / this iteration.
// With --disk-dir, each host fraction above 0 runs again with a disk tier there (this machine's real
// disk, through the runtime's disk engine) under a host that holds --disk-host-share of the host-
// stepped chunks' lists: the Adam state of the others lives on the disk. The disk's limits are
// measured first (bench/disk_limits.hpp); the disk resource is the sequential mode's disk bytes per
// iteration at those limits, and the compute of those rows is calibrated to the larger of the host
// Adam of every chunk and that disk time (again the balanced case).
// With --zero-gbs, rows for ZeRO over 2 in-process ranks whose collectives go over a modelled link
// of each speed (bench/zero/modelled_link.hpp), at the --zero-fractions host shares; the link
// resource is a rank's modelled seconds per sequential iteration, and the compute is balanced
// against the larger of it and the host Adam of a rank's share.
//   bench_overlap [--layers 24] [--chunk-mib 8] [--fractions 0,0.25,0.5,0.75,1] [--rounds 5]
//                 [--hbm-gbs 4000] [--link-gbs 55] [--disk-dir DIR] [--disk-host-share 0.5]
//                 [--zero-gbs 1,0.2] [--zero-fractions 0.5,1] [--no-gather-at-step] [--early-threads N]
//                 [--scopes-ahead N|unbounded] [--activations 0.5] [--turn-chunks 2]
//                 [--json FILE]
//                 [--plot FILE.png] [--quick]
#include "../bench_cli.hpp"
#include "../bench_report.hpp"
#include "../disk_limits.hpp"
#include "../zero/modelled_link.hpp"
#include "modelled_copy_engine.hpp"

#include <chunkstar/comm/in_process_group.hpp>

#include <chunkstar/disk/owned_disk_tier.hpp>

#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/optim/adam.hpp>
#include <chunkstar/placement/auto_placement.hpp>
#include <chunkstar/placement/placement_policy.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <optional>
#include <thread>
#include <vector>

using namespace chunkstar;

namespace {

using clock_type = std::chrono::steady_clock;
double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

/** The last `host_fraction` of chunk indices step on the host (their Adam state lives there; their
 *  lists visit the host for the step), the rest on the device, where their state lives; and, as
 *  auto_placement does (its turn), the first `turn_chunks` step on the device whatever the fraction
 *  where the room at the step holds their state. Budgets as auto_placement's (the tide). */
struct split_placement {
  double host_fraction = 1.0;
  std::size_t turn_chunks = auto_placement{}.turn_chunks;
  [[nodiscard]] std::size_t chunk_budget(const placement_inputs& in) const noexcept {
    return auto_placement{}.chunk_budget(in);
  }
  [[nodiscard]] tier optimizer_tier(const placement_inputs& in, std::size_t c) const noexcept {
    const std::size_t turn =
        in.trace_ready
            ? std::min(chunks_of_state_fitting(in, in.non_model_peak_step, auto_placement{}.margin_use), turn_chunks)
            : 0;
    return c < std::max(device_chunks(host_fraction, in.num_chunks), turn) ? tier::device : tier::host;
  }
  /** The chunks whose state lives on the device at @p host_fraction. */
  [[nodiscard]] static std::size_t device_chunks(double host_fraction, std::size_t chunks) noexcept {
    return static_cast<std::size_t>(std::lround((1.0 - host_fraction) * static_cast<double>(chunks)));
  }
  [[nodiscard]] static constexpr std::string_view name() noexcept { return "split"; }
};
static_assert(PlacementPolicy<split_placement>);

using modelled_platform = platform<simulated_device_space, host_space, bench::modelled_copy_engine>;
template <class Comm>
using runtime_over =
    chunk_runtime<fixed_chunk_layout, split_placement, belady_eviction, warmup_tracer, Comm, modelled_platform>;
using link_comm = bench_zero::modelled_link<in_process_communicator>;

struct settings {
  int layers = 24;
  std::size_t chunk_elems = (8u << 20) / 4;
  std::vector<double> fractions = {0, 0.25, 0.5, 0.75, 1};
  int rounds = 5;
  double hbm_bytes_per_s = 4000e9;
  double link_bytes_per_s = 55e9;  // pinned cudaMemcpyAsync on an H200, each way (docs/performance.md)
  std::string disk_dir;            // empty: no disk rows
  double disk_host_share = 0.5;    // of the host-stepped chunks' lists, what the host holds with a disk
  std::size_t disk_limit_bytes = std::size_t{512} << 20;  // the file the disk's limits are measured over
  std::vector<double> zero_gbs;                           // ZeRO rows over 2 ranks at these link speeds
  std::vector<double> zero_fractions = {0.5, 1};          // ... and these host shares
  bool zero_at_step = true;  // sharding_options::gather_at_step (--no-gather-at-step: the first scope gathers)
  std::optional<std::size_t> scopes_ahead;  // runtime_options::scopes_ahead; none: its default
  int early_threads = 0;  // threads of each early update; 0: the runtime's choice (early_update_threads)
  double activations = 0.5;  // each layer's activations, a share of its chunk's bytes (--activations)
  std::size_t turn_chunks = auto_placement{}.turn_chunks;  // split_placement's (--turn-chunks)
};

/** One chunk's Adam update: real on the host; on the device, modelled time added to @p device_s
 *  (28 bytes per parameter: p, g, m, v read; p, m, v written). */
void update(const step_chunk& c, double hbm_bytes_per_s, double* device_s = nullptr, int threads = 0) {
  if (c.where != tier::host) {
    if (device_s) *device_s += static_cast<double>(c.elems) * 28.0 / hbm_bytes_per_s;
    return;
  }
  adam_chunk a;
  a.count = c.elems;
  a.master = static_cast<float*>(c.param);
  a.m = c.momentum;
  a.v = c.variance;
  a.grad = c.grad;
  a.grad_type = dtype::f32;
  a.param_type = dtype::f32;
  adam_step_host(a, adam_hyper{.lr = 1e-4f, .weight_decay = 0.01f},
                 adam_step_args{.step = 1, .grad_scale = 1.0f, .threads = threads});
}

/** The host with a disk tier under it: room for the staging buffers, one host step's lists and
 *  @p share of the host-stepped chunks' four lists (param, grad, m, v); without one, unlimited. */
host_space_options host_for(const settings& s, double host_fraction, bool disk) {
  if (!disk) return {};
  const double host_chunks = std::round(host_fraction * s.layers);
  const auto chunks = static_cast<std::size_t>(static_cast<double>(runtime_options{}.disk_staging_chunks + 5) +
                                               std::ceil(s.disk_host_share * 4 * host_chunks));
  // Otherwise the default host space, a user's: chunks of 2 MiB and up mapped on huge pages and
  // pre-faulted (with 4 KiB pages the Adam ran 20% slower here; chunk sizes are whole 2 MiB).
  return {.capacity = chunks * s.chunk_elems * 4};
}

/** Bytes of one layer's activations: allocated by its forward scope, freed by its backward one. */
std::size_t overlap_activation_bytes(const settings& s) {
  return static_cast<std::size_t>(s.activations * static_cast<double>(s.chunk_elems * 4));
}

/** A device as small as @p host_fraction allows: every param and grad chunk, the Adam state of the
 *  chunks stepped there (split_placement), the activations' peak and one chunk to spare. So at
 *  the host fraction 1 there is no room for any chunk's state beside the activations, but room at
 *  the step, once they are gone (split_placement's turn). */
std::size_t device_for(const settings& s, double host_fraction) {
  const std::size_t chunk = s.chunk_elems * 4, n = static_cast<std::size_t>(s.layers);
  return (2 * n + 2 * split_placement::device_chunks(host_fraction, n) + 1) * chunk + n * overlap_activation_bytes(s);
}

/** @p o with --scopes-ahead where given. */
runtime_options with_scopes_ahead(runtime_options o, const settings& s) {
  if (s.scopes_ahead) o.scopes_ahead = *s.scopes_ahead;
  return o;
}

/** One process's (or one ZeRO rank's, over @p Comm) model and runtime. */
template <class Comm = single_process_communicator>
struct model {
  simulated_device_space dev;
  host_space host;
  bench::modelled_copy_engine copier;
  std::unique_ptr<owned_disk_tier> disk;  // before the runtime, which uses it
  runtime_over<Comm> rt;
  std::vector<param_id> ids;
  std::vector<std::string> names;  // scope names: one per layer, forward and backward alike
  int early_threads;               // 0: the runtime's choice per update
  std::size_t activation_bytes;    // each forward scope's, held till its backward scope
  std::vector<non_model_buffer<std::byte, runtime_over<Comm>>> activations;
  /** On a device of @p device_capacity bytes, split_placement{host_fraction, turn_chunks}. */
  template <class... CommArg>
  model(const settings& s, double host_fraction, std::size_t turn_chunks, std::size_t device_capacity, bool with_disk,
        runtime_options options, CommArg&... comm)
      : dev({.capacity = device_capacity}),
        host(host_for(s, host_fraction, with_disk)),
        copier(copy_model{.bandwidth_bytes_per_s = s.link_bytes_per_s, .latency_s = 10e-6}, s.hbm_bytes_per_s),
        disk(with_disk ? std::make_unique<owned_disk_tier>(
                             disk_space_options{.directory = s.disk_dir,
                                                .capacity = static_cast<std::size_t>(s.layers) * s.chunk_elems * 4 * 5,
                                                .name = "bench_overlap"})
                       : nullptr),
        rt(dev, host, copier, comm..., with_scopes_ahead(options, s),
           fixed_chunk_layout({.chunk_elems = s.chunk_elems}), split_placement{host_fraction, turn_chunks}),
        early_threads(s.early_threads),
        activation_bytes(overlap_activation_bytes(s)),
        activations(static_cast<std::size_t>(s.layers)) {
    if (disk) rt.attach_disk(disk->tier());
    for (int i = 0; i < s.layers; ++i) {
      names.push_back("layer" + std::to_string(i));
      ids.push_back(
          rt.register_param({names.back(), {static_cast<std::int64_t>(s.chunk_elems)}, dtype::f32, tensor_role::weight},
                            [](std::span<float> v) { std::fill(v.begin(), v.end(), 0.01f); }));
    }
    rt.finalize();
  }
  /** The device's compute, queued on its modelled stream (modelled_copy_engine::compute): the
   *  host goes on, as it does on CUDA, and waits only where the runtime does (a scope whose weights
   *  an update or a copy still holds, the step's norm) and at the iteration's end. */
  void compute(double s) { copier.compute(s); }
  /** One iteration; forward scopes compute @p t each, backward ones 2t. Returns its seconds. */
  double iteration(double t, bool overlap, double hbm) {
    const auto t0 = clock_type::now();
    // Early updates on the threads the runtime chooses for each (early_update_threads, as
    // chunk_adam::prepare's default), or on --early-threads.
    if (overlap)
      rt.arm_early_steps(
          {.update = [hbm, fixed = early_threads](
                         const step_chunk& c) { update(c, hbm, nullptr, fixed > 0 ? fixed : c.threads); },
           .undo = {},
           .spends_gradient = true});  // as chunk_adam's without clipping: nothing reads it after
    // Each scope is closed on the device's stream, as a trainer on CUDA closes its scopes: the
    // runtime orders the chunks' later moves after the compute, and the host does not wait for it.
    for (std::size_t i = 0; i < ids.size(); ++i) {
      auto s = rt.forward(names[i], {ids[i]});
      if (activation_bytes > 0) activations[i] = rt.template allocate_buffer<std::byte>(activation_bytes);
      compute(t);
      s.close(host_stream{});
    }
    for (std::size_t i = ids.size(); i-- > 0;) {
      auto s = rt.backward(names[i], {ids[i]});
      s.template grad<float>(ids[i])[0] = 1e-3f;  // the gradient is written (its chunk materialised, as a kernel would)
      compute(2 * t);
      s.close(host_stream{});
      activations[i].reset();  // nothing reads them on the modelled device
    }
    double device_steps = 0;
    rt.step([hbm, &device_steps](const step_chunk& c) { update(c, hbm, &device_steps); });
    compute(device_steps);        // the device's steps run on its stream, after its backward
    copier.synchronize_device();  // the iteration ends when the device's work has (as reading the loss waits)
    return seconds_since(t0);
  }
};

/** The host Adam of @p chunks chunks, each in memory of its own (as the step's are: one chunk's
 *  lists fit a cache, every chunk's do not) and of the kind the runtime's are (a default
 *  host_space's: 2 MiB pages, pre-faulted; with 4 KiB pages the Adam runs up to a fifth slower);
 *  pass() times one update of every chunk. */
class host_adam_probe {
 public:
  host_adam_probe(const settings& s, int chunks) : elems_(s.chunk_elems) {
    lists_.reserve(static_cast<std::size_t>(chunks));
    constexpr std::array<float, 4> initial{0.01f, 1e-3f, 0.0f, 0.0f};  // p, g, m, v
    for (int c = 0; c < chunks; ++c) {
      lists_.push_back({});
      for (std::size_t k = 0; k < initial.size(); ++k) {
        float*& l = lists_.back()[k];
        l = static_cast<float*>(host_.allocate(bytes(), 4096));
        std::fill(l, l + elems_, initial[k]);
      }
    }
  }
  host_adam_probe(const host_adam_probe&) = delete;
  host_adam_probe& operator=(const host_adam_probe&) = delete;
  ~host_adam_probe() {
    for (auto& l : lists_)
      for (float* p : l) host_.deallocate(p, bytes(), 4096);
  }
  [[nodiscard]] bool empty() const noexcept { return lists_.empty(); }
  double pass() {
    const auto t0 = clock_type::now();
    for (auto& l : lists_)
      update(step_chunk{.index = 0,
                        .where = tier::host,
                        .elems = elems_,
                        .param = l[0],
                        .grad = l[1],
                        .momentum = l[2],
                        .variance = l[3],
                        .tensors = {},
                        .slots = {},
                        .specs = {}},
             0);
    return seconds_since(t0);
  }
  /** max(3, --rounds) passes' seconds (none without chunks). */
  std::vector<double> passes(const settings& s) {
    std::vector<double> times;
    for (int r = 0; r < std::max(3, s.rounds) && !empty(); ++r) times.push_back(pass());
    return times;
  }

 private:
  [[nodiscard]] std::size_t bytes() const noexcept { return elems_ * sizeof(float); }
  std::size_t elems_;
  host_space host_;
  std::vector<std::array<float*, 4>> lists_;  // p, g, m, v
};

/** Seconds of the host Adam of @p chunks chunks: the median of max(3, --rounds) passes. */
double host_adam_seconds(const settings& s, int chunks) {
  if (chunks == 0) return 0;
  return median(host_adam_probe(s, chunks).passes(s));
}

struct row {
  double host_fraction = 0, compute_s = 0, host_adam_s = 0, link_s = 0, sequential_s = 0, overlapped_s = 0;
  double sequential_ratio = 0, overlapped_ratio = 0, practicality_sequential = 0, practicality_overlapped = 0;
  double early_steps_per_iteration = 0, device_steps_per_iteration = 0;  // overlapped iterations
  std::size_t turn_chunks = 0;                                           // split_placement's
  bool disk = false;    // a row with the disk tier
  double zero_gbs = 0;  // > 0: a ZeRO row, 2 ranks over a link of this speed (GB/s)
  double disk_s = 0;    // the sequential mode's disk bytes per iteration at the disk's limits
  double disk_mb_sequential = 0, disk_mb_overlapped = 0;  // MB read + written per iteration, each mode
};

/** Bytes to and from the disk so far. */
template <class Runtime>
double disk_bytes(const Runtime& rt) {
  return static_cast<double>(rt.stats().bytes_to_disk + rt.stats().bytes_from_disk);
}

/** Overlapped iterations before any is counted: the host holds more chunks at once with the early
 *  steps than without (lists coming down ahead of their updates), and a fresh host buffer of a
 *  chunk costs tens of milliseconds on these VMs (first touch), once: the rounds measure the
 *  steady state. */
template <class Model>
void warm_overlapped(Model& m, double t, double hbm) {
  for (int w = 0; w < 3; ++w) (void)m.iteration(t, true, hbm);
}

/** What alternate() measured: the counted iterations' seconds per mode, the early steps over the
 *  overlapped ones, the disk bytes each mode moved, and the host Adam's pass in each round. */
struct timed_rounds {
  std::vector<double> seq, ovl, adam;
  double early = 0, ovl_device_steps = 0, seq_disk_bytes = 0, ovl_disk_bytes = 0;
  double seq_link_bytes = 0, ovl_link_bytes = 0;  // the busier way's, summed over the counted iterations
};

/** @p rounds rounds alternating the modes, each 5 iterations of one mode of which the first two are
 *  not counted: they pay for the mode before (early updates run on into the next iteration's
 *  forward; below a disk tier, the Adam state the sequential step sent down to make room comes back
 *  in the second: debug prints showed one list read there per round, 11 MB an iteration counted,
 *  none after), and, with @p adam, a pass of the host Adam in each round: this VM's memory
 *  bandwidth drifts by a quarter within a run, so the resource an iteration is held against is
 *  measured in the same minutes as the iteration. */
template <class Model>
timed_rounds alternate(Model& m, int rounds, double t, double hbm, host_adam_probe* adam = nullptr) {
  timed_rounds out;
  for (int k = 0; k < rounds; ++k)
    for (const bool overlap : {false, true}) {
      // After the sequential iterations: no early update of the last overlapped ones still runs.
      if (overlap && adam) out.adam.push_back(adam->pass());
      for (int i = 0; i < 2; ++i) (void)m.iteration(t, overlap, hbm);
      const auto before = m.rt.stats();
      const double bytes0 = disk_bytes(m.rt);
      for (int i = 0; i < 3; ++i) (overlap ? out.ovl : out.seq).push_back(m.iteration(t, overlap, hbm));
      (overlap ? out.ovl_disk_bytes : out.seq_disk_bytes) += disk_bytes(m.rt) - bytes0;
      if (overlap) out.early += static_cast<double>(m.rt.stats().early_steps - before.early_steps);
      if (overlap) out.ovl_device_steps += static_cast<double>(m.rt.stats().device_steps - before.device_steps);
      (overlap ? out.ovl_link_bytes : out.seq_link_bytes) += static_cast<double>(std::max(
          m.rt.stats().bytes_to_device - before.bytes_to_device, m.rt.stats().bytes_to_host - before.bytes_to_host));
    }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  settings s;
  std::string json, plot;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw config_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--layers") s.layers = std::stoi(next());
    else if (a == "--chunk-mib") s.chunk_elems = static_cast<std::size_t>(std::stod(next()) * 1048576.0 / 4.0);
    else if (a == "--fractions") s.fractions = bench::parse_number_list(a, next());
    else if (a == "--rounds") s.rounds = std::stoi(next());
    else if (a == "--hbm-gbs") s.hbm_bytes_per_s = std::stod(next()) * 1e9;
    else if (a == "--link-gbs") s.link_bytes_per_s = std::stod(next()) * 1e9;
    else if (a == "--disk-dir") s.disk_dir = next();
    else if (a == "--disk-host-share") s.disk_host_share = std::stod(next());
    else if (a == "--zero-gbs") s.zero_gbs = bench::parse_number_list(a, next());
    else if (a == "--zero-fractions") s.zero_fractions = bench::parse_number_list(a, next());
    else if (a == "--no-gather-at-step") s.zero_at_step = false;
    else if (a == "--early-threads") s.early_threads = std::stoi(next());
    else if (a == "--activations") s.activations = std::stod(next());
    else if (a == "--turn-chunks") s.turn_chunks = static_cast<std::size_t>(std::stoul(next()));
    else if (a == "--scopes-ahead") {
      const std::string v = next();
      s.scopes_ahead = v == "unbounded" ? unbounded_scopes_ahead : static_cast<std::size_t>(std::stoul(v));
    } else if (a == "--json") json = next();
    else if (a == "--plot") plot = next();
    else if (a == "--quick") {
      s.layers = 6;
      s.chunk_elems = (1u << 20) / 4;
      s.rounds = 2;
      s.fractions = {0, 1};
      s.disk_limit_bytes = std::size_t{16} << 20;
    } else {
      std::fprintf(stderr,
                   "usage: bench_overlap [--layers N] [--chunk-mib X] [--fractions 0,0.5,1] [--rounds N] "
                   "[--hbm-gbs X] [--link-gbs X] [--disk-dir DIR] [--disk-host-share X] [--zero-gbs 1,0.2] "
                   "[--zero-fractions 0.5,1] [--no-gather-at-step] [--early-threads N] [--scopes-ahead N|unbounded] "
                   "[--activations X] [--turn-chunks N] "
                   "[--json FILE] "
                   "[--plot FILE.png] [--quick]\n");
      return 2;
    }
  }
  if (s.layers < 2 || s.rounds < 1 || s.chunk_elems == 0 || !(s.activations >= 0))
    throw config_error("bench_overlap: --layers >= 2, --rounds >= 1, --chunk-mib > 0 and --activations >= 0, please");

  // The modelled compute: as long as every chunk's host Adam (the balanced case).
  const double compute = host_adam_seconds(s, s.layers);
  const double t = compute / (3.0 * s.layers);
  std::printf(
      "bench_overlap: %d layers x %.1f MiB fp32 chunks; modelled compute %.1f ms per iteration (forward %.2f "
      "ms, backward %.2f ms per layer) = the host Adam of every chunk; device Adam modelled at %.0f GB/s\n\n",
      s.layers, static_cast<double>(s.chunk_elems) * 4 / 1048576.0, compute * 1e3, t * 1e3, 2 * t * 1e3,
      s.hbm_bytes_per_s / 1e9);

  // The disk's limits are measured after the rows without it: its writes' flushing would slow them.
  std::optional<bench::disk_limits> limits;
  const auto measure_disk = [&] {
    owned_disk_tier probe(
        disk_space_options{.directory = s.disk_dir, .capacity = s.disk_limit_bytes, .name = "bench_overlap_limit"});
    limits = bench::measure_disk_limits(probe, s.chunk_elems * 4, s.disk_limit_bytes, 4);
    std::printf("disk %s (%s): write %.2f GB/s, read %.2f GB/s (O_DIRECT %s; the engine %.2f / %.2f)\n\n",
                s.disk_dir.c_str(), probe.uses_uring() ? "io_uring" : "thread pool", limits->write_gbs,
                limits->read_gbs, limits->direct ? "on" : "off", limits->engine_write_gbs, limits->engine_read_gbs);
  };

  std::vector<row> rows;
  double all_on_device = 0;
  // One row: host fraction h, the turn's chunks (split_placement), with or without the disk tier.
  const auto measure_row = [&](double h, std::size_t turn, bool with_disk) {
    model<> m(s, h, turn, device_for(s, h), with_disk, {});
    row r;
    r.disk = with_disk;
    r.host_fraction = h;
    r.turn_chunks = turn;
    r.compute_s = compute;
    double t_row = t;
    const int host_chunks = static_cast<int>(std::lround(h * s.layers));
    host_adam_probe adam(s, host_chunks);
    std::vector<double> adam_s = adam.passes(s);  // before the rounds; then one in each
    // Two iterations record and adopt the trace.
    for (int w = 0; w < 2; ++w) (void)m.iteration(t_row, false, s.hbm_bytes_per_s);
    warm_overlapped(m, t_row, s.hbm_bytes_per_s);
    if (with_disk) {  // the disk's share of a sequential iteration; the compute balanced against it
      const double before = disk_bytes(m.rt);
      const auto read0 = m.rt.stats().bytes_from_disk;
      (void)m.iteration(t_row, false, s.hbm_bytes_per_s);
      const double read = static_cast<double>(m.rt.stats().bytes_from_disk - read0);
      r.disk_s = limits->seconds(read, disk_bytes(m.rt) - before - read);
      r.compute_s = std::max(compute, r.disk_s);
      t_row = r.compute_s / (3.0 * s.layers);
    }
    const timed_rounds got = alternate(m, s.rounds, t_row, s.hbm_bytes_per_s, adam.empty() ? nullptr : &adam);
    adam_s.insert(adam_s.end(), got.adam.begin(), got.adam.end());
    r.host_adam_s = adam_s.empty() ? 0 : median(adam_s);
    // The link: down, each host chunk's weights and gradient, up its weights (full duplex: the
    // busier way counts), the turn's chunks' Adam state both ways instead; measured, the larger of
    // the two modes' bytes per iteration.
    r.link_s = std::max(got.seq_link_bytes / static_cast<double>(got.seq.size()),
                        got.ovl_link_bytes / static_cast<double>(got.ovl.size())) /
               s.link_bytes_per_s;
    r.early_steps_per_iteration = got.early / static_cast<double>(got.ovl.size());
    r.device_steps_per_iteration = got.ovl_device_steps / static_cast<double>(got.ovl.size());
    r.disk_mb_sequential = got.seq_disk_bytes / static_cast<double>(got.seq.size()) / 1e6;
    r.disk_mb_overlapped = got.ovl_disk_bytes / static_cast<double>(got.ovl.size()) / 1e6;
    r.sequential_s = median(got.seq);
    r.overlapped_s = median(got.ovl);
    const double slowest = std::max({r.compute_s, r.host_adam_s, r.link_s, r.disk_s});
    r.sequential_ratio = r.sequential_s / slowest;
    r.overlapped_ratio = r.overlapped_s / slowest;
    if (h == 0 && !with_disk) all_on_device = r.sequential_s;
    rows.push_back(r);
  };
  for (const bool with_disk : {false, true}) {
    if (with_disk && s.disk_dir.empty()) break;
    if (with_disk) measure_disk();
    for (const double h : s.fractions) {
      if (with_disk && h == 0) continue;  // no host-stepped state: nothing for the disk to hold
      measure_row(h, s.turn_chunks, with_disk);
      // Every chunk's state on the host: the same without the turn, in the same run.
      if (h == 1 && s.turn_chunks > 0) measure_row(h, 0, with_disk);
    }
  }
  // ZeRO rows: 2 in-process ranks, collectives over a modelled link (bench/zero/modelled_link.hpp);
  // each rank steps the chunks it owns, inside backward once reduced to it. The link resource is
  // its modelled seconds per sequential iteration; the compute is balanced against the larger of
  // that and the host Adam of a rank's share. A rank's device holds what it gathers with room to
  // spare, so the host fraction is the split's alone (no turn: its state would stay up).
  const std::size_t zero_device = static_cast<std::size_t>(s.layers) * s.chunk_elems * 4 * 6;
  for (const double gbs : s.zero_gbs)
    for (const double h : s.zero_fractions) {
      constexpr int ranks = 2;
      row r;
      r.zero_gbs = gbs;
      r.host_fraction = h;
      const int host_chunks = static_cast<int>(std::lround(h * s.layers));
      r.host_adam_s = host_adam_seconds(s, (host_chunks + ranks - 1) / ranks);
      std::vector<timed_rounds> got(ranks);
      std::vector<double> link_s(ranks, 0.0);
      run_ranks(ranks, [&](in_process_communicator& comm) {
        const auto me = static_cast<std::size_t>(comm.rank());
        link_comm link(comm, {.bandwidth_bytes_per_s = gbs * 1e9, .latency_s = 10e-6});
        model<link_comm> m(s, h, 0, zero_device, false,
                           {.sharding = {.enabled = true, .gather_at_step = s.zero_at_step}}, link);
        double t_rank = t;
        for (int w = 0; w < 2; ++w) (void)m.iteration(t_rank, false, s.hbm_bytes_per_s);
        warm_overlapped(m, t_rank, s.hbm_bytes_per_s);
        const double l0 = link.modelled_seconds();
        (void)m.iteration(t_rank, false, s.hbm_bytes_per_s);
        link_s[me] = link.modelled_seconds() - l0;
        // Every rank balances against the same figures: rank 0's link time (the ranks' are equal
        // within latency) and the share's host Adam.
        comm.barrier();
        const double balanced = std::max(r.host_adam_s, link_s[0]);
        t_rank = balanced / (3.0 * s.layers);
        got[me] = alternate(m, s.rounds, t_rank, s.hbm_bytes_per_s);
      });
      const auto slowest_rank = [&](std::vector<double> timed_rounds::*times) {
        std::vector<double> worst((got[0].*times).size(), 0.0);
        for (const auto& per : got)
          for (std::size_t i = 0; i < (per.*times).size(); ++i) worst[i] = std::max(worst[i], (per.*times)[i]);
        return median(worst);
      };
      r.link_s = link_s[0];
      r.compute_s = std::max(r.host_adam_s, link_s[0]);
      r.sequential_s = slowest_rank(&timed_rounds::seq);
      r.overlapped_s = slowest_rank(&timed_rounds::ovl);
      r.early_steps_per_iteration = (got[0].early + got[1].early) / static_cast<double>(got[0].ovl.size());
      const double slowest = std::max({r.compute_s, r.host_adam_s, r.link_s});
      r.sequential_ratio = r.sequential_s / slowest;
      r.overlapped_ratio = r.overlapped_s / slowest;
      rows.push_back(r);
    }
  std::printf("%-9s %4s %10s %11s %8s %8s %14s %14s %9s %9s %8s %8s %7s %7s\n", "host", "turn", "compute ms",
              "host Adam ms", "link ms", "disk ms", "sequential ms", "overlapped ms", "seq/max", "ovl/max", "pract seq",
              "pract ovl", "early", "device");
  std::vector<bench::json_record> records;
  std::string dat, disk_dat, no_turn_dat;
  for (auto& r : rows) {
    if (all_on_device > 0 && !r.disk && r.zero_gbs == 0) {
      r.practicality_sequential = all_on_device / r.sequential_s;
      r.practicality_overlapped = all_on_device / r.overlapped_s;
    }
    std::printf("%-9s %4zu %10.1f %11.1f %8.1f %8.1f %14.1f %14.1f %9.3f %9.3f %8.2f %8.2f %7.1f %7.1f\n",
                (std::to_string(r.host_fraction).substr(0, 4) + (r.disk ? " disk" : "") +
                 (r.zero_gbs > 0 ? " zero " + std::to_string(r.zero_gbs).substr(0, 3) : ""))
                    .c_str(),
                r.turn_chunks, r.compute_s * 1e3, r.host_adam_s * 1e3, r.link_s * 1e3, r.disk_s * 1e3,
                r.sequential_s * 1e3, r.overlapped_s * 1e3, r.sequential_ratio, r.overlapped_ratio,
                r.practicality_sequential, r.practicality_overlapped, r.early_steps_per_iteration,
                r.device_steps_per_iteration);
    records.push_back(bench::json_record()
                          .num("host_fraction", r.host_fraction)
                          .num("compute_s", r.compute_s)
                          .num("host_adam_s", r.host_adam_s)
                          .num("link_s", r.link_s)
                          .num("sequential_s", r.sequential_s)
                          .num("overlapped_s", r.overlapped_s)
                          .num("sequential_over_slowest", r.sequential_ratio)
                          .num("overlapped_over_slowest", r.overlapped_ratio)
                          .num("practicality_sequential", r.practicality_sequential)
                          .num("practicality_overlapped", r.practicality_overlapped)
                          .num("early_steps_per_iteration", r.early_steps_per_iteration)
                          .num("device_steps_per_iteration", r.device_steps_per_iteration)
                          .num("turn_chunks", static_cast<double>(r.turn_chunks))
                          .num("activation_share", s.activations)
                          .num("disk", r.disk ? 1 : 0)
                          .num("zero_link_gbs", r.zero_gbs)
                          .num("disk_s", r.disk_s)
                          .num("disk_mb_sequential", r.disk_mb_sequential)
                          .num("disk_mb_overlapped", r.disk_mb_overlapped)
                          .num("disk_read_limit_gbs", limits ? limits->read_gbs : 0)
                          .num("disk_write_limit_gbs", limits ? limits->write_gbs : 0)
                          .num("layers", s.layers)
                          .num("chunk_bytes", static_cast<double>(s.chunk_elems) * 4)
                          .num("rounds", s.rounds));
    if (r.zero_gbs > 0) continue;  // the table and JSON only
    if (r.turn_chunks == 0 && s.turn_chunks > 0) {  // the comparison without the turn: points of its own
      no_turn_dat += std::to_string(r.host_fraction) + " " + std::to_string(r.overlapped_ratio) + "\n";
      continue;
    }
    (r.disk ? disk_dat : dat) += std::to_string(r.host_fraction) + " " + std::to_string(r.sequential_ratio) + " " +
                                 std::to_string(r.overlapped_ratio) + "\n";
  }
  if (disk_dat.empty()) disk_dat = "0 NaN NaN\n";
  if (no_turn_dat.empty()) no_turn_dat = "0 NaN\n";
  std::printf(
      "\nseq/max, ovl/max: the iteration over max(compute, host Adam, link, disk), the step after backward and "
      "inside it (target <= 1.10; <= 1.15 with the disk); turn: the first chunks stepped on the device where the "
      "room at the step holds their state (split_placement, as auto_placement); device: steps there per overlapped "
      "iteration; pract: the all-on-device iteration over this one; disk MB per iteration, sequential / overlapped:");
  for (const auto& r : rows)
    if (r.disk) std::printf(" %.2f: %.0f / %.0f;", r.host_fraction, r.disk_mb_sequential, r.disk_mb_overlapped);
  std::printf("\n");
  if (!json.empty()) bench::write_json(json, records);
  if (!plot.empty())
    return bench::run_gnuplot(
        "bench_overlap", plot,
        "set title 'Iteration over max(compute, host Adam, link, disk): the step after backward and inside "
        "it'\nset xlabel 'share of chunks whose Adam state lives on the host'\nset ylabel 'iteration / slowest "
        "resource'\nset yrange [0:*]\nset key top left\nset grid\nplot '@DIR@/overlap.dat' using "
        "1:2 with linespoints lw 2 title 'step after backward', '' using 1:3 with linespoints "
        "lw 2 title 'step inside backward (early steps)', '@DIR@/disk.dat' using 1:2 with linespoints lw 2 dt 3 "
        "title 'after backward, disk tier', '' using 1:3 with linespoints lw 2 dt 3 title 'inside backward, disk "
        "tier', '@DIR@/no_turn.dat' using 1:2 with points pt 6 ps 2 title 'inside backward, no turn (disk too)', 1.10 "
        "with lines dt 2 title 'target 1.10'\n",
        {{"overlap.dat", dat}, {"disk.dat", disk_dat}, {"no_turn.dat", no_turn_dat}}, "1000,600");
  return 0;
}
