// SPDX-License-Identifier: Apache-2.0
// bench_cpu_trainer: how close the CPU trainer comes to this machine's GEMM speed, measured in one run.
//
//   sgemm rate:  every GEMM one training step of the model performs (forward, input and weight
//                gradients of each linear layer, the tied LM head), timed shape by shape, each the
//                faster of two ways: the trainer's own path (gpt::cpu::detail::gemm: rows split over
//                the OpenMP threads, single-threaded BLAS) and OpenBLAS threading itself (its own
//                pool at the OpenMP thread count): their FLOPs over their summed time.
//   model rate:  the trainer (train_gpt's assembly: chunked_gpt over a chunk runtime, AdamW with
//                clipping) doing real steps: model FLOPs per step / step time, where model FLOPs =
//                6 N tokens (N: the parameters that multiply, i.e. the linear layers' weights and the
//                tied embedding as LM head: exactly the GEMMs' FLOPs) + the causal attention's
//                6 L C T (T + 1) B (QK^T and AV, forward and backward, only the scores t2 <= t).
//   ratio:       model rate / sgemm rate: the share of the GEMM speed the whole step keeps. 1 would
//                mean every other kernel, the optimizer and the runtime cost nothing.
//   kernels:     the step's other float kernels (embedding, LayerNorm, attention, GELU, residual
//                adds, softmax + cross-entropy, bias gradients, zeroing of scratch gradients), each
//                at its shape, times its count per step: what of the step the GEMMs do not explain.
//
// Rounds alternate one training step and one pass over the GEMM shapes and the kernels, so all
// see the same machine; medians over the rounds. See docs/performance.md.
#include "../bench_cli.hpp"
#include "../e2e/e2e_support.hpp"

#include <chunkstar/eviction/belady.hpp>
#include <chunkstar/placement/auto_placement.hpp>
#include <chunkstar/placement/static_placement.hpp>

#include <omp.h>

#include <cmath>
#include <functional>
#include <map>
#include <random>

using namespace chunkstar;
using e2e::seconds_since;

namespace {

struct options {
  std::string preset = "gpt2";
  std::size_t batch = 4, seq = 64;
  int rounds = 7, warmup = 2;
  std::string policy = "resident";  // resident: everything on the device; patrickstar: act + 40%
  bool quick = false;
  std::string json, plot;
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw config_error(a + " needs a value (bench_cpu_trainer --help)");
      return argv[++i];
    };
    auto count = [&](const std::string& v) {
      const auto x = bench::parse_number_list(a, v);
      if (x.size() != 1 || x[0] < 1 || x[0] != std::floor(x[0]))
        throw config_error(a + " takes one positive integer, got '" + v + "'");
      return static_cast<std::size_t>(x[0]);
    };
    if (a == "--preset") o.preset = value();
    else if (a == "--batch") o.batch = count(value());
    else if (a == "--seq") o.seq = count(value());
    else if (a == "--rounds") o.rounds = static_cast<int>(count(value()));
    else if (a == "--warmup") o.warmup = static_cast<int>(count(value()));
    else if (a == "--policy") o.policy = value();
    else if (a == "--quick") o.quick = true;
    else if (a == "--json") o.json = value();
    else if (a == "--plot") o.plot = value();
    else if (a == "--help" || a == "-h") {
      std::printf(
          "usage: bench_cpu_trainer [--preset gpt2] [--batch 4] [--seq 64] [--rounds 7] [--warmup 2]\n"
          "                         [--policy resident|patrickstar] [--quick] [--json FILE] [--plot FILE.png]\n"
          "Measures, alternating, the sgemm rate of the model's GEMM shapes and the trainer's model FLOP/s\n"
          "(6 N tokens + causal attention), and prints their ratio. --quick: preset tiny, 2 x 32, 2 rounds.\n");
      std::exit(0);
    } else throw config_error("unknown option '" + a + "' (bench_cpu_trainer --help)");
  }
  if (o.policy != "resident" && o.policy != "patrickstar")
    throw config_error("--policy: resident or patrickstar, got '" + o.policy + "'");
  if (o.quick) o.preset = "tiny", o.batch = 2, o.seq = 32, o.rounds = 2, o.warmup = 1;
  return o;
}

/** One GEMM the step performs: C[m, n] (+)= op(A)[m, k] op(B)[k, n], `count` times per step. */
struct gemm_shape {
  std::string what;
  bool ta, tb;
  std::size_t m, n, k, count;
  [[nodiscard]] double flops() const { return 2.0 * double(m) * double(n) * double(k) * double(count); }
};

/** The GEMMs of one training step, as gpt_model.hpp calls them (matmul_forward, matmul_backward). */
std::vector<gemm_shape> step_gemms(const gpt::gpt_config& c, std::size_t B, std::size_t T) {
  const std::size_t N = B * T, C = c.width, V = c.vocab, L = static_cast<std::size_t>(c.layers);
  std::vector<gemm_shape> g;
  const struct {
    const char* name;
    std::size_t in, out;
  } linears[] = {{"qkv", C, 3 * C}, {"attn.proj", C, C}, {"fc", C, 4 * C}, {"mlp.proj", 4 * C, C}};
  for (const auto& l : linears) {
    g.push_back({std::string(l.name) + " fwd", false, true, N, l.out, l.in, L});    // out = inp W^T
    g.push_back({std::string(l.name) + " dinp", false, false, N, l.in, l.out, L});  // dinp += dout W
    g.push_back({std::string(l.name) + " dW", true, false, l.out, l.in, N, L});     // dW += dout^T inp
  }
  g.push_back({"lm_head fwd", false, true, N, V, C, 1});
  g.push_back({"lm_head dinp", false, false, N, C, V, 1});
  g.push_back({"lm_head dW", true, false, V, C, N, 1});
  return g;
}

/** Parameters that multiply: every linear weight and the tied embedding (the LM head). */
std::size_t matmul_params(const gpt::gpt_config& c) {
  std::size_t n = 0;
  for (const auto& s : gpt::param_specs(c))
    if (s.role == tensor_role::weight || s.name == "wte") n += s.numel();
  return n;
}

double causal_attention_flops(const gpt::gpt_config& c, std::size_t B, std::size_t T) {
  return 6.0 * c.layers * double(c.width) * double(T) * double(T + 1) * double(B);
}

/** Buffers big enough for every shape, filled once with small random values. */
struct gemm_bench {
  std::vector<gemm_shape> shapes;
  std::vector<float> a, b, c;
  explicit gemm_bench(std::vector<gemm_shape> s) : shapes(std::move(s)) {
    std::size_t na = 0, nb = 0, nc = 0;
    for (const auto& g : shapes)
      na = std::max(na, g.m * g.k), nb = std::max(nb, g.k * g.n), nc = std::max(nc, g.m * g.n);
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> u(-0.5f, 0.5f);
    for (auto* v : {&a, &b, &c}) v->resize(v == &a ? na : v == &b ? nb : nc);
    for (auto* v : {&a, &b, &c})
      for (float& x : *v) x = u(rng);
  }
  /** Seconds of one call of shape @p g (beta 1 for the backward GEMMs, which accumulate), on the
   *  trainer's path or (@p blas_threads) on one BLAS call that threads itself. */
  double time(const gemm_shape& g, bool blas_threads = false) {
    const std::size_t lda = g.ta ? g.m : g.k, ldb = g.tb ? g.k : g.n;
    const float beta = g.tb ? 0.0f : 1.0f;
    const auto t0 = e2e::clock::now();
    if (blas_threads)
      gpt::cpu::detail::blas_gemm(g.ta, g.tb, g.m, g.n, g.k, 1.0f, a.data(), lda, b.data(), ldb, beta, c.data(), g.n);
    else
      gpt::cpu::detail::gemm<float>(g.ta, g.tb, g.m, g.n, g.k, 1.0f, a.data(), lda, b.data(), ldb, beta, c.data(), g.n);
    return seconds_since(t0);
  }
};

/** One non-GEMM kernel call of a training step, `count` times per step, on kernel_bench's buffers. */
struct kernel_call {
  std::string what, shape;
  std::size_t count;
  std::function<void()> run;
};

/** The float kernels a training step calls besides its GEMMs, as gpt_model.hpp's stages call them
 *  (same functions, shapes and counts), on buffers of the step's shapes filled once with small
 *  random values. Listed in step order: each backward runs after its forward in the same round,
 *  so it reads real LayerNorm statistics, attention and softmax probabilities. Not timed: the bias
 *  rows matmul_forward copies before its GEMM (a loop inside it, not a kernel) and mean_loss (N
 *  values summed on one thread); they fall in "the rest". */
struct kernel_bench {
  std::vector<float> x, y, dx, dy, ln_w, ln_b, ln_dw, ln_db, mean, rstd;    // [N, C] rows and LayerNorm's [C], [N]
  std::vector<float> qkv, dqkv, att, att_scratch, h, hg, dh, dhg, dbias;    // attention [N, 3C], MLP [N, 4C]
  std::vector<float> logits, probs, dlogits, losses, wte, wpe, dwte, dwpe;  // head [N, V], embeddings
  std::vector<int> tokens, targets;
  std::vector<kernel_call> calls;

  kernel_bench(const gpt::gpt_config& c, std::size_t B, std::size_t T) {
    const std::size_t N = B * T, C = c.width, V = c.vocab, NH = c.heads, L = static_cast<std::size_t>(c.layers);
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> u(-0.5f, 0.5f);
    const auto fill = [&](std::vector<float>& v, std::size_t n) {
      v.resize(n);
      for (float& e : v) e = u(rng);
    };
    for (auto* v : {&x, &y, &dx, &dy}) fill(*v, N * C);
    for (auto* v : {&ln_w, &ln_b, &ln_dw, &ln_db}) fill(*v, C);
    for (auto* v : {&mean, &rstd, &losses}) fill(*v, N);
    for (auto* v : {&qkv, &dqkv}) fill(*v, 3 * N * C);
    fill(att, B * NH * T * T);
    fill(att_scratch, B * NH * T);
    for (auto* v : {&h, &hg, &dh, &dhg}) fill(*v, 4 * N * C);
    fill(dbias, 4 * C);  // the widest bias (fc's)
    for (auto* v : {&logits, &probs, &dlogits}) fill(*v, N * V);
    for (auto* v : {&wte, &dwte}) fill(*v, V * C);
    for (auto* v : {&wpe, &dwpe}) fill(*v, T * C);
    std::uniform_int_distribution<int> id(0, c.vocab - 1);
    for (auto* v : {&tokens, &targets}) {
      v->resize(N);
      for (int& t : *v) t = id(rng);
    }
    const auto dims = [](std::initializer_list<std::pair<const char*, std::size_t>> d) {
      std::string s;
      for (const auto& [k, n] : d) s.append(s.empty() ? "" : " ").append(k).append("=").append(std::to_string(n));
      return s;
    };
    const float dloss = 1.0f / static_cast<float>(N);  // the mean loss's gradient, as head_backward passes it
    namespace cpu = gpt::cpu;
    const std::string rows = dims({{"N", N}, {"C", C}}), attn = dims({{"B", B}, {"T", T}, {"C", C}, {"NH", NH}});
    const std::string embed = dims({{"B", B}, {"T", T}, {"C", C}}), head = dims({{"N", N}, {"V", V}});
    const std::string mlp = dims({{"n", 4 * N * C}});
    // forward: the embedding; per block ln1, attention, 2 residual adds, ln2, GELU; the head's lnf, softmax + xent
    calls.push_back({"encoder_forward", embed, 1,
                     [=, this] { cpu::encoder_forward(x.data(), tokens.data(), wte.data(), wpe.data(), B, T, C); }});
    calls.push_back({"layernorm_forward", rows, 2 * L + 1, [=, this] {
                       cpu::layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), ln_w.data(), ln_b.data(), N,
                                              C);
                     }});
    calls.push_back({"attention_forward", attn, L,
                     [=, this] { cpu::attention_forward(y.data(), att.data(), qkv.data(), B, T, C, NH); }});
    calls.push_back({"residual_forward", dims({{"n", N * C}}), 2 * L,
                     [=, this] { cpu::residual_forward(y.data(), x.data(), dx.data(), N * C); }});
    calls.push_back({"gelu_forward", mlp, L, [=, this] { cpu::gelu_forward(hg.data(), h.data(), 4 * N * C); }});
    calls.push_back({"softmax_crossentropy_forward", head, 1, [=, this] {
                       cpu::softmax_crossentropy_forward(probs.data(), losses.data(), logits.data(), targets.data(), N,
                                                         V);
                     }});
    // backward: the scratch gradients zeroed before each kernel adds into them (head: dlogits, dln,
    // dres; per block: dfch_gelu, dfch [N, 4C], dqkv [N, 3C], dln twice and datty [N, C])
    const struct {
      std::vector<float>* buf;
      std::size_t n, count;
      const char* shape;
    } zeros[] = {{&dlogits, N * V, 1, "N*V"},
                 {&dh, 4 * N * C, 2 * L, "N*4C"},
                 {&dqkv, 3 * N * C, L, "N*3C"},
                 {&dx, N * C, 3 * L + 2, "N*C"}};
    for (const auto& z : zeros)
      calls.push_back({"zero", std::string(z.shape) + "=" + std::to_string(z.n), z.count,
                       [buf = z.buf, n = z.n] { cpu::zero(buf->data(), n); }});
    calls.push_back({"softmax_crossentropy_backward", head, 1, [=, this] {
                       cpu::softmax_crossentropy_backward(dlogits.data(), probs.data(), targets.data(), dloss, N, V);
                     }});
    // matmul_backward's bias gradients (the tied LM head has none): qkv 3C, attn.proj and mlp.proj C, fc 4C
    const struct {
      std::vector<float>* dout;
      std::size_t oc, count;
    } biases[] = {{&dqkv, 3 * C, L}, {&dy, C, 2 * L}, {&dh, 4 * C, L}};
    for (const auto& bb : biases)
      calls.push_back({"add_column_sums (dbias)", dims({{"N", N}, {"OC", bb.oc}}), bb.count,
                       [=, this] { cpu::detail::add_column_sums(dbias.data(), bb.dout->data(), N, bb.oc); }});
    calls.push_back(
        {"gelu_backward", mlp, L, [=, this] { cpu::gelu_backward(dh.data(), h.data(), dhg.data(), 4 * N * C); }});
    calls.push_back({"attention_backward", attn, L, [=, this] {
                       cpu::attention_backward(dqkv.data(), att_scratch.data(), dy.data(), qkv.data(), att.data(), B, T,
                                               C, NH);
                     }});
    calls.push_back({"layernorm_backward", rows, 2 * L + 1, [=, this] {
                       cpu::layernorm_backward(dx.data(), ln_dw.data(), ln_db.data(), dy.data(), x.data(), ln_w.data(),
                                               mean.data(), rstd.data(), N, C);
                     }});
    calls.push_back({"encoder_backward", embed, 1, [=, this] {
                       cpu::encoder_backward(dwte.data(), dwpe.data(), dy.data(), tokens.data(), B, T, C);
                     }});
  }
  kernel_bench(const kernel_bench&) = delete;  // the calls point into this object's vectors
  kernel_bench& operator=(const kernel_bench&) = delete;

  /** Seconds of one call of @p k. */
  static double time(const kernel_call& k) {
    const auto t0 = e2e::clock::now();
    k.run();
    return seconds_since(t0);
  }
};

/** OpenBLAS's own pool at @p n threads for a scope (the trainer keeps it at 1; see kernels_cpu.hpp). */
struct blas_threads_scope {
  explicit blas_threads_scope(int n) {
#if defined(OPENBLAS_VERSION)
    openblas_set_num_threads(n);
#else
    (void)n;
#endif
  }
  ~blas_threads_scope() {
#if defined(OPENBLAS_VERSION)
    openblas_set_num_threads(1);
#endif
  }
};

template <class Runtime>
struct trainer {
  simulated_device_space device;
  host_space host;
  host_copy_engine copier;
  Runtime rt;
  gpt::chunked_gpt<Runtime> model;
  chunk_adam<> opt;
  trainer(const gpt::gpt_config& c, gpt::batch_shape shape, std::size_t capacity, typename Runtime::placement_type p)
      : device({.capacity = capacity, .name = "device"}),
        rt(device, host, copier, {}, searched_chunk_layout(), std::move(p)),
        model(rt, c, shape, e2e::model_seed),
        opt({.hyper = {.beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = e2e::weight_decay},
             .max_grad_norm = e2e::max_grad_norm},
            param_groups::with_default_decay(e2e::weight_decay)) {
    model.finalize();
  }
};

/** One kernel_call's measured seconds, one per measured round. */
struct kernel_timing {
  std::string what, shape;
  std::size_t count;
  std::vector<double> s;
};

struct result {
  std::vector<double> step_s, fb_s, opt_s, gemm_s, kernels_s;
  std::map<std::string, std::vector<double>> shape_s, shape_blas_s;
  std::vector<kernel_timing> kernels;  // kernel_bench::calls order
  double first_loss = 0, last_loss = 0, moved_per_step = 0;
  std::uint64_t evictions = 0;
};

template <class Runtime>
result run(const options& o, const gpt::gpt_config& c, std::size_t capacity, typename Runtime::placement_type p) {
  auto t = std::make_unique<trainer<Runtime>>(c, gpt::batch_shape{o.batch, o.seq}, capacity, std::move(p));
  gemm_bench gb(step_gemms(c, o.batch, o.seq));
  kernel_bench kb(c, o.batch, o.seq);
  e2e::batches data(o.batch, o.seq);
  result r;
  for (const auto& k : kb.calls) r.kernels.push_back({k.what, k.shape, k.count, {}});
  std::uint64_t moved0 = 0, evictions0 = 0;
  for (int round = 0; round < o.warmup + o.rounds; ++round) {
    const bool measured = round >= o.warmup;
    if (round == o.warmup) moved0 = t->rt.stats().bytes_moved(), evictions0 = t->rt.stats().evictions;
    data.load(round + 1);
    const auto t0 = e2e::clock::now();
    const double loss = t->model.forward_backward(data.tokens(), data.targets());
    const double fb = seconds_since(t0);
    const auto t1 = e2e::clock::now();
    if (!t->opt.step(t->rt, e2e::learning_rate).stepped) throw state_error("an fp32 step was skipped (overflow)");
    const double os = seconds_since(t1);
    if (round == 0) r.first_loss = loss;
    r.last_loss = loss;
    double gemm = 0;
    for (const auto& g : gb.shapes) {
      const double s = gb.time(g);  // the step runs each shape `count` times: one timed call stands for them
      gemm += s * double(g.count);
      if (measured) r.shape_s[g.what].push_back(s);
    }
    {
      const blas_threads_scope threaded(omp_get_max_threads());
      for (const auto& g : gb.shapes) {
        const double s = gb.time(g, true);
        if (measured) r.shape_blas_s[g.what].push_back(s);
      }
    }
    double kernels = 0;
    for (std::size_t i = 0; i < kb.calls.size(); ++i) {
      const double s = kernel_bench::time(kb.calls[i]);  // as for the GEMMs: one timed call stands for `count`
      kernels += s * double(kb.calls[i].count);
      if (measured) r.kernels[i].s.push_back(s);
    }
    if (measured) {
      r.step_s.push_back(fb + os);
      r.fb_s.push_back(fb);
      r.opt_s.push_back(os);
      r.gemm_s.push_back(gemm);
      r.kernels_s.push_back(kernels);
    }
    std::printf(
        "round %2d%s: step %.1f ms (forward+backward %.1f, optimizer %.1f), GEMM shapes %.1f ms, other kernels %.1f "
        "ms, "
        "loss %.4f\n",
        round, measured ? "" : " (warm-up)", 1e3 * (fb + os), 1e3 * fb, 1e3 * os, 1e3 * gemm, 1e3 * kernels, loss);
    std::fflush(stdout);
  }
  r.moved_per_step = double(t->rt.stats().bytes_moved() - moved0) / o.rounds;
  r.evictions = t->rt.stats().evictions - evictions0;
  return r;
}

}  // namespace

int main(int argc, char** argv) try {
  const options o = parse(argc, argv);
  const gpt::gpt_config c = gpt::parse_preset(o.preset);
  const std::size_t tokens = o.batch * o.seq;
  const auto shapes = step_gemms(c, o.batch, o.seq);
  double gemm_flops = 0;
  for (const auto& g : shapes) gemm_flops += g.flops();
  const std::size_t nmat = matmul_params(c);
  const double model_flops = 6.0 * double(nmat) * double(tokens) + causal_attention_flops(c, o.batch, o.seq);
#if defined(OPENBLAS_VERSION)
  const char* blas = OPENBLAS_VERSION;
#else
  const char* blas = "a CBLAS";
#endif
  std::printf(
      "bench_cpu_trainer: preset %s (%d layers, width %d, %d heads): %zu parameters, %zu of them in GEMMs; "
      "batch %zu x %zu = %zu tokens; policy %s\n",
      o.preset.c_str(), c.layers, c.width, c.heads, gpt::param_count(c), nmat, o.batch, o.seq, tokens,
      o.policy.c_str());
  std::printf("CPU kernels: %s; OpenMP threads %d; BLAS:%s (single-threaded, rows split over the OpenMP threads)\n",
              cpu_isa_report().c_str(), omp_get_max_threads(), blas);
  std::printf("model FLOPs per step: 6 N tokens %.3g + causal attention %.3g = %.4g (GEMM shapes: %.4g)\n",
              6.0 * double(nmat) * double(tokens), causal_attention_flops(c, o.batch, o.seq), model_flops, gemm_flops);

  const searched_chunk_layout layout;
  const std::size_t model = e2e::model_bytes(layout, c);
  const std::size_t act = e2e::activation_bytes(c, o.batch, o.seq);
  result r;
  if (o.policy == "resident") {
    using rt = chunk_runtime<searched_chunk_layout, static_placement, belady_eviction>;
    r = run<rt>(o, c, act + model, static_placement::all_device());
  } else {
    using rt = chunk_runtime<searched_chunk_layout, auto_placement, belady_eviction>;
    r = run<rt>(o, c, act + static_cast<std::size_t>(0.4 * double(model)), auto_placement{});
  }

  const double step = e2e::median(r.step_s), fb = e2e::median(r.fb_s), opt = e2e::median(r.opt_s);
  double trainer_gemm = 0;  // the trainer's own GEMM path, per step (sum of the per-shape medians)
  for (const auto& g : shapes) trainer_gemm += e2e::median(r.shape_s[g.what]) * double(g.count);
  std::printf("\n%-14s %5s %5s %5s %5s  %9s  %9s  %9s\n", "GEMM", "m", "n", "k", "x", "ms split", "ms BLAS-thr",
              "GFLOP/s best");
  std::vector<e2e::json_record> records;
  double gemm = 0;  // per step, each shape at the faster of the two ways: the sgemm rate's denominator
  for (const auto& g : shapes) {
    const double s = e2e::median(r.shape_s[g.what]), sb = e2e::median(r.shape_blas_s[g.what]), best = std::min(s, sb);
    gemm += best * double(g.count);
    const double rate = 2.0 * double(g.m) * double(g.n) * double(g.k) / best;
    std::printf("%-14s %5zu %5zu %5zu %5zu  %9.3f  %9.3f  %9.1f\n", g.what.c_str(), g.m, g.n, g.k, g.count, 1e3 * s,
                1e3 * sb, rate / 1e9);
    e2e::json_record j;
    j.str("benchmark", "gemm").str("shape", g.what).num("m", double(g.m)).num("n", double(g.n)).num("k", double(g.k));
    j.num("count_per_step", double(g.count)).num("seconds_split", s).num("seconds_blas_threads", sb);
    j.num("gflops", rate / 1e9);
    records.push_back(j);
  }
  const double sgemm_rate = gemm_flops / gemm, model_rate = model_flops / step;
  std::printf("\n| what | per step | rate | share of step |\n|---|---:|---:|---:|\n");
  std::printf("| GEMM shapes of one step (sgemm, best way per shape) | %.1f ms | %.1f GFLOP/s | %.1f%% |\n", 1e3 * gemm,
              sgemm_rate / 1e9, 100 * gemm / step);
  std::printf("| the same on the trainer's path (rows split) | %.1f ms | %.1f GFLOP/s | %.1f%% |\n", 1e3 * trainer_gemm,
              gemm_flops / trainer_gemm / 1e9, 100 * trainer_gemm / step);
  std::printf("| trainer step (forward + backward + AdamW) | %.1f ms | %.1f model GFLOP/s | 100%% |\n", 1e3 * step,
              model_rate / 1e9);
  std::printf("| - forward + backward | %.1f ms | | %.1f%% |\n", 1e3 * fb, 100 * fb / step);
  std::printf("| - of which not GEMM (other kernels, runtime) | %.1f ms | | %.1f%% |\n", 1e3 * (fb - trainer_gemm),
              100 * (fb - trainer_gemm) / step);
  std::printf("| - optimizer (norm scan, AdamW) | %.1f ms | | %.1f%% |\n", 1e3 * opt, 100 * opt / step);
  std::printf("\n%-30s %-26s %5s  %9s  %7s\n", "kernel (not GEMM)", "shape", "x", "ms/step", "of step");
  double kernels = 0;  // per step, the sum of the per-kernel medians x counts
  for (const auto& k : r.kernels) {
    const double s = e2e::median(k.s), per_step = s * double(k.count);
    kernels += per_step;
    std::printf("%-30s %-26s %5zu  %9.3f  %6.1f%%\n", k.what.c_str(), k.shape.c_str(), k.count, 1e3 * per_step,
                100 * per_step / step);
    e2e::json_record jk;  // seconds: one call, as the gemm records' seconds_split
    jk.str("benchmark", "kernel").str("kernel", k.what).str("shape", k.shape).num("count_per_step", double(k.count));
    jk.num("seconds", s).num("seconds_per_step", per_step);
    records.push_back(jk);
  }
  // The GEMMs on the trainer's path: the way the step runs them, so the rest is what the step adds.
  const double timed = trainer_gemm + kernels;
  std::printf(
      "sum of timed kernels (GEMM + these) %.1f ms of the %.1f ms step; the rest (runtime, optimizer, copies) %.1f ms "
      "(GEMM %.1f + these %.1f; the optimizer alone %.1f)\n",
      1e3 * timed, 1e3 * step, 1e3 * (step - timed), 1e3 * trainer_gemm, 1e3 * kernels, 1e3 * opt);
  std::printf(
      "\nmodel FLOP/s / sgemm rate = %.3f (%.0f tokens/s; chunks moved per step %s MiB, evictions %llu; loss %.4f -> "
      "%.4f)\n",
      model_rate / sgemm_rate, double(tokens) / step, e2e::mib(r.moved_per_step).c_str(),
      static_cast<unsigned long long>(r.evictions), r.first_loss, r.last_loss);
  e2e::json_record j;
  j.str("benchmark", "trainer").str("preset", o.preset).num("batch", double(o.batch)).num("seq", double(o.seq));
  j.str("policy", o.policy)
      .str("isa", std::string(cpu_isa_name(active_cpu_isa())))
      .num("threads", omp_get_max_threads());
  j.num("params", double(gpt::param_count(c)))
      .num("matmul_params", double(nmat))
      .num("model_flops_per_step", model_flops);
  j.num("gemm_flops_per_step", gemm_flops).num("step_s", step).num("forward_backward_s", fb).num("optimizer_s", opt);
  j.num("gemm_s", gemm).num("trainer_gemm_s", trainer_gemm).num("kernels_s", kernels);
  j.num("sgemm_gflops", sgemm_rate / 1e9).num("model_gflops", model_rate / 1e9);
  j.num("ratio", model_rate / sgemm_rate).num("tokens_per_s", double(tokens) / step).num("rounds", o.rounds);
  j.num("bytes_moved_per_step", r.moved_per_step).num("evictions", double(r.evictions));
  records.push_back(j);
  if (!o.json.empty()) e2e::write_json(o.json, records);
  if (!o.plot.empty()) {
    std::string dat;
    int i = 0;
    for (const auto& g : shapes)
      dat += std::to_string(i++) + " \"" + g.what + "\" " +
             std::to_string(2.0 * double(g.m) * double(g.n) * double(g.k) / e2e::median(r.shape_s[g.what]) / 1e9) +
             "\n";
    const std::string script =
        "set title 'GEMM shapes of one " + o.preset + " step (" + std::to_string(o.batch) + "x" +
        std::to_string(o.seq) +
        ") and the trainer'\nset termoption noenhanced\nset ylabel 'GFLOP/s'\nset style fill solid 0.6\n"
        "set boxwidth 0.7\nset xtics rotate by -40\nset yrange [0:*]\n"
        "plot '@DIR@/gemm.dat' using 1:3:xtic(2) with boxes title 'sgemm, per shape', " +
        std::to_string(sgemm_rate / 1e9) + " with lines lw 2 title 'sgemm, all shapes', " +
        std::to_string(model_rate / 1e9) + " with lines lw 2 dt 2 title 'trainer (model FLOP/s)'\n";
    e2e::run_gnuplot("bench_cpu_trainer", o.plot, script, {{"gemm.dat", dat}}, "1200,600");
  }
  return 0;
} catch (const chunkstar::error& e) {
  std::fprintf(stderr, "bench_cpu_trainer: %s\n", e.what());
  return 2;
}
