// SPDX-License-Identifier: Apache-2.0
// bench_optim: throughput of the fused CPU Adam step, per gradient dtype and thread count, as a
// fraction of the memory-bandwidth limit measured in the same run.
//
// Limit = the best of (a) an in-place read-modify-write stream a = a*s + b and (b) a loop with
// exactly Adam's loads and stores for that dtype combination and no arithmetic. The STREAM triad
// (a = b + s*c, into a third array) is printed for reference only: on these machines it
// understates what an in-place update reaches by about 1.5x.
//
// Bytes per element of the Adam step: master, m, v read and written (24) + the gradient read
// (4 for fp32, 2 for fp16/bf16) + the low-precision parameter copy written (2 for fp16/bf16
// params; none for fp32, where the master is the parameter) = 28 in all three configurations.
//
// Built with the default flags (no -march): the kernel and the limit loops both run the ISA that
// chunkstar::active_cpu_isa() chooses at run time (CHUNKSTAR_CPU_ISA=avx2 etc. to compare paths).
//
// Paired rounds: this VM's bandwidth swings by up to 1.7x between runs seconds apart, so each of
// the --reps rounds times the step and both limit loops back to back, and "ratio" is the median of
// the rounds' own ratios ("best" divides the best step by the best limit, as before). "ceiling" is
// the step on a working set that stays in cache (8K elements, the call repeated, one thread, times
// the threads: each core divides on its own): what the arithmetic alone allows. fp32 needs one square root and one division per element, correctly
// rounded; where the ceiling is below the memory limit the step is compute-bound, and the table says
// so ("bound").
#include <chunkstar/core/detail/simd.hpp>
#include <chunkstar/optim/adam.hpp>

#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace bench_limits {
template <chunkstar::cpu_isa>
struct kernels;
}  // namespace bench_limits

#define CHUNKSTAR_SIMD_KERNELS "limit_kernels.inc"
#include <chunkstar/core/simd_foreach_isa.hpp>

using namespace chunkstar;

namespace {

struct free_deleter {
  void operator()(void* p) const noexcept { std::free(p); }
};

// 2 MiB-aligned buffers with transparent huge pages requested: fewer TLB misses on 1 GiB streams.
template <class T>
std::unique_ptr<T[], free_deleter> alloc(std::size_t n) {
  const std::size_t align = std::size_t{2} << 20;
  const std::size_t bytes = (n * sizeof(T) + align - 1) / align * align;
  void* p = std::aligned_alloc(align, bytes);
  if (!p) {
    std::fprintf(stderr, "bench_optim: cannot allocate %zu bytes; try smaller --sizes\n", bytes);
    std::exit(1);
  }
#ifdef MADV_HUGEPAGE
  madvise(p, bytes, MADV_HUGEPAGE);
#endif
  return std::unique_ptr<T[], free_deleter>(static_cast<T*>(p));
}

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

template <class F>
double best_seconds(int reps, F&& f) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const double t0 = now();
    f();
    best = std::min(best, now() - t0);
  }
  return best;
}

/** Runs @p body(begin, end) on each thread's contiguous share of [0, n), in whole 64-element
 *  vectors, with the limit kernels of the active ISA. */
template <class Body>
void per_thread(std::size_t n, int threads, Body&& body) {
#pragma omp parallel num_threads(threads)
  {
    const std::size_t t = static_cast<std::size_t>(omp_get_thread_num()),
                      nt = static_cast<std::size_t>(omp_get_num_threads());
    const std::size_t per = (n / 64 + nt - 1) / nt * 64;
    const std::size_t b = std::min(n, t * per), e = std::min(n, b + per);
    if (b < e) body(b, e);
  }
}

template <class F>
void with_limits(F&& f) {
  with_cpu_isa(active_cpu_isa(), [&](auto isa) { f(bench_limits::kernels<isa()>{}); });
}

// (a) in-place read-modify-write: a = a*s + b (12 bytes per element).
double rmw_stream(float* a, const float* b, std::size_t n, int threads, int reps) {
  double t = 0;
  with_limits([&](auto k) {
    t = best_seconds(reps,
                     [&] { per_thread(n, threads, [&](std::size_t b0, std::size_t e0) { k.rmw(a, b, b0, e0); }); });
  });
  return 12.0 * double(n) / t / 1e9;
}

// (c) STREAM triad a = b + s*c (12 bytes per element counted, as STREAM does).
double triad(float* a, const float* b, const float* c, std::size_t n, int threads, int reps) {
  double t = 0;
  with_limits([&](auto k) {
    t = best_seconds(
        reps, [&] { per_thread(n, threads, [&](std::size_t b0, std::size_t e0) { k.triad(a, b, c, b0, e0); }); });
  });
  return 12.0 * double(n) / t / 1e9;
}

// (b) Adam's loads and stores, no arithmetic.
template <class G, class P>
double adam_shape(float* master, float* m, float* v, const G* g, P* p, std::size_t n, int threads, int reps,
                  double bytes_per_elem) {
  double t = 0;
  with_limits([&](auto k) {
    using K = decltype(k);
    t = best_seconds(reps, [&] {
      per_thread(n, threads,
                 [&](std::size_t b0, std::size_t e0) { K::template adam_shape<G, P>(master, m, v, g, p, b0, e0); });
    });
  });
  return bytes_per_elem * double(n) / t / 1e9;
}

struct record {
  std::size_t params;
  std::string grad_dtype, param_dtype;
  int threads;
  double params_per_s, gbytes_per_s, limit_gbytes_per_s, rmw_gbytes_per_s, adam_shape_gbytes_per_s, triad_gbytes_per_s,
      bytes_per_elem;
  double median_ratio = 0;          ///< the median over the rounds of step / limit, each round's own
  double ceiling_params_per_s = 0;  ///< the step in cache: the arithmetic's limit
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t k = v.size() / 2;
  return v.size() % 2 ? v[k] : 0.5 * (v[k - 1] + v[k]);
}

/** The step's rate on one thread when its data stay in cache (8K elements, the call repeated):
 *  params per second. Each core has its own divider, so N threads on N cores reach N times it. */
template <class G, class P>
double in_cache_ceiling(int reps) {
  constexpr bool has_param = !std::is_same_v<P, float>;
  const std::size_t n = 8192;
  std::vector<float> master(n, 0.5f), m(n, 0.0f), v(n, 0.0f);
  std::vector<G> g(n, from_float<G>(0.01f));
  std::vector<P> p(has_param ? n : 0);
  const adam_hyper h{.lr = 1e-6f, .weight_decay = 0.0f};
  std::int64_t step = 0;
  const auto call = [&] {
    adam_update<G, P>(master, m, v, std::span<const G>(g), std::span<P>(p), h, {.step = ++step, .threads = 1});
  };
  call();
  int calls = 1;
  for (double t0 = now(); now() - t0 < 0.02; ++calls) call();  // how many calls make a measurable round
  calls *= 10;
  const double t = best_seconds(reps, [&] {
    for (int c = 0; c < calls; ++c) call();
  });
  return double(n) * calls / t;
}

// Checks the timed kernel against the portable path (bit for bit) and a float64 step on a slice.
template <class G, class P>
bool verify() {
  constexpr std::size_t n = 100003;
  std::mt19937 rng(1);
  std::normal_distribution<float> d(0.0f, 0.1f);
  std::vector<float> a(n), ma(n), va(n);
  for (std::size_t i = 0; i < n; ++i) a[i] = d(rng), ma[i] = 0.01f * d(rng), va[i] = std::abs(0.001f * d(rng));
  std::vector<G> g(n);
  for (auto& x : g) x = from_float<G>(d(rng));
  auto b = a, mb = ma, vb = va;
  const auto a0 = a, m0 = ma, v0 = va;
  std::vector<P> pa(std::is_same_v<P, float> ? 0 : n), pb = pa;
  const adam_hyper h{.lr = 1e-3f, .weight_decay = 0.01f};
  const adam_step_args s{.step = 10, .grad_scale = 0.5f};
  adam_update<G, P>(a, ma, va, std::span<const G>(g), std::span<P>(pa), h, s);
  adam_update_isa<cpu_isa::portable, G, P>(b, mb, vb, std::span<const G>(g), std::span<P>(pb), h, s);
  if (std::memcmp(a.data(), b.data(), n * 4) || std::memcmp(ma.data(), mb.data(), n * 4) ||
      std::memcmp(va.data(), vb.data(), n * 4) || std::memcmp(pa.data(), pb.data(), pa.size() * sizeof(P)))
    return false;
  // One float64 AdamW step. A single float step rounds each of p and the update a handful of
  // times, so 8 units of 2^-24 of |p| + |update| bound the difference, where |update| is taken
  // with |m0| and |g| (m = 0.9 m0 + 0.1 g may cancel, but its rounding error scales with the terms).
  const double lr = h.lr, wd = h.weight_decay, b1 = h.beta1, b2 = h.beta2;  // the float values, widened
  const double bc1 = 1 - std::pow(b1, 10.0), bc2 = 1 - std::pow(b2, 10.0);
  for (std::size_t i = 0; i < n; ++i) {
    const double gd = double(to_float(g[i])) * 0.5;
    const double m = b1 * double(m0[i]) + (1 - b1) * gd;
    const double v = b2 * double(v0[i]) + (1 - b2) * gd * gd;
    const double upd = lr * (m / bc1) / (std::sqrt(v / bc2) + double(h.eps));
    const double p = double(a0[i]) * (1 - lr * wd) - upd;
    const double mag =
        lr * ((b1 * std::abs(double(m0[i])) + (1 - b1) * std::abs(gd)) / bc1) / (std::sqrt(v / bc2) + double(h.eps));
    if (std::abs(double(a[i]) - p) > 8 * std::ldexp(1.0, -24) * (std::abs(double(a0[i])) + mag)) return false;
  }
  return true;
}

template <class G, class P>
void run_config(std::size_t n, const std::vector<int>& thread_counts, int reps, std::vector<record>& out) {
  if (!verify<G, P>()) {
    std::fprintf(stderr, "bench_optim: the %s kernel differs from the portable reference; not timing it\n",
                 std::string(dtype_name(dtype_of_v<G>)).c_str());
    std::exit(2);
  }
  constexpr bool has_param = !std::is_same_v<P, float>;
  const double bytes = 24.0 + sizeof(G) + (has_param ? sizeof(P) : 0);
  auto master = alloc<float>(n), m = alloc<float>(n), v = alloc<float>(n);
  auto g = alloc<G>(n);
  auto p = alloc<P>(has_param ? n : 64);
  // First touch outside the timing (fresh pages cost ~100x a warm write), in parallel so each
  // page is placed where the threads that use it run.
#pragma omp parallel for schedule(static)
  for (std::size_t i = 0; i < n; ++i) {
    master[i] = 0.01f * float(i % 1000);
    m[i] = 0.0f;
    v[i] = 0.0f;
    g[i] = from_float<G>(1e-3f * float(i % 777) - 0.3f);
    if (has_param) p[i] = from_float<P>(0.0f);
  }
  const adam_hyper h{.lr = 1e-4f, .weight_decay = 0.01f};
  std::int64_t step = 0;
  for (int threads : thread_counts) {
    record r{};
    r.params = n;
    r.grad_dtype = dtype_name(dtype_of_v<G>);
    r.param_dtype = dtype_name(dtype_of_v<P>);
    r.threads = threads;
    r.bytes_per_elem = bytes;
    const std::span<P> pout = has_param ? std::span<P>(p.get(), n) : std::span<P>{};
    auto adam = [&] {
      adam_update<G, P>({master.get(), n}, {m.get(), n}, {v.get(), n}, {g.get(), n}, pout, h,
                        {.step = ++step, .threads = threads});
    };
    adam();  // warm
    // Paired rounds (the file comment): the step, then both limit loops, back to back. The limits
    // use the same (warm) buffers; Adam's state is restored by nothing: values don't matter.
    double t = 1e30;
    std::vector<double> ratios;
    for (int round = 0; round < reps; ++round) {
      const double ta = best_seconds(1, adam);
      t = std::min(t, ta);
      const double rmw = rmw_stream(master.get(), m.get(), n, threads, 1);
      const double shape = adam_shape<G, P>(master.get(), m.get(), v.get(), g.get(), p.get(), n, threads, 1, bytes);
      r.rmw_gbytes_per_s = std::max(r.rmw_gbytes_per_s, rmw);
      r.adam_shape_gbytes_per_s = std::max(r.adam_shape_gbytes_per_s, shape);
      ratios.push_back(bytes * double(n) / ta / 1e9 / std::max(rmw, shape));
    }
    r.params_per_s = double(n) / t;
    r.gbytes_per_s = bytes * double(n) / t / 1e9;
    r.triad_gbytes_per_s = triad(master.get(), m.get(), v.get(), n, threads, reps);
    r.limit_gbytes_per_s = std::max(r.rmw_gbytes_per_s, r.adam_shape_gbytes_per_s);
    r.median_ratio = median(ratios);
    r.ceiling_params_per_s = threads * in_cache_ceiling<G, P>(reps);
    const bool compute_bound = r.ceiling_params_per_s * bytes / 1e9 < r.limit_gbytes_per_s;
    std::printf("%6zuM  %-4s %-4s %3d  %8.3f  %7.1f  %7.1f  %7.1f  %7.1f  %7.1f  %6.1f%%  %6.1f%%  %8.3f  %s\n",
                n >> 20, r.grad_dtype.c_str(), r.param_dtype.c_str(), threads, r.params_per_s / 1e9, r.gbytes_per_s,
                r.rmw_gbytes_per_s, r.adam_shape_gbytes_per_s, r.triad_gbytes_per_s, r.limit_gbytes_per_s,
                100.0 * r.gbytes_per_s / r.limit_gbytes_per_s, 100.0 * r.median_ratio, r.ceiling_params_per_s / 1e9,
                compute_bound ? "compute" : "memory");
    std::fflush(stdout);
    out.push_back(r);
    // Clean state for the next thread count (the limit loops scrambled it).
#pragma omp parallel for schedule(static)
    for (std::size_t i = 0; i < n; ++i) m[i] = 0.0f, v[i] = 0.0f, master[i] = 0.01f * float(i % 1000);
  }
}

std::vector<std::size_t> parse_sizes(const std::string& s) {
  std::vector<std::size_t> out;
  std::size_t pos = 0;
  while (pos < s.size()) {
    const std::size_t comma = s.find(',', pos);
    std::string tok = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    std::size_t mult = 1;
    if (!tok.empty() && (tok.back() == 'M' || tok.back() == 'm')) mult = std::size_t{1} << 20, tok.pop_back();
    if (!tok.empty() && (tok.back() == 'K' || tok.back() == 'k')) mult = std::size_t{1} << 10, tok.pop_back();
    out.push_back(std::stoull(tok) * mult);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::size_t> sizes = {std::size_t{16} << 20, std::size_t{64} << 20, std::size_t{256} << 20};
  std::vector<int> threads = {1, 2};
  std::vector<std::string> dtypes = {"f32", "f16", "bf16"};
  int reps = 5;
  std::string json, plot;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_optim: %s needs a value\n", a.c_str());
        std::exit(1);
      }
      return argv[++i];
    };
    if (a == "--sizes") sizes = parse_sizes(next());
    else if (a == "--threads") {
      threads.clear();
      for (auto t : parse_sizes(next())) threads.push_back(int(t));
    } else if (a == "--dtypes") {
      dtypes.clear();
      std::string s = next();
      for (std::size_t p = 0; p <= s.size();) {
        const auto c = s.find(',', p);
        dtypes.push_back(s.substr(p, c == std::string::npos ? std::string::npos : c - p));
        if (c == std::string::npos) break;
        p = c + 1;
      }
    } else if (a == "--reps") reps = std::stoi(next());
    else if (a == "--json") json = next();
    else if (a == "--plot") plot = next();
    else {
      std::printf(
          "usage: bench_optim [--sizes 16M,64M,256M] [--threads 1,2] [--dtypes f32,f16,bf16] [--reps 5]\n"
          "                   [--json FILE] [--plot FILE.png]\n"
          "Gradient dtype f32 updates fp32 params in place (no copy); f16/bf16 also write an f16/bf16\n"
          "parameter copy. Bytes per element: 28 (f32 p,g,m,v; or 24 + 2 grad + 2 param copy).\n");
      return a == "--help" || a == "-h" ? 0 : 1;
    }
  }
  std::printf("bench_optim: ISA %s, OpenMP max threads %d, %d paired rounds\n", cpu_isa_report().c_str(),
              omp_get_max_threads(), reps);
  std::printf(
      "limit = max(in-place RMW a=a*s+b, Adam loads/stores without math); triad for reference; best = best step / "
      "best limit; ratio = median of the rounds' step / limit; ceiling = the step in cache (Gparam/s)\n");
  std::printf("%7s  %-4s %-4s %3s  %8s  %7s  %7s  %7s  %7s  %7s  %7s  %7s  %8s  %s\n", "params", "grad", "par", "thr",
              "Gparam/s", "GB/s", "rmw", "adamLS", "triad", "limit", "best", "ratio", "ceiling", "bound");
  std::vector<record> recs;
  for (std::size_t n : sizes) {
    n = (n + 63) / 64 * 64;  // whole vectors: the limit loops have no tails
    for (const auto& d : dtypes) {
      if (d == "f32") run_config<float, float>(n, threads, reps, recs);
      else if (d == "f16") run_config<float16, float16>(n, threads, reps, recs);
      else if (d == "bf16") run_config<bfloat16, bfloat16>(n, threads, reps, recs);
      else {
        std::fprintf(stderr, "bench_optim: unknown dtype '%s'; use f32, f16 or bf16\n", d.c_str());
        return 1;
      }
    }
  }
  if (!json.empty()) {
    FILE* f = std::fopen(json.c_str(), "w");
    if (!f) {
      std::fprintf(stderr, "bench_optim: cannot write %s\n", json.c_str());
      return 1;
    }
    std::fprintf(f, "[\n");
    for (std::size_t i = 0; i < recs.size(); ++i) {
      const auto& r = recs[i];
      std::fprintf(f,
                   "  {\"params\": %zu, \"grad_dtype\": \"%s\", \"param_dtype\": \"%s\", \"threads\": %d, "
                   "\"isa\": \"%s\", \"bytes_per_elem\": %.0f, \"params_per_s\": %.6g, \"gbytes_per_s\": %.4g, "
                   "\"limit_gbytes_per_s\": %.4g, \"ratio\": %.4f, \"rmw_gbytes_per_s\": %.4g, "
                   "\"adam_shape_gbytes_per_s\": %.4g, \"triad_gbytes_per_s\": %.4g, \"median_ratio\": %.4f, "
                   "\"ceiling_params_per_s\": %.6g}%s\n",
                   r.params, r.grad_dtype.c_str(), r.param_dtype.c_str(), r.threads,
                   std::string(cpu_isa_name(active_cpu_isa())).c_str(), r.bytes_per_elem, r.params_per_s,
                   r.gbytes_per_s, r.limit_gbytes_per_s, r.gbytes_per_s / r.limit_gbytes_per_s, r.rmw_gbytes_per_s,
                   r.adam_shape_gbytes_per_s, r.triad_gbytes_per_s, r.median_ratio, r.ceiling_params_per_s,
                   i + 1 < recs.size() ? "," : "");
    }
    std::fprintf(f, "]\n");
    std::fclose(f);
  }
  if (!plot.empty()) {
    const std::string dat = plot + ".dat";
    FILE* f = std::fopen(dat.c_str(), "w");
    if (!f) return 1;
    int k = 0;
    for (const auto& r : recs)
      std::fprintf(f, "%d \"%zuM %s %dt\" %.3f %.3f\n", k++, r.params >> 20, r.grad_dtype.c_str(), r.threads,
                   r.gbytes_per_s, r.limit_gbytes_per_s);
    std::fclose(f);
    const std::string cmd = "gnuplot -e \"set terminal png size 1200,500; set output '" + plot +
                            "'; set style data histograms; set style fill solid; set ylabel 'GB/s'; "
                            "set xtics rotate by -45; plot '" +
                            dat + "' using 3:xtic(2) title 'Adam step', '' using 4 title 'limit'\"";
    if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "bench_optim: gnuplot failed; the table and JSON stand\n");
  }
  return 0;
}
