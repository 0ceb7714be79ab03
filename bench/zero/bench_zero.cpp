// SPDX-License-Identifier: Apache-2.0
// bench_zero: ZeRO data parallelism over chunks, N = 1..4 in-process ranks (one thread each).
//
// The trainer is train_gpt's assembly (chunked_gpt over a chunk runtime, fp32, AdamW with clipping)
// with sharding on when N > 1; the global batch is fixed and split over the ranks (each rank trains
// batch/N sequences and steps with micro_batches = N, as train_gpt --parallel zero does). Each rank
// thread runs its OpenMP kernels on one thread (omp_set_num_threads(1)), so N ranks use N threads.
//
//   memory:  each rank's model-data peak (runtime_stats::peak_model_bytes: payloads on every tier
//            plus gather/reduce buffers), max over the ranks, against all model data, its 1/N share
//            (whole chunk groups: the chunk count is padded to a multiple of N) and a full replica.
//            Self-check: peak <= share + the rank's peak gather/reduce buffer bytes, both in the
//            steady state (stats reset after the warm-up) and over the whole run (the first,
//            untraced iteration decides finality from use counts, gradient_final_untraced, and
//            may hold its buffers a little differently). The
//            steady-state buffer peak must equal the theory's (below) exactly.
//   comm:    bytes sent + received by one rank in one steady-state iteration (comm_stats deltas),
//            against the theory computed from the chunk plan alone: the scopes chunked_gpt opens
//            (forward embedding, blocks, head; backward head, blocks, embedding) replayed through
//            the gather/release/reduce rules of zero/shard_manager.hpp give the gathers G and
//            reductions R per iteration; each rank then sends and receives
//            (N-1) x (G x param chunk bytes + R x grad chunk bytes + 8 x (padded chunks + 5 N)) bytes (the
//            last term: the norm's allreduce of one double per chunk; 5 N more: each rank's step arguments,
//            comm/step_agreement.hpp). Self-check: equality, on
//            every rank and every measured iteration, and G, R equal the runtime's own counts. The
//            same replay gives the peak of group buffers (N chunks each) plus reduce scratch. It
//            includes the gathers started a scope ahead (gather_plan.hpp: all of them at the
//            timing runs' ample budget) and, once, the ranks' agreement on them (an allreduce of a
//            double per moment in the first traced iteration). --memory-saving replays the mode's
//            rules instead: one chunk per unit, broadcast from its owner and reduced to it, so the
//            bytes differ per rank (the owner of a chunk sends (N-1) chunks, the others one).
//   time:    every collective runs through modelled_link (modelled_link.hpp), which sleeps each one
//            out to latency + bytes / bandwidth. iteration_s: forward + backward + step, max over
//            the ranks, median over the measured iterations; compute_s: the same run with the link
//            infinitely fast (no sleep); with --rounds R the two runs alternate R times each and
//            both medians are over every round's iterations (a drift of the machine's speed then
//            meets both); comm_s: the modelled seconds of one iteration;
//            overlap = iteration_s / max(compute_s, comm_s). The runtime overlaps each
//            reduce-scatter with the scope after it and each allgather but an iteration's first with
//            the scope before it (--no-gather-ahead: synchronous), so expect between 1 and
//            (compute + comm) / max.
//   scale:   the largest model of --scale-preset's family that trains --scale-steps steps on N
//            ranks, each with --device-budget and --host-budget, against limit_params =
//            N (device + host) / 16 bytes per parameter (fp32 param, grad, momentum, variance:
//            bench_scale's definition). The family grows by width (--scale-grow width, the default):
//            the preset's head count (4 for tiny) at --scale-layers layers (64), width 4, 8, 12, ...,
//            binary-searched for the widest that trains; --scale-grow depth searches the preset's
//            depth at its width instead (the old figure: with --no-chunk-cap it repeats exactly).
//            Width, because ZeRO shards model data: a depth-grown tiny family reaches the limit's
//            parameter count only at ~200 layers, whose activations (13 MiB per micro-batch) fill
//            the 16 MiB device before the model data does. The chunk layout is train_gpt's with its
//            largest chunk capped (scale_layout: a group is N chunks, so at N = 4 the buffers a scope
//            needs, not the share, decide what fits). Two steps by default: the first is the
//            untraced one, the second the traced steady state (its comm bytes are checked as above).
//   Defaults: preset mini, global batch 12 x 64 (12 splits over 1..4 ranks), 2 + 31 iterations,
//            about 70 s on 2 cores; scale over the tiny family by width at 64 layers at 16 MiB +
//            64 MiB per rank, about 20 s (each trial trains 2 steps, 1-2 s at ~15 M parameters).
//
// Losses: printed per step and N. ZeRO is bit-identical to a rank-order reference at each N (the
// `zero` test); across N the summation order changes, so the losses differ in their last bits.
// Within one N the compute-only and the modelled run must give the same bits (a self-check):
// nothing the runtime decides depends on timing.
#include "../bench_cli.hpp"
#include "../e2e/e2e_support.hpp"
#include "modelled_link.hpp"

#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/eviction/belady.hpp>
#include <chunkstar/placement/auto_placement.hpp>
#include <chunkstar/placement/static_placement.hpp>

#include <omp.h>

#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <thread>

using namespace chunkstar;
using bench_zero::link_model;
using bench_zero::modelled_link;

namespace {

constexpr double bytes_per_param = 16;  // fp32 param, grad, momentum, variance (bench_scale)
// --scale-layers: the width family's depth. A GPT block is about 12 C^2 parameters and its largest
// tensor 4 C^2 (the MLP's); a chunk holds at least that tensor, so a ZeRO group (N chunks) is at
// least N/3 of a block (4/3 at N = 4), and at a given model size a block is 1/depth of it: the
// shallower the family, the larger the gather/reduce buffers a scope needs. Measured at
// the default budgets (16 MiB + 64 MiB per rank, 1 x 16 tokens; ratio = largest / limit, N = 1..4):
//   4 layers: 0.894 0.283 0.177 0.107 (chunks 0.7-1.5 MiB: the buffers, 14 MiB, fill the device)
//   32:       0.936 0.903 0.836 0.574      48: 0.948 0.912 0.856 0.676
//   64:       0.956 0.932 0.914 0.726      80: 0.969 0.929 0.890 0.759
//   96:       0.920 0.944 0.930 0.748     128: 0.941 0.953 0.913 0.684
// Shallower, the buffers crowd the device out; deeper, the activations do (they grow as depth x
// width, 9 MiB at 64 layers x width 140); 64 is the best compromise across N.
constexpr int default_scale_layers = 64;

struct options {
  std::string mode = "all";  // all | timing | scale
  std::string preset = "mini";
  std::size_t batch = 12, seq = 64;  // the global batch: 12 splits evenly over 1, 2, 3 and 4 ranks
  std::vector<int> ranks{1, 2, 3, 4};
  int iterations = 31, warmup = 2;
  int rounds = 1;  // timing: compute-only and modelled-link runs alternating, this many of each
  double bandwidth = 1e9, latency = 10e-6;
  bool keep_gathered = false;
  bool gather_ahead = true;
  bool gather_at_step = true;  // the step gathers the next iteration's first groups (sharding_options)
  int gather_depth = sharding_options{}.gather_depth;
  bool memory_saving = false;
  std::string scale_preset = "tiny";
  std::string scale_grow = "width";    // width | depth: what the scale family grows by
  int scale_layers = 0;                // the width family's depth (0: default_scale_layers)
  double scale_buffer_fraction = 0.5;  // the chunk cap: predicted gather/reduce buffers <= this x the device budget
  bool chunk_cap = true;               // false: train_gpt's layout as it is (the old figure)
  std::size_t device_budget = std::size_t{16} << 20, host_budget = std::size_t{64} << 20;
  std::size_t scale_batch = 1, scale_seq = 16;  // per rank
  int scale_steps = 2;
  bool quick = false;
  std::string json, plot;
};

void usage() {
  std::printf(
      "usage: bench_zero [--mode all|timing|scale] [--preset mini] [--batch 12 (global)] [--seq 64] [--ranks 1,2,3,4]\n"
      "                  [--iterations 31] [--warmup 2] [--rounds 1] [--bandwidth 1e9 (B/s)] [--latency 10e-6 (s)] "
      "[--keep-gathered]\n"
      "                  [--no-gather-ahead] [--gather-depth 2] [--no-gather-at-step] [--memory-saving]\n"
      "                  [--scale-preset tiny] [--scale-grow width|depth] [--scale-layers 64 (width: the depth)]\n"
      "                  [--scale-buffer-fraction 0.5] [--no-chunk-cap]\n"
      "                  [--device-budget 16MiB] [--host-budget 64MiB (per rank)]\n"
      "                  [--scale-batch 1] [--scale-seq 16 (per rank)] [--scale-steps 2]\n"
      "                  [--quick] [--json FILE] [--plot FILE.png]\n"
      "timing: per N, model-data peak per rank, comm bytes per iteration against the theory, iteration time on a\n"
      "modelled link (about 70 s). scale: the largest model of the scale preset's family that trains on N ranks with\n"
      "the given per-rank budgets, against N (device + host) / 16 B (about 20 s): the family grows by width (the\n"
      "preset's heads, width in steps of the head count) at --scale-layers layers, or with --scale-grow depth by\n"
      "depth at the preset's width (the old figure). Chunks: train_gpt's layout with the largest size capped so the\n"
      "plan minimises share + predicted gather/reduce buffers, buffers within --scale-buffer-fraction x the device\n"
      "(--no-chunk-cap: train_gpt's layout as it is). --quick: preset tiny, batch 12 x 16, 1 + 2 iterations, scale at\n"
      "2 MiB + 4 MiB per rank and 8 layers (about a second in all).\n");
}

options parse(int argc, char** argv) {
  options o;
  bool preset_set = false, batch_set = false, seq_set = false, its_set = false, warmup_set = false, dev_set = false,
       host_set = false, steps_set = false, layers_set = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw config_error(a + " needs a value (bench_zero --help)");
      return argv[++i];
    };
    auto number = [&](const std::string& v) {
      const auto x = bench::parse_number_list(a, v);
      if (x.size() != 1 || !(x[0] > 0)) throw config_error(a + " takes one positive number, got '" + v + "'");
      return x[0];
    };
    auto count = [&](const std::string& v) {
      const double x = number(v);
      if (x != std::floor(x)) throw config_error(a + " takes one positive integer, got '" + v + "'");
      return static_cast<std::size_t>(x);
    };
    auto bytes = [&](const std::string& v) {
      const auto b = parse_bytes(v);
      if (!b || *b == 0) throw config_error(a + " '" + v + "': write a size like 16MiB or 1.5GiB");
      return *b;
    };
    if (a == "--mode") o.mode = value();
    else if (a == "--preset") o.preset = value(), preset_set = true;
    else if (a == "--batch") o.batch = count(value()), batch_set = true;
    else if (a == "--seq") o.seq = count(value()), seq_set = true;
    else if (a == "--ranks") {
      o.ranks.clear();
      for (double x : bench::parse_number_list(a, value())) {
        if (x < 1 || x > 64 || x != std::floor(x)) throw config_error("--ranks: integers in [1, 64], comma-separated");
        o.ranks.push_back(static_cast<int>(x));
      }
    } else if (a == "--iterations") o.iterations = static_cast<int>(count(value())), its_set = true;
    else if (a == "--warmup") o.warmup = static_cast<int>(count(value())), warmup_set = true;
    else if (a == "--rounds") o.rounds = std::max(1, static_cast<int>(count(value())));
    else if (a == "--bandwidth") o.bandwidth = number(value());
    else if (a == "--latency") {
      const auto x = bench::parse_number_list(a, value());
      if (x.size() != 1 || x[0] < 0) throw config_error("--latency takes one number >= 0 (seconds)");
      o.latency = x[0];
    } else if (a == "--keep-gathered") o.keep_gathered = true;
    else if (a == "--no-gather-ahead") o.gather_ahead = false;
    else if (a == "--no-gather-at-step") o.gather_at_step = false;
    else if (a == "--gather-depth") o.gather_depth = static_cast<int>(count(value()));
    else if (a == "--memory-saving") o.memory_saving = true;
    else if (a == "--scale-preset") o.scale_preset = value();
    else if (a == "--scale-grow") o.scale_grow = value();
    else if (a == "--scale-layers") o.scale_layers = static_cast<int>(count(value())), layers_set = true;
    else if (a == "--no-chunk-cap") o.chunk_cap = false;
    else if (a == "--scale-buffer-fraction") {
      const double f = number(value());
      if (f > 1) throw config_error("--scale-buffer-fraction takes a number in (0, 1]");
      o.scale_buffer_fraction = f;
    } else if (a == "--device-budget") o.device_budget = bytes(value()), dev_set = true;
    else if (a == "--host-budget") o.host_budget = bytes(value()), host_set = true;
    else if (a == "--scale-batch") o.scale_batch = count(value());
    else if (a == "--scale-seq") o.scale_seq = count(value());
    else if (a == "--scale-steps") o.scale_steps = static_cast<int>(count(value())), steps_set = true;
    else if (a == "--quick") o.quick = true;
    else if (a == "--json") o.json = value();
    else if (a == "--plot") o.plot = value();
    else if (a == "--help" || a == "-h") {
      usage();
      std::exit(0);
    } else throw config_error("unknown option '" + a + "' (bench_zero --help)");
  }
  if (o.mode != "all" && o.mode != "timing" && o.mode != "scale")
    throw config_error("--mode: all, timing or scale, got '" + o.mode + "'");
  if (o.scale_grow != "width" && o.scale_grow != "depth")
    throw config_error("--scale-grow: width or depth, got '" + o.scale_grow + "'");
  if (o.scale_layers > gpt::max_layers)
    throw config_error("--scale-layers: at most " + std::to_string(gpt::max_layers));
  if (o.scale_layers == 0) o.scale_layers = default_scale_layers;
  if (o.quick) {  // the CTest smoke run: every part, small
    if (!preset_set) o.preset = "tiny";
    if (!batch_set) o.batch = 12;
    if (!seq_set) o.seq = 16;
    if (!its_set) o.iterations = 2;
    if (!warmup_set) o.warmup = 1;
    if (!dev_set) o.device_budget = std::size_t{2} << 20;
    if (!host_set) o.host_budget = std::size_t{4} << 20;
    if (!steps_set) o.scale_steps = 2;
    if (!layers_set) o.scale_layers = 8;  // a 2 MiB device: at 64 layers the activations alone are 1.6 MiB of it
  }
  // The first iteration runs without a trace (every group released at once, every reduction before
  // the step): the theory is of the traced iterations, so at least one warm-up iteration.
  if (o.warmup < 1) throw config_error("--warmup must be >= 1 (the first iteration is the untraced one)");
  for (int n : o.ranks)
    if (o.batch % static_cast<std::size_t>(n) != 0)
      throw config_error("--batch " + std::to_string(o.batch) + " (the global batch) does not split evenly over " +
                         std::to_string(n) + " ranks: pick a multiple of every --ranks value (12 for 1,2,3,4)");
  return o;
}

// ------------------------------------------------------------------------------------------------
// The theory of one steady-state iteration, from the chunk plan and the model's scope sequence only.

struct comm_theory {
  std::uint64_t gathers = 0, reductions = 0, chunks = 0;  // per iteration; chunks: padded count (the norm's doubles)
  std::uint64_t gathers_ahead = 0;                   // of the gathers, those started while the scope before computes
  std::uint64_t kept = 0;          // groups kept, not gathered again: their next use within the look-ahead
  std::uint64_t next_gathers = 0;  // groups the step gathers for the next iteration's first scope (budget allowing)
  std::uint64_t bytes_sent = 0, bytes_received = 0;  // per rank (equal in the group mode)
  std::uint64_t agreement_bytes_each_way =
      0;  // once, in the first traced iteration: the ranks agree on the gathers ahead
          // (an allreduce of a double per moment of the trace)
  std::uint64_t peak_collective_bytes =
      0;  // most bytes in group buffers (N chunks each) and reduce scratch (one chunk) at once
};

/** Replays the scopes chunked_gpt opens in one iteration through shard_manager.hpp's rules: a scope
 *  gathers each group of its parameter chunks that is not gathered; after it closes, a gathered
 *  group is released unless one of its chunks is used again by the very next scope (with keep:
 *  by any later scope of the iteration); a gradient group is attached at its first backward use
 *  and reduce-scattered once none of its gradient chunks is used again in the iteration. With
 *  @p ahead (the budget holds them all), once a scope is open the groups the next scope needs and
 *  that are not gathered are gathered then; and at @p depth > 1 a group is kept instead of released
 *  where its next use is at most depth scopes after the next one (gather_plan.hpp's keep: the
 *  look-ahead would gather it again before then). */
comm_theory zero_theory(const gpt::gpt_config& c, const chunk_plan& plan, int ranks, bool keep, bool ahead,
                        std::size_t param_chunk_bytes, std::size_t grad_chunk_bytes, bool msc = false, int rank = 0,
                        int depth = 1) {
  comm_theory t;
  if (ranks <= 1) return t;  // sharding is off at one rank: no collective at all
  ahead = ahead && !msc;     // the memory-saving mode gathers nothing ahead
  // The unit gathered and reduced together: a group of N chunks, or (memory-saving mode) one chunk,
  // broadcast from its owner (which holds no buffer for it) and reduced to its owner.
  const std::size_t n = static_cast<std::size_t>(ranks), u = msc ? 1 : n, P = plan.num_chunks, groups = P / u;
  const auto owns = [&](std::size_t chunk) { return chunk % n == static_cast<std::size_t>(rank); };
  // The scopes chunked_gpt opens (gpt::forward_scopes): forward's in order, then backward's in reverse.
  const auto scopes = gpt::forward_scopes(c);
  std::vector<std::vector<std::size_t>> moments(scopes.begin(), scopes.end());
  const std::size_t first_backward = moments.size();
  moments.insert(moments.end(), scopes.rbegin(), scopes.rend());
  const std::size_t M = moments.size();
  std::vector<std::vector<bool>> uses(M, std::vector<bool>(P, false));  // uses[m][chunk]
  for (std::size_t m = 0; m < M; ++m)
    for (std::size_t p : moments[m]) uses[m][plan.slots[p].chunk] = true;
  constexpr std::size_t none = std::numeric_limits<std::size_t>::max();
  // next[m][chunk]: the first moment after m that uses the chunk's parameters (any scope) or its
  // gradients (backward scopes only); none when the iteration has no such use.
  std::vector<std::vector<std::size_t>> next_param(M, std::vector<std::size_t>(P, none)), next_grad = next_param;
  for (std::size_t m = M - 1; m-- > 0;)
    for (std::size_t chunk = 0; chunk < P; ++chunk) {
      next_param[m][chunk] = uses[m + 1][chunk] ? m + 1 : next_param[m + 1][chunk];
      next_grad[m][chunk] = uses[m + 1][chunk] && m + 1 >= first_backward ? m + 1 : next_grad[m + 1][chunk];
    }
  auto next_use = [&](std::size_t chunk, std::size_t m, bool grads) {
    return (grads ? next_grad : next_param)[m][chunk];
  };
  std::vector<bool> gathered(groups, false), attached(groups, false);
  std::vector<std::size_t> hold(groups, none);  // kept (not released) until this moment
  const std::uint64_t group_g = u * grad_chunk_bytes;
  const auto group_p = [&](std::size_t g) -> std::uint64_t { return msc && owns(g) ? 0 : u * param_chunk_bytes; };
  const std::uint64_t result = msc ? 0 : grad_chunk_bytes;  // the owner's result buffer (the mode's reduce is in place)
  std::uint64_t live = 0;                                   // bytes in group buffers now
  std::uint64_t sent = 0, received = 0;
  const auto gather_bytes = [&](std::size_t g) {
    if (!msc) sent += (n - 1) * param_chunk_bytes, received += (n - 1) * param_chunk_bytes;
    else if (owns(g)) sent += (n - 1) * param_chunk_bytes;
    else received += param_chunk_bytes;
  };
  // A reduce-scatter starts when a scope closes with its group final (or before the step) and
  // holds its group buffer and the owner's result chunk until the next scope has closed (or the
  // step begins): it runs while that scope computes.
  std::vector<std::size_t> in_flight;
  auto start = [&](std::size_t g) {
    live += result;
    t.peak_collective_bytes = std::max(t.peak_collective_bytes, live);
    in_flight.push_back(g);
    ++t.reductions;
    if (!msc) sent += (n - 1) * grad_chunk_bytes, received += (n - 1) * grad_chunk_bytes;
    else if (owns(g)) received += (n - 1) * grad_chunk_bytes;
    else sent += grad_chunk_bytes;
  };
  auto finish = [&] {
    for (std::size_t g : in_flight) attached[g] = false, live -= group_g + result;
    in_flight.clear();
  };
  auto reducing = [&](std::size_t g) { return std::find(in_flight.begin(), in_flight.end(), g) != in_flight.end(); };
  for (std::size_t m = 0; m < M; ++m) {
    for (std::size_t chunk = 0; chunk < P; ++chunk) {
      if (!uses[m][chunk]) continue;
      const std::size_t g = chunk / u;
      if (!gathered[g]) gathered[g] = true, ++t.gathers, live += group_p(g), gather_bytes(g);
      if (m >= first_backward && !attached[g]) attached[g] = true, live += group_g;
    }
    for (std::size_t chunk = 0; ahead && m + 1 < M && chunk < P; ++chunk)
      if (uses[m + 1][chunk] && !gathered[chunk / u])
        gathered[chunk / u] = true, ++t.gathers, ++t.gathers_ahead, live += group_p(chunk / u), gather_bytes(chunk / u);
    t.peak_collective_bytes = std::max(t.peak_collective_bytes, live);
    finish();  // the scope of moment m has closed
    for (std::size_t g = 0; g < groups; ++g) {
      if (attached[g] && !reducing(g)) {
        bool final = true;
        for (std::size_t k = g * u; k < g * u + u; ++k) final = final && next_use(k, m, true) == none;
        if (final) start(g);
      }
      if (gathered[g] && (hold[g] == none || hold[g] <= m)) {
        hold[g] = none;
        std::size_t nu = none;
        for (std::size_t k = g * u; k < g * u + u; ++k) nu = std::min(nu, next_use(k, m, false));
        // Released, unless the next scope's look-ahead (depth scopes) reaches its next use: then kept.
        if (nu != none && nu > m + 1 && ahead && depth > 1 && nu <= m + 1 + static_cast<std::size_t>(depth))
          hold[g] = nu, ++t.kept;
        else if (nu == none || (!keep && nu > m + 1)) gathered[g] = false, live -= group_p(g);
      }
    }
  }
  for (std::size_t g = 0; g < groups; ++g) {  // before the step, in group order
    if (attached[g] && !reducing(g)) start(g);
    if (gathered[g]) gathered[g] = false, live -= group_p(g);
  }
  finish();
  t.chunks = P;
  // And the norm: an allreduce of a double per chunk; the step's arguments: one of 5 per rank (step_agreement).
  t.bytes_sent = sent + (n - 1) * (t.chunks + 5 * n) * sizeof(double);
  t.bytes_received = received + (n - 1) * (t.chunks + 5 * n) * sizeof(double);
  // A double per moment of the trace: the scopes, and the step's, one per chunk this rank steps.
  if (ahead) t.agreement_bytes_each_way = (n - 1) * (M + P / n) * sizeof(double);
  // The step's gathers for the next iteration: the groups of its first scope.
  std::vector<bool> first(groups, false);
  for (std::size_t chunk = 0; ahead && chunk < P; ++chunk)
    if (uses[0][chunk] && !first[chunk / u]) first[chunk / u] = true, ++t.next_gathers;
  return t;
}

/** Model data of @p c over every list with the chunk count padded to whole groups of @p ranks. */
std::size_t padded_model_bytes(const searched_chunk_layout& layout, const gpt::gpt_config& c, int ranks) {
  chunk_plan plan = layout.plan(gpt::param_specs(c));
  plan.num_chunks = shard_map{ranks, 0}.padded(plan.num_chunks);
  plan.chunk_tensors.resize(plan.num_chunks);
  std::size_t b = 0;
  for (const auto& l : make_chunk_lists(plan, {.param_type = dtype::f32}))
    if (!l.aliases_param) b += l.chunk_bytes * l.num_chunks;
  return b;
}

// ------------------------------------------------------------------------------------------------
// One group of N ranks training the GPT.

using link_comm = modelled_link<in_process_communicator>;
static_assert(Communicator<link_comm>, "modelled_link must be a Communicator to back a chunk_runtime");

/** What one rank recorded. Per-iteration vectors hold every iteration, warm-up included. */
struct rank_out {
  std::vector<double> iter_s, comm_model_s, losses;
  std::vector<comm_stats> comm;                    // deltas
  std::vector<std::uint64_t> gathers, reductions;  // deltas
  std::vector<std::uint64_t> at_step;              // deltas: the step's gathers for the next iteration
  std::vector<std::uint64_t> kept;                 // deltas: groups kept instead of gathered again
  runtime_stats stats;                             // at the end, since the reset after the warm-up (steady-state peaks)
  runtime_stats warm;  // at the end of the warm-up, before that reset (its peaks: the untraced first iteration)
  std::uint64_t bytes_moved_measured = 0;  // host <-> device chunk bytes over the measured iterations
  std::size_t model_bytes = 0, device_capacity = 0, param_chunk_bytes = 0, num_chunks = 0;
  comm_theory theory;
  std::string error;  // the runtime's invariant violations at the end (empty: none)
};

struct train_setup {
  gpt::gpt_config config;
  std::size_t batch_per_rank = 1, seq = 16;
  int steps = 1;
  int warmup = 0;  // iterations before the stats are reset (peaks then restart: the steady state)
  link_model link;
  bool keep_gathered = false;
  bool gather_ahead = true;
  bool gather_at_step = true;  // the step gathers the next iteration's first groups (sharding_options)
  int gather_depth = sharding_options{}.gather_depth;         // timing runs: room for depth - 1 more groups
  bool memory_saving = false;                                 // ZeRO's memory-saving mode: chunk by chunk
  std::size_t device_capacity = 0, host_capacity = SIZE_MAX;  // 0: sized per N (timing runs)
  bool scale = false;                // auto placement + Belady at the given budgets (else everything on the device)
  searched_layout_options layout{};  // scale runs: the chunk layout (scale_layout: train_gpt's, chunk size capped)
};

/** The AdamW of bench_cpu_trainer and train_gpt (no decay on biases and norms, clipping at 1). */
chunk_adam<> make_adam() {
  return chunk_adam<>({.hyper = {.beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = e2e::weight_decay},
                       .max_grad_norm = e2e::max_grad_norm},
                      param_groups::with_default_decay(e2e::weight_decay));
}

template <class Runtime>
void train_rank(const train_setup& s, const gpt::text_data& data, link_comm& link, int ranks, rank_out& me,
                typename Runtime::layout_type layout, typename Runtime::placement_type placement) {
  const gpt::gpt_config& c = s.config;
  const std::size_t B = s.batch_per_rank, T = s.seq;
  std::size_t device_capacity = s.device_capacity;
  if (device_capacity == 0) {
    // Everything resident in the steady state (train_gpt's resident budget, with the gather/reduce
    // buffers the theory predicts instead of its 3 N chunks): activations + this rank's share +
    // the buffers' peak + one chunk of slack. The untraced first iteration may need a little more
    // (no trace: finality from use counts, no prefetch plan) and then moves owned chunks to the host.
    chunk_plan plan = layout.plan(gpt::param_specs(c));
    const std::size_t chunk_bytes = plan.chunk_elems * sizeof(float);
    plan.num_chunks = shard_map{ranks, 0}.padded(plan.num_chunks);
    const auto theory = zero_theory(c, plan, ranks, s.keep_gathered, s.gather_ahead, chunk_bytes, chunk_bytes,
                                    s.memory_saving, 0, s.gather_depth);
    device_capacity = e2e::activation_bytes(c, B, T) +
                      padded_model_bytes(layout, c, ranks) / static_cast<std::size_t>(ranks) +
                      theory.peak_collective_bytes + chunk_bytes +
                      static_cast<std::size_t>(s.gather_depth - 1) * static_cast<std::size_t>(ranks) * chunk_bytes;
  }
  simulated_device_space device({.capacity = device_capacity, .name = "device"});
  host_space host({.capacity = s.host_capacity});
  host_copy_engine copier;
  Runtime rt(device, host, copier, link,
             {.sharding = {.enabled = ranks > 1,
                           .keep_gathered = s.keep_gathered,
                           .gather_ahead = s.gather_ahead,
                           .gather_depth = s.gather_depth,
                           .gather_at_step = s.gather_at_step,
                           .memory_saving = s.memory_saving}},
             std::move(layout), std::move(placement));
  gpt::chunked_gpt<Runtime> model(rt, c, {B, T}, e2e::model_seed);
  model.finalize();
  auto opt = make_adam();
  me.model_bytes = rt.model_bytes();
  me.device_capacity = device_capacity;
  me.param_chunk_bytes = rt.plan().chunk_elems * sizeof(float);
  me.num_chunks = rt.plan().num_chunks;
  // Under the scale runs' budgets only some gathers start ahead: the theory with all of them
  // ahead bounds the buffers (a gather ahead only starts a group's buffer one scope earlier).
  me.theory = zero_theory(c, rt.plan(), ranks, s.keep_gathered, s.gather_ahead, me.param_chunk_bytes,
                          me.param_chunk_bytes, s.memory_saving, link.rank(), s.gather_depth);
  if (!s.gather_at_step) me.theory.next_gathers = 0;
  std::vector<int> tokens(B * T), targets(B * T);
  const std::size_t first = B * static_cast<std::size_t>(link.rank());  // this rank's slice of the global batch
  std::uint64_t moved0 = 0;
  for (int step = 1; step <= s.steps; ++step) {
    gpt::fill_batch(data.train, e2e::data_seed, gpt::train_key(step, 0), B, T, tokens.data(), targets.data(), first);
    const comm_stats c0 = link.stats();
    const double m0 = link.modelled_seconds();
    if (step == s.warmup + 1) {  // the steady state starts: keep the warm-up's peaks, restart them
      me.warm = rt.stats();
      rt.reset_stats();
      moved0 = 0;
    }
    const runtime_stats r0 = rt.stats();
    const auto t0 = e2e::clock::now();
    const double loss = model.forward_backward(tokens.data(), targets.data());
    if (!opt.step(rt, e2e::learning_rate, ranks).stepped) throw state_error("an fp32 step was skipped (overflow)");
    me.iter_s.push_back(e2e::seconds_since(t0));
    if (!std::isfinite(loss)) throw state_error("non-finite loss while training");
    const comm_stats c1 = link.stats();
    me.comm.push_back(
        {c1.bytes_sent - c0.bytes_sent, c1.bytes_received - c0.bytes_received, c1.collectives - c0.collectives});
    me.gathers.push_back(rt.stats().gathers - r0.gathers);
    me.at_step.push_back(rt.stats().gathers_at_step - r0.gathers_at_step);
    me.kept.push_back(rt.stats().gathers_kept - r0.gathers_kept);
    me.reductions.push_back(rt.stats().reductions - r0.reductions);
    me.comm_model_s.push_back(link.modelled_seconds() - m0);
    me.losses.push_back(loss);
  }
  me.bytes_moved_measured = rt.stats().bytes_moved() - moved0;
  me.stats = rt.stats();
  if (s.warmup == 0) me.warm = me.stats;
  for (const auto& v : rt.invariant_violations(true)) me.error += (me.error.empty() ? "" : "; ") + v;
}

/** Runs @p ranks rank threads (OpenMP at one thread each); returns what each recorded. */
std::vector<rank_out> run_group(const train_setup& s, const gpt::text_data& data, int ranks) {
  std::vector<rank_out> out(static_cast<std::size_t>(ranks));
  run_ranks(ranks, [&](in_process_communicator& comm) {
    omp_set_num_threads(1);  // this rank's kernels, GEMMs and Adam on its own thread
    link_comm link(comm, s.link);
    auto& me = out[static_cast<std::size_t>(comm.rank())];
    if (s.scale) {
      using rt = chunk_runtime<searched_chunk_layout, auto_placement, belady_eviction, warmup_tracer, link_comm>;
      train_rank<rt>(s, data, link, ranks, me, searched_chunk_layout(s.layout), auto_placement{});
    } else {
      using rt = chunk_runtime<searched_chunk_layout, static_placement, belady_eviction, warmup_tracer, link_comm>;
      train_rank<rt>(s, data, link, ranks, me, searched_chunk_layout(), static_placement::all_device());
    }
  });
  return out;
}

// ------------------------------------------------------------------------------------------------
// Summaries.

/** Peaks over the whole run (warm-up included) and over the steady state only. */
std::size_t whole_peak_model(const rank_out& x) { return std::max(x.warm.peak_model_bytes, x.stats.peak_model_bytes); }
std::size_t whole_peak_collective(const rank_out& x) {
  return std::max(x.warm.peak_collective_bytes, x.stats.peak_collective_bytes);
}
std::size_t whole_peak_device(const rank_out& x) {
  return std::max(x.warm.peak_device_bytes, x.stats.peak_device_bytes);
}

template <class F>
double max_over_ranks(const std::vector<rank_out>& r, F f) {
  double m = 0;
  for (const auto& x : r) m = std::max(m, static_cast<double>(f(x)));
  return m;
}

/** Median over the measured iterations (after @p warmup) of the max over ranks of @p per_iteration. */
double median_of_max(const std::vector<rank_out>& r, int warmup, const std::vector<double> rank_out::*per_iteration) {
  std::vector<double> v;
  for (std::size_t i = static_cast<std::size_t>(warmup); i < (r[0].*per_iteration).size(); ++i) {
    double m = 0;
    for (const auto& x : r) m = std::max(m, (x.*per_iteration)[i]);
    v.push_back(m);
  }
  return e2e::median(v);
}

/** Global loss of each step: the mean of the ranks' slice means (equal slices), summed in rank order. */
std::vector<double> global_losses(const std::vector<rank_out>& r) {
  std::vector<double> g(r[0].losses.size(), 0.0);
  for (std::size_t i = 0; i < g.size(); ++i) {
    for (const auto& x : r) g[i] += x.losses[i];
    g[i] /= static_cast<double>(r.size());
  }
  return g;
}

struct zero_result {
  int ranks = 1;
  std::size_t model_bytes = 0, replica_bytes = 0, share = 0, device_capacity = 0;
  std::size_t peak = 0, collective = 0, device_peak = 0;              // steady state (after the warm-up)
  std::size_t peak_all = 0, collective_all = 0, device_peak_all = 0;  // whole run (the untraced first iteration too)
  std::size_t chunk_bytes = 0, num_chunks = 0;
  std::uint64_t bytes_moved = 0;
  comm_theory theory;
  std::uint64_t comm_bytes = 0, gathers = 0, kept = 0, reductions = 0, collectives = 0;
  double iteration_s = 0, compute_s = 0, comm_s = 0, link_wall_s = 0;
  std::vector<double> losses;
};

std::vector<std::string> failures;  // self-check failures, printed at the end
void check(bool ok, const std::string& what) {
  if (!ok) {
    failures.push_back(what);
    std::printf("SELF-CHECK FAILED: %s\n", what.c_str());
  }
}

/** Memory and comm self-checks of one group's run; @p from: the first iteration the theory covers.
 *  @p ample: the budget holds every buffer the theory predicts, so the buffer peak equals it; under
 *  a tight budget the runtime completes reductions early for room, and the peak is at most it.
 *  @p depth > 1 (gathers further ahead, which the theory does not replay): an ample budget's buffer
 *  peak is at least the theory's (a tight budget's is bounded by the device's, checked), and the
 *  first traced iteration agrees on the plan in whole rounds (one allreduce each). */
void check_group(const std::vector<rank_out>& r, int ranks, std::size_t from, const std::string& what,
                 bool ample = true, int depth = 1) {
  const std::string at = what + " at N = " + std::to_string(ranks);
  for (std::size_t k = 0; k < r.size(); ++k) {
    const auto& x = r[k];
    const std::string rk = at + ", rank " + std::to_string(k);
    if (!x.error.empty()) check(false, rk + ": invariant violations: " + x.error);
    const std::size_t share = x.model_bytes / static_cast<std::size_t>(ranks);
    check(x.stats.peak_model_bytes <= share + x.stats.peak_collective_bytes,
          rk + ": steady-state model-data peak " + std::to_string(x.stats.peak_model_bytes) + " > share " +
              std::to_string(share) + " + gather/reduce buffers " + std::to_string(x.stats.peak_collective_bytes));
    check(whole_peak_model(x) <= share + whole_peak_collective(x),
          rk + ": model-data peak " + std::to_string(whole_peak_model(x)) + " > share " + std::to_string(share) +
              " + gather/reduce buffers " + std::to_string(whole_peak_collective(x)) + " (whole run)");
    if (ranks == 1) check(whole_peak_collective(x) == 0, rk + ": collective buffers at one rank");
    check(whole_peak_device(x) <= x.device_capacity, rk + ": device peak above its budget");
    if (from > 0 && from < x.comm.size() && (depth == 1 || ample))  // the steady state's peaks (reset after the warm-up)
      check(depth > 1 ? x.stats.peak_collective_bytes >= x.theory.peak_collective_bytes  // more: groups held ahead
            : ample   ? x.stats.peak_collective_bytes == x.theory.peak_collective_bytes
                      : x.stats.peak_collective_bytes <= x.theory.peak_collective_bytes,
            rk + ": steady-state gather/reduce buffer peak " + std::to_string(x.stats.peak_collective_bytes) +
                " bytes, theory " + std::to_string(x.theory.peak_collective_bytes));
    for (std::size_t i = from; i < x.comm.size(); ++i) {
      const std::string it = rk + ", iteration " + std::to_string(i + 1);
      // The step gathers the next iteration's first groups (every one or, where the budget does
      // not hold them, none): they move a gather from the next iteration into this one, and the
      // next one's first scope agrees, an allreduce of a double, that every rank still holds them.
      const std::uint64_t in = i > 0 ? x.at_step[i - 1] : 0, out = x.at_step[i];
      if (i >= 1)
        check(out == x.theory.next_gathers || (!ample && out == 0), it + ": " + std::to_string(out) +
                                                                        " groups gathered at the step, theory " +
                                                                        std::to_string(x.theory.next_gathers));
      // Groups kept instead of gathered again: every one the theory keeps where the budget holds
      // them; a tight budget may keep fewer (each one then gathered again).
      const std::uint64_t kept = x.kept[i];
      check(ample ? kept == x.theory.kept : kept <= x.theory.kept,
            it + ": " + std::to_string(kept) + " groups kept, theory " + std::to_string(x.theory.kept));
      const std::uint64_t per_gather = (static_cast<std::uint64_t>(ranks) - 1) * x.param_chunk_bytes;
      const std::uint64_t flag = in > 0 ? (static_cast<std::uint64_t>(ranks) - 1) * sizeof(double) : 0;
      const std::uint64_t regathered = (x.theory.kept - std::min(kept, x.theory.kept)) * per_gather;
      const std::uint64_t sent = x.theory.bytes_sent + out * per_gather + flag - in * per_gather + regathered;
      const std::uint64_t received = x.theory.bytes_received + out * per_gather + flag - in * per_gather + regathered;
      std::uint64_t agree = i == 1 ? x.theory.agreement_bytes_each_way : 0;  // i = 1: the first traced
      if (depth > 1 && agree > 0 && x.comm[i].bytes_sent > sent && (x.comm[i].bytes_sent - sent) % agree == 0)
        agree = x.comm[i].bytes_sent - sent;  // several rounds of agreement
      check(x.comm[i].bytes_sent == sent + agree && x.comm[i].bytes_received == received + agree,
            it + ": sent " + std::to_string(x.comm[i].bytes_sent) + " / received " +
                std::to_string(x.comm[i].bytes_received) + " bytes, theory " + std::to_string(sent + agree) + " / " +
                std::to_string(received + agree));
      check(
          x.gathers[i] + kept + in == x.theory.gathers + x.theory.kept + out && x.reductions[i] == x.theory.reductions,
          it + ": " + std::to_string(x.gathers[i]) + " gathers / " + std::to_string(x.reductions[i]) +
              " reductions, theory " + std::to_string(x.theory.gathers + x.theory.kept - kept + out - in) + " / " +
              std::to_string(x.theory.reductions));
    }
  }
}

zero_result run_zero(const options& o, const gpt::gpt_config& c, const gpt::text_data& data, int ranks) {
  train_setup s{.config = c,
                .batch_per_rank = o.batch / static_cast<std::size_t>(ranks),
                .seq = o.seq,
                .steps = o.warmup + o.iterations,
                .warmup = o.warmup,
                // First compute only: nothing slept, as if the link were infinitely fast (the
                // modelled seconds are still counted).
                .link = {.bandwidth_bytes_per_s = o.bandwidth, .latency_s = o.latency, .sleep = false},
                .keep_gathered = o.keep_gathered,
                .gather_ahead = o.gather_ahead,
                .gather_at_step = o.gather_at_step,
                .gather_depth = o.gather_depth,
                .memory_saving = o.memory_saving};
  // Rounds alternate the two runs, so that a drift of this machine's speed meets both alike; the
  // medians are over every round's measured iterations.
  const auto from = static_cast<std::size_t>(o.warmup);
  std::vector<rank_out> compute, modelled;
  std::vector<double> compute_its, modelled_its;
  for (int round = 0; round < o.rounds; ++round) {
    s.link.sleep = false;
    compute = run_group(s, data, ranks);
    s.link.sleep = true;
    modelled = run_group(s, data, ranks);
    check_group(compute, ranks, from, "compute-only run", true, o.gather_depth);
    check_group(modelled, ranks, from, "modelled-link run", true, o.gather_depth);
    check(global_losses(modelled) == global_losses(compute),
          "N = " + std::to_string(ranks) + ": the compute-only and the modelled run gave different losses");
    std::printf("N = %d: iterations (ms, max over ranks) compute-only", ranks);
    for (std::size_t i = 0; i < compute[0].iter_s.size(); ++i) {
      const double t = max_over_ranks(compute, [&](const rank_out& x) { return x.iter_s[i]; });
      std::printf(" %.0f%s", 1e3 * t, i < from ? "w" : "");
      if (i >= from) compute_its.push_back(t);
    }
    std::printf(" | modelled link");
    for (std::size_t i = 0; i < modelled[0].iter_s.size(); ++i) {
      const double t = max_over_ranks(modelled, [&](const rank_out& x) { return x.iter_s[i]; });
      std::printf(" %.0f%s", 1e3 * t, i < from ? "w" : "");
      if (i >= from) modelled_its.push_back(t);
    }
    std::printf(
        " (w: warm-up)%s\n",
        o.rounds > 1 ? (" round " + std::to_string(round + 1) + " of " + std::to_string(o.rounds)).c_str() : "");
    std::fflush(stdout);
  }
  zero_result z;
  z.ranks = ranks;
  z.losses = global_losses(modelled);
  const auto& r0 = modelled[0];
  z.model_bytes = r0.model_bytes;
  z.share = r0.model_bytes / static_cast<std::size_t>(ranks);
  z.peak =
      static_cast<std::size_t>(max_over_ranks(modelled, [](const rank_out& x) { return x.stats.peak_model_bytes; }));
  z.collective = static_cast<std::size_t>(
      max_over_ranks(modelled, [](const rank_out& x) { return x.stats.peak_collective_bytes; }));
  z.device_peak =
      static_cast<std::size_t>(max_over_ranks(modelled, [](const rank_out& x) { return x.stats.peak_device_bytes; }));
  z.peak_all = static_cast<std::size_t>(max_over_ranks(modelled, whole_peak_model));
  z.collective_all = static_cast<std::size_t>(max_over_ranks(modelled, whole_peak_collective));
  z.device_peak_all = static_cast<std::size_t>(max_over_ranks(modelled, whole_peak_device));
  z.bytes_moved =
      static_cast<std::uint64_t>(max_over_ranks(modelled, [](const rank_out& x) { return x.bytes_moved_measured; }));
  z.device_capacity = r0.device_capacity;
  z.chunk_bytes = r0.param_chunk_bytes;
  z.num_chunks = r0.num_chunks;
  z.theory = r0.theory;
  const std::size_t last = r0.comm.size() - 1;  // a steady-state iteration (every measured one was checked)
  z.comm_bytes = r0.comm[last].bytes();
  z.gathers = r0.gathers[last];
  z.kept = r0.kept[last];
  z.reductions = r0.reductions[last];
  z.collectives = r0.comm[last].collectives;
  z.iteration_s = e2e::median(modelled_its);
  z.compute_s = e2e::median(compute_its);
  z.comm_s = median_of_max(modelled, o.warmup, &rank_out::comm_model_s);
  return z;
}

// ------------------------------------------------------------------------------------------------
// Scale: the largest model of a family that trains on N ranks at per-rank budgets.

/** The family the scale search walks, indexed by k = 1, 2, ...: with grow "width", the preset's
 *  head count (4 for tiny) at width k x heads and a fixed depth; with "depth" (the old figure),
 *  the preset at k layers. A fixed head count rather than a fixed head size: the width then steps
 *  by the head count (4), a fine grid (one step is 2 x 4 / width of the parameters, 5% at width
 *  150), where a fixed head size of 16 would step by 16 (about 20% of the parameters at width 150,
 *  over 50% at 64: the grid, not the memory, would decide the ratio); every member is valid (the heads
 *  divide the width); and the attention scores, heads x T^2 per block, stay what they are while
 *  the rest of the activations (16 x T x width per block) and the weights grow. ZeRO shards the
 *  same tensors either way. */
struct scale_family {
  std::string grow;
  gpt::gpt_config preset;
  int layers = 0;  // width: the fixed depth

  [[nodiscard]] gpt::gpt_config member(int k) const {
    gpt::gpt_config c = preset;
    if (grow == "depth") {
      c.layers = k;
    } else {
      c.layers = layers;
      c.width = k * preset.heads;
    }
    return c;
  }
  [[nodiscard]] std::size_t params(int k) const { return gpt::param_count(member(k)); }
  /** The most members there can be (the width or depth bound of gpt::validate). */
  [[nodiscard]] int max_index() const { return grow == "depth" ? gpt::max_layers : gpt::max_dimension / preset.heads; }
};

std::string describe(const gpt::gpt_config& c) {
  return std::to_string(c.layers) + " layers x width " + std::to_string(c.width) + " (" + std::to_string(c.heads) +
         " heads)";
}

/** The chunk layout of a scale run: train_gpt's (the least-waste size between lo, the largest
 *  tensor, and 4 lo), with its largest size capped. Why: a group is N chunks, a backward scope
 *  touches one or two groups of parameters and as many of gradients, and a reduce-scatter holds its
 *  group buffer while the next scope computes, so at N = 4 a wide model's 4-lo chunks need more
 *  buffers than a 16 MiB device has; the smallest chunks, on the other hand, pack badly (lo itself
 *  cannot hold a block's 3C x C and C x C weights with its biases: up to 70% more model data). The rule, the
 *  same at every N: of the caps lo, lo + 3 lo / 48, ..., 4 lo, the one whose plan minimises what a
 *  rank must hold of model data, its share (padded to whole groups, with the packing's waste) plus
 *  the gather/reduce buffer peak that zero_theory replays (without gathers ahead: those start only
 *  where the budget holds them) -- the bound the memory self-check tests -- among those whose
 *  buffers fit --scale-buffer-fraction of the device budget (the device also holds the activations
 *  and the scope's chunks); if none does, the minimum overall (the run then shows whether it
 *  trains). At N = 1 there are no buffers, so the least waste wins (often a little less than
 *  train_gpt's own search finds: it walks its 3 lo span in at most 1024 steps, a narrower cap finer). */
struct scale_chunks {
  searched_layout_options layout;
  std::size_t chunk_elems = 0, num_chunks = 0;  // the chosen plan; num_chunks padded to whole groups
  std::size_t share = 0;                        // model bytes / N at that plan
  std::uint64_t buffers = 0;                    // the replay's buffer peak at that plan (no gathers ahead)
  bool capped = false;                          // the plan differs from train_gpt's uncapped one
  bool within = true;                           // the buffers fit fraction x the device
};

scale_chunks scale_layout(const options& o, const gpt::gpt_config& c, int ranks) {
  const searched_layout_options base = e2e::trainer_layout(c).options();
  const std::size_t lo = base.min_chunk_elems, hi = base.max_chunk_elems;
  const auto budget = static_cast<std::uint64_t>(o.scale_buffer_fraction * static_cast<double>(o.device_budget));
  const auto specs = gpt::param_specs(c);
  const auto evaluate = [&](std::size_t cap) {
    scale_chunks e;
    e.layout = base;
    e.layout.max_chunk_elems = cap;
    chunk_plan plan = searched_chunk_layout(e.layout).plan(specs);
    plan.num_chunks = shard_map{ranks, 0}.padded(plan.num_chunks);
    plan.chunk_tensors.resize(plan.num_chunks);
    const std::size_t bytes = plan.chunk_elems * sizeof(float);
    e.chunk_elems = plan.chunk_elems;
    e.num_chunks = plan.num_chunks;
    std::size_t all = 0;
    for (const auto& l : make_chunk_lists(plan, {.param_type = dtype::f32}))
      if (!l.aliases_param) all += l.chunk_bytes * l.num_chunks;
    e.share = all / static_cast<std::size_t>(ranks);
    e.buffers = zero_theory(c, plan, ranks, o.keep_gathered, /*ahead=*/false, bytes, bytes, o.memory_saving)
                    .peak_collective_bytes;
    e.within = e.buffers <= budget;
    return e;
  };
  const scale_chunks uncapped = evaluate(hi);
  if (!o.chunk_cap) return uncapped;
  scale_chunks best = uncapped;
  constexpr std::size_t steps = 48, align = 32;
  for (std::size_t i = steps; i-- > 0;) {  // smaller caps: a strictly better one replaces the best
    const std::size_t cap = std::max(lo, (lo + i * (hi - lo) / steps) / align * align);
    scale_chunks e = evaluate(cap);
    const bool better = e.within != best.within ? e.within : e.share + e.buffers < best.share + best.buffers;
    if (better) best = e;
  }
  best.capped = best.chunk_elems != uncapped.chunk_elems;
  return best;
}

struct scale_trial {
  gpt::gpt_config config{};
  std::size_t params = 0;
  scale_chunks chunks;
  bool fits = false;
  bool memory_saving = false;  // the mode it ran in: given, or chosen because only it fits (choose_sharding)
  std::string error;
  std::vector<rank_out> ranks;
  double seconds = 0;
};

struct scale_result {
  int ranks = 1;
  double limit_params = 0;
  scale_trial best;
  std::vector<scale_trial> trials;
};

scale_trial try_scale(const options& o, const gpt::gpt_config& c, const gpt::text_data& data, int ranks) {
  scale_trial t;
  t.config = c;
  t.params = gpt::param_count(c);
  t.chunks = scale_layout(o, c, ranks);
  t.memory_saving = o.memory_saving;
  // ZeRO's mode as train_gpt picks it (choose_sharding): the group mode unless only the
  // memory-saving mode fits the budgets; here each mode with the chunk cap chosen for it.
  if (!o.memory_saving && ranks > 1) {
    // The model's non-model bytes moment by moment, with e2e::activation_bytes' allocation slack.
    auto profile = gpt::non_model_profile(c, {o.scale_batch, o.scale_seq}, dtype::f32);
    for (std::size_t m = 0; m + 1 < profile.size(); ++m) profile[m] += 64 * 1024;
    const tier_budgets budgets{.device = o.device_budget, .host = o.host_budget};
    const auto plan = [&](const scale_chunks& ch, bool saving) {
      return plan_memory(gpt::param_specs(c), searched_chunk_layout(ch.layout),
                         {.sharding = {.enabled = true, .keep_gathered = o.keep_gathered, .memory_saving = saving}},
                         ranks, gpt::forward_scopes(c), profile);
    };
    if (!admit(plan(t.chunks, false), budgets).fits()) {
      options saving = o;
      saving.memory_saving = true;
      const scale_chunks ch = scale_layout(saving, c, ranks);
      if (admit(plan(ch, true), budgets).fits()) t.chunks = ch, t.memory_saving = true;
    }
  }
  train_setup s{.config = c,
                .batch_per_rank = o.scale_batch,
                .seq = o.scale_seq,
                .steps = o.scale_steps,
                .warmup = o.scale_steps >= 2 ? 1 : 0,
                .link = {.bandwidth_bytes_per_s = o.bandwidth, .latency_s = o.latency, .sleep = false},
                .keep_gathered = o.keep_gathered,
                .gather_ahead = o.gather_ahead,
                .gather_at_step = o.gather_at_step,
                .gather_depth = o.gather_depth,
                .memory_saving = t.memory_saving,
                .device_capacity = o.device_budget,
                .host_capacity = o.host_budget,
                .scale = true,
                .layout = t.chunks.layout};
  const auto t0 = e2e::clock::now();
  try {
    t.ranks = run_group(s, data, ranks);
    t.fits = true;
  } catch (const out_of_memory_error& e) {
    t.error = std::string("out_of_memory_error: ") + e.what();
  } catch (const config_error& e) {
    t.error = std::string("config_error: ") + e.what();
  }
  t.seconds = e2e::seconds_since(t0);
  return t;
}

scale_result search_scale(const options& o, const scale_family& family, const gpt::text_data& data, int ranks) {
  scale_result r;
  r.ranks = ranks;
  r.limit_params = static_cast<double>(ranks) * static_cast<double>(o.device_budget + o.host_budget) / bytes_per_param;
  std::printf("\n== scale, N = %d: %s + %s per rank, limit %.3f M parameters ==\n", ranks,
              format_bytes(o.device_budget).c_str(), format_bytes(o.host_budget).c_str(), r.limit_params / 1e6);
  if (static_cast<double>(family.params(1)) > r.limit_params) {
    std::printf("even the smallest member (%s) is above the limit\n", describe(family.member(1)).c_str());
    return r;
  }
  int lo = 1, hi = 1;
  if (family.grow == "depth") {  // the old bound (one past the limit at most), so the old figure's trials repeat
    const std::size_t base = family.params(1), per_layer = family.params(2) - base;
    hi = static_cast<int>((r.limit_params - static_cast<double>(base)) / static_cast<double>(per_layer)) + 1;
  } else {  // the widest member within the limit
    while (hi < family.max_index() && static_cast<double>(family.params(hi + 1)) <= r.limit_params) ++hi;
  }
  const auto first_line = [](const std::string& e) {
    if (std::getenv("BENCH_ZERO_FULL_ERRORS")) return e;
    return e.substr(0, std::min<std::size_t>(e.find('\n'), 150));
  };
  while (lo <= hi) {  // fitting is taken as monotone in the index: binary search for the largest that trains
    const int mid = lo + (hi - lo) / 2;
    scale_trial t = try_scale(o, family.member(mid), data, ranks);
    const auto& ch = t.chunks;
    std::printf("  %s %8.3f M params (%5.1f%% of limit), %zu chunks x %s MiB%s, buffers %s MiB predicted%s: ",
                describe(t.config).c_str(), static_cast<double>(t.params) / 1e6,
                100 * static_cast<double>(t.params) / r.limit_params, ch.num_chunks,
                e2e::mib(double(ch.chunk_elems * sizeof(float))).c_str(), ch.capped ? " (capped)" : "",
                e2e::mib(double(ch.buffers)).c_str(), ch.within ? "" : " (above the fraction)");
    if (t.memory_saving && !o.memory_saving) std::printf("memory-saving mode (only it fits), ");
    if (t.fits)
      std::printf("trains, peak model data %s MiB per rank, %s MiB of it gather/reduce buffers (%.1f s)\n",
                  e2e::mib(max_over_ranks(t.ranks, whole_peak_model)).c_str(),
                  e2e::mib(max_over_ranks(t.ranks, whole_peak_collective)).c_str(), t.seconds);
    else std::printf("%s (%.1f s)\n", first_line(t.error).c_str(), t.seconds);
    std::fflush(stdout);
    if (t.fits) {
      lo = mid + 1;
      r.best = t;
    } else {
      hi = mid - 1;
    }
    t.ranks.clear();
    r.trials.push_back(std::move(t));
  }
  return r;
}

// ------------------------------------------------------------------------------------------------

std::string losses_text(const std::vector<double>& l) {
  std::string s;
  char buf[32];
  for (double x : l) {
    std::snprintf(buf, sizeof buf, "%.9g", x);
    if (!s.empty()) s.push_back(',');
    s.append(buf);
  }
  return s;
}

int write_plot(const options& o, const std::vector<zero_result>& zs, const std::vector<scale_result>& ss) {
  std::string mem, tim, sca;
  char buf[256];
  for (const auto& z : zs) {
    std::snprintf(buf, sizeof buf, "%d %.4f %.4f %.4f %.4f %.4f %.4f\n", z.ranks, z.model_bytes / 1048576.0,
                  z.share / 1048576.0, z.peak / 1048576.0, z.collective / 1048576.0, z.replica_bytes / 1048576.0,
                  z.peak_all / 1048576.0);
    mem += buf;
    std::snprintf(buf, sizeof buf, "%d %.3f %.3f %.3f %.3f\n", z.ranks, 1e3 * z.iteration_s, 1e3 * z.compute_s,
                  1e3 * z.comm_s, 1e3 * (z.compute_s + z.comm_s));
    tim += buf;
  }
  for (const auto& s : ss) {
    std::snprintf(buf, sizeof buf, "%d %.4f %.4f\n", s.ranks, s.best.fits ? s.best.params / 1e6 : 0.0,
                  s.limit_params / 1e6);
    sca += buf;
  }
  const int panels = (zs.empty() ? 0 : 2) + (ss.empty() ? 0 : 1);
  std::string script =
      "set termoption noenhanced\nset grid\nset key top left\nset xlabel 'ranks N'\nset xtics 1\nset multiplot layout "
      "1," +
      std::to_string(panels) + " title 'bench_zero: ZeRO over chunks, in-process ranks (" + o.preset +
      ", global batch " + std::to_string(o.batch) + "x" + std::to_string(o.seq) + ")'\n";
  std::vector<std::pair<std::string, std::string>> files;
  if (!zs.empty()) {
    files.emplace_back("mem.dat", mem);
    files.emplace_back("time.dat", tim);
    script +=
        "set title 'model data per rank'\nset ylabel 'MiB'\nset yrange [0:*]\n"
        "plot '@DIR@/mem.dat' using 1:6 with linespoints lw 2 title 'full replica', "
        "'' using 1:3 with linespoints lw 2 title 'share: all / N', "
        "'' using 1:4 with linespoints lw 2 title 'per-rank peak, steady state (max over ranks)', "
        "'' using 1:7 with linespoints lw 1 dt 2 title 'per-rank peak, whole run (untraced 1st iteration)', "
        "'' using 1:5 with linespoints lw 2 title 'gather/reduce buffers'\n";
    char t[160];
    std::snprintf(t, sizeof t, "link %.3g B/s + %.3g s", o.bandwidth, o.latency);
    script += std::string("set title 'one iteration (") + t +
              ")'\nset ylabel 'ms'\n"
              "plot '@DIR@/time.dat' using 1:2 with linespoints lw 2 title 'iteration (modelled link)', "
              "'' using 1:3 with linespoints lw 2 title 'compute (link infinite)', "
              "'' using 1:4 with linespoints lw 2 title 'comm (modelled)', "
              "'' using 1:5 with linespoints lw 1 dt 2 title 'compute + comm'\n";
  }
  if (!ss.empty()) {
    files.emplace_back("scale.dat", sca);
    const std::string family = o.scale_grow == "depth"
                                   ? o.scale_preset + " family by depth"
                                   : o.scale_preset + " family by width, " + std::to_string(o.scale_layers) + " layers";
    script += "set title 'largest model (" + family + "), " + format_bytes(o.device_budget) + " + " +
              format_bytes(o.host_budget) +
              " per rank'\nset ylabel 'parameters (M)'\n"
              "plot '@DIR@/scale.dat' using 1:3 with linespoints lw 2 title 'limit N(device+host)/16 B', "
              "'' using 1:2 with linespoints lw 2 title 'largest that trains'\n";
  }
  script += "unset multiplot\n";
  return e2e::run_gnuplot("bench_zero", o.plot, script, files, panels == 3 ? "1800,560" : "1200,560");
}

}  // namespace

int main(int argc, char** argv) try {
  e2e::configure_process();  // before any OpenMP region: passive OpenMP waiting, caching heap
  const options o = parse(argc, argv);
  std::vector<e2e::json_record> records;
  std::vector<zero_result> zs;
  std::vector<scale_result> ss;
  const unsigned cores = std::thread::hardware_concurrency();
  std::printf("bench_zero: in-process ranks (one thread each, OpenMP 1 thread per rank) on %u cores; CPU kernels %s\n",
              cores, cpu_isa_report().c_str());

  if (o.mode != "scale") {
    const gpt::gpt_config c = gpt::parse_preset(o.preset);
    const gpt::text_data data = gpt::load_text("", o.seq);
    const searched_chunk_layout layout;
    const std::size_t replica = e2e::model_bytes(layout, c);
    std::printf(
        "timing: preset %s (%d layers, width %d): %zu parameters, model data %s MiB (one replica); global batch %zu x "
        "%zu "
        "split over the ranks; fp32, AdamW + clipping, everything on the device (static placement); link %.3g B/s + "
        "%.3g s "
        "per collective%s; gathers up to %d scope%s ahead; %d warm-up + %d measured iterations\n",
        o.preset.c_str(), c.layers, c.width, gpt::param_count(c), e2e::mib(static_cast<double>(replica)).c_str(),
        o.batch, o.seq, o.bandwidth, o.latency, o.keep_gathered ? "; keep_gathered" : "", o.gather_depth,
        o.gather_depth == 1 ? "" : "s", o.warmup, o.iterations);
    std::fflush(stdout);
    for (int n : o.ranks) {
      zero_result z = run_zero(o, c, data, n);
      z.replica_bytes = replica;
      zs.push_back(z);
    }
    std::printf(
        "\nper-rank peaks, max over ranks: steady state (after the warm-up) and, in brackets, the whole run (its "
        "first, "
        "untraced iteration included)\n"
        "| N | model data MiB (all) | share MiB (all/N) | per-rank peak MiB | gather/reduce buf MiB | buf theory MiB | "
        "peak/share | "
        "peak/replica | replica MiB | chunks (MiB each) | device peak / budget MiB | moved MiB/it |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (const auto& z : zs)
      std::printf(
          "| %d | %s | %s | %s [%s] | %s [%s] | %s | %.3f [%.3f] | %.3f [%.3f] | %s | %zu (%s) | %s [%s] / %s | %s |\n",
          z.ranks, e2e::mib(double(z.model_bytes)).c_str(), e2e::mib(double(z.share)).c_str(),
          e2e::mib(double(z.peak)).c_str(), e2e::mib(double(z.peak_all)).c_str(),
          e2e::mib(double(z.collective)).c_str(), e2e::mib(double(z.collective_all)).c_str(),
          e2e::mib(double(z.theory.peak_collective_bytes)).c_str(), double(z.peak) / double(z.share),
          double(z.peak_all) / double(z.share), double(z.peak) / double(z.replica_bytes),
          double(z.peak_all) / double(z.replica_bytes), e2e::mib(double(z.replica_bytes)).c_str(), z.num_chunks,
          e2e::mib(double(z.chunk_bytes)).c_str(), e2e::mib(double(z.device_peak)).c_str(),
          e2e::mib(double(z.device_peak_all)).c_str(), e2e::mib(double(z.device_capacity)).c_str(),
          e2e::mib(double(z.bytes_moved) / o.iterations).c_str());
    std::printf(
        "\n| N | gathers/it (kept instead) | reductions/it | collectives/it | comm MiB/it (sent+recv, one rank) | "
        "theory MiB | ratio "
        "| "
        "iteration ms | compute ms | comm ms (modelled) | overlap = it/max | (c+m)/max |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (const auto& z : zs) {
      const double mx = std::max(z.compute_s, z.comm_s), theory = double(z.theory.bytes_sent + z.theory.bytes_received);
      char ratio[32] = "-";
      if (theory > 0) std::snprintf(ratio, sizeof ratio, "%.6f", double(z.comm_bytes) / theory);
      std::printf(
          "| %d | %llu (theory %llu; %llu) | %llu (theory %llu) | %llu | %s | %s | %s | %.1f | %.1f | %.1f | %.3f | "
          "%.3f "
          "|\n",
          z.ranks, static_cast<unsigned long long>(z.gathers), static_cast<unsigned long long>(z.theory.gathers),
          static_cast<unsigned long long>(z.kept), static_cast<unsigned long long>(z.reductions),
          static_cast<unsigned long long>(z.theory.reductions), static_cast<unsigned long long>(z.collectives),
          e2e::mib(double(z.comm_bytes)).c_str(), e2e::mib(theory).c_str(), ratio, 1e3 * z.iteration_s,
          1e3 * z.compute_s, 1e3 * z.comm_s, z.iteration_s / mx, (z.compute_s + z.comm_s) / mx);
    }
    std::printf(
        "(overlap 1 would mean communication fully hidden behind compute; (c+m)/max, none of it hidden. The runtime "
        "overlaps reduce-scatters with the next backward scope and starts allgathers up to --gather-depth scopes "
        "ahead where the budget holds them: zero/gather_plan.hpp)\n");
    std::printf("\nlosses per step (global batch mean; across N only the summation order differs):\n| step |");
    for (const auto& z : zs) std::printf(" N = %d |", z.ranks);
    std::printf("\n|---|");
    for (std::size_t k = 0; k < zs.size(); ++k) std::printf("---:|");
    std::printf("\n");
    for (std::size_t i = 0; i < zs[0].losses.size(); ++i) {
      std::printf("| %zu |", i + 1);
      for (const auto& z : zs) std::printf(" %.7f |", z.losses[i]);
      std::printf("\n");
    }
    for (const auto& z : zs) {
      double d = 0;
      for (std::size_t i = 0; i < z.losses.size(); ++i) d = std::max(d, std::abs(z.losses[i] - zs[0].losses[i]));
      std::printf("N = %d: largest |loss - loss at N = %d| = %.3g\n", z.ranks, zs[0].ranks, d);
      e2e::json_record j;
      const double mx = std::max(z.compute_s, z.comm_s);
      j.str("benchmark", "zero").str("preset", o.preset).num("batch", double(o.batch)).num("seq", double(o.seq));
      j.num("ranks", z.ranks).num("params", double(gpt::param_count(c))).num("model_bytes", double(z.model_bytes));
      j.num("replica_model_bytes", double(z.replica_bytes)).num("share_bytes", double(z.share));
      j.num("per_rank_model_bytes_peak", double(z.peak)).num("gather_buffer_bytes", double(z.collective));
      j.num("per_rank_model_bytes_peak_whole_run", double(z.peak_all))
          .num("gather_buffer_bytes_whole_run", double(z.collective_all));
      j.num("gather_buffer_bytes_theory", double(z.theory.peak_collective_bytes));
      j.num("device_peak_bytes", double(z.device_peak)).num("device_peak_bytes_whole_run", double(z.device_peak_all));
      j.num("device_budget", double(z.device_capacity));
      j.num("chunk_bytes", double(z.chunk_bytes)).num("num_chunks", double(z.num_chunks));
      j.num("bytes_moved_per_iteration", double(z.bytes_moved) / o.iterations);
      j.num("gathers_per_iteration", double(z.gathers)).num("reductions_per_iteration", double(z.reductions));
      j.num("gathers_kept_per_iteration", double(z.kept));
      j.num("comm_bytes", double(z.comm_bytes))
          .num("comm_bytes_theory", double(z.theory.bytes_sent + z.theory.bytes_received));
      j.num("iteration_s", z.iteration_s).num("compute_s", z.compute_s).num("comm_s", z.comm_s);
      j.num("overlap", z.iteration_s / mx).num("serial_overlap", (z.compute_s + z.comm_s) / mx);
      j.num("bandwidth", o.bandwidth).num("latency", o.latency).boolean("keep_gathered", o.keep_gathered).num("gather_depth", o.gather_depth);
      j.num("iterations", o.iterations)
          .num("warmup", o.warmup)
          .num("rounds", o.rounds)
          .str("losses", losses_text(z.losses));
      records.push_back(j);
    }
  }

  if (o.mode != "timing") {
    const scale_family family{
        .grow = o.scale_grow, .preset = gpt::parse_preset(o.scale_preset), .layers = o.scale_layers};
    const gpt::text_data data = gpt::load_text("", o.scale_seq);
    if (family.grow == "depth")
      std::printf("\nscale: %s family (width %d, %d heads), depth searched", o.scale_preset.c_str(),
                  family.preset.width, family.preset.heads);
    else
      std::printf("\nscale: %s family grown by width at %d layers and %d heads (width steps of %d), width searched",
                  o.scale_preset.c_str(), family.layers, family.preset.heads, family.preset.heads);
    std::printf(
        "; %zu x %zu tokens per rank, %d steps; auto placement + Belady; train_gpt's layout (chunks between the "
        "largest "
        "tensor lo and 4 lo, least waste)",
        o.scale_batch, o.scale_seq, o.scale_steps);
    if (o.chunk_cap)
      std::printf(
          " with its largest chunk capped: of 49 caps lo..4 lo, the one whose plan minimises share + the replay's "
          "gather/reduce buffer peak (no gathers ahead), among those whose buffers fit %.2f x the device budget",
          o.scale_buffer_fraction);
    std::printf("; limit = N (device + host) / %.0f bytes per parameter\n", bytes_per_param);
    for (int n : o.ranks) {
      scale_result r = search_scale(o, family, data, n);
      if (r.best.fits) {  // the largest: the same self-checks as the timing runs
        check_group(r.best.ranks, n, static_cast<std::size_t>(o.scale_steps >= 2 ? 1 : o.scale_steps), "scale",
                    /*ample=*/false, o.gather_depth);
        check(static_cast<double>(r.best.params) <= r.limit_params,
              "scale at N = " + std::to_string(n) + ": above the limit");
      } else {
        check(false, "scale at N = " + std::to_string(n) + ": nothing trains");
      }
      ss.push_back(std::move(r));
    }
    std::printf(
        "\nlargest model per N (%s); peaks: last step [whole run, the untraced first step included]; chunks: count "
        "padded "
        "to whole groups x MiB each, * where the cap changed train_gpt's plan (buffer budget %.2f x device); "
        "activations: one micro-batch's "
        "(e2e::activation_bytes)\n"
        "| N | device + host per rank | limit M params | max M params | ratio | layers | width | chunks | model data "
        "MiB (all) | "
        "per-rank peak MiB | gather/reduce buf MiB | activations MiB | device peak MiB | comm MiB/it | theory MiB | "
        "step ms | "
        "comm ms (modelled, not slept) |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        family.grow == "depth" ? "depth searched"
                               : ("width searched at " + std::to_string(family.layers) + " layers").c_str(),
        o.scale_buffer_fraction);
    for (const auto& r : ss) {
      e2e::json_record j;
      j.str("benchmark", "zero_scale").str("preset", o.scale_preset).str("grow", o.scale_grow).num("ranks", r.ranks);
      if (o.scale_grow == "width") j.num("scale_layers", o.scale_layers);
      j.num("scale_buffer_fraction", o.scale_buffer_fraction);
      j.num("device_budget", double(o.device_budget)).num("host_budget", double(o.host_budget));
      j.num("limit_params", r.limit_params).num("bytes_per_param", bytes_per_param);
      j.num("batch", double(o.scale_batch)).num("seq", double(o.scale_seq)).num("steps", o.scale_steps);
      const auto& b = r.best;
      if (b.fits) {
        const auto& x = b.ranks[0];
        const std::size_t last = x.comm.size() - 1;
        const double it = median_of_max(b.ranks, static_cast<int>(last), &rank_out::iter_s);
        const double cm = median_of_max(b.ranks, static_cast<int>(last), &rank_out::comm_model_s);
        const double peak = max_over_ranks(b.ranks, [](const rank_out& y) { return y.stats.peak_model_bytes; });
        const double coll = max_over_ranks(b.ranks, [](const rank_out& y) { return y.stats.peak_collective_bytes; });
        const double peak_all = max_over_ranks(b.ranks, whole_peak_model),
                     coll_all = max_over_ranks(b.ranks, whole_peak_collective);
        const double dev = max_over_ranks(b.ranks, [](const rank_out& y) { return y.stats.peak_device_bytes; });
        const double dev_all = max_over_ranks(b.ranks, whole_peak_device);
        const double act = double(e2e::activation_bytes(b.config, o.scale_batch, o.scale_seq));
        std::printf(
            "| %d | %s + %s | %.3f | %.3f | %.3f | %d | %d | %zu x %s%s | %s | %s [%s] | %s [%s] | %s | %s [%s] | %s | "
            "%s | %.1f | %.1f |\n",
            r.ranks, format_bytes(o.device_budget).c_str(), format_bytes(o.host_budget).c_str(), r.limit_params / 1e6,
            double(b.params) / 1e6, double(b.params) / r.limit_params, b.config.layers, b.config.width, x.num_chunks,
            e2e::mib(double(x.param_chunk_bytes)).c_str(), b.chunks.capped ? "*" : "",
            e2e::mib(double(x.model_bytes)).c_str(), e2e::mib(peak).c_str(), e2e::mib(peak_all).c_str(),
            e2e::mib(coll).c_str(), e2e::mib(coll_all).c_str(), e2e::mib(act).c_str(), e2e::mib(dev).c_str(),
            e2e::mib(dev_all).c_str(), e2e::mib(double(x.comm[last].bytes())).c_str(),
            e2e::mib(double(x.theory.bytes_sent + x.theory.bytes_received)).c_str(), 1e3 * it, 1e3 * cm);
        j.num("max_params", double(b.params)).num("ratio", double(b.params) / r.limit_params);
        j.num("layers", b.config.layers).num("width", b.config.width).num("heads", b.config.heads);
        j.num("chunk_bytes", double(x.param_chunk_bytes))
            .num("num_chunks", double(x.num_chunks))
            .boolean("chunk_capped", b.chunks.capped);
        j.num("chunk_cap_elems", double(b.chunks.layout.max_chunk_elems))
            .num("gather_buffer_bytes_theory_no_ahead", double(b.chunks.buffers));
        j.num("activation_bytes", act).num("device_peak_bytes", dev).num("device_peak_bytes_whole_run", dev_all);
        j.num("model_bytes", double(x.model_bytes))
            .num("per_rank_model_bytes_peak", peak)
            .num("gather_buffer_bytes", coll);
        j.num("per_rank_model_bytes_peak_whole_run", peak_all).num("gather_buffer_bytes_whole_run", coll_all);
        j.num("gather_buffer_bytes_theory", double(x.theory.peak_collective_bytes));
        j.num("comm_bytes", double(x.comm[last].bytes()))
            .num("comm_bytes_theory", double(x.theory.bytes_sent + x.theory.bytes_received));
        j.num("iteration_s", it).num("compute_s", it).num("comm_s", cm);  // no link slept: compute is the iteration
      } else {
        std::printf("| %d | %s + %s | %.3f | - | - | - | - | - | - | - | - | - | - |\n", r.ranks,
                    format_bytes(o.device_budget).c_str(), format_bytes(o.host_budget).c_str(), r.limit_params / 1e6);
        j.num("max_params", 0).num("ratio", 0);
      }
      std::string tried;
      for (const auto& t : r.trials)
        tried += (tried.empty() ? "" : "; ") + std::to_string(t.config.layers) + " layers x " +
                 std::to_string(t.config.width) + " " + std::to_string(t.params) +
                 (t.fits ? " trains" : " " + t.error.substr(0, t.error.find(':')));
      j.str("trials", tried);
      records.push_back(j);
    }
  }

  if (!o.json.empty()) e2e::write_json(o.json, records);
  if (!o.plot.empty()) write_plot(o, zs, ss);
  if (!failures.empty()) {
    std::printf("\nbench_zero: %zu self-check(s) FAILED\n", failures.size());
    return 1;
  }
  std::printf(
      "\nbench_zero: all self-checks hold (model-data peak <= share + gather/reduce buffers, comm bytes = theory, "
      "same losses with and without the modelled link%s)\n",
      o.mode != "timing" ? ", largest model within the limit" : "");
  return 0;
} catch (const chunkstar::error& e) {
  std::fprintf(stderr, "bench_zero: %s\n", e.what());
  return 2;
}
