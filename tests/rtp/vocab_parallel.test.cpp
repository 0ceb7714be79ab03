// SPDX-License-Identifier: Apache-2.0
// rtp::vocab_parallel on the host kernels (rtp/vocab_kernels.hpp), against a dense float64
// reference, at N = 1-4 ranks with a vocabulary no N divides (padding rows): the embedding (with
// and without learned positions) has the bits of E[token] (+ P[row mod period]); the loss, the
// logits of one row and both gradients (E's, the head's input's) are the dense model's within a
// few units in the last place; the padding rows' gradient stays zero.
#include <chunkstar/comm/in_process_group.hpp>
#include <chunkstar/comm/single_process.hpp>
#include <chunkstar/rtp/counter_init.hpp>
#include <chunkstar/rtp/sharded_model.hpp>
#include <chunkstar/rtp/vocab_parallel.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace vocab_parallel_test {

using namespace chunkstar;

constexpr std::size_t V = 11, C = 6, R = 5, T = 3;  // 11 words: padded at N = 2, 3, 4

TEST_CASE(
    "rtp::vocab_parallel on the host kernels: the embedding's bits, and loss, logits and gradients of a dense float64 "
    "model, N = 1-4") {
  const rtp::counter_init init{.seed = 3, .key = rtp::tensor_key("E")};
  std::vector<float> E(V * C), P(T * C), x(R * C);
  init.fill_normal<float>(E, 0, 0.0f, 1.0f);
  init.fill_normal<float>(P, V * C, 0.0f, 1.0f);
  init.fill_normal<float>(x, V * C + T * C, 0.0f, 1.0f);
  const std::vector<int> tokens{3, 10, 0, 3, 7}, targets{1, 9, 10, 4, 0};
  // The dense reference: logits, loss (mean over rows), dx and dE of the loss.
  std::vector<double> z(R * V), dx(R * C, 0.0), dE(V * C, 0.0);
  double loss = 0;
  for (std::size_t r = 0; r < R; ++r) {
    double mx = -1e300, sum = 0;
    for (std::size_t v = 0; v < V; ++v) {
      for (std::size_t k = 0; k < C; ++k) z[r * V + v] += static_cast<double>(x[r * C + k]) * E[v * C + k];
      mx = std::max(mx, z[r * V + v]);
    }
    for (std::size_t v = 0; v < V; ++v) sum += std::exp(z[r * V + v] - mx);
    const double lse = mx + std::log(sum);
    loss += (lse - z[r * V + static_cast<std::size_t>(targets[r])]) / R;
    for (std::size_t v = 0; v < V; ++v) {
      const double g = (std::exp(z[r * V + v] - lse) - (static_cast<int>(v) == targets[r] ? 1.0 : 0.0)) / R;
      for (std::size_t k = 0; k < C; ++k) dx[r * C + k] += g * E[v * C + k], dE[v * C + k] += g * x[r * C + k];
    }
  }
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    std::vector<float> got_dE(V * C, 0.0f);
    std::vector<std::vector<float>> got_dx(static_cast<std::size_t>(n));
    std::vector<double> got_loss(static_cast<std::size_t>(n));
    std::vector<int> embed_wrong(static_cast<std::size_t>(n)), logits_off(static_cast<std::size_t>(n)),
        padding_nonzero(static_cast<std::size_t>(n));
    run_ranks(n, [&](in_process_communicator& comm) {
      const std::vector<tensor_spec> specs{
          {"E", {static_cast<std::int64_t>(V), static_cast<std::int64_t>(C)}, dtype::f32, tensor_role::embedding}};
      rtp::host_shard_store store;
      rtp::sharded_model<in_process_communicator> m(comm, store, specs);
      using vocab = rtp::vocab_parallel<rtp::sharded_model<in_process_communicator>>;
      const std::size_t part = m.add_rotated(vocab::part(0, comm.size(), comm.rank(), specs));
      m.finalize();
      m.init([&](std::size_t, std::size_t i) { return E[i]; });
      vocab vp(m, part, R);
      const auto me = static_cast<std::size_t>(comm.rank());
      // The embedding: E[token] bit for bit; with positions the serial sum's bits.
      std::vector<float> out(R * C), with_pos(R * C);
      vp.embed(tokens.data(), R, out.data());
      vp.embed(tokens.data(), R, with_pos.data(), P.data(), T);
      for (std::size_t r = 0; r < R; ++r)
        for (std::size_t k = 0; k < C; ++k) {
          const float e = E[static_cast<std::size_t>(tokens[r]) * C + k], p = e + P[(r % T) * C + k];
          embed_wrong[me] +=
              std::memcmp(&out[r * C + k], &e, sizeof e) != 0 || std::memcmp(&with_pos[r * C + k], &p, sizeof p) != 0;
        }
      // The loss, with row 2's logits over the whole vocabulary.
      std::vector<float> logits(V);
      got_loss[me] = vp.loss(x.data(), targets.data(), R, 2, logits.data());
      for (std::size_t v = 0; v < V; ++v)
        logits_off[me] += std::abs(logits[v] - z[2 * V + v]) > 1e-5 * (1 + std::abs(z[2 * V + v]));
      got_dx[me].assign(R * C, 0.0f);
      vp.loss_backward(x.data(), targets.data(), R, 1.0f, got_dx[me].data());
      // E's gradient: the head's (summed over the ranks' rows: every rank passed the same batch,
      // so N times the dense one) — read back whole, padding rows included.
      std::vector<float> g(m.parts()[part].elems);
      m.read(part, chunk_kind::grad, g);
      const std::size_t vs = vp.shard_rows(), v0 = me * vs;
      for (std::size_t r = 0; r < vs; ++r)
        for (std::size_t k = 0; k < C; ++k) {
          if (v0 + r < V) got_dE[(v0 + r) * C + k] = g[r * C + k] / static_cast<float>(n);
          else padding_nonzero[me] += g[r * C + k] != 0.0f;
        }
    });
    for (int r = 0; r < n; ++r) {
      const auto k = static_cast<std::size_t>(r);
      CHECK(embed_wrong[k] == 0);
      CHECK(logits_off[k] == 0);
      CHECK(padding_nonzero[k] == 0);
      CHECK(std::abs(got_loss[k] - loss) <= 1e-5 * loss);
      for (std::size_t i = 0; i < R * C; ++i) CHECK(std::abs(got_dx[k][i] - dx[i]) <= 1e-5);
    }
    for (std::size_t i = 0; i < V * C; ++i) CHECK(std::abs(got_dE[i] - dE[i]) <= 1e-5);
  }
}

TEST_CASE(
    "rtp::vocab_parallel: more ranks than words is refused naming the limit; batches beyond max_rows are refused") {
  const std::vector<tensor_spec> specs{{"E", {3, 2}, dtype::f32, tensor_role::embedding}};
  using model = rtp::sharded_model<single_process_communicator>;
  CHECK_THROWS_WITH_AS(rtp::vocab_parallel<model>::part(0, 4, 3, specs), doctest::Contains("use at most 3 ranks"),
                       config_error);
  single_process_communicator comm;
  rtp::host_shard_store store;
  model m(comm, store, specs);
  const std::size_t part = m.add_rotated(rtp::vocab_parallel<model>::part(0, 1, 0, specs));
  m.finalize();
  rtp::vocab_parallel<model> vp(m, part, 2);
  const std::vector<int> tok{0, 1, 2};
  std::vector<float> out(6);
  CHECK_THROWS_WITH_AS(vp.embed(tok.data(), 3, out.data()), doctest::Contains("built for 1 to 2"), config_error);
}

}  // namespace vocab_parallel_test
