// SPDX-License-Identifier: Apache-2.0
// The RTP test MLP, shared by the in-process test (tests/rtp/rtp_mlp.test.cpp) and the MPI test
// (tests/mpi/rtp.test.cpp): y = s * (W2 gelu(W1 x + b1)) + b2, W1 sharded by rows and W2 by
// columns over the same hidden units, so one shard is [W1 rows | b1 slice | W2 columns] and needs
// no activation traffic; s and b2 are replicated and their gradients all-reduced. Each rank trains
// on its own micro-batch, SGD with an evaluation pass after every iteration; an independent serial
// float64 reference (plain loops over the full weights, N micro-batches per step) and the derived
// tolerances against it (docs/rtp.md, "Tolerance") are here too.
//
// One rank's training (`train_rank`) is generic over the Communicator, so in-process ranks
// (threads) and MPI ranks (processes) run the very same code and can be compared bit for bit.
//
// Tolerances are derived, not tuned: per iteration, each gradient element is checked against the
// reference evaluated at the RTP run's own parameters, within 2 * n_chain * u * M, where
// u = 2^-24, n_chain is the longest chain of fp32 roundings behind the element (dot products, the
// ring's sum over N ranks, the kernel's sum over the micro-batch, the element-wise ops) and M the
// sum of the absolute values of the terms it is made of (a running error bound, computed by the
// reference alongside the values). Along the trajectory, parameter errors are those local errors,
// plus the rounding of each update, amplified by the reference's own measured sensitivity to a
// perturbation of its starting point.
#pragma once

#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/rtp/counter_init.hpp>
#include <chunkstar/rtp/partition.hpp>
#include <chunkstar/rtp/replicated.hpp>
#include <chunkstar/rtp/rotation.hpp>
#include <chunkstar/rtp/weight_pair.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace chunkstar::testing::rtp_mlp {

using rtp::counter_init;
using rtp::tensor_key;

inline constexpr std::size_t d = 8, hidden = 12, dout = 8, batch = 4;
inline constexpr int iterations = 12;
inline constexpr float lr = 0.1f;
inline constexpr std::uint64_t seed = 42;
inline constexpr double u = 0x1.0p-24;     // fp32 unit roundoff
inline constexpr double gelu_slope = 1.2;  // >= max |gelu'(z)| (1.13 for the tanh form)

// ---- data and initial weights, shared by both sides (inputs, not model math) ---------------

struct micro_batch {
  std::vector<float> x, t;  // batch x d, batch x dout
};

/** Micro-batch @p m of step @p step (or of the evaluation set): x ~ N(0, 1), t = sin(A x) for a
 *  fixed teacher A, so the loss can fall. */
inline micro_batch make_batch(bool eval, int step, int m) {
  const counter_init xs{.seed = seed, .key = tensor_key(eval ? "x_eval" : "x")};
  const counter_init teacher{.seed = seed, .key = tensor_key("teacher")};
  micro_batch mb{std::vector<float>(batch * d), std::vector<float>(batch * dout)};
  const std::uint64_t base = (static_cast<std::uint64_t>(step) * 64 + static_cast<std::uint64_t>(m)) * batch * d;
  xs.fill_normal<float>(mb.x, base, 0.0f, 1.0f);
  for (std::size_t b = 0; b < batch; ++b)
    for (std::size_t o = 0; o < dout; ++o) {
      double acc = 0;
      for (std::size_t i = 0; i < d; ++i) acc += teacher.normal<double>(o * d + i, 0.0, 0.5) * mb.x[b * d + i];
      mb.t[b * dout + o] = static_cast<float>(std::sin(acc));
    }
  return mb;
}

// The initial value of every element, by global index in the full tensor (counter_init): the
// flyweight rule that lets a rank build only its shard.
inline const counter_init init_w1{.seed = seed, .key = tensor_key("w1")};
inline const counter_init init_b1{.seed = seed, .key = tensor_key("b1")};
inline const counter_init init_w2{.seed = seed, .key = tensor_key("w2")};
inline const counter_init init_s{.seed = seed, .key = tensor_key("s")};
inline const counter_init init_b2{.seed = seed, .key = tensor_key("b2")};
inline float w1_init(std::size_t unit, std::size_t i) { return init_w1.normal<float>(unit * d + i, 0.0f, 0.35f); }
inline float b1_init(std::size_t unit) { return init_b1.uniform<float>(unit, -0.1f, 0.1f); }
inline float w2_init(std::size_t o, std::size_t unit) { return init_w2.normal<float>(o * hidden + unit, 0.0f, 0.3f); }
inline float s_init(std::size_t o) { return init_s.uniform<float>(o, 0.9f, 1.1f); }
inline float b2_init(std::size_t o) { return init_b2.uniform<float>(o, -0.1f, 0.1f); }

/** The full model, row-major: w1 hidden x d, b1 hidden, w2 dout x hidden, s and b2 dout. */
template <class T>
struct model {
  std::vector<T> w1 = std::vector<T>(hidden * d), b1 = std::vector<T>(hidden), w2 = std::vector<T>(dout * hidden),
                 s = std::vector<T>(dout), b2 = std::vector<T>(dout);
  template <class F>
  void each(F&& f) {
    f("w1", w1), f("b1", b1), f("w2", w2), f("s", s), f("b2", b2);
  }
  template <class F>
  void each(F&& f) const {
    f("w1", w1), f("b1", b1), f("w2", w2), f("s", s), f("b2", b2);
  }
};

inline model<double> initial_model() {
  model<double> p;
  for (std::size_t k = 0; k < hidden; ++k) {
    for (std::size_t i = 0; i < d; ++i) p.w1[k * d + i] = w1_init(k, i);
    p.b1[k] = b1_init(k);
    for (std::size_t o = 0; o < dout; ++o) p.w2[o * hidden + k] = w2_init(o, k);
  }
  for (std::size_t o = 0; o < dout; ++o) p.s[o] = s_init(o), p.b2[o] = b2_init(o);
  return p;
}

// ---- the RTP side: what a user writes against rtp::rotation --------------------------------

template <class T>
T gelu(T z) {
  const T c = T(0.7978845608028654), a = T(0.044715);
  return T(0.5) * z * (T(1) + std::tanh(c * (z + a * z * z * z)));
}
template <class T>
T gelu_grad(T z) {
  const T c = T(0.7978845608028654), a = T(0.044715);
  const T th = std::tanh(c * (z + a * z * z * z));
  return T(0.5) * (T(1) + th) + T(0.5) * z * (T(1) - th * th) * c * (T(1) + T(3) * a * z * z);
}

/** One shard: [W1 rows k x d | b1 k | W2 columns dout x k], k = hidden / N units: the weight pair
 *  W1 then W2 (rtp/weight_pair.hpp), which the GPT block's attention and MLP shards also use. */
struct shard_layout {
  rtp::weight_pair pair;
  explicit shard_layout(int n) : pair(rtp::make_weight_pair(d, hidden, dout, n, "hidden")) {}
  [[nodiscard]] std::size_t w1() const { return pair.a_weight_offset(); }
  [[nodiscard]] std::size_t b1() const { return pair.a_bias_offset(); }
  [[nodiscard]] std::size_t w2() const { return pair.b_weight_offset(); }
  [[nodiscard]] std::size_t elems() const { return pair.shard_elems(); }
};

/** Where a kernel runs, for `kernel_hook`. */
enum class pass { train_forward, backward, eval_forward };

/** Called at the start of every kernel call with (iteration, pass, step of the pass); a hook
 *  that throws is a kernel that fails there (the fault tests). */
using kernel_hook = std::function<void(int, pass, int)>;

/** What one rank records, per iteration: its owned shard before and after the step and its
 *  gradient, the replicated parameters and their gradients after the step (s | b2 | ds | db2), and
 *  the training and evaluation losses (global: the same on every rank). */
struct rank_record {
  std::vector<std::vector<float>> shard_before, shard_grad, shard_after, replicated;
  std::vector<double> train_loss, eval_loss;
  int eval_displaced = 0;  // evaluations that changed the owned shard
};

/** One rank of the RTP MLP on @p comm (N = comm.size(), which must divide `hidden`):
 *  `iterations` SGD steps on its micro-batches, an evaluation pass after each. Every rank of the
 *  communicator calls it; the collectives are the rotation's shifts, one double all-reduce per
 *  loss and one all-reduce of the replicated gradients per iteration. */
template <Communicator Comm>
rank_record train_rank(Comm& comm, const kernel_hook& hook = {}) {
  const int n = comm.size();
  const int me = comm.rank();
  const shard_layout L(n);
  const std::size_t k = L.pair.shard_units();
  const double scale = 1.0 / static_cast<double>(static_cast<std::size_t>(n) * batch);  // mean over the global batch
  rank_record rec;
  rec.shard_before.resize(iterations), rec.shard_grad.resize(iterations), rec.shard_after.resize(iterations);
  rec.replicated.resize(iterations);
  rec.train_loss.resize(iterations), rec.eval_loss.resize(iterations);

  rtp::rotation<Comm> rot(comm, L.elems());
  // Materialise this rank's shard only, from global indices.
  const rtp::index_range units = rtp::shard_range(hidden, n, me, "hidden");
  auto w = rot.owned();
  for (std::size_t kk = 0; kk < k; ++kk) {
    for (std::size_t i = 0; i < d; ++i) w[L.w1() + kk * d + i] = w1_init(units.begin + kk, i);
    w[L.b1() + kk] = b1_init(units.begin + kk);
    for (std::size_t o = 0; o < dout; ++o) w[L.w2() + o * k + kk] = w2_init(o, units.begin + kk);
  }
  std::vector<float> s(dout), b2(dout);
  for (std::size_t o = 0; o < dout; ++o) s[o] = s_init(o), b2[o] = b2_init(o);

  int it = 0;
  std::vector<float> z(batch * hidden), a(batch * hidden), ypart(batch * dout), y(batch * dout), du(batch * dout);
  // Forward of one micro-batch: each shard's units write their slice of the hidden activations
  // and add their partial output to ypart. Returns the micro-batch's share of the mean loss.
  auto forward = [&](const micro_batch& mb, pass p) {
    std::fill(ypart.begin(), ypart.end(), 0.0f);
    int step = 0;
    rot.forward([&](int j, std::span<const float> sh) {
      if (hook) hook(it, p, step++);
      const std::size_t u0 = static_cast<std::size_t>(j) * k;
      for (std::size_t b = 0; b < batch; ++b) {
        for (std::size_t kk = 0; kk < k; ++kk) {
          float acc = sh[L.b1() + kk];
          for (std::size_t i = 0; i < d; ++i) acc += sh[L.w1() + kk * d + i] * mb.x[b * d + i];
          z[b * hidden + u0 + kk] = acc;
          a[b * hidden + u0 + kk] = gelu(acc);
        }
        for (std::size_t o = 0; o < dout; ++o) {
          float q = 0;
          for (std::size_t kk = 0; kk < k; ++kk) q += sh[L.w2() + o * k + kk] * a[b * hidden + u0 + kk];
          ypart[b * dout + o] += q;
        }
      }
    });
    double loss = 0;
    for (std::size_t b = 0; b < batch; ++b)
      for (std::size_t o = 0; o < dout; ++o) {
        y[b * dout + o] = s[o] * ypart[b * dout + o] + b2[o];
        const double e = static_cast<double>(y[b * dout + o]) - mb.t[b * dout + o];
        loss += 0.5 * e * e * scale;
      }
    return loss;
  };
  auto global = [&](double local) {
    double v[1] = {local};
    comm.allreduce(std::span<double>(v), reduce_op::sum);
    return v[0];
  };

  for (; it < iterations; ++it) {
    const auto ii = static_cast<std::size_t>(it);
    const micro_batch mb = make_batch(false, it, me);
    rec.shard_before[ii].assign(rot.owned().begin(), rot.owned().end());
    rec.train_loss[ii] = global(forward(mb, pass::train_forward));  // the same on every rank
    // Replicated parameters' gradients, this rank's micro-batch only until the all-reduce.
    std::vector<float> rep_grad(2 * dout, 0.0f);  // ds | db2
    const auto fscale = static_cast<float>(scale);
    for (std::size_t b = 0; b < batch; ++b)
      for (std::size_t o = 0; o < dout; ++o) {
        const float dy = (y[b * dout + o] - mb.t[b * dout + o]) * fscale;
        rep_grad[o] += dy * ypart[b * dout + o];
        rep_grad[dout + o] += dy;
        du[b * dout + o] = dy * s[o];
      }
    int step = 0;
    rot.backward([&](int j, std::span<const float> sh, std::span<float> g) {
      if (hook) hook(it, pass::backward, step++);
      const std::size_t u0 = static_cast<std::size_t>(j) * k;
      for (std::size_t kk = 0; kk < k; ++kk) {
        for (std::size_t b = 0; b < batch; ++b) {
          const std::size_t h = b * hidden + u0 + kk;
          float da = 0;
          for (std::size_t o = 0; o < dout; ++o) {
            da += du[b * dout + o] * sh[L.w2() + o * k + kk];
            g[L.w2() + o * k + kk] += du[b * dout + o] * a[h];
          }
          const float dz = da * gelu_grad(z[h]);
          for (std::size_t i = 0; i < d; ++i) g[L.w1() + kk * d + i] += dz * mb.x[b * d + i];
          g[L.b1() + kk] += dz;
        }
      }
    });
    rtp::reduce_replicated_grads(comm, std::span<float>(rep_grad));
    rec.shard_grad[ii].assign(rot.owned_grad().begin(), rot.owned_grad().end());
    // SGD, all local: the owned shard, and the replicas (identical on every rank).
    for (std::size_t e = 0; e < L.elems(); ++e) rot.owned()[e] -= lr * rot.owned_grad()[e];
    for (std::size_t o = 0; o < dout; ++o) s[o] -= lr * rep_grad[o], b2[o] -= lr * rep_grad[dout + o];
    rec.shard_after[ii].assign(rot.owned().begin(), rot.owned().end());
    auto& rep = rec.replicated[ii];
    rep = s;
    rep.insert(rep.end(), b2.begin(), b2.end());
    rep.insert(rep.end(), rep_grad.begin(), rep_grad.end());
    // Evaluation between iterations: forward only, and the owned shard must be where it was.
    const std::vector<float> owned(rot.owned().begin(), rot.owned().end());
    rec.eval_loss[ii] = global(forward(make_batch(true, 0, me), pass::eval_forward));
    if (std::memcmp(owned.data(), rot.owned().data(), owned.size() * sizeof(float)) != 0) ++rec.eval_displaced;
  }
  return rec;
}

/** The N ranks of one run as in-process ranks (threads), each one's record at its rank. */
inline std::vector<rank_record> train_in_process(int n) {
  std::vector<rank_record> out(static_cast<std::size_t>(n));
  run_ranks(n, [&](in_process_communicator& comm) { out[static_cast<std::size_t>(comm.rank())] = train_rank(comm); });
  return out;
}

/** Everything one run records, per iteration: the parameters before the update and the
 *  gradients (assembled from every rank's shard), the losses, and per rank the replicated
 *  parameters and their gradients. */
struct run_record {
  std::vector<model<float>> before, grads, after;
  std::vector<double> train_loss, eval_loss;
  std::vector<std::vector<std::vector<float>>> replicated;  // [iteration][rank]: s | b2 | ds | db2 after the step
  std::vector<int> eval_displaced;                          // per rank: evaluations that changed the owned shard
};

/** The whole run from its N ranks' records (rank 0's losses; owner j holds units [j k, (j + 1) k)). */
inline run_record assemble(const std::vector<rank_record>& ranks) {
  const int n = static_cast<int>(ranks.size());
  const shard_layout L(n);
  const std::size_t k = L.pair.shard_units();
  run_record rec;
  rec.before.resize(iterations), rec.grads.resize(iterations), rec.after.resize(iterations);
  rec.train_loss = ranks[0].train_loss, rec.eval_loss = ranks[0].eval_loss;
  rec.replicated.assign(iterations, std::vector<std::vector<float>>(static_cast<std::size_t>(n)));
  for (const rank_record& r : ranks) rec.eval_displaced.push_back(r.eval_displaced);
  auto place = [&](const std::vector<float>& sh, int j, model<float>& out) {
    for (std::size_t kk = 0; kk < k; ++kk) {
      const std::size_t unit = static_cast<std::size_t>(j) * k + kk;
      for (std::size_t i = 0; i < d; ++i) out.w1[unit * d + i] = sh[L.w1() + kk * d + i];
      out.b1[unit] = sh[L.b1() + kk];
      for (std::size_t o = 0; o < dout; ++o) out.w2[o * hidden + unit] = sh[L.w2() + o * k + kk];
    }
  };
  for (std::size_t ii = 0; ii < iterations; ++ii) {
    for (int j = 0; j < n; ++j) {
      const rank_record& r = ranks[static_cast<std::size_t>(j)];
      place(r.shard_before[ii], j, rec.before[ii]);
      place(r.shard_grad[ii], j, rec.grads[ii]);
      place(r.shard_after[ii], j, rec.after[ii]);
      rec.replicated[ii][static_cast<std::size_t>(j)] = r.replicated[ii];
    }
    const auto& rep = rec.replicated[ii][0];
    for (std::size_t o = 0; o < dout; ++o) {
      rec.after[ii].s[o] = rep[o], rec.after[ii].b2[o] = rep[dout + o];
      rec.grads[ii].s[o] = rep[2 * dout + o], rec.grads[ii].b2[o] = rep[3 * dout + o];
    }
    const auto& prev = ii == 0 ? std::vector<float>() : rec.replicated[ii - 1][0];
    for (std::size_t o = 0; o < dout; ++o) {
      rec.before[ii].s[o] = ii == 0 ? s_init(o) : prev[o];
      rec.before[ii].b2[o] = ii == 0 ? b2_init(o) : prev[dout + o];
    }
  }
  return rec;
}

/** A run on @p n in-process ranks, assembled. */
inline run_record run_rtp(int n) { return assemble(train_in_process(n)); }

// ---- the serial reference: float64, full weights, plain loops -------------------------------

/** Loss, gradient and running-error magnitudes (the sum of |terms| behind each value, with the
 *  inputs' own error magnitudes carried along) of the mean loss over micro-batches 0..n-1
 *  (leaving out micro-batch @p skip, to model a run that lost one rank's contribution). */
struct evaluation {
  double loss = 0, loss_mag = 0;
  model<double> grad, grad_mag;
};

inline evaluation evaluate(const model<double>& p, bool eval, int step, int n, int skip = -1) {
  evaluation r;
  for (auto* t : {&r.grad, &r.grad_mag})
    t->each([](const char*, std::vector<double>& v) { std::fill(v.begin(), v.end(), 0.0); });
  const double scale = 1.0 / static_cast<double>(static_cast<std::size_t>(n) * batch);
  for (int m = 0; m < n; ++m) {
    if (m == skip) continue;
    const micro_batch mb = make_batch(eval, eval ? 0 : step, m);
    for (std::size_t b = 0; b < batch; ++b) {
      const float* x = &mb.x[b * d];
      std::vector<double> z(hidden), a(hidden), mz(hidden);
      for (std::size_t h = 0; h < hidden; ++h) {
        z[h] = p.b1[h];
        mz[h] = std::abs(p.b1[h]);
        for (std::size_t i = 0; i < d; ++i) z[h] += p.w1[h * d + i] * x[i], mz[h] += std::abs(p.w1[h * d + i] * x[i]);
        a[h] = gelu(z[h]);  // |gelu(z)| <= |z|, so mz bounds a's magnitude too
      }
      std::vector<double> yp(dout), myp(dout), dy(dout), mdy(dout);
      for (std::size_t o = 0; o < dout; ++o) {
        for (std::size_t h = 0; h < hidden; ++h)
          yp[o] += p.w2[o * hidden + h] * a[h], myp[o] += std::abs(p.w2[o * hidden + h]) * mz[h];
        const double y = p.s[o] * yp[o] + p.b2[o], my = std::abs(p.s[o]) * myp[o] + std::abs(p.b2[o]);
        const double t = mb.t[b * dout + o];
        r.loss += 0.5 * (y - t) * (y - t) * scale;
        r.loss_mag += std::abs(y - t) * my * scale;  // first order: dL = e de, and de = dy (t is exact)
        dy[o] = (y - t) * scale;
        mdy[o] = (my + std::abs(t)) * scale;  // y's error magnitude, not |y - t|: the subtraction may cancel
        r.grad.s[o] += dy[o] * yp[o], r.grad_mag.s[o] += mdy[o] * myp[o];
        r.grad.b2[o] += dy[o], r.grad_mag.b2[o] += mdy[o];
      }
      for (std::size_t h = 0; h < hidden; ++h) {
        double da = 0, mda = 0;
        for (std::size_t o = 0; o < dout; ++o) {
          const double du = dy[o] * p.s[o], mdu = mdy[o] * std::abs(p.s[o]);
          da += du * p.w2[o * hidden + h], mda += mdu * std::abs(p.w2[o * hidden + h]);
          r.grad.w2[o * hidden + h] += du * a[h], r.grad_mag.w2[o * hidden + h] += mdu * mz[h];
        }
        const double dz = da * gelu_grad(z[h]), mdz = mda * gelu_slope;
        for (std::size_t i = 0; i < d; ++i)
          r.grad.w1[h * d + i] += dz * x[i], r.grad_mag.w1[h * d + i] += mdz * std::abs(x[i]);
        r.grad.b1[h] += dz, r.grad_mag.b1[h] += mdz;
      }
    }
  }
  return r;
}

/** The longest chain of fp32 roundings behind a gradient element at N ranks: W1 x + b1 (d + 1),
 *  gelu (8: tanh within 2 ulp and its polynomial), the output sum over hidden units (k per shard
 *  plus N partial sums, <= hidden + N), s * . + b2 - t and the scaling (4), du and the sum over dout
 *  (1 + dout), gelu' (8) and dz (1), then the kernel's sum over its micro-batch (batch) and the
 *  ring's sum over ranks (N). */
inline double chain(int n) {
  return static_cast<double>(d + 1 + 8 + hidden + static_cast<std::size_t>(n) + 4 + 1 + dout + 8 + 1 + batch +
                             static_cast<std::size_t>(n));
}

inline model<double> widen(const model<float>& f) {
  model<double> out;
  auto copy = [](const std::vector<float>& a, std::vector<double>& b) { std::copy(a.begin(), a.end(), b.begin()); };
  copy(f.w1, out.w1), copy(f.b1, out.b1), copy(f.w2, out.w2), copy(f.s, out.s), copy(f.b2, out.b2);
  return out;
}

inline void sgd(model<double>& p, const model<double>& g) {
  auto step = [](std::vector<double>& v, const std::vector<double>& gv) {
    for (std::size_t i = 0; i < v.size(); ++i) v[i] -= static_cast<double>(lr) * gv[i];
  };
  step(p.w1, g.w1), step(p.b1, g.b1), step(p.w2, g.w2), step(p.s, g.s), step(p.b2, g.b2);
}

inline double max_abs(const model<double>& m) {
  double v = 0;
  m.each([&](const char*, const std::vector<double>& x) {
    for (const double e : x) v = std::max(v, std::abs(e));
  });
  return v;
}
inline double l1(const model<double>& m) {
  double v = 0;
  m.each([&](const char*, const std::vector<double>& x) {
    for (const double e : x) v += std::abs(e);
  });
  return v;
}

/** The reference trajectory from @p start: parameters after each of the iterations. */
inline std::vector<model<double>> trajectory(model<double> p, int n) {
  std::vector<model<double>> out;
  for (int it = 0; it < iterations; ++it) {
    sgd(p, evaluate(p, false, it, n).grad);
    out.push_back(p);
  }
  return out;
}

inline bool same_bits(const run_record& a, const run_record& b) {
  auto eq = [](const model<float>& x, const model<float>& y) {
    bool same = true;
    auto cmp = [&](const std::vector<float>& p, const std::vector<float>& q) {
      same = same && p.size() == q.size() && std::memcmp(p.data(), q.data(), p.size() * sizeof(float)) == 0;
    };
    cmp(x.w1, y.w1), cmp(x.b1, y.b1), cmp(x.w2, y.w2), cmp(x.s, y.s), cmp(x.b2, y.b2);
    return same;
  };
  for (std::size_t i = 0; i < iterations; ++i)
    if (!eq(a.grads[i], b.grads[i]) || !eq(a.after[i], b.after[i])) return false;
  return std::memcmp(a.train_loss.data(), b.train_loss.data(), iterations * sizeof(double)) == 0 &&
         std::memcmp(a.eval_loss.data(), b.eval_loss.data(), iterations * sizeof(double)) == 0;
}

/** Checks run @p rec of @p n ranks against the serial reference (doctest CHECKs): no evaluation
 *  moved a shard; replicas agree across ranks; the initial shards are the one-rank model; every
 *  iteration's gradients and losses, and the parameters along the trajectory, within the derived
 *  bounds; the bounds have teeth (a lost contribution, a stale shard land > 10x outside); the loss
 *  falls. */
inline void check_against_reference(const run_record& rec, int n) {
  CAPTURE(n);
  // Evaluation passes never displaced a shard; replicas and their gradients agree bit for bit.
  for (int r = 0; r < n; ++r) CHECK(rec.eval_displaced[static_cast<std::size_t>(r)] == 0);
  for (std::size_t it = 0; it < iterations; ++it)
    for (int r = 1; r < n; ++r) CHECK(rec.replicated[it][static_cast<std::size_t>(r)] == rec.replicated[it][0]);

  // The initial shards, built rank by rank from global indices, are the one-rank model.
  const model<double> init = initial_model();
  CHECK(widen(rec.before[0]).w1 == init.w1);
  CHECK(widen(rec.before[0]).w2 == init.w2);
  CHECK(widen(rec.before[0]).b1 == init.b1);

  // Per iteration (the second and later ones included): the gradient against the reference
  // evaluated at the run's own parameters, element by element within the running error bound.
  std::vector<double> grad_tol(iterations);
  double worst_ratio = 0;
  for (std::size_t it = 0; it < iterations; ++it) {
    CAPTURE(it);
    const model<double> at = widen(rec.before[it]);
    const evaluation ref = evaluate(at, false, static_cast<int>(it), n);
    const model<double> got = widen(rec.grads[it]);
    double tol_max = 0;
    auto check = [&](const char* name, const std::vector<double>& g, const std::vector<double>& want,
                     const std::vector<double>& mag) {
      for (std::size_t i = 0; i < g.size(); ++i) {
        const double tol = 2 * chain(n) * u * mag[i];
        tol_max = std::max(tol_max, tol);
        worst_ratio = std::max(worst_ratio, std::abs(g[i] - want[i]) / tol);
        if (std::abs(g[i] - want[i]) > tol)
          FAIL_CHECK(name << "[" << i << "]: " << g[i] << " vs " << want[i] << " (tolerance " << tol << ")");
      }
    };
    check("w1", got.w1, ref.grad.w1, ref.grad_mag.w1);
    check("b1", got.b1, ref.grad.b1, ref.grad_mag.b1);
    check("w2", got.w2, ref.grad.w2, ref.grad_mag.w2);
    check("s", got.s, ref.grad.s, ref.grad_mag.s);
    check("b2", got.b2, ref.grad.b2, ref.grad_mag.b2);
    grad_tol[it] = tol_max;
    // The bound has teeth: the reference bugs' effects land far outside it. A gradient that lost
    // one rank's contribution, and (from the second iteration) one computed with the previous
    // iteration's weights, as a displaced or stale shard would give.
    auto far_outside = [&](const evaluation& wrong) {
      double worst = 0;
      auto gap = [&](const std::vector<double>& x, const std::vector<double>& y, const std::vector<double>& mag) {
        for (std::size_t i = 0; i < x.size(); ++i)
          worst = std::max(worst, std::abs(x[i] - y[i]) / (2 * chain(n) * u * mag[i]));
      };
      gap(wrong.grad.w1, ref.grad.w1, ref.grad_mag.w1), gap(wrong.grad.w2, ref.grad.w2, ref.grad_mag.w2);
      return worst > 10;
    };
    if (n > 1) CHECK(far_outside(evaluate(at, false, static_cast<int>(it), n, n - 1)));
    if (it > 0) CHECK(far_outside(evaluate(widen(rec.before[it - 1]), false, static_cast<int>(it), n)));
    const double loss_tol = 2 * chain(n) * u * ref.loss_mag;
    CHECK(std::abs(rec.train_loss[it] - ref.loss) <= loss_tol);
  }
  MESSAGE("N = " << n << ": largest gradient error / tolerance = " << worst_ratio);

  // Along the trajectory: an independent reference run from the initial model. Local errors per
  // iteration (lr x the gradient tolerance, plus the rounding of the fp32 update) are amplified
  // by the reference's own sensitivity, measured by running it from a perturbed start.
  const std::vector<model<double>> ref = trajectory(init, n);
  model<double> nudged = init;
  const double eps = 1e-7;
  {
    std::size_t e = 0;
    nudged.each([&](const char*, std::vector<double>& v) {
      for (auto& x : v) x += (++e % 2 ? eps : -eps);
    });
  }
  const std::vector<model<double>> moved = trajectory(nudged, n);
  double amplification = 1;
  for (std::size_t it = 0; it < iterations; ++it) {
    double diff = 0;
    auto a = moved[it], b = ref[it];
    a.each([&](const char* name, std::vector<double>& v) {
      const std::vector<double>* w = nullptr;
      b.each([&](const char* other, const std::vector<double>& x) {
        if (std::string(name) == other) w = &x;
      });
      for (std::size_t i = 0; i < v.size(); ++i) diff = std::max(diff, std::abs(v[i] - (*w)[i]));
    });
    amplification = std::max(amplification, diff / eps);
  }
  double local = 0;
  double worst_param_ratio = 0;
  for (std::size_t it = 0; it < iterations; ++it) {
    CAPTURE(it);
    local += static_cast<double>(lr) * grad_tol[it] + u * max_abs(ref[it]);
    const double tol = 2 * amplification * local;
    const model<double> got = widen(rec.after[it]);
    double err = 0;
    auto cmp = [&](const std::vector<double>& x, const std::vector<double>& y) {
      for (std::size_t i = 0; i < x.size(); ++i) err = std::max(err, std::abs(x[i] - y[i]));
    };
    cmp(got.w1, ref[it].w1), cmp(got.b1, ref[it].b1), cmp(got.w2, ref[it].w2), cmp(got.s, ref[it].s),
        cmp(got.b2, ref[it].b2);
    worst_param_ratio = std::max(worst_param_ratio, err / tol);
    CHECK(err <= tol);
    // Losses at those parameters: their own rounding plus the parameters' error through the gradient.
    const evaluation ev = evaluate(ref[it], true, 0, n);
    CHECK(std::abs(rec.eval_loss[it] - ev.loss) <= 2 * chain(n) * u * ev.loss_mag + l1(ev.grad) * tol);
    if (it + 1 < iterations) {
      const evaluation tr = evaluate(ref[it], false, static_cast<int>(it) + 1, n);
      CHECK(std::abs(rec.train_loss[it + 1] - tr.loss) <= 2 * chain(n) * u * tr.loss_mag + l1(tr.grad) * tol);
    }
    if (it + 1 == iterations && n > 1) {
      // The check has teeth: a run that lost one rank's micro-batch in the last iteration's
      // gradient (the reference bug's effect) is far outside the tolerance.
      const evaluation part = evaluate(ref[it - 1], false, static_cast<int>(it), n, n - 1);
      model<double> broken = ref[it - 1];
      sgd(broken, part.grad);
      double gap = 0;
      auto cmp2 = [&](const std::vector<double>& x, const std::vector<double>& y) {
        for (std::size_t i = 0; i < x.size(); ++i) gap = std::max(gap, std::abs(x[i] - y[i]));
      };
      cmp2(broken.w1, ref[it].w1), cmp2(broken.w2, ref[it].w2), cmp2(broken.b1, ref[it].b1);
      CHECK(gap > 10 * tol);
    }
  }
  MESSAGE("N = " << n << ": amplification " << amplification << ", largest parameter error / tolerance = "
                 << worst_param_ratio << ", losses " << rec.train_loss.front() << " -> " << rec.train_loss.back());
  CHECK(rec.train_loss.back() < rec.train_loss.front());  // it trains
}

}  // namespace chunkstar::testing::rtp_mlp
