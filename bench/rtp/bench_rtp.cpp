// SPDX-License-Identifier: Apache-2.0
// bench_rtp: Rotated Tensor Parallelism of the GPT example (gpt::rtp_gpt) on N = 1..4 in-process
// ranks (one thread each, OpenMP at one thread per rank), beside plain data parallelism and ZeRO on
// the same model, the same data and the same optimizer (AdamW, decay 0.1 except on biases and
// norms, global-norm clipping at 1). Every rank trains on its own micro-batch of --batch x --seq
// tokens: rank r takes sequences [r B, (r + 1) B) of the global batch, so the global batch grows
// with N and each rank's compute stays the same.
//
//   rtp:   rtp_gpt. Memory per rank: model_bytes() + transient_bytes(), everything it allocates for
//          model data (its shards' and the replicas' weights, gradients and Adam moments, and every
//          rotation's transit buffers); "in use": the same with only the largest rotation's transit
//          buffers, since one pass runs at a time. Self-check, every rank:
//            in use <= all / N + R + 2 S + 3 S
//          all: the whole model's data (16 B per parameter, the vocabulary's padding rows included),
//          R: the rank's replicas (4 lists of the LayerNorms, output biases and positions), S: the
//          largest shard; 2 S: the weights in transit, 3 S: the gradient buffers of backward (two in
//          transit and the scratch). Comm: bytes sent per iteration (comm_stats) must equal
//          iteration_bytes_theory() + the step's all-reduces (its 8 arguments per rank, step_agreement,
//          and the clipping norm's one double), on every rank
//          and iteration. ring_wait_s: rtp_gpt::ring_wait_s() per iteration (the time the rotations
//          waited for shifts their kernels did not hide).
//   dp:    every rank a full replica (gpt_reference<float>, plus Adam moments: 16 B per parameter),
//          one synchronous all-reduce of the whole gradient per iteration ((N - 1) x 4 B per
//          parameter sent with the in-process model, checked exactly), local clipping (every rank
//          holds the same sum) and Adam.
//   zero:  the chunk runtime with sharding (chunked_gpt, as bench_zero, everything on a device with
//          room to spare): the per-rank model-data peak (runtime_stats::peak_model_bytes, whole run)
//          and bytes per iteration against the runtime's own gathers and reductions
//          ((N - 1) x ((gathers + reductions) x chunk + chunks x 8), and 8 more after a step that
//          gathered the next iteration's first groups: its first scope's agreement; bench_zero
//          checks those counts against a replay of the rules). Its first two iterations are not
//          checked (untraced, then the ranks' agreement on gathers ahead).
//
// Time: every collective runs through modelled_link (latency + bytes / bandwidth per collective,
// one transfer at a time per rank). iteration_s: forward + backward + step, max over the ranks,
// median over the measured iterations; compute_s: the same with the link infinitely fast (rtp, dp;
// the losses must be the same bits); blocking_s: time in synchronous collectives (all-reduces);
// comm_s: the modelled seconds of the iteration's collectives. An in-process collective, a ring
// shift included, is a rendezvous of the whole group, so with more rank threads than cores the
// ring wait is mostly waiting for the slowest rank to reach the shift: the run with the link
// infinitely fast shows that part ("ring wait, link infinite").
// Losses: rtp and zero against dp at the same N, within --loss-tolerance (fp32, different orders).
#include "../bench_cli.hpp"
#include "../e2e/e2e_support.hpp"
#include "../zero/modelled_link.hpp"
#include "gpt_model.hpp"
#include "rtp_gpt.hpp"

#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/eviction/belady.hpp>
#include <chunkstar/optim/adam.hpp>
#include <chunkstar/optim/clip.hpp>
#include <chunkstar/placement/static_placement.hpp>

#include <omp.h>

#include <cmath>
#include <thread>
#include <utility>

using namespace chunkstar;
using bench_zero::link_model;
using bench_zero::modelled_link;

namespace {

struct options {
  gpt::gpt_config config{.vocab = 256, .context = 64, .layers = 4, .heads = 12, .width = 192};
  std::size_t batch = 2, seq = 64;  // per rank
  std::vector<int> ranks{1, 2, 3, 4};
  int iterations = 12, warmup = 2;
  double bandwidth = 1e9, latency = 10e-6;
  double loss_tolerance = 1e-3;  // nats; measured differences are about 1e-7 to 1e-5 (fp32 orders)
  std::string json, plot;
};

void usage() {
  std::printf(
      "usage: bench_rtp [--layers 4] [--width 192] [--heads 12] [--vocab 256] [--context 64] [--batch 2] [--seq 64 "
      "(per rank)]\n"
      "                 [--ranks 1,2,3,4] [--iterations 12] [--warmup 2] [--bandwidth 1e9 (B/s)] [--latency 10e-6 "
      "(s)]\n"
      "                 [--loss-tolerance 1e-3] [--quick] [--json FILE] [--plot FILE.png]\n"
      "RTP (rtp_gpt), data parallelism and ZeRO on the same GPT at N ranks: per-rank model data, bytes sent per "
      "iteration\n"
      "against the theory, iteration time and ring wait on a modelled link. --quick: 2 layers, width 48, context and "
      "seq 16,\n"
      "batch 1, 2 + 2 iterations (about a second).\n");
}

options parse(int argc, char** argv) {
  options o;
  // --quick first, so that any option given beside it overrides its smaller defaults.
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--quick") {  // the CTest smoke run: every mode and check, small
      o.config = {.vocab = 256, .context = 16, .layers = 2, .heads = 12, .width = 48};
      o.batch = 1;
      o.seq = 16;
      o.iterations = 2;
    }
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw config_error(a + " needs a value (bench_rtp --help)");
      return argv[++i];
    };
    auto number = [&](const std::string& v) {
      const auto x = bench::parse_number_list(a, v);
      if (x.size() != 1 || !(x[0] > 0)) throw config_error(a + " takes one positive number, got '" + v + "'");
      return x[0];
    };
    auto count = [&](const std::string& v) {
      const double x = number(v);
      if (x != std::floor(x) || x > 1e9) throw config_error(a + " takes one positive integer, got '" + v + "'");
      return static_cast<int>(x);
    };
    if (a == "--layers") o.config.layers = count(value());
    else if (a == "--width") o.config.width = count(value());
    else if (a == "--heads") o.config.heads = count(value());
    else if (a == "--vocab") o.config.vocab = count(value());
    else if (a == "--context") o.config.context = count(value());
    else if (a == "--batch") o.batch = static_cast<std::size_t>(count(value()));
    else if (a == "--seq") o.seq = static_cast<std::size_t>(count(value()));
    else if (a == "--ranks") {
      o.ranks.clear();
      for (double x : bench::parse_number_list(a, value())) {
        if (x < 1 || x > 64 || x != std::floor(x)) throw config_error("--ranks: integers in [1, 64], comma-separated");
        o.ranks.push_back(static_cast<int>(x));
      }
    } else if (a == "--iterations") o.iterations = count(value());
    else if (a == "--warmup") o.warmup = count(value());
    else if (a == "--bandwidth") o.bandwidth = number(value());
    else if (a == "--latency") {
      const auto x = bench::parse_number_list(a, value());
      if (x.size() != 1 || x[0] < 0) throw config_error("--latency takes one number >= 0 (seconds)");
      o.latency = x[0];
    } else if (a == "--loss-tolerance") o.loss_tolerance = number(value());
    else if (a == "--quick") continue;  // applied above
    else if (a == "--json") o.json = value();
    else if (a == "--plot") o.plot = value();
    else if (a == "--help" || a == "-h") {
      usage();
      std::exit(0);
    } else throw config_error("unknown option '" + a + "' (bench_rtp --help)");
  }
  gpt::validate(o.config);
  // The corpus is bytes: every id 0..255 occurs, so a smaller vocabulary could not embed it.
  if (o.config.vocab < 256) throw config_error("--vocab must be >= 256 (the embedded corpus is byte-level)");
  if (o.seq > static_cast<std::size_t>(o.config.context))
    throw config_error("--seq " + std::to_string(o.seq) + " is longer than --context " +
                       std::to_string(o.config.context));
  // ZeRO's first iteration is untraced and its second carries the ranks' agreement on gathers
  // ahead: its bytes are checked from the third on.
  if (o.warmup < 2)
    throw config_error("--warmup must be >= 2 (ZeRO's first two iterations differ from its steady state)");
  for (int n : o.ranks)
    if (o.config.heads % n != 0)
      throw config_error(
          "--heads " + std::to_string(o.config.heads) + " does not split over " + std::to_string(n) +
          " ranks (RTP shards the attention by heads): pick a multiple of every --ranks value (12 for 1,2,3,4)");
  return o;
}

// ------------------------------------------------------------------------------------------------
// One rank's training loop, the same for every mode.

using link_comm = modelled_link<in_process_communicator>;
static_assert(Communicator<link_comm>, "modelled_link must be a Communicator to carry rtp_gpt and the chunk runtime");

struct setup {
  gpt::gpt_config config;
  std::size_t batch = 1, seq = 16;
  int warmup = 2, iterations = 1;
  link_model link;
  const gpt::text_data* data = nullptr;
};

/** What one rank recorded. Per-iteration vectors hold every iteration, warm-up included. */
struct rank_out {
  std::vector<double> iter_s, ring_wait_s, blocking_s, comm_s, losses;
  std::vector<std::uint64_t> sent, theory;  // bytes this rank sent in each iteration, and the mode's theory
  std::size_t model_bytes = 0;              // this rank's model data (rtp: shards and replicas; zero: its 1/N share)
  std::size_t peak = 0;                     // per_rank_model_bytes_peak
  std::size_t in_use = 0;                   // = peak (rtp: the shared transit buffers are all in use in any pass)
  std::size_t replica_bytes = 0;            // rtp: the replicated tensors' 4 lists
  std::size_t largest_shard = 0;            // rtp: the largest shard; zero: a chunk
  std::size_t whole = 0;                    // zero: the model data of all ranks (padded to whole groups)
  std::size_t collective = 0;               // zero: peak gather/reduce buffer bytes
  std::string error;                        // zero: the runtime's invariant violations
};

/** What one iteration of a mode reports besides what the loop measures. */
struct iteration {
  double loss = 0, ring_wait_s = 0;
  std::uint64_t theory = 0;  // bytes this rank should have sent
};

template <class Step>
void train(const setup& s, link_comm& link, rank_out& me, Step&& step) {
  const std::size_t B = s.batch, T = s.seq, first = B * static_cast<std::size_t>(link.rank());
  std::vector<int> tokens(B * T), targets(B * T);
  for (int it = 1; it <= s.warmup + s.iterations; ++it) {
    gpt::fill_batch(s.data->train, e2e::data_seed, gpt::train_key(it, 0), B, T, tokens.data(), targets.data(), first);
    const comm_stats c0 = link.stats();
    const double w0 = link.wall_seconds(), m0 = link.modelled_seconds();
    const auto t0 = e2e::clock::now();
    const iteration r = step(it, tokens.data(), targets.data());
    me.iter_s.push_back(e2e::seconds_since(t0));
    if (!std::isfinite(r.loss)) throw state_error("non-finite loss while training");
    me.sent.push_back(link.stats().bytes_sent - c0.bytes_sent);
    me.blocking_s.push_back(link.wall_seconds() - w0);
    me.comm_s.push_back(link.modelled_seconds() - m0);
    me.theory.push_back(r.theory);
    me.ring_wait_s.push_back(r.ring_wait_s);
    me.losses.push_back(r.loss);
  }
}

const adam_hyper hyper{.lr = e2e::learning_rate, .beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = e2e::weight_decay};
const param_groups groups = param_groups::with_default_decay(e2e::weight_decay);

void rtp_rank(const setup& s, link_comm& link, rank_out& me) {
  const int n = link.size();
  gpt::rtp_gpt<link_comm> m(link, s.config, s.batch, s.seq);
  m.init(e2e::model_seed);
  std::size_t replicated = 0;
  for (const auto& p : m.parts())
    if (p.replicated) replicated += p.elems;
  me.replica_bytes = 4 * replicated * sizeof(float);
  me.model_bytes = m.model_bytes();
  // Every rotation shares one set of transit buffers (five shards of the largest), all in use
  // during any pass: allocated and in use are the same.
  me.peak = m.model_bytes() + m.transient_bytes();
  me.in_use = me.peak;
  me.largest_shard = m.largest_shard_bytes();
  // The step's all-reduces: its arguments, 8 doubles per rank (step_agreement), and the clipping norm's one.
  const std::uint64_t norm_bytes =
      static_cast<std::uint64_t>(n - 1) * (8 * static_cast<std::uint64_t>(n) + 1) * sizeof(double);
  train(s, link, me, [&](int, const int* tokens, const int* targets) {
    m.reset_ring_stats();
    const double loss = m.forward(tokens, targets);
    m.backward(tokens, targets);
    m.step(hyper, groups, n, e2e::max_grad_norm);
    return iteration{loss, m.ring_wait_s(), m.iteration_bytes_theory() + norm_bytes};
  });
}

void dp_rank(const setup& s, link_comm& link, rank_out& me) {
  const int n = link.size();
  gpt::gpt_reference<float> ref(s.config, s.batch, s.seq);
  gpt::init_params(s.config, ref.params, e2e::model_seed);
  const std::size_t P = ref.param_data.size();
  std::vector<float> m(P, 0.0f), v(P, 0.0f);
  const auto specs = gpt::param_specs(s.config);
  me.model_bytes = me.peak = me.in_use = 4 * P * sizeof(float);
  std::int64_t steps = 0;
  train(s, link, me, [&](int, const int* tokens, const int* targets) {
    const double loss = ref.forward(tokens, targets);
    ref.backward(tokens, targets);
    link.allreduce(ref.grad_data.data(), P, dtype::f32, reduce_op::sum);
    // The global batch's mean gradient, clipped: every rank holds the same sum, so its norm needs
    // no collective (rtp_gpt's step squares the same unscaled values).
    const float unscale = 1.0f / static_cast<float>(n);
    double sq = 0;
    for (const float g : ref.grad_data) {
      const double y = static_cast<double>(g * unscale);
      sq += y * y;
    }
    const adam_step_args args{.step = ++steps,
                              .grad_scale = unscale * clip_coefficient(sq, e2e::max_grad_norm).coefficient};
    std::size_t at = 0;
    for (const auto& spec : specs) {
      const std::size_t k = spec.numel();
      adam_update(std::span<float>(ref.param_data).subspan(at, k), std::span<float>(m).subspan(at, k),
                  std::span<float>(v).subspan(at, k), std::span<const float>(ref.grad_data).subspan(at, k),
                  std::span<float>(), groups.hyper_for(spec, hyper), args);
      at += k;
    }
    return iteration{loss, 0.0, static_cast<std::uint64_t>(n - 1) * P * sizeof(float)};
  });
}

using zero_runtime = chunk_runtime<searched_chunk_layout, static_placement, belady_eviction, warmup_tracer, link_comm>;

void zero_rank(const setup& s, link_comm& link, rank_out& me) {
  const int n = link.size();
  const auto& c = s.config;
  const searched_chunk_layout layout;
  // Everything on the device, with room to spare: the activations and twice the whole model (a
  // rank's share plus its gather/reduce buffers is less; bench_zero sizes the budget exactly).
  simulated_device_space device(
      {.capacity = e2e::activation_bytes(c, s.batch, s.seq) + 2 * e2e::model_bytes(layout, c), .name = "device"});
  host_space host;
  host_copy_engine copier;
  zero_runtime rt(device, host, copier, link, {.sharding = {.enabled = n > 1}}, layout, static_placement::all_device());
  gpt::chunked_gpt<zero_runtime> model(rt, c, {s.batch, s.seq}, e2e::model_seed);
  model.finalize();
  chunk_adam<> opt({.hyper = hyper, .max_grad_norm = e2e::max_grad_norm}, groups);
  const std::uint64_t chunk = rt.plan().chunk_elems * sizeof(float), chunks = rt.plan().num_chunks;
  const auto n1 = static_cast<std::uint64_t>(n - 1);
  runtime_stats warm;
  std::uint64_t held = 0;  // groups the last step gathered for this iteration
  train(s, link, me, [&](int it, const int* tokens, const int* targets) {
    if (it == s.warmup + 1) {  // the steady state starts: keep the warm-up's peaks, restart them
      warm = rt.stats();
      rt.reset_stats();
    }
    const runtime_stats r0 = rt.stats();
    const double loss = model.forward_backward(tokens, targets);
    if (!opt.step(rt, e2e::learning_rate, n).stepped) throw state_error("a ZeRO fp32 step was skipped (overflow)");
    const std::uint64_t units = (rt.stats().gathers - r0.gathers) + (rt.stats().reductions - r0.reductions);
    // A step that gathered the next iteration's first groups: that iteration's first scope agrees
    // that every rank still holds them (an allreduce of one double).
    const std::uint64_t agreed = std::exchange(held, rt.stats().gathers_at_step - r0.gathers_at_step) > 0 ? 1 : 0;
    // And the step's arguments: 5 doubles per rank (step_agreement).
    return iteration{loss, 0.0, n1 * (units * chunk + (chunks + agreed + 5 * (n1 + 1)) * sizeof(double))};
  });
  me.whole = rt.model_bytes();
  me.model_bytes = me.whole / static_cast<std::size_t>(n);
  me.peak = me.in_use = std::max(warm.peak_model_bytes, rt.stats().peak_model_bytes);
  me.collective = std::max(warm.peak_collective_bytes, rt.stats().peak_collective_bytes);
  me.largest_shard = chunk;
  for (const auto& v : rt.invariant_violations(true)) me.error += (me.error.empty() ? "" : "; ") + v;
}

using rank_fn = void (*)(const setup&, link_comm&, rank_out&);

std::vector<rank_out> run_group(const setup& s, int n, rank_fn fn) {
  std::vector<rank_out> out(static_cast<std::size_t>(n));
  run_ranks(n, [&](in_process_communicator& comm) {
    omp_set_num_threads(1);  // this rank's kernels, GEMMs and Adam on its own thread
    link_comm link(comm, s.link);
    fn(s, link, out[static_cast<std::size_t>(comm.rank())]);
  });
  return out;
}

// ------------------------------------------------------------------------------------------------
// Summaries and self-checks.

std::vector<std::string> failures;  // self-check failures, printed at the end
void check(bool ok, const std::string& what) {
  if (!ok) {
    failures.push_back(what);
    std::printf("SELF-CHECK FAILED: %s\n", what.c_str());
  }
}

/** Median over the measured iterations of the max over ranks of @p per_iteration. */
double median_of_max(const std::vector<rank_out>& r, int warmup, const std::vector<double> rank_out::*per_iteration) {
  std::vector<double> v;
  for (std::size_t i = static_cast<std::size_t>(warmup); i < (r[0].*per_iteration).size(); ++i) {
    double m = 0;
    for (const auto& x : r) m = std::max(m, (x.*per_iteration)[i]);
    v.push_back(m);
  }
  return e2e::median(v);
}

/** The global batch's loss of each iteration: the mean of the ranks' micro-batch means. */
std::vector<double> global_losses(const std::vector<rank_out>& r) {
  std::vector<double> g(r[0].losses.size(), 0.0);
  for (std::size_t i = 0; i < g.size(); ++i) {
    for (const auto& x : r) g[i] += x.losses[i];
    g[i] /= static_cast<double>(r.size());
  }
  return g;
}

/** One mode at one N. Bytes: one rank's, the last iteration (every rank and checked iteration
 *  was compared with the theory). */
struct result {
  std::string mode;
  int ranks = 1;
  std::size_t whole = 0, peak = 0, in_use = 0, bound = 0, largest_shard = 0, collective = 0;
  std::uint64_t comm_bytes = 0, comm_theory = 0;
  double iteration_s = 0, compute_s = -1, ring_wait_s = 0, blocking_s = 0, comm_s = 0;
  double ring_wait_compute_s = 0;  // rtp: the ring wait with the link infinitely fast (waiting for peers)
  std::vector<double> losses;
};

/** Bytes against the theory on every rank, from iteration @p from (0-based) on. */
void check_bytes(const std::vector<rank_out>& r, std::size_t from, const std::string& at) {
  for (std::size_t k = 0; k < r.size(); ++k)
    for (std::size_t i = from; i < r[k].sent.size(); ++i)
      check(r[k].sent[i] == r[k].theory[i], at + ", rank " + std::to_string(k) + ", iteration " +
                                                std::to_string(i + 1) + ": sent " + std::to_string(r[k].sent[i]) +
                                                " bytes, theory " + std::to_string(r[k].theory[i]));
}

result summarise(const std::string& mode, const setup& s, const std::vector<rank_out>& r) {
  result x;
  x.mode = mode;
  x.ranks = static_cast<int>(r.size());
  x.losses = global_losses(r);
  for (const auto& y : r) {
    x.peak = std::max(x.peak, y.peak);
    x.in_use = std::max(x.in_use, y.in_use);
    x.largest_shard = std::max(x.largest_shard, y.largest_shard);
    x.collective = std::max(x.collective, y.collective);
  }
  x.comm_bytes = r[0].sent.back();
  x.comm_theory = r[0].theory.back();
  x.iteration_s = median_of_max(r, s.warmup, &rank_out::iter_s);
  x.ring_wait_s = median_of_max(r, s.warmup, &rank_out::ring_wait_s);
  x.blocking_s = median_of_max(r, s.warmup, &rank_out::blocking_s);
  x.comm_s = median_of_max(r, s.warmup, &rank_out::comm_s);
  return x;
}

result run_rtp(const setup& s, int n) {
  const std::string at = "rtp at N = " + std::to_string(n);
  setup fast = s;
  fast.link.sleep = false;
  const auto compute = run_group(fast, n, rtp_rank);
  const auto r = run_group(s, n, rtp_rank);
  result x = summarise("rtp", s, r);
  x.compute_s = median_of_max(compute, s.warmup, &rank_out::iter_s);
  x.ring_wait_compute_s = median_of_max(compute, s.warmup, &rank_out::ring_wait_s);
  check(global_losses(compute) == x.losses, at + ": the compute-only and the modelled run gave different losses");
  check_bytes(r, 0, at);
  // The whole model's data: every rank's shards, and the replicas once.
  for (const auto& y : r) x.whole += y.model_bytes - y.replica_bytes;
  x.whole += r[0].replica_bytes;
  for (std::size_t k = 0; k < r.size(); ++k) {
    const auto& y = r[k];
    const std::size_t bound = x.whole / static_cast<std::size_t>(n) + y.replica_bytes + 5 * y.largest_shard;
    x.bound = std::max(x.bound, bound);
    check(y.in_use <= bound, at + ", rank " + std::to_string(k) + ": model data in use " + std::to_string(y.in_use) +
                                 " bytes > all/N + replicas + 2 + 3 largest shards = " + std::to_string(bound));
    for (std::size_t i = 0; i < y.ring_wait_s.size(); ++i) {
      check(y.ring_wait_s[i] >= 0, at + ": negative ring wait");
      if (n == 1)
        check(y.ring_wait_s[i] == 0, at + ": ring wait " + std::to_string(y.ring_wait_s[i]) + " s with one rank");
    }
  }
  return x;
}

result run_dp(const setup& s, int n) {
  const std::string at = "dp at N = " + std::to_string(n);
  setup fast = s;
  fast.link.sleep = false;
  const auto compute = run_group(fast, n, dp_rank);
  const auto r = run_group(s, n, dp_rank);
  result x = summarise("dp", s, r);
  x.compute_s = median_of_max(compute, s.warmup, &rank_out::iter_s);
  check(global_losses(compute) == x.losses, at + ": the compute-only and the modelled run gave different losses");
  check_bytes(r, 0, at);
  x.whole = r[0].model_bytes;  // one replica is the whole model; every rank holds it
  return x;
}

result run_zero(const setup& s, int n) {
  const std::string at = "zero at N = " + std::to_string(n);
  const auto r = run_group(s, n, zero_rank);
  result x = summarise("zero", s, r);
  check_bytes(r, static_cast<std::size_t>(s.warmup), at);
  x.whole = r[0].whole;
  for (std::size_t k = 0; k < r.size(); ++k) {
    const auto& y = r[k];
    const std::string rk = at + ", rank " + std::to_string(k);
    if (!y.error.empty()) check(false, rk + ": invariant violations: " + y.error);
    check(y.peak <= y.model_bytes + y.collective, rk + ": model-data peak " + std::to_string(y.peak) + " > share " +
                                                      std::to_string(y.model_bytes) + " + gather/reduce buffers " +
                                                      std::to_string(y.collective));
  }
  return x;
}

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

double mib(std::size_t bytes) { return static_cast<double>(bytes) / 1048576.0; }

int write_plot(const options& o, const std::vector<result>& rs) {
  // One row per N: rtp, dp, zero (the order main runs them in).
  std::string mem, tim, wait;
  char buf[256];
  for (std::size_t i = 0; i + 2 < rs.size(); i += 3) {
    const result &r = rs[i], &d = rs[i + 1], &z = rs[i + 2];
    std::snprintf(buf, sizeof buf, "%d %.4f %.4f %.4f %.4f %.4f %.4f\n", r.ranks, mib(r.peak), mib(r.in_use),
                  mib(r.bound), mib(d.peak), mib(z.peak), mib(r.whole) / r.ranks);
    mem += buf;
    std::snprintf(buf, sizeof buf, "%d %.3f %.3f %.3f %.3f %.3f\n", r.ranks, 1e3 * r.iteration_s, 1e3 * d.iteration_s,
                  1e3 * z.iteration_s, 1e3 * r.compute_s, 1e3 * d.compute_s);
    tim += buf;
    std::snprintf(buf, sizeof buf, "%d %.4f %.4f %.4f\n", r.ranks, 100 * r.ring_wait_s / r.iteration_s,
                  100 * r.ring_wait_compute_s / r.compute_s, 100 * d.blocking_s / d.iteration_s);
    wait += buf;
  }
  const auto& c = o.config;
  char title[256], link[96];
  std::snprintf(title, sizeof title,
                "bench_rtp: GPT %d layers x width %d, %d heads, %zu x %zu tokens per rank; in-process ranks", c.layers,
                c.width, c.heads, o.batch, o.seq);
  std::snprintf(link, sizeof link, "link %.3g B/s + %.3g s", o.bandwidth, o.latency);
  // One colour per mode in every panel; dashed: the same mode with the link infinitely fast.
  const std::string rtp = " lc rgb '#1f77b4'", dp = " lc rgb '#d62728'", zero = " lc rgb '#2ca02c'";
  std::string script =
      std::string("set termoption noenhanced\nset grid\nset xlabel 'ranks N'\nset xtics 1\n") +
      "set multiplot layout 1,3 title '" + title + "'\n" +
      "set title 'model data per rank (max over ranks)'\nset ylabel 'MiB'\nset yrange [0:*]\nset key top right\n"
      "plot '@DIR@/mem.dat' using 1:5 with linespoints lw 2" +
      dp +
      " title 'dp: full replica', "
      "'' using 1:6 with linespoints lw 2" +
      zero +
      " title 'zero: peak', "
      "'' using 1:2 with linespoints lw 2" +
      rtp +
      " title 'rtp: allocated', "
      "'' using 1:3 with linespoints lw 2 dt 2" +
      rtp +
      " title 'rtp: in use (one rotation)', "
      "'' using 1:4 with lines lw 1 dt 3 lc rgb '#555555' title 'rtp bound: all/N + replicas + 5 shards', "
      "'' using 1:7 with lines lw 1 dt 4 lc rgb '#000000' title 'all / N'\n" +
      "set title 'one iteration (" + link +
      ")'\nset ylabel 'ms'\nset key top left\n"
      "plot '@DIR@/time.dat' using 1:2 with linespoints lw 2" +
      rtp +
      " title 'rtp', "
      "'' using 1:3 with linespoints lw 2" +
      dp +
      " title 'dp', "
      "'' using 1:4 with linespoints lw 2" +
      zero +
      " title 'zero', "
      "'' using 1:5 with linespoints lw 1 dt 2" +
      rtp +
      " title 'rtp, link infinite', "
      "'' using 1:6 with linespoints lw 1 dt 2" +
      dp +
      " title 'dp, link infinite'\n"
      "set title 'communication not hidden, share of the iteration'\nset ylabel '%'\n"
      "plot '@DIR@/wait.dat' using 1:2 with linespoints lw 2" +
      rtp +
      " title 'rtp: ring wait', "
      "'' using 1:3 with linespoints lw 1 dt 2" +
      rtp +
      " title 'rtp: ring wait, link infinite (peers)', "
      "'' using 1:4 with linespoints lw 2" +
      dp +
      " title 'dp: all-reduce'\n"
      "unset multiplot\n";
  return e2e::run_gnuplot("bench_rtp", o.plot, script, {{"mem.dat", mem}, {"time.dat", tim}, {"wait.dat", wait}},
                          "1800,560");
}

}  // namespace

int main(int argc, char** argv) try {
  e2e::configure_process();  // before any OpenMP region: passive OpenMP waiting, caching heap
  const options o = parse(argc, argv);
  const gpt::gpt_config& c = o.config;
  const gpt::text_data data = gpt::load_text("", o.seq);
  const setup s{.config = c,
                .batch = o.batch,
                .seq = o.seq,
                .warmup = o.warmup,
                .iterations = o.iterations,
                .link = {.bandwidth_bytes_per_s = o.bandwidth, .latency_s = o.latency},
                .data = &data};
  const std::size_t params = gpt::param_count(c);
  std::printf("bench_rtp: in-process ranks (one thread each, OpenMP 1 thread per rank) on %u cores; CPU kernels %s\n",
              std::thread::hardware_concurrency(), cpu_isa_report().c_str());
  std::printf(
      "GPT: %d layers, width %d, %d heads, vocabulary %d, context %d: %zu parameters, %.1f MiB of fp32 model data with "
      "Adam; "
      "%zu x %zu tokens per rank; AdamW + clipping; link %.3g B/s + %.3g s per collective; %d warm-up + %d measured "
      "iterations\n",
      c.layers, c.width, c.heads, c.vocab, c.context, params, mib(16 * params), o.batch, o.seq, o.bandwidth, o.latency,
      o.warmup, o.iterations);
  std::fflush(stdout);

  std::vector<result> rs;  // rtp, dp, zero per N
  for (int n : o.ranks) {
    const auto t0 = e2e::clock::now();
    rs.push_back(run_rtp(s, n));
    rs.push_back(run_dp(s, n));
    rs.push_back(run_zero(s, n));
    const result &r = rs[rs.size() - 3], &d = rs[rs.size() - 2], &z = rs.back();
    double drtp = 0, dzero = 0;
    for (std::size_t i = 0; i < d.losses.size(); ++i) {
      drtp = std::max(drtp, std::abs(r.losses[i] - d.losses[i]));
      dzero = std::max(dzero, std::abs(z.losses[i] - d.losses[i]));
    }
    check(drtp <= o.loss_tolerance,
          "N = " + std::to_string(n) + ": rtp's losses differ from dp's by " + std::to_string(drtp));
    check(dzero <= o.loss_tolerance,
          "N = " + std::to_string(n) + ": zero's losses differ from dp's by " + std::to_string(dzero));
    std::printf(
        "N = %d: losses %.4f -> %.4f (dp); largest |rtp - dp| %.3g, |zero - dp| %.3g; iteration ms rtp %.1f, dp %.1f, "
        "zero %.1f "
        "(%.1f s)\n",
        n, d.losses.front(), d.losses.back(), drtp, dzero, 1e3 * r.iteration_s, 1e3 * d.iteration_s,
        1e3 * z.iteration_s, e2e::seconds_since(t0));
    std::fflush(stdout);
  }

  std::printf(
      "\nmodel data per rank, max over ranks (fp32 weights, gradients, Adam moments; rtp: + the rotations' transit "
      "buffers; "
      "zero: the runtime's peak, gather/reduce buffers included)\n"
      "| mode | N | all ranks MiB | all / N MiB | per-rank peak MiB | rtp: in use MiB | rtp: bound MiB | peak / "
      "replica | "
      "largest shard (zero: chunk) KiB |\n|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
  const double replica = static_cast<double>(16 * params);
  for (const auto& x : rs) {
    char in_use[32] = "-", bound[32] = "-", shard[32] = "-";
    if (x.mode == "rtp") {
      std::snprintf(in_use, sizeof in_use, "%.2f", mib(x.in_use));
      std::snprintf(bound, sizeof bound, "%.2f", mib(x.bound));
    }
    if (x.largest_shard > 0) std::snprintf(shard, sizeof shard, "%.1f", static_cast<double>(x.largest_shard) / 1024);
    std::printf("| %s | %d | %.2f | %.2f | %.2f | %s | %s | %.3f | %s |\n", x.mode.c_str(), x.ranks, mib(x.whole),
                mib(x.whole) / x.ranks, mib(x.peak), in_use, bound, static_cast<double>(x.peak) / replica, shard);
  }
  std::printf(
      "\none iteration (forward, backward, step), median over the measured iterations of the max over ranks; bytes "
      "sent by one "
      "rank in one iteration\n"
      "| mode | N | comm MiB | theory MiB | = | comm ms (modelled) | iteration ms | link infinite ms | ring wait ms | "
      "ring wait / iteration | ring wait, link infinite ms | blocking all-reduces ms |\n"
      "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const auto& x : rs) {
    char compute[32] = "-", wait[32] = "-", share[32] = "-", skew[32] = "-";
    if (x.compute_s >= 0) std::snprintf(compute, sizeof compute, "%.1f", 1e3 * x.compute_s);
    if (x.mode == "rtp") {
      std::snprintf(wait, sizeof wait, "%.2f", 1e3 * x.ring_wait_s);
      std::snprintf(share, sizeof share, "%.3f", x.ring_wait_s / x.iteration_s);
      std::snprintf(skew, sizeof skew, "%.2f", 1e3 * x.ring_wait_compute_s);
    }
    std::printf("| %s | %d | %.3f | %.3f | %s | %.1f | %.1f | %s | %s | %s | %s | %.2f |\n", x.mode.c_str(), x.ranks,
                mib(x.comm_bytes), mib(x.comm_theory), x.comm_bytes == x.comm_theory ? "yes" : "NO", 1e3 * x.comm_s,
                1e3 * x.iteration_s, compute, wait, share, skew, 1e3 * x.blocking_s);
  }

  if (!o.json.empty()) {
    std::vector<e2e::json_record> records;
    for (const auto& x : rs) {
      e2e::json_record j;
      j.str("benchmark", "rtp").str("mode", x.mode).num("ranks", x.ranks);
      j.num("layers", c.layers)
          .num("width", c.width)
          .num("heads", c.heads)
          .num("vocab", c.vocab)
          .num("context", c.context);
      j.num("batch", double(o.batch)).num("seq", double(o.seq)).num("params", double(params));
      j.num("model_bytes", double(x.whole)).num("per_rank_model_bytes_peak", double(x.peak));
      j.num("per_rank_model_bytes_in_use", double(x.in_use));
      if (x.mode == "rtp") j.num("per_rank_model_bytes_bound", double(x.bound));
      if (x.mode == "zero") j.num("gather_buffer_bytes", double(x.collective));
      j.num("largest_shard_bytes", double(x.largest_shard));
      j.num("comm_bytes", double(x.comm_bytes)).num("comm_bytes_theory", double(x.comm_theory));
      j.num("iteration_s", x.iteration_s)
          .num("ring_wait_s", x.ring_wait_s)
          .num("blocking_comm_s", x.blocking_s)
          .num("comm_s", x.comm_s);
      if (x.compute_s >= 0) j.num("compute_s", x.compute_s);
      if (x.mode == "rtp") j.num("ring_wait_link_infinite_s", x.ring_wait_compute_s);
      j.num("bandwidth", o.bandwidth).num("latency", o.latency).num("iterations", o.iterations).num("warmup", o.warmup);
      j.str("losses", losses_text(x.losses));
      records.push_back(j);
    }
    e2e::write_json(o.json, records);
  }
  if (!o.plot.empty()) write_plot(o, rs);
  if (!failures.empty()) {
    std::printf("\nbench_rtp: %zu self-check(s) FAILED\n", failures.size());
    return 1;
  }
  std::printf(
      "\nbench_rtp: all self-checks hold (rtp and dp bytes = theory, zero bytes = its gathers and reductions, rtp "
      "model data in "
      "use <= all/N + replicas + 5 largest shards, zero peak <= share + buffers, rtp and zero losses within %.3g of "
      "dp's, "
      "the same losses with and without the modelled link, ring wait >= 0 and 0 at one rank)\n",
      o.loss_tolerance);
  return 0;
} catch (const chunkstar::error& e) {
  std::fprintf(stderr, "bench_rtp: %s\n", e.what());
  return 2;
}
