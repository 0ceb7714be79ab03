// SPDX-License-Identifier: Apache-2.0
// A float64 reference of one GPT transformer block (forward and backward, plain loops over the
// full weights, independent of kernels_cpu.hpp) that carries, beside every value, a first-order
// bound on the error of an fp32 evaluation of that value in any summation order: a running error
// analysis (Higham, "Accuracy and Stability of Numerical Algorithms", ch. 3). Used by
// rtp_block.test.cpp to check the RTP block and the serial fp32 block against it, and each other.
//
// The rules, for a value v computed in fp32 from inputs that carry bounds E_in:
//  - a sum or dot product of n terms, in any order or grouping (BLAS blocking, a SIMD tree, the
//    ring's N partial sums): |fl - exact| <= sum |d v / d in| E_in + gamma(n) sum |terms|, with
//    gamma(n) = n u / (1 - n u), u = 2^-24. n counts every term, the bias and the partial sums.
//  - an element-wise op: |d op / d in| E_in + k u |v|, k the op's roundings (libm and the vector
//    exp within a few ulp: k is counted generously, e.g. 8 for exp, (16 + 4|z|) for GELU').
//  - nonlinear maps (LayerNorm, softmax) through the absolute value of their Jacobians, written
//    out below; products of errors (second order) are left out, and the tests multiply every
//    bound by a safety factor for them.
// Every gradient of a weight is a sum over all ranks' rows: its bound is its propagated part plus
// gamma(N B T + N + 1) times the sum of |terms| over every micro-batch.
#pragma once

#include "rtp_block.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <random>
#include <vector>

namespace gpt::testing {

inline constexpr double u32 = 0x1.0p-24;  // fp32 unit roundoff
inline double gamma_n(double n) { return n * u32 / (1 - n * u32); }

/** Values and their bounds, one vector each. */
struct bounded {
  std::vector<double> v, e;
  explicit bounded(std::size_t n = 0) : v(n, 0.0), e(n, 0.0) {}
};

/** One block's parameters (or gradients) as 12 full tensors, `block_tensor` order. */
template <class T>
struct block_tensors {
  std::array<std::vector<T>, block_tensor_count> t;
  explicit block_tensors(std::size_t C = 0) {
    for (std::size_t k = 0; k < block_tensor_count; ++k)
      t[k].assign(block_tensor_elems(static_cast<block_tensor>(k), C), T(0));
  }
  std::vector<T>& operator[](block_tensor k) { return t[static_cast<std::size_t>(k)]; }
  const std::vector<T>& operator[](block_tensor k) const { return t[static_cast<std::size_t>(k)]; }
  /** The `block_params` view (pointers into this object). */
  block_params<T> view() {
    auto p = [&](block_tensor k) { return (*this)[k].data(); };
    return {p(block_tensor::ln1_w),  p(block_tensor::ln1_b),  p(block_tensor::qkv_w),    p(block_tensor::qkv_b),
            p(block_tensor::proj_w), p(block_tensor::proj_b), p(block_tensor::ln2_w),    p(block_tensor::ln2_b),
            p(block_tensor::fc_w),   p(block_tensor::fc_b),   p(block_tensor::fcproj_w), p(block_tensor::fcproj_b)};
  }
};

/** A weight gradient being summed over micro-batches: value, propagated bound, sum of |terms|. */
struct grad_sum {
  std::vector<double> v, prop, mag;
  explicit grad_sum(std::size_t n = 0) : v(n, 0.0), prop(n, 0.0), mag(n, 0.0) {}
};

struct block_shape {
  std::size_t B, Tn, C, H, world;
};

/** d/dx of the tanh-form GELU, and a bound on |d^2/dx^2| (max 0.80 near 0; the test checks 1). */
inline double gelu_value(double x) {
  const double k = 0.79788456080286535588, a = 0.044715;
  return 0.5 * x * (1 + std::tanh(k * (x + a * x * x * x)));
}
inline double gelu_slope(double x) {
  const double k = 0.79788456080286535588, a = 0.044715;
  const double th = std::tanh(k * (x + a * x * x * x));
  return 0.5 * (1 + th) + 0.5 * x * (1 - th * th) * k * (1 + 3 * a * x * x);
}
inline constexpr double gelu_curvature_bound = 1.0;

/** What the forward of one micro-batch keeps for its backward, with bounds. */
struct block_forward_state {
  bounded ln1, m1, s1, qkv, p, atty, res2, ln2, m2, s2, fch, fchg, y;
};

/** The bounded reference of the block on one micro-batch and of the sum of the micro-batches'
 *  gradients. */
class bounded_block {
 public:
  /** With @p rng, every value also gets a local error drawn uniformly from +-(its local
   *  rounding bound), added where the op happens (a Monte Carlo sample of the first-order error,
   *  see rtp_block.test.cpp); without, the values are plain float64. The bounds are the same. */
  bounded_block(const block_tensors<double>& p, block_shape s, std::mt19937_64* rng = nullptr)
      : p_(p), s_(s), g_(), rng_(rng) {
    for (std::size_t k = 0; k < block_tensor_count; ++k) g_[k] = grad_sum(p.t[k].size());
  }

  /** A local error for a value whose local rounding bound is @p local: 0, or uniform in
   *  [-local, local] in Monte Carlo mode. */
  double jit(double local) const {
    if (!rng_) return 0;
    return local * std::uniform_real_distribution<double>(-1.0, 1.0)(*rng_);
  }

  /** Forward of micro-batch @p x ([B Tn, C], exact: E = 0). @p drop_group >= 0 leaves that head
   *  group's contribution out of the attention projection (a lost shard, for the tests' teeth). */
  block_forward_state forward(const std::vector<double>& x, int drop_group = -1) const {
    const std::size_t N = s_.B * s_.Tn, C = s_.C;
    block_forward_state f;
    bounded xin(N * C);
    xin.v = x;
    layernorm(xin, P(block_tensor::ln1_w), P(block_tensor::ln1_b), f.ln1, f.m1, f.s1);
    linear(f.ln1, P(block_tensor::qkv_w), P(block_tensor::qkv_b), 3 * C, f.qkv);
    attention(f);
    bounded atty = f.atty;
    if (drop_group >= 0) {
      const std::size_t Cs = C / s_.world, c0 = static_cast<std::size_t>(drop_group) * Cs;
      for (std::size_t n = 0; n < N; ++n)
        for (std::size_t c = c0; c < c0 + Cs; ++c) atty.v[n * C + c] = 0;
    }
    bounded proj;
    linear(atty, P(block_tensor::proj_w), P(block_tensor::proj_b), C, proj);
    residual(xin, proj, f.res2);
    layernorm(f.res2, P(block_tensor::ln2_w), P(block_tensor::ln2_b), f.ln2, f.m2, f.s2);
    linear(f.ln2, P(block_tensor::fc_w), P(block_tensor::fc_b), 4 * C, f.fch);
    f.fchg = bounded(f.fch.v.size());
    for (std::size_t i = 0; i < f.fch.v.size(); ++i) {
      const double z = f.fch.v[i];
      const double local = (8 + 3 * std::abs(z)) * u32 * std::abs(z);
      f.fchg.v[i] = gelu_value(z) + jit(local);
      f.fchg.e[i] = std::abs(gelu_slope(z)) * f.fch.e[i] + local;
    }
    linear(f.fchg, P(block_tensor::fcproj_w), P(block_tensor::fcproj_b), C, proj);
    residual(f.res2, proj, f.y);
    return f;
  }

  /** Backward of micro-batch @p x from the output gradient @p dy (with its bounds): adds the
   *  weight gradients into the running sums and returns d(x) with bounds. */
  bounded backward(const std::vector<double>& x, const block_forward_state& f, const bounded& dy) {
    const std::size_t N = s_.B * s_.Tn, C = s_.C;
    bounded dres = dy;
    // MLP
    bounded dfchg(N * 4 * C), dfch(N * 4 * C), dln(N * C);
    linear_backward(dres, f.fchg, P(block_tensor::fcproj_w), C, 4 * C, dfchg, G(block_tensor::fcproj_w),
                    G(block_tensor::fcproj_b));
    for (std::size_t i = 0; i < dfch.v.size(); ++i) {
      const double z = f.fch.v[i], gp = gelu_slope(z), d = dfchg.v[i];
      const double local = (16 + 4 * std::abs(z)) * u32 * std::abs(gp * d);
      dfch.v[i] = gp * d + jit(local);
      dfch.e[i] = gelu_curvature_bound * f.fch.e[i] * std::abs(d) + std::abs(gp) * dfchg.e[i] + local;
    }
    linear_backward(dfch, f.ln2, P(block_tensor::fc_w), 4 * C, C, dln, G(block_tensor::fc_w), G(block_tensor::fc_b));
    layernorm_backward(dln, f.res2, P(block_tensor::ln2_w), f.m2, f.s2, dres, G(block_tensor::ln2_w),
                       G(block_tensor::ln2_b));
    // attention
    bounded datty(N * C), dqkv(N * 3 * C);
    linear_backward(dres, f.atty, P(block_tensor::proj_w), C, C, datty, G(block_tensor::proj_w),
                    G(block_tensor::proj_b));
    attention_backward(f, datty, dqkv);
    dln = bounded(N * C);
    linear_backward(dqkv, f.ln1, P(block_tensor::qkv_w), 3 * C, C, dln, G(block_tensor::qkv_w), G(block_tensor::qkv_b));
    bounded xin(N * C);
    xin.v = x;
    layernorm_backward(dln, xin, P(block_tensor::ln1_w), f.m1, f.s1, dres, G(block_tensor::ln1_w),
                       G(block_tensor::ln1_b));
    return dres;
  }

  /** The weight gradients summed over every micro-batch given to `backward`, with bounds. */
  std::array<bounded, block_tensor_count> gradients(std::size_t micro_batches) const {  // once per step
    const double n_sum = static_cast<double>(micro_batches * s_.B * s_.Tn + s_.world + 1);
    std::array<bounded, block_tensor_count> out;
    for (std::size_t k = 0; k < block_tensor_count; ++k) {
      out[k] = bounded(g_[k].v.size());
      for (std::size_t i = 0; i < g_[k].v.size(); ++i) {
        const double local = gamma_n(n_sum) * g_[k].mag[i];
        out[k].v[i] = g_[k].v[i] + jit(local);
        out[k].e[i] = g_[k].prop[i] + local;
      }
    }
    return out;
  }

 private:
  const std::vector<double>& P(block_tensor t) const { return p_[t]; }
  grad_sum& G(block_tensor t) { return g_[static_cast<std::size_t>(t)]; }
  /** Extra terms of every sum over a sharded dimension: the bias and the N partial sums. */
  [[nodiscard]] double extra() const { return static_cast<double>(s_.world + 2); }

  /** out[n, o] = sum_k in[n, k] W[o, k] + b[o]. */
  void linear(const bounded& in, const std::vector<double>& W, const std::vector<double>& b, std::size_t O,
              bounded& out) const {
    const std::size_t K = in.v.size() / (s_.B * s_.Tn), N = s_.B * s_.Tn;
    out = bounded(N * O);
    for (std::size_t n = 0; n < N; ++n)
      for (std::size_t o = 0; o < O; ++o) {
        double v = b[o], prop = 0, mag = std::abs(b[o]);
        for (std::size_t k = 0; k < K; ++k) {
          v += in.v[n * K + k] * W[o * K + k];
          prop += in.e[n * K + k] * std::abs(W[o * K + k]);
          mag += std::abs(in.v[n * K + k] * W[o * K + k]);
        }
        const double local = gamma_n(static_cast<double>(K) + extra()) * mag;
        out.v[n * O + o] = v + jit(local);
        out.e[n * O + o] = prop + local;
      }
  }

  /** dinp += dout W (a sum over O terms); dW += dout^T in, db += column sums (into the running sums). */
  void linear_backward(const bounded& dout, const bounded& in, const std::vector<double>& W, std::size_t O,
                       std::size_t K, bounded& dinp, grad_sum& dW, grad_sum& db) const {
    const std::size_t N = s_.B * s_.Tn;
    for (std::size_t n = 0; n < N; ++n)
      for (std::size_t k = 0; k < K; ++k) {
        double v = 0, prop = 0, mag = 0;
        for (std::size_t o = 0; o < O; ++o) {
          v += dout.v[n * O + o] * W[o * K + k];
          prop += dout.e[n * O + o] * std::abs(W[o * K + k]);
          mag += std::abs(dout.v[n * O + o] * W[o * K + k]);
        }
        const double local = gamma_n(static_cast<double>(O) + extra()) * mag;
        dinp.v[n * K + k] += v + jit(local);
        dinp.e[n * K + k] += prop + local;
      }
    for (std::size_t o = 0; o < O; ++o) {
      for (std::size_t k = 0; k < K; ++k) {
        auto& v = dW.v[o * K + k];
        auto& prop = dW.prop[o * K + k];
        auto& mag = dW.mag[o * K + k];
        for (std::size_t n = 0; n < N; ++n) {
          const double d = dout.v[n * O + o], x = in.v[n * K + k];
          v += d * x;
          prop += dout.e[n * O + o] * std::abs(x) + std::abs(d) * in.e[n * K + k];
          mag += std::abs(d * x);
        }
      }
      for (std::size_t n = 0; n < N; ++n) {
        db.v[o] += dout.v[n * O + o];
        db.prop[o] += dout.e[n * O + o];
        db.mag[o] += std::abs(dout.v[n * O + o]);
      }
    }
  }

  void residual(const bounded& a, const bounded& b, bounded& out) const {
    out = bounded(a.v.size());
    for (std::size_t i = 0; i < a.v.size(); ++i) {
      const double local = u32 * std::abs(a.v[i] + b.v[i]);
      out.v[i] = a.v[i] + b.v[i] + jit(local);
      out.e[i] = a.e[i] + b.e[i] + local;
    }
  }

  /** y = (x - m) s w + b per row, m the mean and s = 1/sqrt(var + eps); keeps m, s and their bounds. */
  void layernorm(const bounded& x, const std::vector<double>& w, const std::vector<double>& b, bounded& y, bounded& m,
                 bounded& s) const {
    const std::size_t N = s_.B * s_.Tn, C = s_.C;
    const double Cd = static_cast<double>(C);
    y = bounded(N * C), m = bounded(N), s = bounded(N);
    std::vector<double> d(C), ed(C);
    for (std::size_t n = 0; n < N; ++n) {
      const double* xv = &x.v[n * C];
      const double* xe = &x.e[n * C];
      double mean = 0, mag = 0, em = 0;
      for (std::size_t c = 0; c < C; ++c) mean += xv[c], mag += std::abs(xv[c]), em += xe[c];
      const double m_local = gamma_n(Cd + 2) * mag / Cd;  // C terms, the division (or a multiply by 1/C)
      mean = mean / Cd + jit(m_local);
      em = em / Cd + m_local;
      double var = 0, ev = 0;
      for (std::size_t c = 0; c < C; ++c) {
        const double local = u32 * std::abs(xv[c] - mean);
        d[c] = xv[c] - mean + jit(local);
        ed[c] = xe[c] + em + local;
        var += d[c] * d[c];
        ev += 2 * std::abs(d[c]) * ed[c];
      }
      var /= Cd;
      const double v_local = gamma_n(Cd + 3) * var;  // d^2 (1), C terms, division
      var += jit(v_local);
      ev = ev / Cd + v_local;
      const double veps = var + cpu::layernorm_eps;
      const double s_local = 3.5 * u32 / std::sqrt(veps);  // + eps (relative u, halved by the root), sqrt, division
      const double rs = 1 / std::sqrt(veps) + jit(s_local);
      const double es = rs * 0.5 * ev / veps + s_local;
      m.v[n] = mean, m.e[n] = em, s.v[n] = rs, s.e[n] = es;
      for (std::size_t c = 0; c < C; ++c) {
        const double xh_local = u32 * std::abs(d[c] * rs);
        const double xhat = d[c] * rs + jit(xh_local), exhat = ed[c] * rs + std::abs(d[c]) * es + xh_local;
        const double y_local = 3 * u32 * (std::abs(xhat * w[c]) + std::abs(b[c]));
        y.v[n * C + c] = xhat * w[c] + b[c] + jit(y_local);
        y.e[n * C + c] = std::abs(w[c]) * exhat + y_local;
      }
    }
  }

  /** dx += s (g w - mean(g w) - xhat mean(g w xhat)); dw += sum g xhat; db += sum g. */
  void layernorm_backward(const bounded& g, const bounded& x, const std::vector<double>& w, const bounded& m,
                          const bounded& s, bounded& dx, grad_sum& dw, grad_sum& db) const {
    const std::size_t N = s_.B * s_.Tn, C = s_.C;
    const double Cd = static_cast<double>(C);
    std::vector<double> xhat(C), exhat(C), gw(C), egw(C);
    for (std::size_t n = 0; n < N; ++n) {
      const double rs = s.v[n], es = s.e[n];
      double A = 0, eA = 0, mA = 0, Bq = 0, eB = 0, mB = 0;
      for (std::size_t c = 0; c < C; ++c) {
        const std::size_t i = n * C + c;
        const double d_local = u32 * std::abs(x.v[i] - m.v[n]);
        const double d = x.v[i] - m.v[n] + jit(d_local);
        const double xh_local = u32 * std::abs(d * rs);
        xhat[c] = d * rs + jit(xh_local);
        exhat[c] = (x.e[i] + m.e[n] + d_local) * rs + std::abs(d) * es + xh_local;
        const double gw_local = u32 * std::abs(g.v[i] * w[c]);
        gw[c] = g.v[i] * w[c] + jit(gw_local);
        egw[c] = g.e[i] * std::abs(w[c]) + gw_local;
        A += gw[c], eA += egw[c], mA += std::abs(gw[c]);
        Bq += gw[c] * xhat[c], eB += egw[c] * std::abs(xhat[c]) + std::abs(gw[c]) * exhat[c];
        mB += std::abs(gw[c] * xhat[c]);
      }
      const double A_local = gamma_n(Cd + 2) * mA / Cd, B_local = gamma_n(Cd + 3) * mB / Cd;
      A = A / Cd + jit(A_local), Bq = Bq / Cd + jit(B_local);
      eA = eA / Cd + A_local;
      eB = eB / Cd + B_local;
      for (std::size_t c = 0; c < C; ++c) {
        const std::size_t i = n * C + c;
        const double inner = gw[c] - A - xhat[c] * Bq;
        const double local = 5 * u32 * rs * (std::abs(gw[c]) + std::abs(A) + std::abs(xhat[c] * Bq)) +
                             u32 * std::abs(dx.v[i] + rs * inner);  // the add into dres
        dx.v[i] += rs * inner + jit(local);
        dx.e[i] += es * std::abs(inner) + rs * (egw[c] + eA + exhat[c] * std::abs(Bq) + std::abs(xhat[c]) * eB) + local;
        dw.v[c] += g.v[i] * xhat[c];
        dw.prop[c] += g.e[i] * std::abs(xhat[c]) + std::abs(g.v[i]) * exhat[c];
        dw.mag[c] += std::abs(g.v[i] * xhat[c]);
        db.v[c] += g.v[i];
        db.prop[c] += g.e[i];
        db.mag[c] += std::abs(g.v[i]);
      }
    }
  }

  /** Causal attention per (b, h) on f.qkv ([N, 3C]: q | k | v, head h at channels h hs): f.p the
   *  probabilities [B, H, T, T], f.atty the output [N, C]. */
  void attention(block_forward_state& f) const {
    const std::size_t B = s_.B, Tn = s_.Tn, C = s_.C, H = s_.H, hs = C / H, C3 = 3 * C, N = B * Tn;
    const double scale = 1 / std::sqrt(static_cast<double>(hs));
    f.p = bounded(B * H * Tn * Tn), f.atty = bounded(N * C);
    const auto& q = f.qkv;
    std::vector<double> sc(Tn), esc(Tn);
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t h = 0; h < H; ++h)
        for (std::size_t t = 0; t < Tn; ++t) {
          const std::size_t qi = (b * Tn + t) * C3 + h * hs;
          double mx = -INFINITY;
          for (std::size_t t2 = 0; t2 <= t; ++t2) {
            const std::size_t ki = (b * Tn + t2) * C3 + C + h * hs;
            double v = 0, prop = 0, mag = 0;
            for (std::size_t i = 0; i < hs; ++i) {
              v += q.v[qi + i] * q.v[ki + i];
              prop += q.e[qi + i] * std::abs(q.v[ki + i]) + std::abs(q.v[qi + i]) * q.e[ki + i];
              mag += std::abs(q.v[qi + i] * q.v[ki + i]);
            }
            const double local = scale * gamma_n(static_cast<double>(hs) + 1) * mag;
            sc[t2] = v * scale + jit(local);
            esc[t2] = scale * prop + local;
            mx = std::max(mx, sc[t2]);
          }
          double sum = 0, mean_err = 0, max_shift = 0;
          double* p = &f.p.v[((b * H + h) * Tn + t) * Tn];
          double* ep = &f.p.e[((b * H + h) * Tn + t) * Tn];
          for (std::size_t t2 = 0; t2 <= t; ++t2) {
            // the subtraction's rounding is a relative error u |z| of exp(z); exp within 8 u
            p[t2] = std::exp(sc[t2] - mx) * (1 + jit(u32 * (mx - sc[t2]) + 8 * u32));
            sum += p[t2], max_shift = std::max(max_shift, mx - sc[t2]);
          }
          sum *= 1 + jit(gamma_n(static_cast<double>(t) + 1));
          for (std::size_t t2 = 0; t2 <= t; ++t2) p[t2] = p[t2] / sum * (1 + jit(2 * u32));
          for (std::size_t t2 = 0; t2 <= t; ++t2) mean_err += p[t2] * esc[t2];
          for (std::size_t t2 = 0; t2 <= t; ++t2) {
            // input errors through the softmax Jacobian; the subtraction's rounding (relative
            // u |z| in exp), exp (8 u), the sum of t + 1 positive terms and the division.
            const double rel =
                esc[t2] + mean_err + u32 * (mx - sc[t2] + max_shift) + 8 * u32 + gamma_n(static_cast<double>(t) + 3);
            ep[t2] = p[t2] * rel;
          }
          const std::size_t oi = (b * Tn + t) * C + h * hs;
          for (std::size_t i = 0; i < hs; ++i) {
            double v = 0, prop = 0, mag = 0;
            for (std::size_t t2 = 0; t2 <= t; ++t2) {
              const std::size_t vi = (b * Tn + t2) * C3 + 2 * C + h * hs + i;
              v += p[t2] * q.v[vi];
              prop += ep[t2] * std::abs(q.v[vi]) + p[t2] * q.e[vi];
              mag += p[t2] * std::abs(q.v[vi]);
            }
            const double local = gamma_n(static_cast<double>(t) + 2) * mag;
            f.atty.v[oi + i] = v + jit(local);
            f.atty.e[oi + i] = prop + local;
          }
        }
  }

  void attention_backward(const block_forward_state& f, const bounded& d, bounded& dqkv) const {
    const std::size_t B = s_.B, Tn = s_.Tn, C = s_.C, H = s_.H, hs = C / H, C3 = 3 * C;
    const double scale = 1 / std::sqrt(static_cast<double>(hs));
    const auto& q = f.qkv;
    // dq and dk sum over up to Tn terms, dv too: their rounding is gamma(Tn + 2) times the sum of
    // |terms|, collected in mags and applied at the end.
    std::vector<double> mag(dqkv.v.size(), 0.0);
    std::vector<double> datt(Tn), edatt(Tn);
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t h = 0; h < H; ++h)
        for (std::size_t t = 0; t < Tn; ++t) {
          const double* p = &f.p.v[((b * H + h) * Tn + t) * Tn];
          const double* ep = &f.p.e[((b * H + h) * Tn + t) * Tn];
          const std::size_t di = (b * Tn + t) * C + h * hs;
          for (std::size_t t2 = 0; t2 <= t; ++t2) {
            const std::size_t vi = (b * Tn + t2) * C3 + 2 * C + h * hs;
            double v = 0, prop = 0, m = 0;
            for (std::size_t i = 0; i < hs; ++i) {
              v += d.v[di + i] * q.v[vi + i];
              prop += d.e[di + i] * std::abs(q.v[vi + i]) + std::abs(d.v[di + i]) * q.e[vi + i];
              m += std::abs(d.v[di + i] * q.v[vi + i]);
              dqkv.v[vi + i] += p[t2] * d.v[di + i];
              dqkv.e[vi + i] += ep[t2] * std::abs(d.v[di + i]) + p[t2] * d.e[di + i];
              mag[vi + i] += std::abs(p[t2] * d.v[di + i]);
            }
            const double local = gamma_n(static_cast<double>(hs)) * m;
            datt[t2] = v + jit(local);
            edatt[t2] = prop + local;
          }
          double dot = 0, edot = 0, mdot = 0;
          for (std::size_t t2 = 0; t2 <= t; ++t2) {
            dot += p[t2] * datt[t2];
            edot += ep[t2] * std::abs(datt[t2]) + p[t2] * edatt[t2];
            mdot += p[t2] * std::abs(datt[t2]);
          }
          const double dot_local = gamma_n(static_cast<double>(t) + 2) * mdot;
          dot += jit(dot_local);
          edot += dot_local;
          const std::size_t qi = (b * Tn + t) * C3 + h * hs;
          for (std::size_t t2 = 0; t2 <= t; ++t2) {
            const double ds_local = 3 * u32 * scale * p[t2] * (std::abs(datt[t2]) + std::abs(dot));
            const double ds = p[t2] * (datt[t2] - dot) * scale + jit(ds_local);
            const double eds = scale * (ep[t2] * std::abs(datt[t2] - dot) + p[t2] * (edatt[t2] + edot)) + ds_local;
            const std::size_t ki = (b * Tn + t2) * C3 + C + h * hs;
            for (std::size_t i = 0; i < hs; ++i) {
              dqkv.v[qi + i] += ds * q.v[ki + i];
              dqkv.e[qi + i] += eds * std::abs(q.v[ki + i]) + std::abs(ds) * q.e[ki + i];
              mag[qi + i] += std::abs(ds * q.v[ki + i]);
              dqkv.v[ki + i] += ds * q.v[qi + i];
              dqkv.e[ki + i] += eds * std::abs(q.v[qi + i]) + std::abs(ds) * q.e[qi + i];
              mag[ki + i] += std::abs(ds * q.v[qi + i]);
            }
          }
        }
    for (std::size_t i = 0; i < mag.size(); ++i) {
      const double local = gamma_n(static_cast<double>(Tn) + 2) * mag[i];
      dqkv.v[i] += jit(local);
      dqkv.e[i] += local;
    }
  }

  const block_tensors<double>& p_;
  block_shape s_;
  std::array<grad_sum, block_tensor_count> g_;
  std::mt19937_64* rng_;
};

}  // namespace gpt::testing
