// SPDX-License-Identifier: Apache-2.0
// The whole-GPT RTP test's pieces, shared by the in-process test (rtp_model.test.cpp) and the MPI
// test (mpi/rtp_gpt.test.cpp): the config, the micro-batches, one rank's training (generic over
// the Communicator, so in-process ranks (threads) and MPI ranks (processes) run the very same
// code and can be compared bit for bit), the serial model in fp32 and float64, and the checks of
// a run against them. The tolerance is docs/rtp.md's "The whole model": RTP's distance from
// float64 is at most K times the serial fp32 model's own.
#pragma once

#include "rtp_gpt.hpp"

#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/optim/adam.hpp>
#include <chunkstar/optim/param_groups.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <span>
#include <vector>

namespace gpt::testing::rtp_model {

// 12 heads over 1-4 ranks; a 50-word vocabulary pads to 51 rows at N = 3 and 52 at N = 4.
inline const gpt_config config{.vocab = 50, .context = 8, .layers = 2, .heads = 12, .width = 48};
inline constexpr std::size_t B = 2, Tn = 6, rows = B * Tn;
inline constexpr std::uint64_t seed = 7;
inline constexpr float lr = 0.1f;
inline constexpr int iterations = 10;

// The AdamW phase (after the SGD one, where a run has one): its hyper-parameters, the default
// decay groups, and a clipping norm below the gradients' (so the norm's all-reduce decides).
inline constexpr chunkstar::adam_hyper adamw{.lr = 3e-3f};
inline const chunkstar::param_groups adam_groups = chunkstar::param_groups::with_default_decay(0.1f);
inline constexpr float max_norm = 0.5f;

struct micro_batch {
  std::vector<int> tokens, targets;
};

/** Micro-batch @p m of iteration @p it (an evaluation batch if @p eval): a pure function of them. */
inline micro_batch make_batch(bool eval, int it, int m) {
  std::mt19937 rng(static_cast<std::uint32_t>(1000003 * (eval ? 1 : 2) + 7919 * it + m));
  std::uniform_int_distribution<int> tok(0, config.vocab - 1);
  // A learnable rule (each token 7 past the previous, mod V) with one token in four random.
  std::vector<int> seq(rows + 1);
  seq[0] = tok(rng);
  for (std::size_t k = 1; k < seq.size(); ++k) seq[k] = k % 4 == 0 ? tok(rng) : (seq[k - 1] + 7) % config.vocab;
  return {{seq.begin(), seq.end() - 1}, {seq.begin() + 1, seq.end()}};
}

/** The full model as one flat vector (param_specs order), fp32. */
using flat = std::vector<float>;
inline const std::size_t param_elems = param_count(config);

/** What one rank saw: its assembled view of the model at each point, and its losses. */
struct rank_record {
  std::vector<flat> params, grads;  // after each step / of each step; the shard elements of this rank plus the replicas
  flat initial;
  std::vector<double> train_loss, eval_loss;
  int eval_displaced = 0;  // evaluation passes after which a stored shard differed
  // The AdamW phase, the same per step, plus every part's Adam moments (m then v, parts() order)
  // and what `step` reported. Empty in a run without one.
  std::vector<flat> adam_params, adam_grads, adam_moments;
  std::vector<double> adam_train_loss, adam_eval_loss, grad_norm;
  std::vector<float> clip_scale;
  std::vector<float> probs;
};

/** This rank's elements of the model written into a zero vector (the rest stay 0). */
template <class M>
flat stored(const M& model, bool grads) {
  flat f(param_elems, 0.0f);
  const auto p = bind_params(config, f.data());
  grads ? model.store_grads(p) : model.store(p);
  return f;
}

/** Every part's Adam moments, m then v, in parts() order. */
template <class M>
flat moments(const M& model) {
  flat f, v;
  for (std::size_t k = 0; k < model.parts().size(); ++k)
    for (const auto kind : {chunkstar::chunk_kind::momentum, chunkstar::chunk_kind::variance}) {
      v.resize(model.parts()[k].elems);
      model.read(k, kind, v);
      f.insert(f.end(), v.begin(), v.end());
    }
  return f;
}

/** One SGD step of every part (shards and replicas), then the gradients cleared. */
template <class M>
void sgd(M& model) {
  std::vector<float> w, g;
  for (std::size_t k = 0; k < model.parts().size(); ++k) {
    w.resize(model.parts()[k].elems);
    g.resize(w.size());
    model.read(k, chunkstar::chunk_kind::param, w);
    model.read(k, chunkstar::chunk_kind::grad, g);
    for (std::size_t i = 0; i < w.size(); ++i) w[i] -= lr * g[i];
    model.write(k, chunkstar::chunk_kind::param, w);
  }
  model.zero_grad();
}

/** The calls of `train_rank`, for a fault test's hook. */
enum class stage { train_forward, backward, step, eval };
/** Called before each call with its iteration (the AdamW phase continues the count), the micro-batch
 *  it will pass and, before a `step`, its micro-batch count: a fault test spoils one of them on one
 *  rank, or arms a communicator. */
using call_hook = std::function<void(int iteration, stage, micro_batch&, int& micro_batches)>;

/** One rank's run: @p iters SGD steps of the global batch (rank r takes micro-batch r), an
 *  evaluation after each, then @p adam_steps AdamW steps (`rtp_gpt::step`, clipped to `max_norm`)
 *  with an evaluation after each, then the next-token probabilities of a short context. */
template <class Comm, class Model>
rank_record train_model(Comm& comm, Model& model, int iters, int adam_steps = 0, const call_hook& hook = {}) {
  const int n = comm.size(), r = comm.rank();
  model.init(seed);
  rank_record rec;
  rec.initial = stored(model, false);
  int micro_batches = 1;
  const auto before = [&](int it, stage s, micro_batch& mb) {
    if (hook) hook(it, s, mb, micro_batches);
  };
  const auto evaluate = [&](int it) {
    micro_batch ev = make_batch(true, 0, r);  // the same evaluation set each time
    before(it, stage::eval, ev);
    double l = model.loss(ev.tokens.data(), ev.targets.data());
    comm.allreduce(std::span<double>(&l, 1), chunkstar::reduce_op::sum);
    return l / n;
  };
  for (int it = 0; it < iters; ++it) {
    micro_batch mb = make_batch(false, it, r);
    before(it, stage::train_forward, mb);
    rec.train_loss.push_back(model.forward(mb.tokens.data(), mb.targets.data()));
    before(it, stage::backward, mb);
    model.backward(mb.tokens.data(), mb.targets.data(), 1.0f / static_cast<float>(n));  // the global batch's mean
    rec.grads.push_back(stored(model, true));
    sgd(model);
    rec.params.push_back(stored(model, false));
    rec.eval_loss.push_back(evaluate(it));
    if (stored(model, false) != rec.params.back()) ++rec.eval_displaced;
  }
  for (int s = 0; s < adam_steps; ++s) {
    const int it = iters + s;
    micro_batch mb = make_batch(false, it, r);
    before(it, stage::train_forward, mb);
    rec.adam_train_loss.push_back(model.forward(mb.tokens.data(), mb.targets.data()));
    before(it, stage::backward, mb);
    model.backward(mb.tokens.data(), mb.targets.data(), 1.0f / static_cast<float>(n));
    rec.adam_grads.push_back(stored(model, true));
    micro_batches = 1;
    before(it, stage::step, mb);
    const auto res = model.step(adamw, adam_groups, micro_batches, max_norm);
    rec.grad_norm.push_back(res.grad_norm);
    rec.clip_scale.push_back(res.clip_scale);
    rec.adam_params.push_back(stored(model, false));
    rec.adam_moments.push_back(moments(model));
    rec.adam_eval_loss.push_back(evaluate(it));
    if (stored(model, false) != rec.adam_params.back()) ++rec.eval_displaced;
  }
  const std::vector<int> context{3, 1, 4, 1, 5};
  rec.probs = model.next_token_probs(context);
  return rec;
}

/** `train_model` on this rank's model with its shards in host memory and the CPU kernels. */
template <class Comm>
rank_record train_rank(Comm& comm, int iters, int adam_steps = 0, const call_hook& hook = {}) {
  rtp_gpt<Comm> model(comm, config, B, Tn);
  return train_model(comm, model, iters, adam_steps, hook);
}

/** The run of @p n in-process ranks (threads), every rank's record. */
inline std::vector<rank_record> run_rtp(int n, int iters = iterations, int adam_steps = 0) {
  std::vector<rank_record> out(static_cast<std::size_t>(n));
  chunkstar::run_ranks(n, [&](chunkstar::in_process_communicator& comm) {
    out[static_cast<std::size_t>(comm.rank())] = train_rank(comm, iters, adam_steps);
  });
  return out;
}

/** The whole model from every rank's stored elements: element e from the rank whose stored value is
 *  the one written (the ranks' zero vectors differ only where they hold the element). */
inline flat assemble(const std::vector<rank_record>& ranks, std::vector<flat> rank_record::*field, std::size_t it) {
  flat out(param_elems, 0.0f);
  for (const auto& r : ranks) {
    const flat& f = (r.*field)[it];
    for (std::size_t e = 0; e < param_elems; ++e)
      if (f[e] != 0.0f) out[e] = f[e];
  }
  return out;
}

/** The serial model in precision T: the N micro-batches of each step one after another, gradients
 *  summed and divided by N, SGD; the evaluation loss after each step. */
template <class T>
struct serial_run {
  std::vector<std::vector<T>> params, grads;
  std::vector<double> train_loss, eval_loss;
  std::vector<float> probs;
};

template <class T>
serial_run<T> run_serial(int n, int iters = iterations, int drop = -1) {
  gpt_reference<T> ref(config, B, Tn);
  init_params(config, ref.params, seed);
  serial_run<T> out;
  std::vector<T> sum(param_elems);
  for (int it = 0; it < iters; ++it) {
    std::fill(sum.begin(), sum.end(), T(0));
    double loss = 0;
    for (int m = 0; m < n; ++m) {
      const micro_batch mb = make_batch(false, it, m);
      loss += ref.forward(mb.tokens.data(), mb.targets.data()) / n;
      ref.backward(mb.tokens.data(), mb.targets.data());
      if (m == drop) continue;
      for (std::size_t e = 0; e < param_elems; ++e) sum[e] += ref.grad_data[e];
    }
    for (auto& g : sum) g /= static_cast<T>(n);
    out.train_loss.push_back(loss);
    out.grads.push_back(sum);
    for (std::size_t e = 0; e < param_elems; ++e) ref.param_data[e] -= static_cast<T>(lr) * sum[e];
    out.params.push_back(ref.param_data);
    double ev = 0;
    for (int m = 0; m < n; ++m) {
      const micro_batch mb = make_batch(true, 0, m);
      ev += ref.forward(mb.tokens.data(), mb.targets.data()) / n;
    }
    out.eval_loss.push_back(ev);
  }
  return out;
}

template <class A, class R>
double max_diff(const std::vector<A>& a, const std::vector<R>& ref) {
  double d = 0;
  for (std::size_t e = 0; e < a.size(); ++e)
    d = std::max(d, std::abs(static_cast<double>(a[e]) - static_cast<double>(ref[e])));
  return d;
}
template <class A>
double max_abs(const std::vector<A>& a) {
  double d = 0;
  for (const auto x : a) d = std::max(d, std::abs(static_cast<double>(x)));
  return d;
}

// RTP's distance from float64 may be at most K times the serial fp32 model's own, plus a floor of
// a few roundings of the largest value (where the serial error happens to be tiny). Both are fp32
// evaluations of the same function whose orders differ only in the ring's partial sums
// (docs/rtp.md derives K = 4).
inline constexpr double K = 4;
inline constexpr double floor_ulps = 8 * 0x1.0p-24;

/** Bit equality (NaNs and signed zeros included); an empty vector's data() may be null, which
 *  memcmp must not see. */
template <class T>
bool bits_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

inline bool same_bits(const std::vector<rank_record>& a, const std::vector<rank_record>& b) {
  for (std::size_t r = 0; r < a.size(); ++r) {
    if (a[r].params != b[r].params || a[r].grads != b[r].grads || a[r].probs != b[r].probs) return false;
    if (!bits_equal(a[r].train_loss, b[r].train_loss) || !bits_equal(a[r].eval_loss, b[r].eval_loss)) return false;
    if (a[r].adam_params != b[r].adam_params || a[r].adam_grads != b[r].adam_grads ||
        a[r].adam_moments != b[r].adam_moments || a[r].clip_scale != b[r].clip_scale)
      return false;
    if (!bits_equal(a[r].adam_train_loss, b[r].adam_train_loss) ||
        !bits_equal(a[r].adam_eval_loss, b[r].adam_eval_loss) || !bits_equal(a[r].grad_norm, b[r].grad_norm))
      return false;
  }
  return true;
}

/** Checks the SGD phase of the run @p ranks of @p n ranks against the serial model in fp32 and
 *  float64 (doctest CHECKs): no evaluation displaced a shard, evaluation losses and replicas agree
 *  across ranks, parameters, gradients and losses of every iteration within the tolerance (with
 *  teeth: a step that lost one micro-batch is far outside it), the same probabilities everywhere. */
inline void check_against_serial(const std::vector<rank_record>& ranks, int n) {
  const auto ser = run_serial<float>(n);
  const auto f64 = run_serial<double>(n);
  double worst_param = 0, worst_grad = 0, worst_loss = 0;
  for (int it = 0; it < iterations; ++it) {
    CAPTURE(it);
    const auto i = static_cast<std::size_t>(it);
    for (const auto& r : ranks) {
      CHECK(r.eval_displaced == 0);
      CHECK(r.eval_loss[i] == ranks[0].eval_loss[i]);
    }
    // Replicas (LayerNorms, output biases, positions, final LayerNorm) are the same bits on every
    // rank, and so are their gradients: they are where each rank wrote them.
    for (const auto& r : ranks)
      for (std::size_t e = 0; e < param_elems; ++e)
        if (r.params[i][e] != 0.0f && ranks[0].params[i][e] != 0.0f && r.params[i][e] != ranks[0].params[i][e]) {
          FAIL_CHECK("element " << e << " differs between ranks after step " << it);
          break;
        }
    const flat got = assemble(ranks, &rank_record::params, i), grad = assemble(ranks, &rank_record::grads, i);
    const double scale_p = max_abs(f64.params[i]), scale_g = max_abs(f64.grads[i]);
    const double tol_p = K * max_diff(ser.params[i], f64.params[i]) + floor_ulps * scale_p;
    const double tol_g = K * max_diff(ser.grads[i], f64.grads[i]) + floor_ulps * scale_g;
    const double err_p = max_diff(got, f64.params[i]), err_g = max_diff(grad, f64.grads[i]);
    CHECK(err_p <= tol_p);
    CHECK(err_g <= tol_g);
    worst_param = std::max(worst_param, err_p / tol_p);
    worst_grad = std::max(worst_grad, err_g / tol_g);
    double loss = 0;
    for (const auto& r : ranks) loss += r.train_loss[i] / n;
    const double tol_l = K * std::abs(ser.train_loss[i] - f64.train_loss[i]) +
                         K * std::abs(ser.eval_loss[i] - f64.eval_loss[i]) + floor_ulps * f64.train_loss[i];
    CHECK(std::abs(loss - f64.train_loss[i]) <= tol_l);
    CHECK(std::abs(ranks[0].eval_loss[i] - f64.eval_loss[i]) <= tol_l);
    worst_loss = std::max(worst_loss, std::abs(ranks[0].eval_loss[i] - f64.eval_loss[i]) / tol_l);
    if (it == 1 && n > 1) {
      // Teeth: a step that lost one rank's micro-batch is far outside the gradient tolerance.
      const auto lost = run_serial<double>(n, 2, n - 1);
      CHECK(max_diff(lost.grads[1], f64.grads[1]) > 10 * tol_g);
      MESSAGE("N = " << n << ": gradients without one micro-batch are " << max_diff(lost.grads[1], f64.grads[1]) / tol_g
                     << "x the tolerance");
    }
  }
  // Sampling: the same probabilities on every rank.
  for (const auto& r : ranks) CHECK(r.probs == ranks[0].probs);
  MESSAGE("N = " << n << ": largest error / tolerance: parameters " << worst_param << ", gradients " << worst_grad
                 << ", evaluation loss " << worst_loss << "; evaluation loss " << ranks[0].eval_loss.front() << " -> "
                 << ranks[0].eval_loss.back());
}

}  // namespace gpt::testing::rtp_model
