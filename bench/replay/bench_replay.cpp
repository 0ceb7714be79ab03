// SPDX-License-Identifier: Apache-2.0
// bench_replay: records the chunk-access trace of a transformer-shaped model training through a
// chunk_runtime on a simulated device, then replays training at budgets from 100% down to 10% of
// the model data, for LRU and Belady eviction with prefetch on and off, over a modelled link.
// Every row is compared with offline references computed from the recorded trace alone: Belady's
// MIN and the exact optimum (belady_min.hpp), and with the time bound max(compute, transfer).
// See docs/replay.md.
#include "../bench_cli.hpp"
#include "belady_min.hpp"

#include <chunkstar/eviction/belady.hpp>
#include <chunkstar/eviction/lru.hpp>
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/placement/auto_placement.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>
#include <chunkstar/tracer/warmup_tracer.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <malloc.h>
#include <unistd.h>

namespace {

using namespace chunkstar;
using clock_type = std::chrono::steady_clock;

/** Auto placement's tide-like budget, with every optimizer step on the compute tier: the benchmark
 *  measures eviction and prefetch, so every byte that moves is their decision (with SGD there is no
 *  optimizer state to keep on the host). */
struct replay_placement {
  auto_placement tide{};
  [[nodiscard]] std::size_t chunk_budget(const placement_inputs& in) const noexcept { return tide.chunk_budget(in); }
  [[nodiscard]] tier optimizer_tier(const placement_inputs&, std::size_t) const noexcept { return tier::device; }
  [[nodiscard]] static constexpr std::string_view name() noexcept { return "replay"; }
};
static_assert(PlacementPolicy<replay_placement>);

struct options {
  int layers = 12;
  int width = 256;
  int vocab = 2048;
  int context = 256;
  int tokens = 512;               // batch x sequence
  double flops = 0.5e12;          // modelled FLOP/s of the compute tier
  double bandwidth = 3e9;         // modelled link, bytes/s per direction
  double latency = 10e-6;         // modelled link, seconds per copy
  double step_bandwidth = 100e9;  // modelled optimizer memory bandwidth, bytes/s
  std::size_t prefetch_depth = 2;
  int iterations = 3;
  bool quick = false;
  std::string policy;  // empty: both
  std::vector<double> budgets{1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1};
  std::string json, plot;
};

/** One parameter: the runtime's handle, its registration spec, and whether it is a matrix used in a
 *  matmul (only those count FLOPs). */
struct param_info {
  param_id id;
  std::size_t numel = 0;
  bool matrix = false;
};

/** A scope of the model: a layer with its parameters and the activation it keeps for backward. */
struct layer {
  std::string name;
  std::vector<param_id> params;
  double fwd_flops = 0;
  std::size_t activation_bytes = 0;
};

struct model {
  std::vector<param_info> params;
  std::vector<layer> layers;
};

/** Deterministic initial value of element i of parameter t (cheap, exact in fp32). */
float init_value(std::size_t t, std::size_t i) {
  return static_cast<float>(static_cast<int>((i * 2654435761u + t * 97u) % 2001u) - 1000) * 1e-5f;
}

constexpr std::size_t grad_stride = 1024;  // backward writes one gradient element per 4 KiB
constexpr float grad_scale = 1e-3f;
constexpr float lr = 0.5f;

/** GPT-shaped: tied token embedding (also the LM head), positions, blocks of layernorm + qkv +
 *  projection + layernorm + MLP, final layernorm. One scope per layer (module hooks). */
template <class RT>
model build_model(RT& rt, const options& o) {
  model m;
  const auto d = static_cast<std::int64_t>(o.width);
  auto add = [&](const std::string& name, std::vector<std::int64_t> shape, tensor_role role, bool matrix) {
    const std::size_t t = m.params.size();
    tensor_spec spec{name, std::move(shape), dtype::f32, role};
    const auto numel = spec.numel();
    const auto id = rt.register_param(std::move(spec), [t](std::span<float> v) {
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = init_value(t, i);
    });
    m.params.push_back({id, numel, matrix});
    return id;
  };
  const double T = o.tokens;
  const std::size_t act = static_cast<std::size_t>(o.tokens) * static_cast<std::size_t>(o.width) * sizeof(float);
  const auto wte = add("wte", {o.vocab, d}, tensor_role::embedding, false);
  const auto wpe = add("wpe", {o.context, d}, tensor_role::embedding, false);
  m.layers.push_back({"embed", {wte, wpe}, 0, act});
  for (int b = 0; b < o.layers; ++b) {
    const std::string p = "h" + std::to_string(b) + ".";
    const auto ln1w = add(p + "ln1.w", {d}, tensor_role::norm, false),
               ln1b = add(p + "ln1.b", {d}, tensor_role::norm, false);
    const auto qkvw = add(p + "qkv.w", {3 * d, d}, tensor_role::weight, true),
               qkvb = add(p + "qkv.b", {3 * d}, tensor_role::bias, false);
    const auto projw = add(p + "proj.w", {d, d}, tensor_role::weight, true),
               projb = add(p + "proj.b", {d}, tensor_role::bias, false);
    const auto ln2w = add(p + "ln2.w", {d}, tensor_role::norm, false),
               ln2b = add(p + "ln2.b", {d}, tensor_role::norm, false);
    const auto fcw = add(p + "fc.w", {4 * d, d}, tensor_role::weight, true),
               fcb = add(p + "fc.b", {4 * d}, tensor_role::bias, false);
    const auto fc2w = add(p + "fc2.w", {d, 4 * d}, tensor_role::weight, true),
               fc2b = add(p + "fc2.b", {d}, tensor_role::bias, false);
    const double dd = static_cast<double>(d * d);
    m.layers.push_back({p + "qkv", {ln1w, ln1b, qkvw, qkvb}, 2 * T * 3 * dd, 3 * act});
    m.layers.push_back({p + "proj", {projw, projb}, 2 * T * dd, act});
    m.layers.push_back({p + "fc", {ln2w, ln2b, fcw, fcb}, 2 * T * 4 * dd, 4 * act});
    m.layers.push_back({p + "fc2", {fc2w, fc2b}, 2 * T * 4 * dd, act});
  }
  const auto lnfw = add("ln_f.w", {d}, tensor_role::norm, false), lnfb = add("ln_f.b", {d}, tensor_role::norm, false);
  // The head reuses wte (tied) and keeps the logits.
  m.layers.push_back({"head",
                      {lnfw, lnfb, wte},
                      2 * T * static_cast<double>(o.vocab) * static_cast<double>(d),
                      static_cast<std::size_t>(o.tokens) * static_cast<std::size_t>(o.vocab) * sizeof(float)});
  return m;
}

fixed_chunk_layout replay_layout(const options& o) {
  // Two MLP matrices per chunk: the largest tensor (4 d^2) always fits, a layer scope spans at most
  // two chunks, and a 12-block model of width 256 has about 22 chunks per list.
  const auto d = static_cast<std::size_t>(o.width);
  return fixed_chunk_layout({.chunk_elems = (8 * d * d + 2048 + 31) / 32 * 32, .align_elems = 32});
}

/** The compute tier "runs" a kernel: real work already done, then wait out the modelled time.
 *  Sleeps most of it (the cores are shared with the copy workers) and spins the last 200 us. */
void finish_compute(clock_type::time_point deadline) {
  const auto spin = std::chrono::microseconds(200);
  if (clock_type::now() + spin < deadline) std::this_thread::sleep_until(deadline - spin);
  while (clock_type::now() < deadline) {
  }
}

struct row {
  std::string policy;
  bool prefetch = false;
  double budget_fraction = 0;
  std::size_t capacity = 0, chunk_bytes = 0, num_chunks = 0, model_bytes = 0, non_model_peak = 0;
  double bytes_moved = 0, bytes_to_device = 0, bytes_to_host = 0, belady_min_bytes = 0, optimum_bytes = 0;
  double iteration_s = 0, compute_s = 0, modelled_compute_s = 0, transfer_s = 0, link_s = 0, stall_s = 0;
  double overhead_s = 0;  // iteration - compute - stall: runtime bookkeeping, zeroing gradients, allocation
  double evictions = 0, loads = 0, prefetches = 0, prefetch_hits = 0, demand_loads = 0;
  double lookahead_fraction = 0;
  [[nodiscard]] double bound_s() const { return std::max(compute_s, transfer_s); }
  [[nodiscard]] double duplex_bound_s() const { return std::max(compute_s, link_s); }
};

struct references {
  double belady_min_bytes = 0, optimum_bytes = 0;
  double lookahead_fraction = 0;  // moments whose chunks fit next to the next moment's
};

/** The offline references for the recorded trace of @p rt at device capacity @p capacity, per
 *  iteration in steady state: cost(R2 iterations) - cost(R1 iterations), divided by R2 - R1, both
 *  windows starting with every parameter on the host, so start and end effects cancel. */
template <class RT>
references offline_references(const RT& rt, std::size_t capacity, std::size_t chunk_bytes, int iterations) {
  using bench::min_place;
  const auto& tr = rt.tracer();
  const auto acc = tr.accesses();
  const auto moments = tr.moments();
  const std::size_t M = moments.size();
  const std::size_t n_chunks = rt.plan().num_chunks;
  auto dense = [&](chunk_id c) {
    return static_cast<std::uint32_t>(static_cast<std::size_t>(c.kind) * n_chunks + c.index);
  };
  // Groups: a forward/backward moment needs all its chunks at once; the optimizer moment needs one
  // chunk index (param + grad) at a time, in the order it touched them.
  struct group {
    std::size_t moment;
    std::vector<std::uint32_t> need;
    std::vector<std::uint32_t> drop;  // the runtime frees a chunk's gradient right after its step
  };
  std::vector<group> one;
  for (const auto& a : acc) {
    const bool optimizer = moments[a.moment].kind == moment_kind::optimizer;
    const bool same = !one.empty() && one.back().moment == a.moment &&
                      (!optimizer || (one.back().need.back() % n_chunks) == a.id.index);
    if (!same) one.push_back({a.moment, {}, {}});
    one.back().need.push_back(dense(a.id));
    if (optimizer && one.back().drop.empty()) one.back().drop.push_back(dense({chunk_kind::grad, a.id.index}));
  }
  std::vector<std::size_t> cap_of_moment(M);
  for (std::size_t m = 0; m < M; ++m) {
    const std::size_t nm = std::max(moments[m].non_model_peak, moments[(m + 1) % M].non_model_peak);
    cap_of_moment[m] = (capacity > nm ? capacity - nm : 0) / chunk_bytes;
  }
  const std::size_t n = 2 * n_chunks;  // param list, then grad list
  std::vector<bool> droppable(n, false);
  for (std::size_t c = n_chunks; c < n; ++c) droppable[c] = true;
  std::vector<min_place> initial(n, min_place::host);
  for (std::size_t c = n_chunks; c < n; ++c) initial[c] = min_place::absent;
  auto steps_for = [&](int reps) {
    std::vector<bench::min_step> s;
    for (int r = 0; r < reps; ++r)
      for (std::size_t g = 0; g < one.size(); ++g)
        s.push_back({one[g].need, cap_of_moment[one[g].moment], g + 1 == one.size(), one[g].drop, r});
    return s;
  };
  const int r1 = 2, r2 = 2 + iterations;
  const auto s1 = steps_for(r1), s2 = steps_for(r2);
  const double min_per_it = (static_cast<double>(bench::belady_min(s2, droppable, initial).moves()) -
                             static_cast<double>(bench::belady_min(s1, droppable, initial).moves())) /
                            iterations;
  const double opt_per_it = (static_cast<double>(bench::optimal_moves(s2, droppable, initial)) -
                             static_cast<double>(bench::optimal_moves(s1, droppable, initial))) /
                            iterations;
  // A look-ahead is possible at a moment when its chunks and the next moment's fit the budget at
  // once: only then can the next moment's loads overlap this moment's compute.
  std::size_t fit = 0;
  for (std::size_t g = 0; g < one.size(); ++g) {
    auto both = one[g].need;
    for (auto c : one[(g + 1) % one.size()].need)
      if (std::find(both.begin(), both.end(), c) == both.end()) both.push_back(c);
    if (both.size() <= cap_of_moment[one[g].moment]) ++fit;
  }
  return {min_per_it * static_cast<double>(chunk_bytes), opt_per_it * static_cast<double>(chunk_bytes),
          static_cast<double>(fit) / static_cast<double>(one.size())};
}

template <class Eviction>
row run_config(const options& o, double fraction, bool prefetch, std::size_t model_data, std::size_t non_model_peak) {
  using rt_type = chunk_runtime<fixed_chunk_layout, replay_placement, Eviction, warmup_tracer>;
  row r;
  r.policy = std::string(Eviction::name());
  r.prefetch = prefetch;
  r.budget_fraction = fraction;
  r.capacity = non_model_peak + static_cast<std::size_t>(fraction * static_cast<double>(model_data));
  r.model_bytes = model_data;
  r.non_model_peak = non_model_peak;
  const copy_model link{.bandwidth_bytes_per_s = o.bandwidth, .latency_s = o.latency};
  simulated_device_space dev({.capacity = r.capacity, .link = link});
  host_space host;
  host_copy_engine copier(link);
  rt_type rt(dev, host, copier,
             {.param_type = dtype::f32, .optimizer_state = false, .prefetch_depth = prefetch ? o.prefetch_depth : 0},
             replay_layout(o));
  const model mdl = build_model(rt, o);
  rt.finalize();
  r.chunk_bytes = rt.plan().chunk_elems * sizeof(float);
  r.num_chunks = 2 * rt.plan().num_chunks;

  std::vector<std::size_t> uses(mdl.params.size(), 0);  // backward scopes per parameter, for the reference
  for (const auto& l : mdl.layers)
    for (auto p : l.params) ++uses[p.value];
  volatile float sink = 0;
  double compute_s = 0, modelled_s = 0;
  auto iteration = [&] {
    std::vector<std::pair<void*, std::size_t>> acts;
    for (const auto& l : mdl.layers) {
      auto s = rt.forward(l.name, l.params);
      const auto t0 = clock_type::now();
      const double model_s = std::max(l.fwd_flops / o.flops, 5e-6);
      float sum = 0;
      for (auto p : l.params) {
        const auto v = s.template param<float>(p);
        for (std::size_t i = 0; i < v.size(); i += grad_stride) sum += v[i];
      }
      sink = sink + sum;
      acts.emplace_back(rt.allocate_non_model(l.activation_bytes), l.activation_bytes);
      finish_compute(t0 + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(model_s)));
      compute_s += std::chrono::duration<double>(clock_type::now() - t0).count();
      modelled_s += model_s;
    }
    for (auto it = mdl.layers.rbegin(); it != mdl.layers.rend(); ++it) {
      auto s = rt.backward(it->name, it->params);
      const auto t0 = clock_type::now();
      const double model_s = std::max(2 * it->fwd_flops / o.flops, 5e-6);
      for (auto p : it->params) {
        const auto v = s.template param<float>(p);
        auto g = s.template grad<float>(p);
        for (std::size_t i = 0; i < v.size(); i += grad_stride) g[i] += grad_scale * v[i];
      }
      rt.deallocate_non_model(acts.back().first, acts.back().second);
      acts.pop_back();
      finish_compute(t0 + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(model_s)));
      compute_s += std::chrono::duration<double>(clock_type::now() - t0).count();
      modelled_s += model_s;
    }
    rt.step([&](const step_chunk& c) {
      const auto t0 = clock_type::now();
      auto* p = static_cast<float*>(c.param);
      const auto* g = static_cast<const float*>(c.grad);
      std::size_t elems = 0;
      for (auto t : c.tensors) {
        const auto& sl = c.slots[t];
        for (std::size_t i = sl.offset; i < sl.offset + sl.numel; ++i) p[i] -= lr * g[i];
        elems += sl.numel;
      }
      const double model_s = 3.0 * sizeof(float) * static_cast<double>(elems) / o.step_bandwidth;
      finish_compute(t0 + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(model_s)));
      compute_s += std::chrono::duration<double>(clock_type::now() - t0).count();
      modelled_s += model_s;
    });
  };

  // Warm-up: the first iteration records the trace; the second moves from that iteration's
  // demand-only placement to the steady state prefetch keeps (LRU may differ there by a chunk).
  iteration();
  iteration();
  rt.copy_engine().synchronize();
  const auto before = rt.stats();
  const auto copies_before = rt.copy_engine().stats();
  compute_s = modelled_s = 0;
  const auto t0 = clock_type::now();
  for (int i = 0; i < o.iterations; ++i) iteration();
  rt.copy_engine().synchronize();
  const double wall = std::chrono::duration<double>(clock_type::now() - t0).count();
  const auto after = rt.stats();
  const auto copies_after = rt.copy_engine().stats();
  if (rt.tracer().stats().divergences != 0)
    throw state_error("the measured iterations left the recorded trace; the replay would not be comparable");

  const double its = o.iterations;
  r.bytes_to_device = static_cast<double>(after.bytes_to_device - before.bytes_to_device) / its;
  r.bytes_to_host = static_cast<double>(after.bytes_to_host - before.bytes_to_host) / its;
  r.bytes_moved = r.bytes_to_device + r.bytes_to_host;
  const double n_to_dev = static_cast<double>(copies_after[copy_direction::to_device].copies -
                                              copies_before[copy_direction::to_device].copies) /
                          its;
  const double n_to_host = static_cast<double>(copies_after[copy_direction::to_host].copies -
                                               copies_before[copy_direction::to_host].copies) /
                           its;
  r.transfer_s = r.bytes_moved / o.bandwidth + (n_to_dev + n_to_host) * o.latency;
  r.link_s = std::max(r.bytes_to_device / o.bandwidth + n_to_dev * o.latency,
                      r.bytes_to_host / o.bandwidth + n_to_host * o.latency);
  r.iteration_s = wall / its;
  r.compute_s = compute_s / its;
  r.modelled_compute_s = modelled_s / its;
  r.stall_s = (after.stall_s - before.stall_s) / its;
  r.overhead_s = r.iteration_s - r.compute_s - r.stall_s;
  r.evictions = static_cast<double>(after.evictions - before.evictions) / its;
  r.loads = static_cast<double>(after.loads - before.loads) / its;
  r.prefetches = static_cast<double>(after.prefetches - before.prefetches) / its;
  r.prefetch_hits = static_cast<double>(after.prefetch_hits - before.prefetch_hits) / its;
  r.demand_loads = static_cast<double>(after.demand_loads - before.demand_loads) / its;
  if (dev.peak() > dev.capacity()) throw state_error("the simulated device exceeded its capacity");

  const auto refs = offline_references(rt, r.capacity, r.chunk_bytes, o.iterations);
  r.belady_min_bytes = refs.belady_min_bytes;
  r.optimum_bytes = refs.optimum_bytes;
  r.lookahead_fraction = refs.lookahead_fraction;

  // Nothing faked: every parameter must hold exactly what plain fp32 arithmetic gives after
  // 2 + iterations SGD steps (gradients at every grad_stride-th element, zero elsewhere).
  const int steps = 2 + o.iterations;
  std::vector<float> got;
  for (std::size_t t = 0; t < mdl.params.size(); ++t) {
    got.resize(mdl.params[t].numel);
    rt.read_tensor(mdl.params[t].id, chunk_kind::param, got);
    for (std::size_t i = 0; i < got.size(); ++i) {
      float p = init_value(t, i);
      if (i % grad_stride == 0)
        for (int s = 0; s < steps; ++s) {
          float g = 0;
          for (std::size_t u = 0; u < uses[t]; ++u) g += grad_scale * p;
          p -= lr * g;
        }
      if (got[i] != p)
        throw state_error("parameter '" + rt.params()[t].name + "' element " + std::to_string(i) +
                          " differs from the fp32 reference after training: a chunk move lost data");
    }
  }
  return r;
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

void write_json(const std::string& path, const std::vector<row>& rows, const options& o) {
  std::ofstream f(path);
  if (!f) throw config_error("cannot write '" + path + "': check that the directory exists");
  f << "[\n";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    char buf[2048];
    std::snprintf(buf, sizeof buf,
                  "  {\"policy\": \"%s\", \"prefetch\": %s, \"prefetch_depth\": %zu, \"budget_fraction\": %.2f, "
                  "\"capacity_bytes\": %zu, \"model_bytes\": %zu, \"non_model_peak_bytes\": %zu, \"chunk_bytes\": %zu, "
                  "\"num_chunks\": %zu, \"bytes_moved\": %.0f, \"bytes_to_device\": %.0f, \"bytes_to_host\": %.0f, "
                  "\"belady_min_bytes\": %.0f, \"optimum_bytes\": %.0f, \"iteration_s\": %.6f, \"compute_s\": %.6f, "
                  "\"modelled_compute_s\": %.6f, \"transfer_s\": %.6f, \"link_s\": %.6f, \"stall_s\": %.6f, "
                  "\"overhead_s\": %.6f, "
                  "\"evictions\": %.1f, \"loads\": %.1f, \"prefetches\": %.1f, \"prefetch_hits\": %.1f, "
                  "\"demand_loads\": %.1f, \"lookahead_fraction\": %.3f, \"bandwidth_bytes_per_s\": %.0f}%s\n",
                  json_escape(r.policy).c_str(), r.prefetch ? "true" : "false", r.prefetch ? o.prefetch_depth : 0,
                  r.budget_fraction, r.capacity, r.model_bytes, r.non_model_peak, r.chunk_bytes, r.num_chunks,
                  r.bytes_moved, r.bytes_to_device, r.bytes_to_host, r.belady_min_bytes, r.optimum_bytes, r.iteration_s,
                  r.compute_s, r.modelled_compute_s, r.transfer_s, r.link_s, r.stall_s, r.overhead_s, r.evictions,
                  r.loads, r.prefetches, r.prefetch_hits, r.demand_loads, r.lookahead_fraction, o.bandwidth,
                  i + 1 < rows.size() ? "," : "");
    f << buf;
  }
  f << "]\n";
  if (!f) throw config_error("failed writing '" + path + "': check free disk space");
}

int write_plot(const std::string& png, const std::vector<row>& rows) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    std::fprintf(stderr, "bench_replay: --plot needs gnuplot on PATH (apt-get install gnuplot-nox); no plot written\n");
    return 1;
  }
  const auto dir = std::filesystem::temp_directory_path() / ("bench_replay_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  // One data file per (policy, prefetch): budget%, moved MiB, MIN MiB, optimum MiB, iteration ms,
  // compute ms, transfer ms, duplex-link ms.
  std::map<std::string, std::string> files;
  for (const auto& r : rows) {
    const std::string key = r.policy + (r.prefetch ? "_prefetch" : "_demand");
    auto& text = files[key];
    char buf[256];
    std::snprintf(buf, sizeof buf, "%.0f %.2f %.2f %.2f %.3f %.3f %.3f %.3f\n", r.budget_fraction * 100,
                  r.bytes_moved / 1048576.0, r.belady_min_bytes / 1048576.0, r.optimum_bytes / 1048576.0,
                  r.iteration_s * 1e3, r.compute_s * 1e3, r.transfer_s * 1e3, r.link_s * 1e3);
    text += buf;
  }
  for (const auto& [k, text] : files) std::ofstream(dir / (k + ".dat")) << text;
  std::ofstream gp(dir / "replay.gp");
  gp << "set terminal pngcairo size 1400,560 font ',10'\nset output '" << png << "'\n"
     << "set multiplot layout 1,2 title 'bench\\_replay: recorded trace replayed on a simulated device'\n"
     << "set grid\nset xlabel 'device budget (% of model data, beyond peak activations)'\nset xrange [105:5]\n"
     << "set key top left\nset ylabel 'MiB moved per iteration'\n";
  std::string plot1 = "plot ", plot2 = "plot ";
  bool first = true;
  for (const auto& [k, text] : files) {
    const std::string f = (dir / (k + ".dat")).string();
    std::string title = k;
    for (auto& ch : title)
      if (ch == '_') ch = ' ';
    plot1 += (first ? "" : ", ") + ("'" + f + "' using 1:2 with linespoints title '" + title + "'");
    plot2 += (first ? "" : ", ") + ("'" + f + "' using 1:5 with linespoints title '" + title + "'");
    first = false;
  }
  const std::string any = (dir / (files.begin()->first + ".dat")).string();
  plot1 += ", '" + any + "' using 1:4 with lines dt 2 lw 2 title 'offline optimum'";
  plot1 += ", '" + any + "' using 1:3 with lines dt 3 title 'Belady MIN (offline)'";
  plot2 += ", '" + any + "' using 1:6 with lines dt 2 lw 2 title 'compute'";
  gp << plot1 << "\nset ylabel 'ms per iteration'\n" << plot2 << "\nunset multiplot\n";
  gp.close();
  const std::string cmd = "gnuplot '" + (dir / "replay.gp").string() + "'";
  const int rc = std::system(cmd.c_str());
  std::filesystem::remove_all(dir);
  if (rc != 0) {
    std::fprintf(stderr, "bench_replay: gnuplot failed (exit %d); no plot written\n", rc);
    return 1;
  }
  std::printf("plot: %s\n", png.c_str());
  return 0;
}

void usage() {
  std::printf(
      "usage: bench_replay [--quick] [--json FILE] [--plot FILE.png] [--bandwidth BYTES_PER_S] [--layers N]\n"
      "                    [--width N] [--flops FLOP_PER_S] [--prefetch-depth N] [--iterations N]\n"
      "                    [--budgets F,F,...] [--policy lru|belady]\n");
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw config_error(a + " needs a value (see --help)");
      return argv[++i];
    };
    if (a == "--quick") o.quick = true;
    else if (a == "--json") o.json = value();
    else if (a == "--plot") o.plot = value();
    else if (a == "--bandwidth") o.bandwidth = std::stod(value());
    else if (a == "--layers") o.layers = std::stoi(value());
    else if (a == "--width") o.width = std::stoi(value());
    else if (a == "--flops") o.flops = std::stod(value());
    else if (a == "--prefetch-depth") o.prefetch_depth = static_cast<std::size_t>(std::stoul(value()));
    else if (a == "--iterations") o.iterations = std::stoi(value());
    else if (a == "--budgets") o.budgets = bench::parse_number_list(a, value());
    else if (a == "--policy") o.policy = value();
    else if (a == "--help" || a == "-h") {
      usage();
      std::exit(0);
    } else {
      usage();
      throw config_error("unknown argument '" + a + "'");
    }
  }
  if (o.quick) {
    o.layers = std::min(o.layers, 4);
    o.iterations = 2;
    o.budgets = {1.0, 0.5, 0.3};
  }
  for (double f : o.budgets)
    if (!(f > 0 && f <= 1)) throw config_error("--budgets takes fractions of the model data in (0, 1], e.g. 0.5,0.2");
  if (!o.policy.empty() && o.policy != "lru" && o.policy != "belady")
    throw config_error("--policy is lru or belady, not '" + o.policy + "'");
  if (o.layers < 1 || o.width < 32 || o.width % 32 != 0 || o.bandwidth <= 0 || o.flops <= 0 || o.iterations < 1)
    throw config_error(
        "need --layers >= 1, --width a multiple of 32, positive --bandwidth and --flops, --iterations >= 1");
  return o;
}

}  // namespace

int main(int argc, char** argv) try {
  const options o = parse(argc, argv);
  // The simulated device allocates from the C heap. Keep freed blocks (chunk payloads, activations)
  // in the process like a device caching allocator, instead of returning them to the kernel: else
  // every move and every zeroed gradient pays fresh page faults, CPU time no real device spends.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  // Model data and peak activations, from a runtime that holds everything.
  std::size_t model_data = 0, non_model_peak = 0;
  {
    simulated_device_space big({.capacity = std::size_t{1} << 34});
    host_space h;
    host_copy_engine e;
    chunk_runtime<fixed_chunk_layout, replay_placement, lru_eviction> probe(big, h, e, {.optimizer_state = false},
                                                                            replay_layout(o));
    const model m = build_model(probe, o);
    probe.finalize();
    model_data = probe.model_bytes();
    for (const auto& l : m.layers) non_model_peak += l.activation_bytes;
    std::printf(
        "model: %d blocks, width %d, %zu tensors, %zu chunks of %s (param + grad lists), model data %s, "
        "peak activations %s\n",
        o.layers, o.width, m.params.size(), 2 * probe.plan().num_chunks,
        format_bytes(probe.plan().chunk_elems * sizeof(float)).c_str(), format_bytes(model_data).c_str(),
        format_bytes(non_model_peak).c_str());
    std::printf("link: %.2f GB/s per direction, %.0f us per copy; compute: %.2f TFLOP/s; prefetch depth %zu\n",
                o.bandwidth / 1e9, o.latency * 1e6, o.flops / 1e12, o.prefetch_depth);
  }
  std::vector<row> rows;
  std::printf("\n%-7s %-4s %6s %9s %9s %9s %6s %6s %9s %9s %9s %9s %7s %8s %6s %7s %6s %6s\n", "policy", "pf", "budget",
              "moved MiB", "MIN MiB", "opt MiB", "/MIN", "/opt", "iter ms", "comp ms", "xfer ms", "link ms", "iter/bd",
              "stall ms", "ovh ms", "evicts", "hits", "ahead");
  for (double f : o.budgets) {
    for (int pol = 0; pol < 2; ++pol) {
      if (!o.policy.empty() && o.policy != (pol == 0 ? "lru" : "belady")) continue;
      for (bool pf : {false, true}) {
        const row r = pol == 0 ? run_config<lru_eviction>(o, f, pf, model_data, non_model_peak)
                               : run_config<belady_eviction>(o, f, pf, model_data, non_model_peak);
        const double mib = 1048576.0;
        std::printf(
            "%-7s %-4s %5.0f%% %9.1f %9.1f %9.1f %6.3f %6.3f %9.2f %9.2f %9.2f %9.2f %7.3f %8.2f %6.2f %7.1f %6.1f "
            "%5.0f%%\n",
            r.policy.c_str(), r.prefetch ? "on" : "off", 100 * r.budget_fraction, r.bytes_moved / mib,
            r.belady_min_bytes / mib, r.optimum_bytes / mib,
            r.belady_min_bytes > 0 ? r.bytes_moved / r.belady_min_bytes : (r.bytes_moved == 0 ? 1.0 : INFINITY),
            r.optimum_bytes > 0 ? r.bytes_moved / r.optimum_bytes : (r.bytes_moved == 0 ? 1.0 : INFINITY),
            r.iteration_s * 1e3, r.compute_s * 1e3, r.transfer_s * 1e3, r.link_s * 1e3, r.iteration_s / r.bound_s(),
            r.stall_s * 1e3, r.overhead_s * 1e3, r.evictions, r.prefetch_hits, 100 * r.lookahead_fraction);
        std::fflush(stdout);
        rows.push_back(r);
      }
    }
  }
  std::printf(
      "\nMIN = Belady's MIN and opt = exact optimum for the recorded trace and budget (offline, per iteration);\n"
      "iter/bd = iteration time / max(compute, transfer); link = busier direction of the duplex link;\n"
      "ovh = iteration - compute - stall (runtime bookkeeping, allocation, threads sharing the cores);\n"
      "ahead = moments whose chunks fit the budget next to the next moment's (a look-ahead is possible).\n");
  if (!o.json.empty()) {
    write_json(o.json, rows, o);
    std::printf("json: %s\n", o.json.c_str());
  }
  if (!o.plot.empty()) return write_plot(o.plot, rows);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_replay: %s\n", e.what());
  return 1;
}
