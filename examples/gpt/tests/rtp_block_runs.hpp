// SPDX-License-Identifier: Apache-2.0
// One rank's run of rtp_block with its shards outside the block (external_shard, the way rtp_gpt
// holds them) on any LayerBackend: shards, replicas, transit buffers, activations and workspace in
// the backend's compute-tier memory, the host touching them only through to_compute and
// from_compute. Shared by the CPU-side test with an asynchronous double (rtp_block_backend.test.cpp)
// and the GPU test (rtp_block_cuda.test.cpp), which compare runs on different backends.
#pragma once

#include "rtp_block.hpp"

#include <chunkstar/rtp/counter_init.hpp>
#include <chunkstar/rtp/transit_buffers.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gpt::testing {

// heads = 12 divides over 1, 2, 3 and 4 ranks; 4C = 192 hidden units.
inline const gpt_config rtp_run_config{.vocab = 8, .context = 8, .layers = 1, .heads = 12, .width = 48};
inline constexpr std::size_t rtp_run_B = 2, rtp_run_T = 7;

/** What one rank's run recorded, in host memory, per iteration. */
struct rtp_block_record {
  std::vector<std::vector<float>> y, dx, attn_grad, mlp_grad, rep_grad, attn, mlp, rep;
  friend bool operator==(const rtp_block_record&, const rtp_block_record&) = default;
};

/** Shard k's weights and gradient sum in compute-tier memory, loaded and stored with the backend's
 *  copies (queued on its stream, as a shard store on a device does). */
template <LayerBackend Backend>
struct compute_shard_io final : rtp_block_io {
  Backend& b;
  compute_buffer<Backend> w[2], g[2];
  compute_shard_io(Backend& backend, std::size_t attn, std::size_t mlp)
      : b(backend), w{{backend, attn}, {backend, mlp}}, g{{backend, attn}, {backend, mlp}} {}
  void load(int which, std::span<float> dst) override { b.copy(dst.data(), w[which].data(), dst.size()); }
  void store_grad(int which, std::span<const float> sum) override { b.copy(g[which].data(), sum.data(), sum.size()); }
};

/** @p iters SGD steps of one rank: forward and backward on its own micro-batch (a pure function of
 *  the rank and step), then the update on the host, written back. */
template <class Comm, LayerBackend Backend>
rtp_block_record run_rtp_block(Comm& comm, Backend& b, int iters, float lr = 0.1f) {
  const gpt_config& c = rtp_run_config;
  const std::size_t B = rtp_run_B, T = rtp_run_T, C = static_cast<std::size_t>(c.width), rows = B * T;
  const backend_tier<Backend> tier{&b};
  chunkstar::rtp::transit_buffers<float> transit([tier](std::size_t n) { return tier.allocate(n); },
                                                 [tier](float* p, std::size_t n) { tier.deallocate(p, n); });
  rtp_block<Comm, Backend> blk(comm, c, transit, chunkstar::rtp::external_shard, &b);
  const rtp_block_partition& part = blk.partition();
  compute_shard_io<Backend> io(b, part.attn_elems(), part.mlp_elems());

  // This rank's shards and the replicas, by global index.
  const chunkstar::rtp::counter_init init{.seed = 7, .key = chunkstar::rtp::tensor_key("rtp_block_runs")};
  const auto value = [&](block_tensor t, std::size_t i) {  // LayerNorm gains about 1, the rest about 0
    const float centre = t == block_tensor::ln1_w || t == block_tensor::ln2_w ? 1.0f : 0.0f;
    return centre + init.normal<float>(static_cast<std::uint64_t>(t) * 100000 + i, 0.0f, 0.1f);
  };
  std::vector<float> attn(part.attn_elems()), mlp(part.mlp_elems()), rep(part.replicated_elems());
  part.for_each_attention(comm.rank(), [&](block_tensor t, std::size_t i, std::size_t off) { attn[off] = value(t, i); });
  part.for_each_mlp(comm.rank(), [&](block_tensor t, std::size_t i, std::size_t off) { mlp[off] = value(t, i); });
  part.for_each_replicated([&](block_tensor t, std::size_t i, std::size_t off) { rep[off] = value(t, i); });

  const auto sizes = compute_activation_sizes(c, B, T);
  compute_buffer<Backend> act(b, sizes.block), work(b, sizes.workspace), proj(b, rows * C), x(b, rows * C);
  const auto a = bind_block_activations(c, B, T, act.data());
  const auto w = bind_backward_workspace(c, B, T, work.data());
  const auto fetch = [&](const float* p, std::size_t n) {
    std::vector<float> h(n);
    b.from_compute(h.data(), p, n * sizeof(float));
    return h;
  };
  rtp_block_record r;
  for (int it = 0; it < iters; ++it) {
    b.to_compute(io.w[0].data(), attn.data(), attn.size() * sizeof(float));
    b.to_compute(io.w[1].data(), mlp.data(), mlp.size() * sizeof(float));
    blk.write_replicated(rep);
    const chunkstar::rtp::counter_init xs{.seed = 11, .key = chunkstar::rtp::tensor_key("x")};
    std::vector<float> xh(rows * C), target(rows * C);
    const std::uint64_t base = (static_cast<std::uint64_t>(it) * 64 + static_cast<std::uint64_t>(comm.rank())) * 2 * rows * C;
    xs.fill_normal<float>(xh, base, 0.0f, 1.0f);
    xs.fill_normal<float>(target, base + rows * C, 0.0f, 1.0f);
    b.to_compute(x.data(), xh.data(), xh.size() * sizeof(float));

    blk.forward(B, T, x.data(), a, proj.data(), &io);
    r.y.push_back(fetch(a.res3, rows * C));
    std::vector<float> dy(rows * C);
    for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = (r.y.back()[i] - target[i]) / static_cast<float>(rows * C);
    b.to_compute(w.dres, dy.data(), dy.size() * sizeof(float));
    blk.backward(B, T, x.data(), a, w, &io);
    r.dx.push_back(fetch(w.dres, rows * C));
    r.attn_grad.push_back(fetch(io.g[0].data(), attn.size()));
    r.mlp_grad.push_back(fetch(io.g[1].data(), mlp.size()));
    std::vector<float> rg(rep.size());
    blk.read_replicated(rg, true);
    r.rep_grad.push_back(rg);

    for (std::size_t i = 0; i < attn.size(); ++i) attn[i] -= lr * r.attn_grad.back()[i];
    for (std::size_t i = 0; i < mlp.size(); ++i) mlp[i] -= lr * r.mlp_grad.back()[i];
    for (std::size_t i = 0; i < rep.size(); ++i) rep[i] -= lr * rg[i];
    r.attn.push_back(attn), r.mlp.push_back(mlp), r.rep.push_back(rep);
  }
  b.quiesce();
  return r;
}

}  // namespace gpt::testing
