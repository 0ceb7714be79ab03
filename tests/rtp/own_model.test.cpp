// SPDX-License-Identifier: Apache-2.0
// RTP for a model that is not the GPT (examples/own_model/residual_mlp.hpp: a residual MLP language
// model with a tied embedding and head, built from library headers only), checked as its user
// would check it:
// - on 1-4 ranks every step's losses and gradients are within a derived bound of an independent
//   float64 serial model evaluated at the run's own parameters, the reported global norm counts
//   each replica once, and the loss falls;
// - the same bits whatever the store: the host's, and a chunk runtime at any budget, placement and
//   eviction policy (with clipping: the same bits across every chunk placement);
// - a checkpoint saved under RTP resumes at the same world size bit for bit, and loads in one
//   process with every element's bits, which then trains on the same micro-batches within the
//   same bound.
//
// The bound is a running error bound (as tests/support/rtp_mlp.hpp's): each value's error is at
// most chain x u x M, u = 2^-24, M the sum of |terms| behind it (with its inputs' own magnitudes
// carried along, gelu's slope <= 1.2 and curvature <= 1), chain the longest sequence of fp32
// roundings behind any value (`chain` below); checked with a factor 2 of slack, and shown to have
// teeth: a gradient that lost one rank's micro-batch lands far outside it.
#include "../../examples/own_model/residual_mlp.hpp"

#include <chunkstar/runtime/assemblies.hpp>
#include <chunkstar/checkpoint/runtime_checkpoint.hpp>
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/comm/single_process.hpp>
#include <chunkstar/rtp/checkpoint_view.hpp>
#include <chunkstar/rtp/chunk_shard_store.hpp>
#include <chunkstar/rtp/counter_init.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "support/disk_test_dir.hpp"
#include "support/runtimes.hpp"

namespace own_model_test {

using namespace chunkstar;
using own_model::config;

const config cfg{};
constexpr double u = 0x1.0p-24;
constexpr int steps = 5;
const adam_hyper adamw{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
const param_groups groups = param_groups::with_default_decay(adamw.weight_decay);

/** Micro-batch @p m of step @p step: random tokens, each one's target a fixed function of it. */
struct micro_batch {
  std::vector<int> tokens, targets;
};
micro_batch make_batch(int step, int m) {
  const rtp::counter_init r{.seed = 11, .key = rtp::tensor_key("tokens")};
  micro_batch b;
  for (std::size_t i = 0; i < cfg.rows; ++i) {
    const auto t = static_cast<int>(
        r.uniform01((static_cast<std::uint64_t>(step) * 64 + static_cast<std::uint64_t>(m)) * cfg.rows + i) *
        static_cast<double>(cfg.vocab));
    b.tokens.push_back(t);
    b.targets.push_back((7 * t + 3) % static_cast<int>(cfg.vocab));
  }
  return b;
}

/** Whole tensors, one vector each (the specs' order). */
using tensors = std::vector<std::vector<float>>;
tensors empty_tensors() {
  tensors t;
  for (const auto& s : own_model::specs(cfg)) t.emplace_back(s.numel(), 0.0f);
  return t;
}
/** Writes this rank's elements of list @p kind into @p out (a replica from rank 0 only). */
template <class State>
void gather(const State& m, chunk_kind kind, tensors& out) {
  std::vector<float> v;
  for (std::size_t k = 0; k < m.parts().size(); ++k) {
    const auto& p = m.parts()[k];
    if (p.replicated && m.rank() != 0) continue;
    v.resize(p.elems);
    m.read(k, kind, v);
    p.for_each([&](std::size_t t, std::size_t i, std::size_t off) { out[t][i] = v[off]; });
  }
}
bool same_bits(const tensors& a, const tensors& b) {
  for (std::size_t t = 0; t < a.size(); ++t)
    if (a[t].size() != b[t].size() || std::memcmp(a[t].data(), b[t].data(), a[t].size() * sizeof(float)) != 0)
      return false;
  return true;
}

/** What a run records per step: parameters before it, gradients, losses per micro-batch, norm. */
struct run {
  std::vector<tensors> params, grads;
  std::vector<std::vector<double>> losses;  // [step][micro-batch]
  std::vector<double> norms;
  tensors final_params, final_m, final_v;
  std::uint64_t ring_bytes = 0;  // what rank 0's rotations sent
  std::vector<bool> stepped;     // per step (false: skipped on an fp16 overflow)
  float loss_scale = 1;          // at the end
  std::uint64_t early_steps = 0, host_steps = 0;  // rank 0's chunk updates: inside backward (prepare_step), on the host
  bool operator==(const run& o) const {
    if (params.size() != o.params.size()) return false;
    for (std::size_t s = 0; s < params.size(); ++s)
      if (!same_bits(params[s], o.params[s])) return false;
    for (std::size_t s = 0; s < std::min(grads.size(), o.grads.size()); ++s)  // a run with early steps has none
      if (!same_bits(grads[s], o.grads[s])) return false;
    return losses == o.losses && same_bits(final_params, o.final_params) && same_bits(final_m, o.final_m) &&
           same_bits(final_v, o.final_v);
  }
};

/** Trains steps [from, to) on this rank of @p world micro-batches per step (a rank takes
 *  micro-batches rank, rank + N, ...: one each under RTP on `world` ranks, all of them in one
 *  process), loading @p load first and saving to @p save after. Records into @p rec (shared by the
 *  ranks: each writes its own elements, rank 0 the scalars). With @p early each step is prepared
 *  before its micro-batches (the updates start inside backward) and no gradient is recorded: an
 *  update that nothing can undo spends its chunk's gradient. */
template <class Comm, class Store>
void train(Comm& comm, Store& store, int world, int from, int to, float clip, run& rec,
           const std::filesystem::path& load = {}, const std::filesystem::path& save = {}, bool early = false) {
  own_model::residual_mlp<Comm, Store> model(comm, store, cfg);
  model.init();
  auto& m = model.state();
  if (!load.empty()) {
    rtp::checkpoint_load_view view(m);
    m.restore_step_count(std::stoll(load_checkpoint(view, load).at("optimizer_steps")));
  }
  for (int s = from; s < to; ++s) {
    const auto us = static_cast<std::size_t>(s - from);
    comm.barrier();  // every rank is done writing the last step's records before rank 0 grows them
    if (comm.rank() == 0) {
      rec.params.push_back(empty_tensors()), rec.losses.emplace_back(world);
      if (!early) rec.grads.push_back(empty_tensors());
    }
    comm.barrier();
    gather(m, chunk_kind::param, rec.params[us]);
    if (early) m.prepare_step(adamw, groups, world, clip);
    for (int mb = comm.rank(); mb < world; mb += comm.size()) {
      const micro_batch b = make_batch(s, mb);
      rec.losses[us][static_cast<std::size_t>(mb)] = model.forward(b.tokens.data(), b.targets.data());
      model.backward(b.tokens.data(), b.targets.data());
    }
    if (!early) gather(m, chunk_kind::grad, rec.grads[us]);
    const auto r = m.step(adamw, groups, world, clip);
    if (comm.rank() == 0) rec.norms.push_back(r.grad_norm), rec.stepped.push_back(r.stepped);
  }
  if (comm.rank() == 0) rec.ring_bytes = m.ring_stats().bytes_sent, rec.loss_scale = m.loss_scale();
  comm.barrier();
  if (comm.rank() == 0)
    rec.final_params = empty_tensors(), rec.final_m = empty_tensors(), rec.final_v = empty_tensors();
  comm.barrier();
  gather(m, chunk_kind::param, rec.final_params);
  gather(m, chunk_kind::momentum, rec.final_m);
  gather(m, chunk_kind::variance, rec.final_v);
  if (!save.empty()) {
    rtp::checkpoint_save_view view(m, comm);
    save_checkpoint(view, save, {{"optimizer_steps", std::to_string(m.step_count())}});
  }
}

run run_host(int n, int from, int to, float clip, const std::filesystem::path& load = {},
             const std::filesystem::path& save = {}) {
  run rec;
  run_ranks(n, [&](in_process_communicator& comm) {
    rtp::host_shard_store store;
    train(comm, store, n, from, to, clip, rec, load, save);
  });
  return rec;
}

/** The run with every rank's parts in its own chunk runtime @p Runtime, the device holding
 *  @p share of the model data beside the non-model memory. */
template <class Runtime, class T = float>
run run_chunked(int n, double share, float clip, typename Runtime::placement_type placement = {},
                dynamic_loss_scaler scaler = dynamic_loss_scaler(), bool early = false, int world = 0,
                searched_layout_options layout = {}) {
  run rec;
  run_ranks(n, [&](in_process_communicator& comm) {
    std::size_t model_bytes = 0;
    {
      rtp::host_shard_store probe;
      own_model::residual_mlp<in_process_communicator> sizing(comm, probe, cfg);
      model_bytes = probe.bytes();
    }
    simulated_device_space device(
        {.capacity = static_cast<std::size_t>(share * static_cast<double>(model_bytes)) + (64 << 10)});
    host_space host;
    host_copy_engine copier;
    single_process_communicator one;
    Runtime rt(device, host, copier, one, {.param_type = dtype_of_v<T>}, searched_chunk_layout(layout), placement);
    using store_type = rtp::chunk_shard_store<Runtime, rtp::host_shard_ops, host_adam_kernels, T>;
    std::optional<store_type> store;
    if constexpr (std::is_same_v<T, float16>) store.emplace(rt, rtp::host_shard_ops{}, scaler);
    else store.emplace(rt);
    train(comm, *store, world > 0 ? world : n, 0, steps, clip, rec, {}, {}, early);
    if (comm.rank() == 0) rec.early_steps = rt.stats().early_steps, rec.host_steps = rt.stats().host_steps;
  });
  return rec;
}

// ---- the serial float64 reference ----------------------------------------------------------------

constexpr double gelu_slope = 1.2, gelu_curvature = 1.0;  // >= max |gelu'| (1.13), max |gelu''| (0.8)

struct reference {
  std::vector<double> loss, loss_mag;  // per micro-batch
  std::vector<std::vector<double>> grad, mag;
};

/** Loss and gradient of the sum over micro-batches @p mbs of their mean losses, at @p P, with the
 *  magnitudes of the running error bound (the file comment). */
reference evaluate(const tensors& P, const std::vector<micro_batch>& mbs) {
  const std::size_t V = cfg.vocab, C = cfg.width, H = cfg.hidden, L = cfg.layers, R = cfg.rows;
  reference out;
  for (const auto& t : P) out.grad.emplace_back(t.size(), 0.0), out.mag.emplace_back(t.size(), 0.0);
  const auto& E = P[0];
  const auto& g = P.back();
  for (const auto& mb : mbs) {
    double loss = 0, loss_mag = 0;
    for (std::size_t r = 0; r < R; ++r) {
      const auto tok = static_cast<std::size_t>(mb.tokens[r]), tgt = static_cast<std::size_t>(mb.targets[r]);
      std::vector<std::vector<double>> x(L + 1, std::vector<double>(C)), mx = x, a(L, std::vector<double>(H)), ma = a;
      for (std::size_t i = 0; i < C; ++i) x[0][i] = E[tok * C + i], mx[0][i] = std::abs(x[0][i]);
      for (std::size_t l = 0; l < L; ++l) {
        const auto &W1 = P[own_model::w1(l)], &b1 = P[own_model::w1(l) + 1], &W2 = P[own_model::w1(l) + 2],
                   &b2 = P[own_model::b2(l)];
        for (std::size_t h = 0; h < H; ++h) {
          a[l][h] = b1[h], ma[l][h] = std::abs(b1[h]);
          for (std::size_t i = 0; i < C; ++i)
            a[l][h] += W1[h * C + i] * x[l][i], ma[l][h] += std::abs(W1[h * C + i]) * mx[l][i];
        }
        for (std::size_t o = 0; o < C; ++o) {
          double y = b2[o], my = std::abs(b2[o]);
          for (std::size_t h = 0; h < H; ++h)
            y += W2[o * H + h] * own_model::gelu(a[l][h]), my += std::abs(W2[o * H + h]) * gelu_slope * ma[l][h];
          x[l + 1][o] = x[l][o] + y, mx[l + 1][o] = mx[l][o] + my;
        }
      }
      std::vector<double> f(C), mf(C), z(V), mz(V);
      for (std::size_t i = 0; i < C; ++i) f[i] = x[L][i] * g[i], mf[i] = mx[L][i] * std::abs(g[i]);
      double zmax = -1e300, mzmax = 0;
      for (std::size_t v = 0; v < V; ++v) {
        for (std::size_t i = 0; i < C; ++i) z[v] += f[i] * E[v * C + i], mz[v] += mf[i] * std::abs(E[v * C + i]);
        zmax = std::max(zmax, z[v]), mzmax = std::max(mzmax, mz[v]);
      }
      double sum = 0;
      for (std::size_t v = 0; v < V; ++v) sum += std::exp(z[v] - zmax);
      const double lse = zmax + std::log(sum);
      loss += (lse - z[tgt]) / static_cast<double>(R);
      loss_mag += (mzmax + mz[tgt] + std::abs(lse)) / static_cast<double>(R);
      // Backward of this row's share of the mean.
      const double dl = 1.0 / static_cast<double>(R);
      std::vector<double> df(C), mdf(C), dx(C), mdx(C);
      auto& gE = out.grad[0];
      auto& mE = out.mag[0];
      for (std::size_t v = 0; v < V; ++v) {
        const double p = std::exp(z[v] - lse), dz = (p - (v == tgt ? 1.0 : 0.0)) * dl;
        const double mdz = dl * (p * (mz[v] + mzmax + std::abs(lse)) + p + (v == tgt ? 1.0 : 0.0));
        for (std::size_t i = 0; i < C; ++i) {
          gE[v * C + i] += dz * f[i], mE[v * C + i] += mdz * std::abs(f[i]) + std::abs(dz) * mf[i];
          df[i] += dz * E[v * C + i], mdf[i] += mdz * std::abs(E[v * C + i]);
        }
      }
      for (std::size_t i = 0; i < C; ++i) {
        out.grad.back()[i] += df[i] * x[L][i],
            out.mag.back()[i] += mdf[i] * std::abs(x[L][i]) + std::abs(df[i]) * mx[L][i];
        dx[i] = df[i] * g[i], mdx[i] = mdf[i] * std::abs(g[i]);
      }
      for (std::size_t l = L; l-- > 0;) {
        const std::size_t t1 = own_model::w1(l);
        const auto &W1 = P[t1], &W2 = P[t1 + 2];
        std::vector<double> px = dx, mpx = mdx;
        for (std::size_t o = 0; o < C; ++o)
          out.grad[own_model::b2(l)][o] += dx[o], out.mag[own_model::b2(l)][o] += mdx[o];
        for (std::size_t h = 0; h < H; ++h) {
          double dh = 0, mdh = 0;
          const double act = own_model::gelu(a[l][h]), mact = gelu_slope * ma[l][h];
          for (std::size_t o = 0; o < C; ++o) {
            dh += dx[o] * W2[o * H + h], mdh += mdx[o] * std::abs(W2[o * H + h]);
            out.grad[t1 + 2][o * H + h] += dx[o] * act,
                out.mag[t1 + 2][o * H + h] += mdx[o] * std::abs(act) + std::abs(dx[o]) * mact;
          }
          const double da = dh * own_model::gelu_grad(a[l][h]),
                       mda = mdh * gelu_slope + std::abs(dh) * gelu_curvature * ma[l][h];
          for (std::size_t i = 0; i < C; ++i) {
            out.grad[t1][h * C + i] += da * x[l][i],
                out.mag[t1][h * C + i] += mda * std::abs(x[l][i]) + std::abs(da) * mx[l][i];
            px[i] += da * W1[h * C + i], mpx[i] += mda * std::abs(W1[h * C + i]);
          }
          out.grad[t1 + 1][h] += da, out.mag[t1 + 1][h] += mda;
        }
        dx = px, mdx = mpx;
      }
      for (std::size_t i = 0; i < C; ++i) gE[tok * C + i] += dx[i], mE[tok * C + i] += mdx[i];
    }
    out.loss.push_back(loss), out.loss_mag.push_back(loss_mag);
  }
  return out;
}

/** The longest chain of fp32 roundings behind a value at N ranks: per block forward W1 x + b1
 *  (C + 1), gelu (8), the output over units and shards (H + N) and the residual (2); the gain (1),
 *  the logits (C), the online softmax over shards (V + N + 8) and the loss (2); backward the
 *  softmax's gradient (8), the sum over the vocabulary's shards (V + N), and per block the
 *  hidden gradient (C), gelu' (9), the input gradient over units and shards (H + N + 1); then the
 *  product (1), the sum over the micro-batch's rows (R), the ring's sum over ranks (N), the tied
 *  weight's two passes (1) and the accumulation of @p world micro-batches on one rank. */
double chain(int n, int world) {
  const auto N = static_cast<double>(n), C = static_cast<double>(cfg.width), H = static_cast<double>(cfg.hidden),
             V = static_cast<double>(cfg.vocab), L = static_cast<double>(cfg.layers), R = static_cast<double>(cfg.rows);
  return L * (C + 1 + 8 + H + N + 2) + 1 + C + V + N + 8 + 2 + 8 + V + N + L * (C + 9 + H + N + 1) + 1 + R + N + 1 +
         world;
}

/** Every step of @p rec (of @p n ranks, @p world micro-batches per step, from step @p from) against
 *  the reference at the run's own parameters. Returns the largest error / tolerance. */
double check_against_reference(const run& rec, int n, int world, int from, float clip) {
  double worst = 0;
  for (std::size_t s = 0; s < rec.params.size(); ++s) {
    CAPTURE(s);
    std::vector<micro_batch> mbs;
    for (int m = 0; m < world; ++m) mbs.push_back(make_batch(from + static_cast<int>(s), m));
    const reference ref = evaluate(rec.params[s], mbs);
    const double k = 2 * chain(n, world) * u;
    double own_sq = 0;
    for (std::size_t t = 0; t < ref.grad.size(); ++t)
      for (std::size_t i = 0; i < ref.grad[t].size(); ++i) {
        const double got = rec.grads[s][t][i], want = ref.grad[t][i], tol = k * ref.mag[t][i];
        worst = std::max(worst, std::abs(got - want) / tol);
        if (std::abs(got - want) > tol)
          FAIL_CHECK("tensor " << t << "[" << i << "]: " << got << " vs " << want << " (tolerance " << tol << ")");
        own_sq += (got / world) * (got / world);
      }
    for (int m = 0; m < world; ++m) {
      const auto mu = static_cast<std::size_t>(m);
      CHECK(std::abs(rec.losses[s][mu] - ref.loss[mu]) <= k * ref.loss_mag[mu]);
    }
    // The norm the step clipped by: every replica once (counted N times it would be far off).
    // The norm the step clipped by is that of the gradients it holds, every replica once (counted
    // on every rank, it would be several per cent off); it differs by the roundings of the sum.
    if (clip > 0) CHECK(std::abs(rec.norms[s] - std::sqrt(own_sq)) <= 1e-6 * std::sqrt(own_sq));
    // The bound has teeth: a gradient without the last micro-batch's contribution is far outside.
    if (world > 1) {
      const reference lost = evaluate(rec.params[s], std::vector<micro_batch>(mbs.begin(), mbs.end() - 1));
      double gap = 0;
      for (std::size_t t = 0; t < ref.grad.size(); ++t)
        for (std::size_t i = 0; i < ref.grad[t].size(); ++i)
          gap = std::max(gap, std::abs(lost.grad[t][i] - ref.grad[t][i]) / (k * ref.mag[t][i]));
      CHECK(gap > 10);
    }
  }
  return worst;
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (const double x : v) s += x;
  return s / static_cast<double>(v.size());
}

TEST_CASE(
    "own model under RTP on 1-4 ranks: losses and gradients within the derived bound of a float64 serial model, the "
    "clipping norm counts replicas once; it trains") {
  for (const int n : {1, 2, 3, 4}) {
    CAPTURE(n);
    const run rec = run_host(n, 0, steps, 0.5f);
    const double worst = check_against_reference(rec, n, n, 0, 0.5f);
    MESSAGE("N = " << n << ": largest error / tolerance " << worst << ", loss " << mean(rec.losses.front()) << " -> "
                   << mean(rec.losses.back()));
    CHECK(mean(rec.losses.back()) < mean(rec.losses.front()));
    // Flyweight initialisation: every world size starts from the same model.
    CHECK(same_bits(rec.params[0], run_host(1, 0, 0, 0.5f).final_params));
  }
}

/** The largest relative difference between two runs' losses, over every step and micro-batch. */
double loss_gap(const run& a, const run& b) {
  double worst = 0;
  for (std::size_t s = 0; s < a.losses.size(); ++s)
    for (std::size_t m = 0; m < a.losses[s].size(); ++m)
      worst = std::max(worst, std::abs(a.losses[s][m] - b.losses[s][m]) / std::abs(b.losses[s][m]));
  return worst;
}

TEST_CASE(
    "own model under RTP in bf16 and fp16: 16-bit shards rotate (half the ring's bytes), the same bits at every "
    "budget, "
    "placement and policy, and the fp32 run's losses within the 16-bit weights' rounding") {
  using namespace chunkstar::testing;
  for (const int n : {1, 2, 3}) {
    CAPTURE(n);
    const run fp32 = run_chunked<patrickstar_runtime>(n, 1.5, 0.5f);
    // fp16 at a loss scale under which this model's gradients stay finite (the default 65536 is too
    // high for them: the next test case).
    const dynamic_loss_scaler scaler({.init_scale = 64.0f});
    const auto check = [&](const run& roomy, auto type, double tol) {
      using T = decltype(type);
      CHECK(run_chunked<patrickstar_runtime, T>(n, 0.3, 0.5f, {}, scaler) == roomy);
      CHECK(run_chunked<lru_runtime, T>(n, 0.3, 0.5f, {}, scaler) == roomy);
      CHECK(run_chunked<static_runtime, T>(n, 0.3, 0.5f, static_placement::all_host(), scaler) == roomy);
      CHECK(roomy.ring_bytes * 2 == fp32.ring_bytes);  // the same shifts, of 16-bit shards
      CHECK(std::all_of(roomy.stepped.begin(), roomy.stepped.end(), [](bool b) { return b; }));
      // Each step's weights are the fp32 run's rounded to 16 bits (relative u: bf16 2^-8, fp16
      // 2^-11) and its gradient sums are rounded once per add: a loss moves by at most a few u
      // (the model's loss changes by less than its weights do, relatively) per step: 4 x steps x u.
      const double gap = loss_gap(roomy, fp32);
      MESSAGE("N = " << n << ", " << dtype_name(dtype_of_v<T>) << ": losses within " << gap << " of fp32's (bound "
                     << tol << ")");
      CHECK(gap <= tol);
      CHECK(gap > 0);  // 16-bit weights do change the arithmetic
    };
    check(run_chunked<patrickstar_runtime, bfloat16>(n, 1.5, 0.5f), bfloat16{}, 4.0 * steps * std::ldexp(1.0, -8));
    check(run_chunked<patrickstar_runtime, float16>(n, 1.5, 0.5f, {}, scaler), float16{},
          4.0 * steps * std::ldexp(1.0, -11));
  }
}

TEST_CASE(
    "own model under RTP in fp16: an overflow on any rank skips the step on every rank, and the scale backs off") {
  using namespace chunkstar::testing;
  for (const int n : {1, 3}) {
    CAPTURE(n);
    // The default scale, 65536: this model's scaled gradients overflow fp16 (max 65504).
    const run r = run_chunked<patrickstar_runtime, float16>(n, 1.5, 0.5f);
    REQUIRE(!r.stepped.empty());
    CHECK_FALSE(r.stepped.front());
    CHECK(same_bits(r.params[1], r.params[0]));  // a skipped step changes no weight, on any rank
    CHECK(r.loss_scale < 65536.0f);              // it backed off
  }
}

TEST_CASE(
    "own model under RTP: the same bits in the host store and in a chunk runtime at any budget, placement and policy") {
  using namespace chunkstar::testing;
  for (const int n : {1, 3}) {
    CAPTURE(n);
    // Without clipping nothing depends on how the norm's sum is grouped: the host store's bits.
    const run host = run_host(n, 0, steps, 0.0f);
    CHECK(run_chunked<patrickstar_runtime>(n, 1.5, 0.0f) == host);
    CHECK(run_chunked<patrickstar_runtime>(n, 0.3, 0.0f) == host);
    // With clipping, the same bits at every budget, placement and eviction policy.
    const run roomy = run_chunked<patrickstar_runtime>(n, 1.5, 0.5f);
    CHECK(run_chunked<patrickstar_runtime>(n, 0.3, 0.5f) == roomy);
    CHECK(run_chunked<lru_runtime>(n, 0.3, 0.5f) == roomy);
    CHECK(run_chunked<static_runtime>(n, 0.3, 0.5f, static_placement::all_host()) == roomy);
    check_against_reference(roomy, n, n, 0, 0.5f);
  }
}

/** run_chunked under a device holding 0.3 of the model, with chunks as small as the largest tensor
 *  (several per rank, whose gradients become final one after another in backward; the default
 *  layout packs this tiny model into one); @p early: each step prepared before its micro-batches. */
template <class Runtime, class T = float>
run run_small_chunks(int n, float clip, bool early, typename Runtime::placement_type placement = {}, int world = 0,
                     dynamic_loss_scaler scaler = dynamic_loss_scaler()) {
  return run_chunked<Runtime, T>(n, 0.3, clip, placement, scaler, early, world, {.spread = 1});
}

TEST_CASE(
    "own model under RTP, the step inside backward (sharded_model::prepare_step): every host-stepped chunk's update "
    "starts once its shard's gradient sum has come home, and the bits are the step's after backward") {
  using namespace chunkstar::testing;
  // Every optimizer step on the host (the offload placement), and the PatrickStar placement (some
  // chunks step on the device).
  const auto offload = static_placement::all_host();
  for (const int n : {1, 3}) {
    CAPTURE(n);
    // clip 0: nothing can undo an update, which spends its gradient; 1e3: never clips (each update
    // keeps what undoes it, and is kept). This model's norms fall from 6 to 2 over the steps.
    for (const float clip : {0.0f, 1e3f}) {
      CAPTURE(clip);
      const run plain = run_small_chunks<static_runtime>(n, clip, false, offload);
      const run early = run_small_chunks<static_runtime>(n, clip, true, offload);
      CHECK(early == plain);
      CHECK(early.early_steps > 0);
      CHECK(run_small_chunks<patrickstar_runtime>(n, clip, true) == plain);
    }
    // 0.02: every step clips, so after the first (no trace yet) none speculates (speculation_advised).
    const run clipped = run_small_chunks<static_runtime>(n, 0.02f, true, offload);
    CHECK(clipped == run_small_chunks<static_runtime>(n, 0.02f, false, offload));
    CHECK(clipped.early_steps == 0);
    // Two micro-batches per rank: the updates start in the second one's backward.
    const run accumulated = run_small_chunks<static_runtime>(n, 0.0f, true, offload, 2 * n);
    CHECK(accumulated == run_small_chunks<static_runtime>(n, 0.0f, false, offload, 2 * n));
    CHECK(accumulated.early_steps > 0);
    // 16-bit shards, fp32 masters updated and 16-bit weights rounded inside backward: fp16 under its
    // dynamic scale (an overflow would undo the updates: their state is kept; at this scale this
    // model's gradients stay finite), and bf16.
    const dynamic_loss_scaler fp16_scale({.init_scale = 64.0f});
    const run half = run_small_chunks<static_runtime, float16>(n, 0.0f, true, offload, 0, fp16_scale);
    CHECK(half == run_small_chunks<static_runtime, float16>(n, 0.0f, false, offload, 0, fp16_scale));
    CHECK(half.early_steps > 0);
    const run brain = run_small_chunks<static_runtime, bfloat16>(n, 1e3f, true, offload);
    CHECK(brain == run_small_chunks<static_runtime, bfloat16>(n, 1e3f, false, offload));
    CHECK(brain.early_steps > 0);
    MESSAGE("N = " << n << ": " << accumulated.early_steps << " of rank 0's " << accumulated.host_steps
                   << " chunk updates inside backward (" << steps << " steps of two micro-batches each)");
  }
}

TEST_CASE("own model under RTP: a step with other clipping than prepare_step's is refused before it changes anything") {
  using store_type = rtp::chunk_shard_store<static_runtime>;
  simulated_device_space device({.capacity = 1 << 20});
  host_space host;
  host_copy_engine copier;
  single_process_communicator one;
  static_runtime rt(device, host, copier, one, {}, searched_chunk_layout({.spread = 1}),
                    static_placement::all_host());
  store_type store(rt);
  own_model::residual_mlp<single_process_communicator, store_type> model(one, store, cfg);
  model.init();
  auto& m = model.state();
  for (int s = 0; s < 2; ++s) {  // the second step has a trace: its updates start inside backward
    const micro_batch b = make_batch(s, 0);
    CHECK(m.prepare_step(adamw, groups, 1, 0.0f));
    (void)model.forward(b.tokens.data(), b.targets.data());
    model.backward(b.tokens.data(), b.targets.data());
    if (s > 0) CHECK_THROWS_AS((void)m.step(adamw, groups, 1, 0.5f), state_error);
    const auto r = m.step(adamw, groups, 1, 0.0f);  // what prepare_step was given: the step goes on
    CHECK(r.stepped);
    CHECK((r.early_steps > 0) == (s > 0));  // the result says how many started inside backward
    CHECK_FALSE(r.early_redone);
  }
  CHECK(rt.stats().early_steps > 0);
}

TEST_CASE(
    "own model under RTP: a checkpoint resumes at the same world size bit for bit and loads in one process with every "
    "bit") {
  test::scratch_dir dir;
  for (const int n : {2, 4}) {
    CAPTURE(n);
    const std::string half = dir.path() + "/half" + std::to_string(n);
    const run straight = run_host(n, 0, 2 * steps, 0.5f);
    const run first = run_host(n, 0, steps, 0.5f, {}, half);
    const run second = run_host(n, steps, 2 * steps, 0.5f, half);
    CHECK(same_bits(second.final_params, straight.final_params));
    CHECK(same_bits(second.final_m, straight.final_m));
    CHECK(same_bits(second.final_v, straight.final_v));
    // One process (single_process_communicator, all n micro-batches per step) loads every bit and
    // trains on, within the bound of the serial model.
    single_process_communicator comm;
    run loaded, one;
    {
      rtp::host_shard_store store;
      train(comm, store, n, steps, steps, 0.5f, loaded, half);
    }
    CHECK(same_bits(loaded.final_params, first.final_params));
    CHECK(same_bits(loaded.final_m, first.final_m));
    CHECK(same_bits(loaded.final_v, first.final_v));
    rtp::host_shard_store store;
    train(comm, store, n, steps, 2 * steps, 0.5f, one, half);
    check_against_reference(one, 1, n, steps, 0.5f);
    MESSAGE("N = " << n << " resumed in one process: loss " << mean(one.losses.back()) << " (at " << n
                   << " ranks: " << mean(straight.losses.back()) << ")");
  }
}

TEST_CASE("own model under RTP: a rank stepping with another lr or clipping at a later step stops every rank there") {
  // sharded_model::step compares every step's arguments across the ranks before its first
  // collective (step_agreement): one rank's schedule going its own way is a config_error on all.
  const auto run_with = [](const std::function<void(int rank, int step, adam_hyper&, float& clip)>& vary) {
    std::vector<std::string> messages(2);
    std::vector<int> failed_at(2, 0);
    run_ranks(2, [&](in_process_communicator& comm) {
      rtp::host_shard_store store;
      own_model::residual_mlp<in_process_communicator> model(comm, store, cfg);
      model.init();
      auto& m = model.state();
      const auto me = static_cast<std::size_t>(comm.rank());
      for (int s = 1; s <= 3; ++s) {
        const micro_batch b = make_batch(s, comm.rank());
        (void)model.forward(b.tokens.data(), b.targets.data());
        model.backward(b.tokens.data(), b.targets.data());
        adam_hyper h = adamw;
        float clip = 0.5f;
        vary(comm.rank(), s, h, clip);
        try {
          (void)m.step(h, groups, 2, clip);
        } catch (const config_error& e) {
          messages[me] = e.what();
          failed_at[me] = s;
          break;
        }
      }
    });
    return std::pair{messages, failed_at};
  };
  const auto [none, none_at] = run_with([](int, int, adam_hyper&, float&) {});
  CHECK(none_at == std::vector<int>{0, 0});
  const auto [lr, lr_at] = run_with([](int r, int s, adam_hyper& h, float&) {
    if (r == 1 && s >= 2) h.lr *= 2;
  });
  CHECK(lr_at == std::vector<int>{2, 2});
  CHECK(lr[0] == lr[1]);
  CHECK(lr[0].find("rtp::sharded_model::step: the ranks' step arguments differ: rank 0 passes lr") !=
        std::string::npos);
  const auto [clip, clip_at] = run_with([](int r, int s, adam_hyper&, float& c) {
    if (r == 0 && s >= 3) c = 0.0f;  // without clipping rank 0 would skip the norm's all-reduce
  });
  CHECK(clip_at == std::vector<int>{3, 3});
  CHECK(clip[1].find("rank 0 passes max_norm 0 but rank 1 passes max_norm 0.5") != std::string::npos);
}

}  // namespace own_model_test
