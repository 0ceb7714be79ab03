// SPDX-License-Identifier: Apache-2.0
// One rank's run of rtp_block with its shards outside the block (rotations built with
// external_shard, passes that load the shards and take their gradient sums, the way rtp_gpt runs
// its blocks through its sharded_model) on any LayerBackend: shards, replicas, transit buffers, activations and
// workspace in
// the backend's compute-tier memory, the host touching them only through to_compute and
// from_compute. Shared by the CPU-side test with an asynchronous double (rtp_block_backend.test.cpp)
// and the GPU test (rtp_block_cuda.test.cpp), which compare runs on different backends.
#pragma once

#include "rtp_block.hpp"

#include <chunkstar/rtp/counter_init.hpp>
#include <chunkstar/rtp/replicated.hpp>
#include <chunkstar/rtp/transit_buffers.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
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

/** @p iters SGD steps of one rank: forward and backward on its own micro-batch (a pure function of
 *  the rank and step), then the update on the host, written back. */
template <class Comm, LayerBackend Backend>
rtp_block_record run_rtp_block(Comm& comm, Backend& b, int iters, float lr = 0.1f) {
  const gpt_config& c = rtp_run_config;
  const std::size_t B = rtp_run_B, T = rtp_run_T, C = static_cast<std::size_t>(c.width), rows = B * T;
  const backend_tier<Backend> tier{&b};
  chunkstar::rtp::transit_buffers<float> transit([tier](std::size_t n) { return tier.allocate(n); },
                                                 [tier](float* p, std::size_t n) { tier.deallocate(p, n); });
  using block_type = rtp_block<Comm, Backend>;
  using rotation_type = typename block_type::rotation_type;
  const rtp_block_partition part = partition_block(c, comm.size());
  rotation_type attn_rot(comm, part.attn_elems(), transit, chunkstar::rtp::external_shard,
                         backend_buffer_ops<Backend>{&b});
  rotation_type mlp_rot(comm, part.mlp_elems(), transit, chunkstar::rtp::external_shard,
                        backend_buffer_ops<Backend>{&b});
  // Each rotation's weights and gradient sum, the replicas and their gradients in compute-tier
  // memory, copied with the backend (queued on its stream, as a shard store on a device does).
  compute_buffer<Backend> attn_w(b, part.attn_elems()), attn_g(b, part.attn_elems()), mlp_w(b, part.mlp_elems()),
      mlp_g(b, part.mlp_elems()), rep_w(b, part.replicated_elems()), rep_g(b, part.replicated_elems());
  block_type blk(comm, c, attn_rot, mlp_rot, rep_w.data(), rep_g.data(), &b);
  const auto pass = [&](int which, auto&& f) {
    rotation_type& r = which == 0 ? attn_rot : mlp_rot;
    float* const shard = (which == 0 ? attn_w : mlp_w).data();
    float* const sum_out = (which == 0 ? attn_g : mlp_g).data();
    const auto load = [&](std::span<float> d) { b.copy(d.data(), shard, d.size()); };
    if constexpr (std::is_invocable_v<decltype(f), int, std::span<const float>>) r.forward(load, f);
    else r.backward(load, f, [&](std::span<const float> sum) { b.copy(sum_out, sum.data(), sum.size()); });
  };

  // This rank's shards and the replicas, by global index.
  const chunkstar::rtp::counter_init init{.seed = 7, .key = chunkstar::rtp::tensor_key("rtp_block_runs")};
  const auto value = [&](block_tensor t, std::size_t i) {  // LayerNorm gains about 1, the rest about 0
    const float centre = t == block_tensor::ln1_w || t == block_tensor::ln2_w ? 1.0f : 0.0f;
    return centre + init.normal<float>(static_cast<std::uint64_t>(t) * 100000 + i, 0.0f, 0.1f);
  };
  std::vector<float> attn(part.attn_elems()), mlp(part.mlp_elems()), rep(part.replicated_elems());
  part.for_each_attention(comm.rank(),
                          [&](block_tensor t, std::size_t i, std::size_t off) { attn[off] = value(t, i); });
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
    b.to_compute(attn_w.data(), attn.data(), attn.size() * sizeof(float));
    b.to_compute(mlp_w.data(), mlp.data(), mlp.size() * sizeof(float));
    b.to_compute(rep_w.data(), rep.data(), rep.size() * sizeof(float));
    const chunkstar::rtp::counter_init xs{.seed = 11, .key = chunkstar::rtp::tensor_key("x")};
    std::vector<float> xh(rows * C), target(rows * C);
    const std::uint64_t base =
        (static_cast<std::uint64_t>(it) * 64 + static_cast<std::uint64_t>(comm.rank())) * 2 * rows * C;
    xs.fill_normal<float>(xh, base, 0.0f, 1.0f);
    xs.fill_normal<float>(target, base + rows * C, 0.0f, 1.0f);
    b.to_compute(x.data(), xh.data(), xh.size() * sizeof(float));

    blk.forward(B, T, x.data(), a, proj.data(), pass);
    r.y.push_back(fetch(a.res3, rows * C));
    std::vector<float> dy(rows * C);
    for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = (r.y.back()[i] - target[i]) / static_cast<float>(rows * C);
    b.to_compute(w.dres, dy.data(), dy.size() * sizeof(float));
    blk.backward(B, T, x.data(), a, w, pass);
    b.quiesce();  // the all-reduce reads the replicas' gradients the kernels wrote
    chunkstar::rtp::reduce_replicated_grads(comm, std::span<float>(rep_g.data(), rep.size()));
    r.dx.push_back(fetch(w.dres, rows * C));
    r.attn_grad.push_back(fetch(attn_g.data(), attn.size()));
    r.mlp_grad.push_back(fetch(mlp_g.data(), mlp.size()));
    const std::vector<float> rg = fetch(rep_g.data(), rep.size());
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
