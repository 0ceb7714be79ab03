// SPDX-License-Identifier: Apache-2.0
// chunk_runtime over a communicator it cannot copy or create: two in-process ranks (threads), each
// with its own spaces, copy engine and runtime built with the Comm& constructor, train with
// chunk_adam under a device budget that makes chunks move, and end with the same parameters —
// equal to one process fed the same data. Run under ThreadSanitizer too (tests/run.sh).
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/layout/fixed_chunk_layout.hpp>
#include <chunkstar/runtime/chunk_adam.hpp>
#include <chunkstar/runtime/chunk_runtime.hpp>

#include "support/runtimes.hpp"

#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <concepts>
#include <string>
#include <vector>

using namespace chunkstar;

namespace runtime_ranks_test {

static_assert(Communicator<in_process_communicator>);
static_assert(!std::copyable<in_process_communicator>);
static_assert(!std::default_initializable<in_process_communicator>,
              "only the Comm& constructor can build this runtime");

namespace {

template <class Comm>
using runtime_t = chunk_runtime<fixed_chunk_layout, auto_placement, belady_eviction, warmup_tracer, Comm>;

constexpr int L = 4, D = 16, B = 4, steps = 3;

struct run_result {
  std::vector<float> params;
  std::vector<double> losses;
  std::vector<double> norms;
  std::uint64_t bytes_moved = 0;
  std::vector<std::string> violations;
};

/** How the gradients of the ranks are combined. */
enum class exchange { none, average };

/** A tanh MLP trained on fixed data; @p comm (when not null) averages gradients inside each
 *  backward scope, as a user's kernel would after its local backward. */
template <class Comm>
run_result train(runtime_t<Comm>& rt, Comm* comm, exchange how) {
  run_result out;
  std::vector<param_id> w, b;
  for (int l = 0; l < L; ++l) {
    w.push_back(
        rt.register_param({"w" + std::to_string(l), {D, D}, dtype::f32, tensor_role::weight}, [l](std::span<float> v) {
          for (std::size_t i = 0; i < v.size(); ++i)
            v[i] = 0.25f * std::sin(0.37f * static_cast<float>(i) + static_cast<float>(l));
        }));
    b.push_back(rt.register_param({"b" + std::to_string(l), {D}, dtype::f32, tensor_role::bias}));
  }
  rt.finalize();
  // One host thread per kernel call: the ranks are the threads here (and libgomp is not built with TSan).
  chunk_adam<> adam({.hyper = {.lr = 1e-2f, .weight_decay = 0.01f}, .max_grad_norm = 0.5f, .threads = 1},
                    param_groups::with_default_decay(0.01f));
  const std::size_t act = static_cast<std::size_t>(B * D);
  for (int step = 1; step <= steps; ++step) {
    std::vector<non_model_buffer<float, runtime_t<Comm>>> h;
    for (int l = 0; l <= L; ++l) h.push_back(rt.template allocate_buffer<float>(act));
    for (std::size_t i = 0; i < act; ++i) h[0].span()[i] = std::cos(0.11f * static_cast<float>(i * step));
    for (int l = 0; l < L; ++l) {
      auto s = rt.forward("l" + std::to_string(l), {w[l], b[l]});
      const auto W = s.template param<float>(w[l]);
      const auto bias = s.template param<float>(b[l]);
      for (int n = 0; n < B; ++n)
        for (int o = 0; o < D; ++o) {
          float acc = bias[o];
          for (int i = 0; i < D; ++i) acc += W[o * D + i] * h[l].span()[n * D + i];
          h[l + 1].span()[n * D + o] = std::tanh(acc);
        }
    }
    auto dh = rt.template allocate_buffer<float>(act);
    auto dprev = rt.template allocate_buffer<float>(act);
    double loss = 0;
    for (std::size_t i = 0; i < act; ++i) {
      const float d = h[L].span()[i] - 0.3f;
      loss += 0.5 * d * d;
      dh.span()[i] = d / B;
    }
    out.losses.push_back(loss);
    for (int l = L - 1; l >= 0; --l) {
      auto s = rt.backward("l" + std::to_string(l), {w[l], b[l]});
      const auto W = s.template param<float>(w[l]);
      auto gW = s.template grad<float>(w[l]);
      auto gb = s.template grad<float>(b[l]);
      std::vector<float> lw(gW.size(), 0.0f), lb(gb.size(), 0.0f);
      for (std::size_t i = 0; i < act; ++i) dh.span()[i] *= 1.0f - h[l + 1].span()[i] * h[l + 1].span()[i];
      for (int n = 0; n < B; ++n)
        for (int o = 0; o < D; ++o) {
          lb[o] += dh.span()[n * D + o];
          for (int i = 0; i < D; ++i) lw[o * D + i] += dh.span()[n * D + o] * h[l].span()[n * D + i];
        }
      if (comm != nullptr && how == exchange::average) {
        comm->allreduce(lw.data(), lw.size(), dtype::f32, reduce_op::sum);
        comm->allreduce(lb.data(), lb.size(), dtype::f32, reduce_op::sum);
        const float inv = 1.0f / static_cast<float>(comm->size());
        for (float& x : lw) x *= inv;
        for (float& x : lb) x *= inv;
      }
      for (std::size_t i = 0; i < lw.size(); ++i) gW[i] += lw[i];
      for (std::size_t i = 0; i < lb.size(); ++i) gb[i] += lb[i];
      for (int n = 0; n < B; ++n)
        for (int i = 0; i < D; ++i) {
          float acc = 0;
          for (int o = 0; o < D; ++o) acc += W[o * D + i] * dh.span()[n * D + o];
          dprev.span()[n * D + i] = acc;
        }
      std::swap(dh, dprev);
    }
    dh.reset();
    dprev.reset();
    h.clear();
    if (how == exchange::average)  // every chunk's gradient is the ranks' average: said to the runtime
      for (std::uint32_t c = 0; c < rt.plan().num_chunks; ++c) rt.gradient_reduced(c);
    const auto r = adam.step(rt, 1e-2f);
    CHECK(r.stepped);
    out.norms.push_back(r.grad_norm);
  }
  for (std::size_t t = 0; t < rt.params().size(); ++t) {
    std::vector<float> v(rt.params()[t].numel());
    rt.read_tensor(param_id{static_cast<std::uint32_t>(t)}, chunk_kind::param, v);
    out.params.insert(out.params.end(), v.begin(), v.end());
  }
  out.bytes_moved = rt.stats().bytes_moved();
  out.violations = rt.invariant_violations(/*sole_user=*/true);
  return out;
}

/** Activations plus about a third of the model data (8 chunks of 512 fp32 x 4 lists). */
constexpr std::size_t device_capacity = (L + 3) * B * D * 4 + 10 * 512 * 4;
fixed_chunk_layout small_layout() { return fixed_chunk_layout({.chunk_elems = 512, .align_elems = 32}); }

run_result reference(gradient_mode mode) {
  simulated_device_space dev({.capacity = device_capacity});
  host_space host;
  host_copy_engine copier;
  runtime_t<single_process_communicator> rt(dev, host, copier, {.gradients = mode}, small_layout());
  return train<single_process_communicator>(rt, nullptr, exchange::none);
}

}  // namespace

TEST_CASE("two in-process ranks, each its own runtime over a non-copyable communicator: the same parameters") {
  const struct {
    gradient_mode mode;
    exchange how;
    const char* what;
  } cases[] = {{gradient_mode::replicated, exchange::average, "gradients averaged by the user, replicated norm"},
               {gradient_mode::sharded, exchange::none, "sharded norm: chunk_adam all-reduces the squared norm"}};
  for (const auto& c : cases) {
    CAPTURE(c.what);
    std::array<run_result, 2> ranks;
    run_ranks(2, [&](in_process_communicator& comm) {
      simulated_device_space dev({.capacity = device_capacity, .name = "rank" + std::to_string(comm.rank())});
      host_space host;
      host_copy_engine copier;
      runtime_t<in_process_communicator> rt(dev, host, copier, comm, {.gradients = c.mode}, small_layout());
      REQUIRE(&rt.communicator() == &comm);
      auto& mine = ranks[static_cast<std::size_t>(comm.rank())];
      mine = train<in_process_communicator>(rt, &comm, c.how);
      if (rt.owner(1) != 1) mine.violations.push_back("chunk 1 is not owned by rank 1 (owner = index mod world)");
    });
    CHECK(ranks[0].params == ranks[1].params);
    CHECK(ranks[0].losses == ranks[1].losses);
    CHECK(ranks[0].norms == ranks[1].norms);
    CHECK(ranks[0].bytes_moved > 0);  // the budget made chunks move on every rank
    CHECK(ranks[1].bytes_moved == ranks[0].bytes_moved);
    for (const auto& r : ranks)
      for (const auto& v : r.violations) FAIL_CHECK(v);
    const auto ref = reference(c.mode);
    if (c.mode == gradient_mode::replicated) {
      // (g + g) / 2 == g exactly: the ranks train exactly as one process on the same data.
      CHECK(ranks[0].params == ref.params);
      CHECK(ranks[0].norms == ref.norms);
    } else {
      for (std::size_t i = 0; i < ref.norms.size(); ++i)
        CHECK(ranks[0].norms[i] == doctest::Approx(std::sqrt(2.0) * ref.norms[i]));
    }
    CHECK(ranks[0].losses.front() == ref.losses.front());
  }
}

}  // namespace runtime_ranks_test
