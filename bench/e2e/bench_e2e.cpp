// SPDX-License-Identifier: Apache-2.0
// bench_e2e: the GPT trainer end to end.
//
//   overhead: one iteration (forward, backward, AdamW step) with every chunk resident in chunkstar,
//             against the same trainer over plain arrays; both compute the same step-1 loss (checked
//             bit for bit before timing), and their iterations alternate so machine noise hits both.
//   offload:  the chunkstar trainer at device budgets from 100% down to 10% of the model data (plus
//             room for activations), Belady and LRU eviction, prefetch on and off, with a modelled
//             host<->device link; iteration time against an all-resident trainer run alongside.
//
// See docs/performance.md for the results and how to read them.
#include "../bench_cli.hpp"
#include "e2e_support.hpp"

#include <chunkstar/eviction/belady.hpp>
#include <chunkstar/eviction/lru.hpp>
#include <chunkstar/optim/adam.hpp>
#include <chunkstar/optim/clip.hpp>
#include <chunkstar/optim/grad_check.hpp>
#include <chunkstar/optim/param_groups.hpp>
#include <chunkstar/placement/auto_placement.hpp>
#include <chunkstar/placement/static_placement.hpp>

#include <cmath>
#include <cstring>
#include <ctime>
#include <map>

using namespace chunkstar;
using e2e::seconds_since;

namespace {

struct options {
  std::string mode = "all";
  std::string json, plot;
  std::string preset = "small";
  std::size_t batch = 4, seq = 128;
  int iterations = 0;  // measured iterations per trainer and configuration; 0: 31 (overhead), 5 (offload)
  int warmup = 2;      // iterations before measuring (the first one records the trace)
  double bandwidth = 2e9;
  double latency = 10e-6;
  std::size_t prefetch_depth = 2;
  std::vector<double> budgets{1.0, 0.75, 0.5, 0.25, 0.1};
  bool quick = false;

  [[nodiscard]] int overhead_iterations() const { return iterations ? iterations : 31; }
  [[nodiscard]] int offload_iterations() const { return iterations ? iterations : 5; }
};

/** CPU seconds of this process (all threads): less sensitive than wall time to other processes
 *  on a shared machine, though not to their cache and memory-bandwidth pressure. */
double process_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// ------------------------------------------------------------------------------------------------
// The plain trainer: the same model math over flat arrays (gpt_reference), and the same AdamW
// update as chunk_adam, tensor by tensor: global norm from sum_of_squares, clipping coefficient
// folded into the gradient scale, per-role weight decay.

class plain_trainer {
 public:
  plain_trainer(const gpt::gpt_config& c, std::size_t B, std::size_t T)
      : ref_(c, B, T),
        specs_(gpt::param_specs(c)),
        m_(ref_.param_data.size(), 0.0f),
        v_(ref_.param_data.size(), 0.0f),
        groups_(param_groups::with_default_decay(e2e::weight_decay)) {
    params_ = gpt::param_list(ref_.params);
    grads_ = gpt::param_list(ref_.grads);
    for (std::size_t i = 0; i < specs_.size(); ++i)
      gpt::init_tensor<float>(c, specs_[i], i, params_[i], e2e::model_seed);
  }

  double step(const int* tokens, const int* targets) {
    const double loss = ref_.forward(tokens, targets);
    ref_.backward(tokens, targets);  // zeroes the gradients first, as chunkstar starts from FREE grads
    double sum_sq = 0;
    for (std::size_t t = 0; t < specs_.size(); ++t)
      sum_sq += sum_of_squares<float>({grads_[t], specs_[t].numel()}, 1.0f);
    if (!std::isfinite(sum_sq)) throw state_error("plain trainer: gradient overflow in fp32");
    const float coefficient = clip_coefficient(sum_sq, e2e::max_grad_norm).coefficient;
    const adam_hyper base{.lr = e2e::learning_rate, .weight_decay = e2e::weight_decay};
    const adam_step_args args{.step = ++steps_, .grad_scale = coefficient};
    std::size_t offset = 0;
    for (std::size_t t = 0; t < specs_.size(); ++t) {
      const std::size_t n = specs_[t].numel();
      adam_update<float, float>({params_[t], n}, {m_.data() + offset, n}, {v_.data() + offset, n}, {grads_[t], n}, {},
                                groups_.hyper_for(specs_[t], base), args);
      offset += n;
    }
    return loss;
  }

 private:
  gpt::gpt_reference<float> ref_;
  std::vector<tensor_spec> specs_;
  std::vector<float*> params_, grads_;
  std::vector<float> m_, v_;
  param_groups groups_;
  std::int64_t steps_ = 0;
};

// ------------------------------------------------------------------------------------------------
// The chunkstar trainers.

using resident_runtime = chunk_runtime<searched_chunk_layout, static_placement>;
template <class Eviction>
using offload_runtime = chunk_runtime<searched_chunk_layout, auto_placement, Eviction>;

/** Everything resident: static placement keeps every chunk (and every optimizer step) on a device
 *  with room for all of it, so after the first iteration nothing moves. */
std::unique_ptr<e2e::chunk_trainer<resident_runtime>> make_resident(const gpt::gpt_config& c, const options& o,
                                                                    copy_model link = {}) {
  const auto layout = e2e::trainer_layout(c);
  const std::size_t capacity = 2 * (e2e::model_bytes(layout, c) + e2e::activation_bytes(c, o.batch, o.seq));
  return std::make_unique<e2e::chunk_trainer<resident_runtime>>(
      c, gpt::batch_shape{o.batch, o.seq}, e2e::trainer_memory{.device_capacity = capacity, .link = link},
      runtime_options{.prefetch_depth = o.prefetch_depth}, layout, static_placement::all_device());
}

// ------------------------------------------------------------------------------------------------
// overhead

struct overhead_result {
  std::vector<double> plain_s, chunk_s;          // wall seconds per iteration
  std::vector<double> plain_cpu_s, chunk_cpu_s;  // process CPU seconds per iteration
  double plain_loss1 = 0, chunk_loss1 = 0, plain_loss2 = 0, chunk_loss2 = 0;
};

overhead_result run_overhead(const gpt::gpt_config& c, const options& o) {
  std::printf("\n== overhead: plain arrays vs everything resident in chunkstar ==\n");
  plain_trainer plain(c, o.batch, o.seq);
  auto chunk = make_resident(c, o);
  e2e::batches data(o.batch, o.seq);
  overhead_result r;
  // Step 1 from the same initial parameters on the same batch: the same loss, bit for bit.
  data.load(1);
  r.plain_loss1 = plain.step(data.tokens(), data.targets());
  r.chunk_loss1 = chunk->step(data.tokens(), data.targets());
  data.load(2);
  r.plain_loss2 = plain.step(data.tokens(), data.targets());
  r.chunk_loss2 = chunk->step(data.tokens(), data.targets());
  std::printf("step-1 loss: plain %.9f, chunkstar %.9f (%s)\n", r.plain_loss1, r.chunk_loss1,
              r.plain_loss1 == r.chunk_loss1 ? "identical bits" : "DIFFERENT");
  std::printf("step-2 loss (after one AdamW step): plain %.9f, chunkstar %.9f (%s)\n", r.plain_loss2, r.chunk_loss2,
              r.plain_loss2 == r.chunk_loss2 ? "identical bits"
                                             : "differ: the global norm adds the same squares in another order");
  if (r.plain_loss1 != r.chunk_loss1)
    throw state_error("the chunkstar trainer's step-1 loss differs from the plain trainer's: timing different work");
  if (std::abs(r.plain_loss2 - r.chunk_loss2) > 1e-4 * std::abs(r.plain_loss2))
    throw state_error("the chunkstar trainer's step-2 loss is far from the plain trainer's: the optimizers differ");
  std::int64_t step = 3;
  const auto chunk_moved_before = chunk->runtime().stats().bytes_moved();
  for (int i = 0; i < o.warmup; ++i, ++step) {
    data.load(step);
    plain.step(data.tokens(), data.targets());
    chunk->step(data.tokens(), data.targets());
  }
  std::printf("%6s %12s %12s %8s %12s %12s %8s\n", "round", "plain ms", "chunkstar ms", "ratio", "plain cpu",
              "chunk cpu", "ratio");
  for (int i = 0; i < o.overhead_iterations(); ++i, ++step) {
    data.load(step);
    // Alternate which goes first, so a slow spell on the shared machine does not favour one side.
    auto time_plain = [&] {
      const double c0 = process_cpu_s();
      const auto t0 = e2e::clock::now();
      plain.step(data.tokens(), data.targets());
      r.plain_s.push_back(seconds_since(t0));
      r.plain_cpu_s.push_back(process_cpu_s() - c0);
    };
    auto time_chunk = [&] {
      const double c0 = process_cpu_s();
      const auto t0 = e2e::clock::now();
      chunk->step(data.tokens(), data.targets());
      r.chunk_s.push_back(seconds_since(t0));
      r.chunk_cpu_s.push_back(process_cpu_s() - c0);
    };
    if (i % 2 == 0) {
      time_plain();
      time_chunk();
    } else {
      time_chunk();
      time_plain();
    }
    std::printf("%6d %12.1f %12.1f %8.3f %12.1f %12.1f %8.3f\n", i + 1, 1e3 * r.plain_s.back(), 1e3 * r.chunk_s.back(),
                r.chunk_s.back() / r.plain_s.back(), 1e3 * r.plain_cpu_s.back(), 1e3 * r.chunk_cpu_s.back(),
                r.chunk_cpu_s.back() / r.plain_cpu_s.back());
    std::fflush(stdout);
  }
  if (chunk->runtime().stats().bytes_moved() != chunk_moved_before)
    throw state_error("the all-resident chunkstar trainer moved chunks after its first iteration");
  std::vector<double> ratios;
  for (std::size_t i = 0; i < r.plain_s.size(); ++i) ratios.push_back(r.chunk_s[i] / r.plain_s[i]);
  const double pm = e2e::median(r.plain_s), cm = e2e::median(r.chunk_s);
  std::printf("median wall: plain %.1f ms, chunkstar %.1f ms: ratio %.4f (median of per-round ratios %.4f)\n", 1e3 * pm,
              1e3 * cm, cm / pm, e2e::median(ratios));
  std::printf("median CPU:  plain %.1f ms, chunkstar %.1f ms: ratio %.4f\n", 1e3 * e2e::median(r.plain_cpu_s),
              1e3 * e2e::median(r.chunk_cpu_s), e2e::median(r.chunk_cpu_s) / e2e::median(r.plain_cpu_s));
  return r;
}

// ------------------------------------------------------------------------------------------------
// offload

struct offload_row {
  std::string policy;
  bool prefetch = false;
  double budget_fraction = 0;
  std::size_t capacity = 0;
  double iteration_s = 0, resident_s = 0;                                       // medians over the measured iterations
  double bytes_moved = 0, bytes_to_device = 0, bytes_to_host = 0, stall_s = 0;  // per iteration
  double evictions = 0, offloads = 0, demand_loads = 0, prefetches = 0, prefetch_hits = 0;
  double host_steps = 0, device_steps = 0;
  std::size_t peak_device = 0;
  std::string error;  // non-empty: the budget could not hold a stage's working set
};

/** One configuration of the offload sweep, type-erased so the sweep can interleave them. */
class offload_trainer {
 public:
  virtual ~offload_trainer() = default;
  virtual void step(const e2e::batches& b) = 0;
  [[nodiscard]] virtual runtime_stats stats() const = 0;
  [[nodiscard]] virtual std::size_t device_peak() const = 0;
  virtual void reset_device_peak() = 0;
};

template <class Eviction>
class offload_trainer_of final : public offload_trainer {
 public:
  offload_trainer_of(const gpt::gpt_config& c, const options& o, std::size_t capacity, bool prefetch)
      : t_(c, {o.batch, o.seq},
           {.device_capacity = capacity, .link = {.bandwidth_bytes_per_s = o.bandwidth, .latency_s = o.latency}},
           {.prefetch_depth = prefetch ? o.prefetch_depth : 0}, e2e::trainer_layout(c), auto_placement{}) {}
  void step(const e2e::batches& b) override { t_.step(b.tokens(), b.targets()); }
  [[nodiscard]] runtime_stats stats() const override { return const_cast<trainer&>(t_).runtime().stats(); }
  [[nodiscard]] std::size_t device_peak() const override { return const_cast<trainer&>(t_).device().peak(); }
  void reset_device_peak() override { t_.device().reset_peak(); }

 private:
  using trainer = e2e::chunk_trainer<offload_runtime<Eviction>>;
  trainer t_;
};

/** Runs @p f, turning the typed errors of a budget too small for a stage into @p error. */
template <class F>
bool guarded(std::string& error, F&& f) {
  try {
    f();
    return true;
  } catch (const out_of_memory_error& e) {
    error = std::string("out_of_memory_error: ") + e.what();
  } catch (const config_error& e) {
    error = std::string("config_error: ") + e.what();
  }
  return false;
}

std::vector<offload_row> run_offload(const gpt::gpt_config& c, const options& o) {
  const auto layout = e2e::trainer_layout(c);
  const auto plan = layout.plan(gpt::param_specs(c));
  const std::size_t model = e2e::model_bytes(layout, c), act = e2e::activation_bytes(c, o.batch, o.seq);
  std::printf("\n== offload: device budget = activations %s MiB + fraction x model data %s MiB ==\n",
              e2e::mib(static_cast<double>(act)).c_str(), e2e::mib(static_cast<double>(model)).c_str());
  std::printf(
      "layout: %zu chunks of %zu elements per list (%s MiB per fp32 chunk, waste %.1f%%); 4 lists (param, grad, "
      "momentum, variance)\n",
      plan.num_chunks, plan.chunk_elems, e2e::mib(static_cast<double>(plan.chunk_elems * 4)).c_str(),
      100 * plan.waste_fraction());
  std::printf("link: %.2f GB/s per direction (full duplex), %.0f us per copy; prefetch depth %zu when on\n",
              o.bandwidth / 1e9, o.latency * 1e6, o.prefetch_depth);
  std::printf(
      "per budget, the four configurations and an all-resident trainer ('resid') take turns, one iteration\n"
      "each per round, %d warm-up + %d measured rounds\n\n",
      o.warmup, o.offload_iterations());
  auto resident = make_resident(c, o);
  e2e::batches data(o.batch, o.seq);
  for (int i = 0; i < o.warmup; ++i) {  // its first iterations record the trace and load every chunk
    data.load(i + 1);
    resident->step(data.tokens(), data.targets());
  }
  std::printf("%-7s %-3s %6s %9s %9s %7s %10s %9s %8s %8s %7s\n", "policy", "pf", "budget", "iter ms", "resid ms",
              "ratio", "moved MiB", "stall ms", "evicts", "demand", "host st");
  std::vector<offload_row> rows;
  for (double f : o.budgets) {
    const std::size_t capacity = act + static_cast<std::size_t>(f * static_cast<double>(model));
    std::vector<offload_row> group;
    std::vector<std::unique_ptr<offload_trainer>> trainers;
    for (int pol = 0; pol < 2; ++pol) {
      for (bool pf : {true, false}) {
        offload_row r;
        r.policy = pol == 0 ? "belady" : "lru";
        r.prefetch = pf;
        r.budget_fraction = f;
        r.capacity = capacity;
        std::unique_ptr<offload_trainer> t;
        guarded(r.error, [&] {
          if (pol == 0) t = std::make_unique<offload_trainer_of<belady_eviction>>(c, o, capacity, pf);
          else t = std::make_unique<offload_trainer_of<lru_eviction>>(c, o, capacity, pf);
        });
        group.push_back(r);
        trainers.push_back(std::move(t));
      }
    }
    const std::size_t n = group.size();
    std::vector<std::vector<double>> times(n);
    std::vector<double> resident_times;
    std::vector<runtime_stats> before(n);
    for (int round = 0; round < o.warmup + o.offload_iterations(); ++round) {
      const bool measured = round >= o.warmup;
      if (measured && round == o.warmup)
        for (std::size_t i = 0; i < n; ++i)
          if (trainers[i]) {
            before[i] = trainers[i]->stats();
            trainers[i]->reset_device_peak();
          }
      data.load(round + 1);
      // Rotate who goes first each round, so a slow spell on the shared machine spreads evenly.
      for (std::size_t k = 0; k <= n; ++k) {
        const std::size_t i = (k + static_cast<std::size_t>(round)) % (n + 1);
        if (i == n) {
          const auto t0 = e2e::clock::now();
          resident->step(data.tokens(), data.targets());
          if (measured) resident_times.push_back(seconds_since(t0));
          continue;
        }
        if (!trainers[i]) continue;
        const auto t0 = e2e::clock::now();
        if (!guarded(group[i].error, [&] { trainers[i]->step(data); })) {
          trainers[i].reset();
          continue;
        }
        if (measured) times[i].push_back(seconds_since(t0));
      }
    }
    for (std::size_t i = 0; i < n; ++i) {
      offload_row& r = group[i];
      if (trainers[i]) {
        const runtime_stats s = trainers[i]->stats();
        const runtime_stats& b = before[i];
        const double it = o.offload_iterations();
        r.iteration_s = e2e::median(times[i]);
        r.resident_s = e2e::median(resident_times);
        r.bytes_to_device = static_cast<double>(s.bytes_to_device - b.bytes_to_device) / it;
        r.bytes_to_host = static_cast<double>(s.bytes_to_host - b.bytes_to_host) / it;
        r.bytes_moved = r.bytes_to_device + r.bytes_to_host;
        r.stall_s = (s.stall_s - b.stall_s) / it;
        r.evictions = static_cast<double>(s.evictions - b.evictions) / it;
        r.offloads = static_cast<double>(s.offloads - b.offloads) / it;
        r.demand_loads = static_cast<double>(s.demand_loads - b.demand_loads) / it;
        r.prefetches = static_cast<double>(s.prefetches - b.prefetches) / it;
        r.prefetch_hits = static_cast<double>(s.prefetch_hits - b.prefetch_hits) / it;
        r.host_steps = static_cast<double>(s.host_steps - b.host_steps) / it;
        r.device_steps = static_cast<double>(s.device_steps - b.device_steps) / it;
        r.peak_device = trainers[i]->device_peak();
        if (r.peak_device > r.capacity) throw state_error("a simulated device went over its capacity");
        std::printf("%-7s %-3s %5.0f%% %9.1f %9.1f %7.3f %10.1f %9.1f %8.1f %8.1f %7.1f\n", r.policy.c_str(),
                    r.prefetch ? "on" : "off", 100 * f, 1e3 * r.iteration_s, 1e3 * r.resident_s,
                    r.iteration_s / r.resident_s, r.bytes_moved / 1048576.0, 1e3 * r.stall_s, r.evictions,
                    r.demand_loads, r.host_steps);
      } else {
        std::printf("%-7s %-3s %5.0f%%  skipped: %s\n", r.policy.c_str(), r.prefetch ? "on" : "off", 100 * f,
                    r.error.substr(0, r.error.find('\n')).c_str());
      }
      rows.push_back(r);
    }
    std::fflush(stdout);
  }
  std::printf(
      "\nratio = iteration / resident iteration (medians); moved = both directions; demand = loads a scope\n"
      "waited for from the start; host st = chunk optimizer steps on the host (their chunks move there and back)\n");
  return rows;
}

// ------------------------------------------------------------------------------------------------
// output

int write_plot(const options& o, const overhead_result* ov, const std::vector<offload_row>& rows) {
  std::vector<std::pair<std::string, std::string>> files;
  std::string script = "set grid\n";
  const int panels = (ov ? 1 : 0) + (rows.empty() ? 0 : 3);
  script += panels > 1 ? "set multiplot layout 2,2 title 'bench\\_e2e: GPT trainer over chunkstar'\n" : "";
  if (ov) {
    std::string text;
    for (std::size_t i = 0; i < ov->plain_s.size(); ++i) {
      char buf[96];
      std::snprintf(buf, sizeof buf, "%zu %.3f %.3f\n", i + 1, 1e3 * ov->plain_s[i], 1e3 * ov->chunk_s[i]);
      text += buf;
    }
    files.emplace_back("overhead.dat", text);
    const double ratio = e2e::median(ov->chunk_s) / e2e::median(ov->plain_s);
    char title[160];
    std::snprintf(title, sizeof title, "overhead: everything resident, median ratio %.3f", ratio);
    script += std::string("set title '") + title +
              "'\nset xlabel 'round (alternating)'\nset ylabel 'ms per iteration'\n"
              "set yrange [0:*]\nset key bottom right\n"
              "plot '@DIR@/overhead.dat' using 1:2 with linespoints title 'plain arrays', "
              "'@DIR@/overhead.dat' using 1:3 with linespoints title 'chunkstar'\nset yrange [*:*]\n";
  }
  if (!rows.empty()) {
    std::map<std::string, std::string> by;
    for (const auto& r : rows) {
      if (!r.error.empty()) continue;
      char buf[160];
      std::snprintf(buf, sizeof buf, "%.0f %.4f %.2f %.3f\n", 100 * r.budget_fraction, r.iteration_s / r.resident_s,
                    r.bytes_moved / 1048576.0, 1e3 * r.stall_s);
      by[r.policy + (r.prefetch ? "_prefetch" : "_no_prefetch")] += buf;
    }
    std::string p1, p2, p3;
    for (const auto& [k, text] : by) {
      files.emplace_back(k + ".dat", text);
      std::string title = k;
      std::replace(title.begin(), title.end(), '_', ' ');
      const std::string f = "'@DIR@/" + k + ".dat'";
      p1 += (p1.empty() ? "plot " : ", ") + f + " using 1:2 with linespoints title '" + title + "'";
      p2 += (p2.empty() ? "plot " : ", ") + f + " using 1:3 with linespoints title '" + title + "'";
      p3 += (p3.empty() ? "plot " : ", ") + f + " using 1:4 with linespoints title '" + title + "'";
    }
    char link[96];
    std::snprintf(link, sizeof link, " (link %.1f GB/s)", o.bandwidth / 1e9);
    script += std::string(
                  "set xlabel 'device budget (% of model data, beyond activations)'\nset xrange [105:5]\n"
                  "set key top left\nset title 'offload: iteration time / all-resident") +
              link +
              "'\n"
              "set ylabel 'ratio'\n" +
              p1 +
              ", 1.15 with lines dt 2 lc rgb 'gray' title '+15%'\n"
              "set title 'offload: bytes moved per iteration'\nset ylabel 'MiB'\n" +
              p2 +
              "\n"
              "set title 'offload: stall per iteration'\nset ylabel 'ms'\n" +
              p3 + "\n";
  }
  if (panels > 1) script += "unset multiplot\n";
  return e2e::run_gnuplot("bench_e2e", o.plot, script, files);
}

void usage() {
  std::printf(
      "usage: bench_e2e [--mode overhead|offload|all] [--json FILE] [--plot FILE.png] [--quick]\n"
      "                 [--preset NAME (small)] [--batch B (4)] [--seq T (128)] [--iterations N (31 overhead, 5 "
      "offload)]\n"
      "                 [--warmup N (2)] [--bandwidth BYTES_PER_S (2e9)] [--prefetch-depth N (2)]\n"
      "                 [--budgets 1,0.75,0.5,0.25,0.1]\n");
}

options parse(int argc, char** argv) {
  options o;
  bool batch_set = false, seq_set = false, iterations_set = false, preset_set = false, budgets_set = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw config_error(a + " needs a value (see --help)");
      return argv[++i];
    };
    if (a == "--quick") o.quick = true;
    else if (a == "--mode") o.mode = value();
    else if (a == "--json") o.json = value();
    else if (a == "--plot") o.plot = value();
    else if (a == "--preset") o.preset = value(), preset_set = true;
    else if (a == "--batch") o.batch = std::stoul(value()), batch_set = true;
    else if (a == "--seq") o.seq = std::stoul(value()), seq_set = true;
    else if (a == "--iterations") o.iterations = std::stoi(value()), iterations_set = true;
    else if (a == "--warmup") o.warmup = std::stoi(value());
    else if (a == "--bandwidth") o.bandwidth = std::stod(value());
    else if (a == "--prefetch-depth") o.prefetch_depth = std::stoul(value());
    else if (a == "--budgets") {
      o.budgets = chunkstar::bench::parse_number_list(a, value());
      budgets_set = true;
    } else if (a == "--help" || a == "-h") {
      usage();
      std::exit(0);
    } else {
      usage();
      throw config_error("unknown argument '" + a + "'");
    }
  }
  if (o.quick) {  // tiny sizes for the CTest smoke run; explicit flags still win
    if (!preset_set) o.preset = "tiny";
    if (!batch_set) o.batch = 2;
    if (!seq_set) o.seq = 32;
    if (!iterations_set) o.iterations = 2;
    if (!budgets_set) o.budgets = {1.0, 0.5, 0.25};
  }
  if (o.mode != "overhead" && o.mode != "offload" && o.mode != "all")
    throw config_error("--mode '" + o.mode + "': use overhead, offload or all");
  if (o.iterations < 0 || o.warmup < 1 || o.bandwidth <= 0 || o.batch < 1 || o.seq < 1)
    throw config_error(
        "need --iterations >= 1 (0: the defaults), --warmup >= 1 (the first iteration records the trace), "
        "--bandwidth > 0, --batch >= 1 and --seq >= 1");
  for (double f : o.budgets)
    if (!(f > 0 && f <= 1)) throw config_error("--budgets: every fraction must lie in (0, 1]");
  return o;
}

}  // namespace

int main(int argc, char** argv) try {
  e2e::configure_process();  // before any OpenMP region: passive OpenMP waiting, caching heap
  const options o = parse(argc, argv);
  const gpt::gpt_config c = gpt::parse_preset(o.preset);
  std::printf(
      "bench_e2e: preset %s (%d layers, width %d, %d heads): %zu parameters; batch %zu x %zu tokens; "
      "OMP_WAIT_POLICY=%s\n",
      o.preset.c_str(), c.layers, c.width, c.heads, gpt::param_count(c), o.batch, o.seq,
      std::getenv("OMP_WAIT_POLICY"));
  std::vector<e2e::json_record> records;
  std::optional<overhead_result> ov;
  std::vector<offload_row> rows;
  if (o.mode != "offload") {
    ov = run_overhead(c, o);
    for (const bool chunk : {false, true}) {
      const auto& s = chunk ? ov->chunk_s : ov->plain_s;
      e2e::json_record j;
      j.str("benchmark", "overhead").str("mode", chunk ? "chunkstar" : "plain").num("iteration_s", e2e::median(s));
      j.num("ratio_to_plain", e2e::median(s) / e2e::median(ov->plain_s));
      j.num("step1_loss", chunk ? ov->chunk_loss1 : ov->plain_loss1)
          .num("step2_loss", chunk ? ov->chunk_loss2 : ov->plain_loss2);
      std::string samples;
      for (double x : s) samples += (samples.empty() ? "" : " ") + std::to_string(x);
      const auto& cpu = chunk ? ov->chunk_cpu_s : ov->plain_cpu_s;
      j.num("cpu_s", e2e::median(cpu)).num("cpu_ratio_to_plain", e2e::median(cpu) / e2e::median(ov->plain_cpu_s));
      j.str("iteration_samples_s", samples).str("preset", o.preset).num("batch", static_cast<double>(o.batch));
      j.num("seq", static_cast<double>(o.seq)).num("params", static_cast<double>(gpt::param_count(c)));
      records.push_back(j);
    }
  }
  if (o.mode != "overhead") {
    rows = run_offload(c, o);
    for (const auto& r : rows) {
      e2e::json_record j;
      j.str("benchmark", "offload").str("policy", r.policy).boolean("prefetch", r.prefetch);
      j.num("prefetch_depth", r.prefetch ? static_cast<double>(o.prefetch_depth) : 0)
          .num("budget_fraction", r.budget_fraction);
      j.num("device_capacity", static_cast<double>(r.capacity));
      if (!r.error.empty()) {
        j.str("error", r.error);
      } else {
        j.num("iteration_s", r.iteration_s).num("resident_iteration_s", r.resident_s);
        j.num("ratio_to_resident", r.iteration_s / r.resident_s).num("bytes_moved", r.bytes_moved);
        j.num("bytes_to_device", r.bytes_to_device).num("bytes_to_host", r.bytes_to_host).num("stall_s", r.stall_s);
        j.num("evictions", r.evictions).num("offloads", r.offloads).num("demand_loads", r.demand_loads);
        j.num("prefetches", r.prefetches).num("prefetch_hits", r.prefetch_hits).num("host_steps", r.host_steps);
        j.num("device_steps", r.device_steps).num("peak_device_bytes", static_cast<double>(r.peak_device));
      }
      j.num("bandwidth_bytes_per_s", o.bandwidth).num("latency_s", o.latency).str("preset", o.preset);
      j.num("batch", static_cast<double>(o.batch)).num("seq", static_cast<double>(o.seq));
      records.push_back(j);
    }
  }
  if (!o.json.empty()) e2e::write_json(o.json, records);
  if (!o.plot.empty()) return write_plot(o, ov ? &*ov : nullptr, rows);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_e2e: %s\n", e.what());
  return 1;
}
