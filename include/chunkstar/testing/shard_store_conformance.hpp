// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `check_shard_store`: the laws of the `ShardStore` concept (chunkstar/rtp/shard_store.hpp)
 *         on a store you build, whose compute-tier buffers are host memory.
 *
 *  The store under test comes from a factory you pass, `with_store(body)`, which builds a fresh
 *  store (and whatever it lives in: a chunk runtime, its spaces), calls `body(store)` and then
 *  destroys it; the check calls it several times. Each store gets the same two shards: one of
 *  three segments (weight, bias, weight) and one of a single embedding segment. Laws checked:
 *  - `add_shard` returns 0, 1, ... and refuses segments that do not tile the shard (a gap, an
 *    empty segment, a short cover) with `config_error`;
 *  - `write` then `read` gives back the bits, for weights, gradients, momentum and variance;
 *  - inside `stage(...)`, `load(k, dst)` copies shard k's weights, and two `add_grad(k, g)` calls
 *    leave the gradient (0 + a) + b, bit for bit; `zero_grad()` zeroes every gradient;
 *  - `step` without clipping is AdamW by `adam_update` per segment, with the hyper-parameters of
 *    its role's group and gradients scaled by 1 / micro_batches: the same bits; it zeroes the
 *    gradients, reports grad_scale 1 / micro_batches, coefficient 1 and a NaN norm, and counts the
 *    step (`step_count()`); `restore_step_count(n)` makes the next step's bias correction n + 1;
 *  - `step` with clipping calls `global_sum_sq` with this store's sum of squares of the scaled
 *    gradients and clips by the square root of what it returns (norm, coefficient and grad_scale
 *    within 1e-6 of the law; the weights within 1e-6 of AdamW at that coefficient), and two fresh
 *    stores given the same inputs end with the same bits;
 *  - a shard added with `counted_in_norm` false is stepped like the others (the same bits) but left
 *    out of the sum of squares `global_sum_sq` is given;
 *  - `allocate(n)` returns zeroed floats, also where memory was just freed dirty;
 *  - `untraced()` returns a guard;
 *  - `sleep()` then `wake()` leaves every list's bits (with gradients accumulated), `asleep()`
 *    says so in between, a stage while asleep is a `state_error`, and a stage after `wake()`
 *    works.
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/optim/adam.hpp>
#include <chunkstar/optim/clip.hpp>
#include <chunkstar/optim/param_groups.hpp>
#include <chunkstar/rtp/shard_store.hpp>
#include <chunkstar/testing/conformance.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace chunkstar::testing {

namespace shard_store_detail {

/** The two shards every store under test gets. */
inline std::vector<std::vector<rtp::shard_segment>> shards() {
  return {{{"a.w@0", 0, 24, tensor_role::weight},
           {"a.b@0", 24, 8, tensor_role::bias},
           {"b.w@0", 32, 16, tensor_role::weight}},
          {{"emb@0", 0, 40, tensor_role::embedding}}};
}
inline std::size_t elems(const std::vector<rtp::shard_segment>& s) { return s.back().offset + s.back().elems; }

/** Deterministic values, different per (shard, list, salt). */
inline std::vector<float> values(std::size_t n, std::size_t shard, int list, int salt) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = 0.25f * std::sin(0.37f * static_cast<float>(i + 1) + 1.3f * static_cast<float>(shard) +
                            0.7f * static_cast<float>(list) + 0.11f * static_cast<float>(salt));
  return v;
}

inline bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() &&
         std::equal(a.begin(), a.end(), b.begin(), [](float x, float y) { return std::memcmp(&x, &y, sizeof x) == 0; });
}

inline bool close(double a, double b, double rel) {
  return std::abs(a - b) <= rel * std::max({std::abs(a), std::abs(b), 1e-30});
}

}  // namespace shard_store_detail

/** @brief Checks the `ShardStore` laws (see the file comment) on stores built by @p with_store,
 *  called as `with_store([&](S& store) { ... })`. */
template <rtp::ShardStore S, class WithStore>
[[nodiscard]] conformance_report check_shard_store(WithStore&& with_store, std::string name = "store") {
  namespace d = shard_store_detail;
  conformance_report r;
  r.subject = "ShardStore '" + name + "'";
  const auto layout = d::shards();
  const adam_hyper base{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-6f, .weight_decay = 0.1f};
  const param_groups groups = param_groups::with_default_decay(base.weight_decay);
  constexpr int micro = 2;

  // Builds the two shards, writes weights, moments and gradients (salt picks the values), runs
  // f(store) and returns nothing: f records what it checks.
  bool second_counted = true;  // shard 1's counted_in_norm
  auto run = [&](int salt, auto&& f) {
    try {
      with_store([&](S& s) {
        for (std::size_t k = 0; k < layout.size(); ++k) {
          const std::size_t got = k == 1 ? s.add_shard(d::elems(layout[k]), layout[k], second_counted)
                                         : s.add_shard(d::elems(layout[k]), layout[k]);
          r.expect(got == k,
                   [&] { return "add_shard returned " + std::to_string(got) + " for shard " + std::to_string(k); });
        }
        s.finalize();
        for (std::size_t k = 0; k < layout.size(); ++k)
          for (const auto kind : {chunk_kind::param, chunk_kind::momentum, chunk_kind::variance}) {
            auto v = d::values(d::elems(layout[k]), k, static_cast<int>(kind), salt);
            if (kind == chunk_kind::variance)
              for (float& x : v) x = x * x;  // a variance is not negative
            s.write(k, kind, v);
          }
        f(s);
      });
    } catch (const std::exception& e) {
      r.fail(std::string("unexpected exception: ") + e.what());
    }
  };
  auto read = [&](S& s, std::size_t k, chunk_kind kind) {
    std::vector<float> v(d::elems(layout[k]));
    s.read(k, kind, v);
    return v;
  };
  // Adds gradient a then b to every shard inside a backward stage; returns the expected sums.
  auto add_grads = [&](S& s, int salt) {
    std::vector<std::vector<float>> expected;
    const std::vector<std::size_t> all = {0, 1};
    s.stage("backward", true, std::span<const std::size_t>(all), [&] {
      for (std::size_t k = 0; k < layout.size(); ++k) {
        const std::size_t n = d::elems(layout[k]);
        const auto a = d::values(n, k, 10, salt), b = d::values(n, k, 11, salt);
        float* buf = s.allocate(n);
        std::copy(a.begin(), a.end(), buf);
        s.add_grad(k, std::span<const float>(buf, n));
        std::copy(b.begin(), b.end(), buf);
        s.add_grad(k, std::span<const float>(buf, n));
        s.deallocate(buf, n);
        std::vector<float> e(n);
        for (std::size_t i = 0; i < n; ++i) e[i] = (0.0f + a[i]) + b[i];
        expected.push_back(std::move(e));
      }
    });
    return expected;
  };
  // AdamW per segment, as the law states, on the lists as they were written for @p salt.
  auto reference_step = [&](std::size_t k, const std::vector<float>& grad, int salt, std::int64_t t, float scale) {
    const std::size_t n = d::elems(layout[k]);
    std::vector<std::vector<float>> lists(3);
    for (const auto kind : {chunk_kind::param, chunk_kind::momentum, chunk_kind::variance}) {
      auto v = d::values(n, k, static_cast<int>(kind), salt);
      if (kind == chunk_kind::variance)
        for (float& x : v) x = x * x;
      lists[kind == chunk_kind::param ? 0 : kind == chunk_kind::momentum ? 1 : 2] = v;
    }
    for (const auto& seg : layout[k])
      adam_update(std::span<float>(lists[0]).subspan(seg.offset, seg.elems),
                  std::span<float>(lists[1]).subspan(seg.offset, seg.elems),
                  std::span<float>(lists[2]).subspan(seg.offset, seg.elems),
                  std::span<const float>(grad).subspan(seg.offset, seg.elems), std::span<float>(),
                  groups.hyper_for(seg.role, base), adam_step_args{.step = t, .grad_scale = scale});
    return lists;
  };

  // Segments that do not tile their shard are refused.
  try {
    with_store([&](S& s) {
      const std::vector<std::vector<rtp::shard_segment>> bad = {
          {{"gap", 0, 4, tensor_role::weight}, {"after-gap", 6, 4, tensor_role::weight}},
          {{"empty", 0, 0, tensor_role::weight}, {"rest", 0, 10, tensor_role::weight}},
          {{"short", 0, 6, tensor_role::weight}}};
      for (const auto& segs : bad) {
        bool refused = false;
        try {
          (void)s.add_shard(10, segs);
        } catch (const config_error&) {
          refused = true;
        }
        r.expect(refused, [&] {
          return "add_shard(10, segments starting with '" + segs[0].name + "') was accepted: they do not tile it";
        });
      }
    });
  } catch (const std::exception& e) {
    r.fail(std::string("unexpected exception while refusing bad segments: ") + e.what());
  }

  // Round trips, load, accumulation, zero_grad.
  run(1, [&](S& s) {
    for (std::size_t k = 0; k < layout.size(); ++k) {
      const std::size_t n = d::elems(layout[k]);
      for (const auto kind : {chunk_kind::param, chunk_kind::grad, chunk_kind::momentum, chunk_kind::variance}) {
        const auto v = d::values(n, k, 20 + static_cast<int>(kind), 1);
        s.write(k, kind, v);
        r.expect(d::same_bits(read(s, k, kind), v), [&] {
          return "read after write differs: shard " + std::to_string(k) + ", " + std::string(chunk_kind_name(kind));
        });
      }
    }
    s.zero_grad();
    for (std::size_t k = 0; k < layout.size(); ++k) {
      const auto g = read(s, k, chunk_kind::grad);
      r.expect(std::all_of(g.begin(), g.end(), [](float x) { return x == 0.0f; }),
               [&] { return "zero_grad left shard " + std::to_string(k) + "'s gradient non-zero"; });
    }
    const std::vector<std::size_t> all = {0, 1};
    s.stage("forward", false, std::span<const std::size_t>(all), [&] {
      for (std::size_t k = 0; k < layout.size(); ++k) {
        const std::size_t n = d::elems(layout[k]);
        float* buf = s.allocate(n);
        s.load(k, std::span<float>(buf, n));
        r.expect(d::same_bits(std::span<const float>(buf, n), read(s, k, chunk_kind::param)),
                 [&] { return "load(" + std::to_string(k) + ") is not the shard's weights"; });
        s.deallocate(buf, n);
      }
    });
    const auto expected = add_grads(s, 1);
    for (std::size_t k = 0; k < layout.size(); ++k)
      r.expect(d::same_bits(read(s, k, chunk_kind::grad), expected[k]),
               [&] { return "two add_grad calls on shard " + std::to_string(k) + " did not leave (0 + a) + b"; });
  });

  // A step without clipping: AdamW's bits; the gradients zeroed; the count.
  run(2, [&](S& s) {
    const auto grads = add_grads(s, 2);
    const auto t0 = s.step_count();
    const rtp::shard_step_result res = s.step(base, groups, micro, 0.0f, {});
    r.expect(s.step_count() == t0 + 1, "step() did not count the step");
    r.expect(res.grad_scale == 1.0f / micro,
             [&] { return "grad_scale " + std::to_string(res.grad_scale) + ", expected 1 / micro_batches"; });
    r.expect(res.clip_coefficient == 1.0f && std::isnan(res.grad_norm),
             "without clipping: coefficient 1 and a NaN norm");
    for (std::size_t k = 0; k < layout.size(); ++k) {
      const auto want = reference_step(k, grads[k], 2, t0 + 1, 1.0f / micro);
      r.expect(d::same_bits(read(s, k, chunk_kind::param), want[0]) &&
                   d::same_bits(read(s, k, chunk_kind::momentum), want[1]) &&
                   d::same_bits(read(s, k, chunk_kind::variance), want[2]),
               [&] {
                 return "shard " + std::to_string(k) +
                        " after step(): not AdamW's bits (adam_update per segment, its role's group)";
               });
      const auto g = read(s, k, chunk_kind::grad);
      r.expect(std::all_of(g.begin(), g.end(), [](float x) { return x == 0.0f; }), "step() did not zero the gradients");
    }
    // The bias correction follows restore_step_count.
    s.restore_step_count(41);
    r.expect(s.step_count() == 41, "restore_step_count(41) then step_count() != 41");
  });
  run(3, [&](S& s) {
    s.restore_step_count(41);
    const auto grads = add_grads(s, 3);
    (void)s.step(base, groups, micro, 0.0f, {});
    for (std::size_t k = 0; k < layout.size(); ++k)
      r.expect(d::same_bits(read(s, k, chunk_kind::param), reference_step(k, grads[k], 3, 42, 1.0f / micro)[0]), [&] {
        return "after restore_step_count(41) the step's bias correction was not for step 42 (shard " +
               std::to_string(k) + ")";
      });
  });

  // A step with clipping: the global sum of squares decides, and the same inputs give the same bits.
  std::vector<std::vector<float>> first_result;
  for (int trial = 0; trial < 3; ++trial) {
    second_counted = trial < 2;  // the third: shard 1 out of the sum, stepped alike
    run(4, [&](S& s) {
      const auto grads = add_grads(s, 4);
      double local = 0;
      for (std::size_t k = 0; k < grads.size(); ++k)
        for (const float x : k == 1 && !second_counted ? std::vector<float>() : grads[k]) {
          const double y = static_cast<double>(x * (1.0f / micro));
          local += y * y;
        }
      double seen = -1;
      int calls = 0;
      const float max_norm = 0.05f;
      const auto res = s.step(base, groups, micro, max_norm, [&](double sq) {
        seen = sq;
        ++calls;
        return 4.0 * sq;  // as if three more ranks held as much
      });
      const clip_result want = clip_coefficient(4.0 * local, max_norm);
      r.expect(calls == 1 && d::close(seen, local, 1e-6), [&] {
        return "global_sum_sq was called " + std::to_string(calls) + " times with " + std::to_string(seen) +
               ", expected once with " + std::to_string(local) +
               " (the sum of squares of the gradients / micro_batches" +
               (second_counted ? ")" : ", shard 1 left out: it was added with counted_in_norm false)");
      });
      r.expect(d::close(res.grad_norm, want.norm, 1e-6) && d::close(res.clip_coefficient, want.coefficient, 1e-6) &&
                   d::close(res.grad_scale, want.coefficient / micro, 1e-6),
               [&] {
                 return "clipping: norm " + std::to_string(res.grad_norm) + ", coefficient " +
                        std::to_string(res.clip_coefficient) + ", expected " + std::to_string(want.norm) + ", " +
                        std::to_string(want.coefficient);
               });
      std::vector<std::vector<float>> now;
      for (std::size_t k = 0; k < layout.size(); ++k) {
        const auto w = read(s, k, chunk_kind::param);
        const auto ref = reference_step(k, grads[k], 4, 1, res.grad_scale)[0];
        double worst = 0;
        for (std::size_t i = 0; i < w.size(); ++i)
          worst = std::max(worst, std::abs(static_cast<double>(w[i]) - ref[i]));
        r.expect(worst <= 1e-6, [&] {
          return "clipped step on shard " + std::to_string(k) + " is " + std::to_string(worst) + " from AdamW";
        });
        now.push_back(w);
      }
      if (trial == 0) first_result = now;
      else if (trial == 1)
        for (std::size_t k = 0; k < now.size(); ++k)
          r.expect(d::same_bits(now[k], first_result[k]), "two stores given the same inputs ended with different bits");
    });
  }

  second_counted = true;

  // Zeroed buffers, also in memory just freed dirty; and the untraced guard.
  run(5, [&](S& s) {
    for (int round = 0; round < 3; ++round) {
      constexpr std::size_t n = 1000;
      float* p = s.allocate(n);
      r.expect(std::all_of(p, p + n, [](float x) { return x == 0.0f; }),
               "allocate(n) returned memory that is not zeroed");
      std::fill(p, p + n, 3.0f);
      s.deallocate(p, n);
    }
    { [[maybe_unused]] auto guard = s.untraced(); }
  });

  // Sleep and wake: the same bits in every list, stages refused while asleep.
  run(6, [&](S& s) {
    add_grads(s, 6);
    std::vector<std::vector<float>> before;
    for (std::size_t k = 0; k < layout.size(); ++k)
      for (const auto kind : {chunk_kind::param, chunk_kind::grad, chunk_kind::momentum, chunk_kind::variance})
        before.push_back(read(s, k, kind));
    s.sleep();
    r.expect(s.asleep(), "asleep() is false after sleep()");
    bool refused = false;
    try {
      const std::vector<std::size_t> all = {0, 1};
      s.stage("forward", false, std::span<const std::size_t>(all), [] {});
    } catch (const state_error&) {
      refused = true;
    }
    r.expect(refused, "a stage while asleep was not refused with a state_error");
    std::size_t i = 0;
    for (std::size_t k = 0; k < layout.size(); ++k)
      for (const auto kind : {chunk_kind::param, chunk_kind::grad, chunk_kind::momentum, chunk_kind::variance})
        r.expect(d::same_bits(read(s, k, kind), before[i++]), "read() while asleep changed the bits");
    s.wake();
    r.expect(!s.asleep(), "asleep() is true after wake()");
    add_grads(s, 6);  // a stage works again
  });
  return r;
}

}  // namespace chunkstar::testing
