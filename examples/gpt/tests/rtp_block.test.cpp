// SPDX-License-Identifier: Apache-2.0
// The GPT transformer block under RTP (rtp_block.hpp) on 1-4 in-process ranks against the serial
// block (gpt_model.hpp block_forward / block_backward on the full weights, fp32) and against an
// independent float64 reference that carries a running error bound for every value
// (block_error_bound.hpp). Each rank has its own micro-batch; the serial block runs the N
// micro-batches one after another with its gradients summed. Tolerances are derived, not tuned:
// docs/rtp.md ("The GPT block", "Tolerance") derives them.
#include "block_error_bound.hpp"
#include "rtp_block.hpp"

#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/comm/single_process.hpp>
#include <chunkstar/rtp/counter_init.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace rtp_block_test {

namespace {

using chunkstar::in_process_communicator;
using chunkstar::rtp::counter_init;
using chunkstar::rtp::tensor_key;
using gpt::block_tensor;
using gpt::testing::block_tensors;
using gpt::testing::bounded;

// heads = 12 divides over 1, 2, 3 and 4 ranks; head size 4; 4C = 192 hidden units.
const gpt::gpt_config config{.vocab = 8, .context = 8, .layers = 1, .heads = 12, .width = 48};
constexpr std::size_t B = 2, Tn = 7, rows = B * Tn, C = 48;
constexpr std::uint64_t seed = 2024;
constexpr float lr = 0.2f;
constexpr int iterations = 6;
// First-order running bounds leave out products of errors and count libm's ulps generously; a
// factor 2 covers both (gamma_n against n u is already exact). Two fp32 runs (RTP, serial) each
// within `safety * E` of the exact value are within twice that of each other.
constexpr double safety = 2;

const char* tensor_name(block_tensor t) {
  static const char* names[] = {"ln1.w", "ln1.b", "qkv.w", "qkv.b", "proj.w",   "proj.b",
                                "ln2.w", "ln2.b", "fc.w",  "fc.b",  "fcproj.w", "fcproj.b"};
  return names[static_cast<int>(t)];
}

/** The initial value of element i of tensor t: a pure function of (seed, tensor, i). */
float init_value(block_tensor t, std::size_t i) {
  const counter_init g{.seed = seed, .key = tensor_key(tensor_name(t))};
  switch (t) {
    case block_tensor::ln1_w:
    case block_tensor::ln2_w: return g.uniform<float>(i, 0.8f, 1.2f);
    case block_tensor::qkv_w: return g.normal<float>(i, 0.0f, 0.15f);
    case block_tensor::proj_w: return g.normal<float>(i, 0.0f, 0.1f);
    case block_tensor::fc_w: return g.normal<float>(i, 0.0f, 0.15f);
    case block_tensor::fcproj_w: return g.normal<float>(i, 0.0f, 0.07f);
    default: return g.uniform<float>(i, -0.1f, 0.1f);  // biases and LayerNorm biases
  }
}

block_tensors<float> initial_block() {
  block_tensors<float> p(C);
  for (std::size_t k = 0; k < gpt::block_tensor_count; ++k)
    for (std::size_t i = 0; i < p.t[k].size(); ++i) p.t[k][i] = init_value(static_cast<block_tensor>(k), i);
  return p;
}

/** Micro-batch m of a step (or of the evaluation set): input x ~ N(0, 1) and target. */
struct micro_batch {
  std::vector<float> x, target;
};
micro_batch make_batch(bool eval, int step, int m) {
  const counter_init xs{.seed = seed, .key = tensor_key(eval ? "x_eval" : "x")};
  const counter_init ts{.seed = seed, .key = tensor_key(eval ? "t_eval" : "t")};
  micro_batch mb{std::vector<float>(rows * C), std::vector<float>(rows * C)};
  const std::uint64_t base =
      (static_cast<std::uint64_t>(eval ? 0 : step) * 64 + static_cast<std::uint64_t>(m)) * rows * C;
  xs.fill_normal<float>(mb.x, base, 0.0f, 1.0f);
  ts.fill_normal<float>(mb.target, base, 0.0f, 1.0f);
  return mb;
}

/** The loss of a micro-batch is 0.5 scale sum (y - t)^2 with scale = 1 / (N rows): the mean over
 *  the global batch's tokens. dy = (y - t) scale, in fp32 on both sides. */
double loss_scale(int n) { return 1.0 / (static_cast<double>(n) * rows * C); }
std::vector<float> output_grad(const std::vector<float>& y, const micro_batch& mb, int n) {
  const auto s = static_cast<float>(loss_scale(n));
  std::vector<float> dy(y.size());
  for (std::size_t i = 0; i < y.size(); ++i) dy[i] = (y[i] - mb.target[i]) * s;
  return dy;
}
double loss_of(const std::vector<float>& y, const micro_batch& mb, int n) {
  double l = 0;
  for (std::size_t i = 0; i < y.size(); ++i) {
    const double e = static_cast<double>(y[i]) - mb.target[i];
    l += 0.5 * e * e;
  }
  return l * loss_scale(n);
}

/** Activations and workspace of one micro-batch (the serial block's sizes, for either side). */
struct block_buffers {
  std::vector<float> act, work, proj;
  gpt::block_activations<float> a;
  gpt::backward_workspace<float> w;
  block_buffers() {
    const auto s = gpt::compute_activation_sizes(config, B, Tn);
    act.assign(s.block, 0.0f), work.assign(s.workspace, 0.0f), proj.assign(rows * C, 0.0f);
    a = gpt::bind_block_activations(config, B, Tn, act.data());
    w = gpt::bind_backward_workspace(config, B, Tn, work.data());
  }
  block_buffers(const block_buffers&) = delete;
  block_buffers& operator=(const block_buffers&) = delete;
  std::vector<float> out() const { return {a.res3, a.res3 + rows * C}; }
  std::vector<float> dres() const { return {w.dres, w.dres + rows * C}; }
};

// ---- one training step (forward, backward) on each side --------------------------------------

struct step_result {
  std::vector<std::vector<float>> y, dx;  // per micro-batch (rank)
  block_tensors<float> grad{C};
};

/** The serial block on the full weights: micro-batches [first, last) (default 0..n-1) one after
 *  another, gradients summed (block_backward adds into them); @p n sets the loss scale. */
step_result serial_step(block_tensors<float>& p, int n, int step, int first = 0, int last = -1) {
  step_result r;
  const auto pv = p.view();
  const auto gv = r.grad.view();
  for (int m = first; m < (last < 0 ? n : last); ++m) {
    const micro_batch mb = make_batch(false, step, m);
    block_buffers buf;
    gpt::block_forward(config, B, Tn, pv, mb.x.data(), buf.a, buf.proj.data());
    r.y.push_back(buf.out());
    const auto dy = output_grad(r.y.back(), mb, n);
    std::copy(dy.begin(), dy.end(), buf.w.dres);
    gpt::block_backward(config, B, Tn, pv, gv, mb.x.data(), buf.a, buf.w);
    r.dx.push_back(buf.dres());
  }
  return r;
}

/** What one RTP rank records over a run. */
struct rank_record {
  std::vector<std::vector<float>> y, dx;           // per iteration: this rank's output and input gradient
  std::vector<block_tensors<float>> before, grad;  // per iteration: this rank's stored shards (others NaN)
  std::vector<block_tensors<float>> after;
  std::vector<double> eval_loss;  // global (all-reduced)
  int eval_displaced = 0;         // evaluations that changed an owned shard
};

block_tensors<float> nan_block() {
  block_tensors<float> b(C);
  for (auto& t : b.t) std::fill(t.begin(), t.end(), std::numeric_limits<float>::quiet_NaN());
  return b;
}

/** One rank: @p iters SGD steps on its micro-batches, an evaluation pass after each. */
template <class Comm>
rank_record train_rank(Comm& comm, int iters) {
  const int n = comm.size(), me = comm.rank();
  gpt::rtp_block<Comm> blk(comm, config);
  blk.fill(init_value);  // this rank's shards only, by global index
  rank_record rec;
  block_buffers buf;
  auto snapshot = [&](bool grads) {
    block_tensors<float> s = nan_block();
    if (grads) blk.store_grads(s.view());
    else blk.store(s.view());
    return s;
  };
  for (int it = 0; it < iters; ++it) {
    const micro_batch mb = make_batch(false, it, me);
    rec.before.push_back(snapshot(false));
    blk.forward(B, Tn, mb.x.data(), buf.a, buf.proj.data());
    rec.y.push_back(buf.out());
    const auto dy = output_grad(rec.y.back(), mb, n);
    std::copy(dy.begin(), dy.end(), buf.w.dres);
    blk.backward(B, Tn, mb.x.data(), buf.a, buf.w);
    rec.dx.push_back(buf.dres());
    rec.grad.push_back(snapshot(true));
    // SGD, all local: the owned shards, and the replicas (the same on every rank).
    for (auto* rot : {&blk.attention(), &blk.mlp()})
      for (std::size_t e = 0; e < rot->shard_elems(); ++e) rot->owned()[e] -= lr * rot->owned_grad()[e];
    for (std::size_t e = 0; e < blk.replicated().size(); ++e) blk.replicated()[e] -= lr * blk.replicated_grad()[e];
    rec.after.push_back(snapshot(false));
    // Evaluation: forward only; the owned shards must be bit-unchanged.
    const std::vector<float> a0(blk.attention().owned().begin(), blk.attention().owned().end());
    const std::vector<float> m0(blk.mlp().owned().begin(), blk.mlp().owned().end());
    const micro_batch ev = make_batch(true, 0, me);
    blk.forward(B, Tn, ev.x.data(), buf.a, buf.proj.data());
    double l[1] = {loss_of(buf.out(), ev, n)};
    comm.allreduce(std::span<double>(l), chunkstar::reduce_op::sum);
    rec.eval_loss.push_back(l[0]);
    if (std::memcmp(a0.data(), blk.attention().owned().data(), a0.size() * sizeof(float)) != 0 ||
        std::memcmp(m0.data(), blk.mlp().owned().data(), m0.size() * sizeof(float)) != 0)
      ++rec.eval_displaced;
  }
  return rec;
}

std::vector<rank_record> run_rtp(int n, int iters) {
  std::vector<rank_record> out(static_cast<std::size_t>(n));
  chunkstar::run_ranks(
      n, [&](in_process_communicator& comm) { out[static_cast<std::size_t>(comm.rank())] = train_rank(comm, iters); });
  return out;
}

/** The whole block from every rank's stored shards: shard j from rank j; the replicas from rank 0
 *  (the test checks they agree). */
block_tensors<float> assemble(const std::vector<block_tensors<float>>& per_rank) {
  const int n = static_cast<int>(per_rank.size());
  block_tensors<float> out = per_rank[0];
  const gpt::rtp_block_partition part = gpt::partition_block(config, n);
  for (int j = 1; j < n; ++j) {
    const auto& src = per_rank[static_cast<std::size_t>(j)];
    auto copy = [&](block_tensor t, std::size_t i, std::size_t) { out[t][i] = src[t][i]; };
    part.for_each_attention(j, copy);
    part.for_each_mlp(j, copy);
  }
  return out;
}

template <class Field>
block_tensors<float> assemble_at(const std::vector<rank_record>& ranks, std::size_t it, Field field) {
  std::vector<block_tensors<float>> per;
  for (const auto& r : ranks) per.push_back((r.*field)[it]);
  return assemble(per);
}

bool replicas_agree(const std::vector<block_tensors<float>>& per_rank) {
  for (const block_tensor t : gpt::rtp_block_partition::replicated_tensors)
    for (const auto& r : per_rank)
      if (std::memcmp(r[t].data(), per_rank[0][t].data(), C * sizeof(float)) != 0) return false;
  return true;
}

bool no_nan(const block_tensors<float>& b) {
  for (const auto& t : b.t)
    for (const float v : t)
      if (std::isnan(v)) return false;
  return true;
}

block_tensors<double> widen(const block_tensors<float>& f) {
  block_tensors<double> d(C);
  for (std::size_t k = 0; k < gpt::block_tensor_count; ++k) std::copy(f.t[k].begin(), f.t[k].end(), d.t[k].begin());
  return d;
}

// ---- the bounded float64 reference of one step -------------------------------------------------

struct reference_step {
  std::vector<bounded> y, dx;
  std::array<bounded, gpt::block_tensor_count> grad;
  double eval_loss = 0, eval_loss_bound = 0;  // filled by reference_eval
};

/** The bounded reference at parameters @p p of micro-batches 0..n-1 (leaving out @p skip), with
 *  head group @p drop_group's attention output lost (for the bounds' teeth). */
reference_step reference(const block_tensors<double>& p, int n, int step, int skip = -1, int drop_group = -1,
                         std::mt19937_64* rng = nullptr, bool eval = false) {
  gpt::testing::bounded_block ref(p, {B, Tn, C, static_cast<std::size_t>(config.heads), static_cast<std::size_t>(n)},
                                  rng);
  reference_step r;
  const double scale = loss_scale(n);
  for (int m = 0; m < n; ++m) {
    const micro_batch mb = make_batch(eval, step, m);
    const std::vector<double> x(mb.x.begin(), mb.x.end());
    const auto f = ref.forward(x, drop_group);
    r.y.push_back(f.y);
    bounded dy(rows * C);
    for (std::size_t i = 0; i < dy.v.size(); ++i) {
      const double local =
          2 * gpt::testing::u32 * std::abs((f.y.v[i] - mb.target[i]) * scale);  // the subtraction and the scaling
      dy.v[i] = (f.y.v[i] - mb.target[i]) * scale + ref.jit(local);
      dy.e[i] = scale * f.y.e[i] + local;
    }
    if (m == skip || eval) {  // (evaluation: forward only)
      r.dx.push_back(bounded(rows * C));
      continue;
    }
    r.dx.push_back(ref.backward(x, f, dy));
  }
  r.grad = ref.gradients(static_cast<std::size_t>(n));
  return r;
}

/** The Monte Carlo tolerance of every value of a step: `mc_factor` times the root mean square,
 *  over `mc_samples` runs of the reference with every local error drawn at random within its
 *  bound, of the deviation from the plain float64 run. Returned in the `e` fields of a
 *  reference_step whose values are the plain run's. */
constexpr int mc_samples = 32;
// Hoeffding: for independent zero-mean local errors |d_s| <= b_s, P(|sum J_s d_s| >= lambda
// sqrt(sum J_s^2 b_s^2)) <= 2 exp(-lambda^2 / 2); lambda = 6 gives 3e-8 per element. A uniform
// draw in [-b_s, b_s] has variance b_s^2 / 3, so sqrt(sum J_s^2 b_s^2) = sqrt(3) rms; and 32
// samples estimate the rms within a factor 2 except with probability 5e-6 (chi-square, 32
// degrees of freedom). So: 6 sqrt(3) 2 = 20.8.
constexpr double mc_factor = 6 * 1.7320508075688772 * 2;

reference_step monte_carlo(const block_tensors<double>& p, int n, int step, bool eval = false) {
  reference_step plain = reference(p, n, step, -1, -1, nullptr, eval);
  reference_step acc = plain;
  auto each = [](reference_step& r, auto&& f) {
    for (auto& b : r.y) f(b);
    for (auto& b : r.dx) f(b);
    for (auto& b : r.grad) f(b);
  };
  each(acc, [](bounded& b) { std::fill(b.e.begin(), b.e.end(), 0.0); });
  std::mt19937_64 rng(static_cast<std::uint64_t>(step) * 977 + static_cast<std::uint64_t>(n));
  for (int k = 0; k < mc_samples; ++k) {
    reference_step s = reference(p, n, step, -1, -1, &rng, eval);
    std::vector<bounded*> sv, av, pv;
    each(s, [&](bounded& b) { sv.push_back(&b); });
    each(acc, [&](bounded& b) { av.push_back(&b); });
    each(plain, [&](bounded& b) { pv.push_back(&b); });
    for (std::size_t t = 0; t < sv.size(); ++t)
      for (std::size_t i = 0; i < sv[t]->v.size(); ++i) {
        const double d = sv[t]->v[i] - pv[t]->v[i];
        av[t]->e[i] += d * d;
      }
  }
  each(acc, [](bounded& b) {
    for (auto& e : b.e) e = mc_factor * std::sqrt(e / mc_samples);
  });
  return acc;
}

/** The evaluation loss at @p p, its Monte Carlo tolerance (sum |y - t| scale tol_y), and the l1
 *  norm of its gradient with respect to the parameters (float64 kernels), for the trajectory. */
struct eval_reference {
  double loss = 0, bound = 0, grad_l1 = 0;
};
eval_reference reference_eval(const block_tensors<double>& p, int n) {
  eval_reference r;
  const reference_step mc = monte_carlo(p, n, 0, true);
  const double scale = loss_scale(n);
  block_tensors<double> pd = p, g(C);
  const auto pv = pd.view();
  const auto gv = g.view();
  const auto sz = gpt::compute_activation_sizes(config, B, Tn);
  std::vector<double> act(sz.block), work(sz.workspace), proj(rows * C);
  const auto a = gpt::bind_block_activations(config, B, Tn, act.data());
  const auto w = gpt::bind_backward_workspace(config, B, Tn, work.data());
  for (int m = 0; m < n; ++m) {
    const micro_batch mb = make_batch(true, 0, m);
    const auto& y = mc.y[static_cast<std::size_t>(m)];
    for (std::size_t i = 0; i < y.v.size(); ++i) {
      const double e = y.v[i] - mb.target[i];
      r.loss += 0.5 * e * e * scale;
      r.bound += std::abs(e) * scale * y.e[i];
    }
    const std::vector<double> x(mb.x.begin(), mb.x.end());
    gpt::block_forward(config, B, Tn, pv, x.data(), a, proj.data());
    for (std::size_t i = 0; i < rows * C; ++i) w.dres[i] = (a.res3[i] - mb.target[i]) * scale;
    gpt::block_backward(config, B, Tn, pv, gv, x.data(), a, w);
  }
  for (const auto& t : g.t)
    for (const double v : t) r.grad_l1 += std::abs(v);
  return r;
}

/** max over elements of |got - want| / (factor * bound); FAIL_CHECKs the ones above 1. */
double worst_ratio(const char* what, const std::vector<float>& got, const bounded& want, double factor) {
  double worst = 0;
  int reported = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double tol = factor * want.e[i];
    const double err = std::abs(static_cast<double>(got[i]) - want.v[i]);
    worst = std::max(worst, err / tol);
    if (err > tol && reported++ < 5)
      FAIL_CHECK(what << "[" << i << "]: " << got[i] << " vs " << want.v[i] << " (tolerance " << tol << ")");
  }
  return worst;
}
/** The same between two fp32 results, against the sum of their bounds. */
double worst_ratio(const char* what, const std::vector<float>& a, const std::vector<float>& b, const bounded& ref,
                   double factor) {
  double worst = 0;
  int reported = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double tol = factor * ref.e[i];
    const double err = std::abs(static_cast<double>(a[i]) - b[i]);
    worst = std::max(worst, err / tol);
    if (err > tol && reported++ < 5)
      FAIL_CHECK(what << "[" << i << "]: " << a[i] << " vs " << b[i] << " (tolerance " << tol << ")");
  }
  return worst;
}

/** Largest |x - y| / (factor * bound) of a result that is wrong (the teeth): > 10 means far outside. */
double gap(const bounded& wrong, const bounded& right, double factor) {
  double worst = 0;
  for (std::size_t i = 0; i < right.v.size(); ++i)
    worst = std::max(worst, std::abs(wrong.v[i] - right.v[i]) / (factor * right.e[i]));
  return worst;
}

double max_abs_diff(const block_tensors<float>& a, const block_tensors<float>& b) {
  double d = 0;
  for (std::size_t k = 0; k < gpt::block_tensor_count; ++k)
    for (std::size_t i = 0; i < a.t[k].size(); ++i)
      d = std::max(d, std::abs(static_cast<double>(a.t[k][i]) - b.t[k][i]));
  return d;
}
double max_abs(const block_tensors<float>& a) {
  double d = 0;
  for (const auto& t : a.t)
    for (const float v : t) d = std::max(d, std::abs(static_cast<double>(v)));
  return d;
}

bool same_bits(const std::vector<rank_record>& a, const std::vector<rank_record>& b) {
  auto eq = [](const std::vector<float>& x, const std::vector<float>& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
  };
  auto eqb = [&](const block_tensors<float>& x, const block_tensors<float>& y) {
    for (std::size_t k = 0; k < gpt::block_tensor_count; ++k)  // NaN placeholders compare by bits too
      if (!eq(x.t[k], y.t[k])) return false;
    return true;
  };
  for (std::size_t r = 0; r < a.size(); ++r)
    for (std::size_t it = 0; it < a[r].y.size(); ++it)
      if (!eq(a[r].y[it], b[r].y[it]) || !eq(a[r].dx[it], b[r].dx[it]) || !eqb(a[r].grad[it], b[r].grad[it]) ||
          !eqb(a[r].after[it], b[r].after[it]) ||
          std::memcmp(&a[r].eval_loss[it], &b[r].eval_loss[it], sizeof(double)) != 0)
        return false;
  return true;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

TEST_CASE("rtp block partition: shards tile every sharded tensor, layouts and sizes") {
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    const gpt::rtp_block_partition p = gpt::partition_block(config, n);
    CHECK(p.shard_heads * static_cast<std::size_t>(n) == 12);
    CHECK(p.shard_channels == C / static_cast<std::size_t>(n));
    CHECK(p.shard_units == 4 * C / static_cast<std::size_t>(n));
    CHECK(p.attn_elems() == p.shard_channels * (4 * C + 3));
    CHECK(p.mlp_elems() == p.shard_units * (2 * C + 1));
    // Every element of every tensor is held exactly once: by one shard or by the replicas.
    block_tensors<float> hits(C);
    std::vector<int> attn_offsets(p.attn_elems()), mlp_offsets(p.mlp_elems());
    for (int j = 0; j < n; ++j) {
      std::fill(attn_offsets.begin(), attn_offsets.end(), 0);
      std::fill(mlp_offsets.begin(), mlp_offsets.end(), 0);
      p.for_each_attention(
          j, [&](block_tensor t, std::size_t i, std::size_t off) { hits[t][i] += 1, attn_offsets[off] += 1; });
      p.for_each_mlp(j,
                     [&](block_tensor t, std::size_t i, std::size_t off) { hits[t][i] += 1, mlp_offsets[off] += 1; });
      CHECK(std::all_of(attn_offsets.begin(), attn_offsets.end(), [](int h) { return h == 1; }));
      CHECK(std::all_of(mlp_offsets.begin(), mlp_offsets.end(), [](int h) { return h == 1; }));
    }
    p.for_each_replicated([&](block_tensor t, std::size_t i, std::size_t) { hits[t][i] += 1; });
    for (const auto& t : hits.t) CHECK(std::all_of(t.begin(), t.end(), [](float h) { return h == 1.0f; }));
    // Per-rank model data is the block's 12 C^2 + 13 C parameters: 1/N of the 12 C^2 + 7 C sharded
    // ones plus the 6 C replicated.
    CHECK(static_cast<std::size_t>(n) * (p.attn_elems() + p.mlp_elems()) + p.replicated_elems() == 12 * C * C + 13 * C);
  }
  // Shard j's q rows are head group j's channels of q (rows j Cs .. of qkv.w), k and v likewise.
  const auto p = gpt::partition_block(config, 3);
  std::vector<std::size_t> q_rows;
  p.for_each_attention(1, [&](block_tensor t, std::size_t i, std::size_t off) {
    if (t == block_tensor::qkv_w && i % C == 0) {
      q_rows.push_back(i / C);
      CHECK(off % C == 0);
    }
  });
  REQUIRE(q_rows.size() == 3 * 16);
  CHECK(q_rows[0] == 16);
  CHECK(q_rows[15] == 31);
  CHECK(q_rows[16] == 48 + 16);
  CHECK(q_rows[32] == 96 + 16);
}

TEST_CASE("rtp block: a world size that does not divide the heads is a config_error naming them and the valid sizes") {
  for (const int n : {5, 7, 8, 13}) {
    CAPTURE(n);
    try {
      (void)gpt::partition_block(config, n);
      FAIL("expected config_error");
    } catch (const chunkstar::config_error& e) {
      const std::string msg = e.what();
      CHECK(msg.find("'heads'") != std::string::npos);
      CHECK(msg.find("1, 2, 3, 4, 6, 12") != std::string::npos);
    }
  }
  // 3 heads of 8 channels: width 24 and 4C = 96 divide over 2 ranks, the heads do not.
  const gpt::gpt_config three{.vocab = 8, .context = 8, .layers = 1, .heads = 3, .width = 24};
  try {
    (void)gpt::partition_block(three, 2);
    FAIL("expected config_error");
  } catch (const chunkstar::config_error& e) {
    const std::string msg = e.what();
    CHECK(msg.find("'heads' of size 3") != std::string::npos);
    CHECK(msg.find(": 1, 3;") != std::string::npos);
  }
  CHECK_THROWS_AS((void)gpt::partition_block(config, 0), chunkstar::config_error);
  // Constructing the block on ranks that do not divide it throws on every rank before any
  // collective, so no rank waits for another.
  CHECK_THROWS_AS(
      chunkstar::run_ranks(
          5, [](in_process_communicator& comm) { gpt::rtp_block<in_process_communicator> b(comm, config); }),
      chunkstar::config_error);
}

TEST_CASE(
    "the bounded float64 reference computes the float64 kernels' block, and GELU's curvature is within its bound") {
  // The reference is separate code (plain loops); its values must be gpt_model.hpp's float64
  // block to double rounding, or the bounds would describe another function.
  const block_tensors<double> p = widen(initial_block());
  const reference_step ref = reference(p, 2, 0);
  block_tensors<double> pd = p, g(C);
  const auto sz = gpt::compute_activation_sizes(config, B, Tn);
  std::vector<double> act(sz.block), work(sz.workspace), proj(rows * C);
  const auto a = gpt::bind_block_activations(config, B, Tn, act.data());
  const auto w = gpt::bind_backward_workspace(config, B, Tn, work.data());
  double worst = 0;
  for (int m = 0; m < 2; ++m) {
    const micro_batch mb = make_batch(false, 0, m);
    const std::vector<double> x(mb.x.begin(), mb.x.end());
    gpt::block_forward(config, B, Tn, pd.view(), x.data(), a, proj.data());
    for (std::size_t i = 0; i < rows * C; ++i) {
      worst =
          std::max(worst, std::abs(a.res3[i] - ref.y[static_cast<std::size_t>(m)].v[i]) / (1 + std::abs(a.res3[i])));
      w.dres[i] = (a.res3[i] - mb.target[i]) * loss_scale(2);
    }
    gpt::block_backward(config, B, Tn, pd.view(), g.view(), x.data(), a, w);
    for (std::size_t i = 0; i < rows * C; ++i)
      worst = std::max(worst,
                       std::abs(w.dres[i] - ref.dx[static_cast<std::size_t>(m)].v[i]) / (1e-3 + std::abs(w.dres[i])));
  }
  for (std::size_t k = 0; k < gpt::block_tensor_count; ++k)
    for (std::size_t i = 0; i < g.t[k].size(); ++i)
      worst = std::max(worst, std::abs(g.t[k][i] - ref.grad[k].v[i]) / (1e-3 + std::abs(g.t[k][i])));
  MESSAGE("float64 kernels vs the bounded reference: largest relative difference " << worst);
  CHECK(worst < 1e-11);
  double curvature = 0;
  for (double z = -10; z <= 10; z += 1e-3)
    curvature =
        std::max(curvature, std::abs(gpt::testing::gelu_slope(z + 1e-5) - gpt::testing::gelu_slope(z - 1e-5)) / 2e-5);
  CHECK(curvature < gpt::testing::gelu_curvature_bound);
}

TEST_CASE(
    "rtp block on 1-4 ranks: one step's outputs, input gradients and weight gradients = the serial block and float64, "
    "within the derived bounds") {
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    const auto ranks = run_rtp(n, 1);
    block_tensors<float> full = initial_block();
    const step_result ser = serial_step(full, n, 0);
    const reference_step ref = reference(widen(full), n, 0);

    // The shards every rank built from global indices are the full initial block.
    std::vector<block_tensors<float>> before, grads;
    for (const auto& r : ranks) before.push_back(r.before[0]), grads.push_back(r.grad[0]);
    CHECK(replicas_agree(before));
    CHECK(replicas_agree(grads));
    const block_tensors<float> built = assemble(before);
    CHECK(no_nan(built));
    CHECK(max_abs_diff(built, full) == 0.0);
    const block_tensors<float> g = assemble(grads);
    REQUIRE(no_nan(g));

    // The first-order worst-case bound (x the safety factor) holds for both, everywhere.
    double rig = 0;
    for (int m = 0; m < n; ++m) {
      const auto mm = static_cast<std::size_t>(m);
      rig = std::max({rig, worst_ratio("y rtp vs bound", ranks[mm].y[0], ref.y[mm], safety),
                      worst_ratio("y serial vs bound", ser.y[mm], ref.y[mm], safety),
                      worst_ratio("dx rtp vs bound", ranks[mm].dx[0], ref.dx[mm], safety),
                      worst_ratio("dx serial vs bound", ser.dx[mm], ref.dx[mm], safety)});
    }
    for (std::size_t k = 0; k < gpt::block_tensor_count; ++k)
      rig = std::max({rig, worst_ratio("grad rtp vs bound", g.t[k], ref.grad[k], safety),
                      worst_ratio("grad serial vs bound", ser.grad.t[k], ref.grad[k], safety)});

    // The Monte Carlo tolerance: each fp32 result within it of float64, the two within twice it.
    const reference_step mc = monte_carlo(widen(full), n, 0);
    double y_ref = 0, y_ser = 0, y_pair = 0, dx_ref = 0, dx_ser = 0, dx_pair = 0, g_ref = 0, g_ser = 0, g_pair = 0;
    for (int m = 0; m < n; ++m) {
      const auto mm = static_cast<std::size_t>(m);
      const auto& r = ranks[mm];
      y_ref = std::max(y_ref, worst_ratio("y rtp vs float64", r.y[0], mc.y[mm], 1));
      y_ser = std::max(y_ser, worst_ratio("y serial vs float64", ser.y[mm], mc.y[mm], 1));
      y_pair = std::max(y_pair, worst_ratio("y rtp vs serial", r.y[0], ser.y[mm], mc.y[mm], 2));
      dx_ref = std::max(dx_ref, worst_ratio("dx rtp vs float64", r.dx[0], mc.dx[mm], 1));
      dx_ser = std::max(dx_ser, worst_ratio("dx serial vs float64", ser.dx[mm], mc.dx[mm], 1));
      dx_pair = std::max(dx_pair, worst_ratio("dx rtp vs serial", r.dx[0], ser.dx[mm], mc.dx[mm], 2));
    }
    for (std::size_t k = 0; k < gpt::block_tensor_count; ++k) {
      CAPTURE(tensor_name(static_cast<block_tensor>(k)));
      g_ref = std::max(g_ref, worst_ratio("grad rtp vs float64", g.t[k], mc.grad[k], 1));
      g_ser = std::max(g_ser, worst_ratio("grad serial vs float64", ser.grad.t[k], mc.grad[k], 1));
      g_pair = std::max(g_pair, worst_ratio("grad rtp vs serial", g.t[k], ser.grad.t[k], mc.grad[k], 2));
    }
    MESSAGE("N = " << n << ": worst-case bound, largest error / bound " << rig
                   << "; Monte Carlo tolerance, largest error / tolerance, rtp vs float64 | serial vs float64 | rtp vs "
                      "serial: output "
                   << y_ref << " | " << y_ser << " | " << y_pair << "; input gradient " << dx_ref << " | " << dx_ser
                   << " | " << dx_pair << "; weight gradients " << g_ref << " | " << g_ser << " | " << g_pair);

    // The tolerance has teeth: a forward that lost one head group's output, and gradients that lost
    // one rank's micro-batch (what a displaced shard or a dropped contribution gives), land far
    // outside it (the worst-case bound, ~1e5 times looser, would not catch them).
    if (n > 1) {
      const reference_step lost_heads = reference(widen(full), n, 0, -1, n - 1);
      CHECK(gap(lost_heads.y[0], mc.y[0], 1) > 10);
      const reference_step lost_batch = reference(widen(full), n, 0, n - 1);
      double worst = 0;
      for (std::size_t k = 0; k < gpt::block_tensor_count; ++k)
        worst = std::max(worst, gap(lost_batch.grad[k], mc.grad[k], 1));
      CHECK(worst > 10);
      MESSAGE("N = " << n << ": a lost head group is " << gap(lost_heads.y[0], mc.y[0], 1)
                     << "x the output tolerance, a lost micro-batch " << worst << "x the gradient tolerance");
    }
  }
}

TEST_CASE(
    "rtp block on 1-4 ranks: SGD with an evaluation pass after every step follows the serial block, shards stay home, "
    "runs repeat bit for bit") {
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    const auto ranks = run_rtp(n, iterations);
    for (const auto& r : ranks) CHECK(r.eval_displaced == 0);
    CHECK(same_bits(ranks, run_rtp(n, iterations)));

    // The serial block on the same micro-batches, and its evaluation losses.
    block_tensors<float> ser = initial_block();
    std::vector<block_tensors<float>> ser_after;
    std::vector<double> ser_eval;
    std::vector<double> grad_tol(iterations);
    for (int it = 0; it < iterations; ++it) {
      // The gradient tolerance at this step's parameters, its largest element.
      const reference_step ref = monte_carlo(widen(ser), n, it);
      double tol = 0;
      for (const auto& gk : ref.grad)
        for (const double e : gk.e) tol = std::max(tol, e);
      grad_tol[static_cast<std::size_t>(it)] = tol;
      const step_result s = serial_step(ser, n, it);
      for (std::size_t k = 0; k < gpt::block_tensor_count; ++k)
        for (std::size_t i = 0; i < ser.t[k].size(); ++i) ser.t[k][i] -= lr * s.grad.t[k][i];
      ser_after.push_back(ser);
      double l = 0;
      for (int m = 0; m < n; ++m) {
        const micro_batch ev = make_batch(true, 0, m);
        block_buffers buf;
        gpt::block_forward(config, B, Tn, ser.view(), ev.x.data(), buf.a, buf.proj.data());
        l += loss_of(buf.out(), ev, n);
      }
      ser_eval.push_back(l);
    }

    // How much the float64 trajectory amplifies a perturbation of its start (a nudge of +-1e-7 per
    // element), the same measure as the RTP MLP test's.
    auto trajectory = [&](block_tensors<double> p) {
      std::vector<block_tensors<double>> out;
      const auto sz = gpt::compute_activation_sizes(config, B, Tn);
      std::vector<double> act(sz.block), work(sz.workspace), proj(rows * C);
      const auto a = gpt::bind_block_activations(config, B, Tn, act.data());
      const auto w = gpt::bind_backward_workspace(config, B, Tn, work.data());
      for (int it = 0; it < iterations; ++it) {
        block_tensors<double> g(C);
        for (int m = 0; m < n; ++m) {
          const micro_batch mb = make_batch(false, it, m);
          const std::vector<double> x(mb.x.begin(), mb.x.end());
          gpt::block_forward(config, B, Tn, p.view(), x.data(), a, proj.data());
          for (std::size_t i = 0; i < rows * C; ++i) w.dres[i] = (a.res3[i] - mb.target[i]) * loss_scale(n);
          gpt::block_backward(config, B, Tn, p.view(), g.view(), x.data(), a, w);
        }
        for (std::size_t k = 0; k < gpt::block_tensor_count; ++k)
          for (std::size_t i = 0; i < p.t[k].size(); ++i) p.t[k][i] -= static_cast<double>(lr) * g.t[k][i];
        out.push_back(p);
      }
      return out;
    };
    const block_tensors<double> start = widen(initial_block());
    block_tensors<double> nudged = start;
    const double eps = 1e-7;
    std::size_t e = 0;
    for (auto& t : nudged.t)
      for (auto& v : t) v += (++e % 2 ? eps : -eps);
    const auto ref_traj = trajectory(start), moved = trajectory(nudged);
    double amplification = 1;
    for (int it = 0; it < iterations; ++it)
      for (std::size_t k = 0; k < gpt::block_tensor_count; ++k)
        for (std::size_t i = 0; i < start.t[k].size(); ++i)
          amplification = std::max(amplification, std::abs(moved[static_cast<std::size_t>(it)].t[k][i] -
                                                           ref_traj[static_cast<std::size_t>(it)].t[k][i]) /
                                                      eps);

    // Per step the two runs' gradients differ by at most twice the gradient bound and each fp32
    // update rounds once (u |p|): the local errors, summed over the steps, amplified.
    double local = 0, worst_param = 0, worst_loss = 0;
    for (int it = 0; it < iterations; ++it) {
      CAPTURE(it);
      const auto ii = static_cast<std::size_t>(it);
      std::vector<block_tensors<float>> after, grads;
      for (const auto& r : ranks) after.push_back(r.after[ii]), grads.push_back(r.grad[ii]);
      CHECK(replicas_agree(after));
      CHECK(replicas_agree(grads));
      const block_tensors<float> got = assemble(after);
      local += static_cast<double>(lr) * 2 * grad_tol[ii] + 2 * gpt::testing::u32 * max_abs(ser_after[ii]);
      const double tol = 2 * amplification * local;
      const double err = max_abs_diff(got, ser_after[ii]);
      worst_param = std::max(worst_param, err / tol);
      CHECK(err <= tol);
      // Evaluation losses: each run's rounding (twice the bound) plus the parameters' difference
      // through the loss's gradient.
      const eval_reference ev = reference_eval(widen(ser_after[ii]), n);
      const double loss_tol = 2 * ev.bound + ev.grad_l1 * tol;
      const double loss_err = std::abs(ranks[0].eval_loss[ii] - ser_eval[ii]);
      worst_loss = std::max(worst_loss, loss_err / loss_tol);
      CHECK(loss_err <= loss_tol);
      for (const auto& r : ranks) CHECK(r.eval_loss[ii] == ranks[0].eval_loss[ii]);
      if (it == iterations - 1 && n > 1) {
        // The tolerance has teeth: the last step without rank n-1's micro-batch (a lost
        // contribution) lands far outside it.
        block_tensors<float> prev = ser_after[ii - 1];
        const step_result lost = serial_step(prev, n, it, n - 1, n);
        block_tensors<float> broken = ser_after[ii];
        for (std::size_t k = 0; k < gpt::block_tensor_count; ++k)
          for (std::size_t i = 0; i < broken.t[k].size(); ++i) broken.t[k][i] += lr * lost.grad.t[k][i];
        CHECK(max_abs_diff(broken, ser_after[ii]) > 10 * tol);
        MESSAGE("N = " << n << ": a step that lost a micro-batch is " << max_abs_diff(broken, ser_after[ii]) / tol
                       << "x the parameter tolerance");
      }
    }
    MESSAGE("N = " << n << ": amplification " << amplification << ", largest parameter error / tolerance "
                   << worst_param << ", largest evaluation-loss error / tolerance " << worst_loss
                   << ", evaluation loss " << ranks[0].eval_loss.front() << " -> " << ranks[0].eval_loss.back());
    CHECK(ranks[0].eval_loss.back() < ranks[0].eval_loss.front());  // it trains
  }
}

TEST_CASE("rtp block: one rank over the single-process communicator gives the one-rank in-process bits") {
  chunkstar::single_process_communicator comm;
  const rank_record solo = train_rank(comm, 2);
  const auto group = run_rtp(1, 2);
  CHECK(same_bits({solo}, group));
}

}  // namespace rtp_block_test
