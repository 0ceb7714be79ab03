// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief The GPT model's forward and backward on the CPU, stage by stage, over caller-owned
 *         parameters, activations and workspace. Written for float (training) and double (the
 *         reference the tests compare against).
 *
 *  Stages are separate functions (embedding, one block, head) so a trainer can wrap each in an
 *  access scope for the memory runtime; gpt_forward / gpt_backward chain them for the whole model.
 *  Nothing here allocates model data; activation_sizes() says how much the caller must provide.
 */
#pragma once

#include "kernels_cpu.hpp"
#include "model_config.hpp"
#include "splitmix64.hpp"

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/tensor_spec.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace gpt {

// ---------------------------------------------------------------------------------------------
// Parameters (and, with the same shapes, their gradients)

/** @brief One block's tensors, in param_layers() order. */
template <cpu::scalar T>
struct block_params {
  T* ln1_w;
  T* ln1_b;
  T* qkv_w;   ///< [3C, C]
  T* qkv_b;   ///< [3C]
  T* proj_w;  ///< attention output projection [C, C]
  T* proj_b;  ///< [C]
  T* ln2_w;
  T* ln2_b;
  T* fc_w;      ///< [4C, C]
  T* fc_b;      ///< [4C]
  T* fcproj_w;  ///< [C, 4C]
  T* fcproj_b;  ///< [C]
};

/** @brief Every parameter of the model (or every gradient). wte doubles as the LM head. */
template <cpu::scalar T>
struct gpt_params {
  T* wte = nullptr;  ///< [V, C]
  T* wpe = nullptr;  ///< [T_max, C]
  std::vector<block_params<T>> blocks;
  T* lnf_w = nullptr;
  T* lnf_b = nullptr;
};

/** @brief Builds the view from one pointer per tensor, in param_specs() order (what the trainer
 *         gets back from registering those specs). */
template <cpu::scalar T>
gpt_params<T> params_from_list(const gpt_config& c, std::span<T* const> t) {
  const std::size_t need = 4 + tensors_per_block * static_cast<std::size_t>(c.layers);
  if (t.size() != need)
    throw chunkstar::config_error("params_from_list: got " + std::to_string(t.size()) + " tensors, the model has " +
                                  std::to_string(need) + "; pass one pointer per param_specs() entry, in order");
  gpt_params<T> p;
  p.wte = t[0];
  p.wpe = t[1];
  for (int l = 0; l < c.layers; ++l) {
    T* const* b = t.data() + 2 + tensors_per_block * static_cast<std::size_t>(l);
    p.blocks.push_back({b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11]});
  }
  p.lnf_w = t[need - 2];
  p.lnf_b = t[need - 1];
  return p;
}

/** @brief The inverse of params_from_list: one pointer per tensor, in param_specs() order. */
template <cpu::scalar T>
std::vector<T*> param_list(const gpt_params<T>& p) {
  std::vector<T*> t{p.wte, p.wpe};
  for (const auto& b : p.blocks)
    t.insert(t.end(), {b.ln1_w, b.ln1_b, b.qkv_w, b.qkv_b, b.proj_w, b.proj_b, b.ln2_w, b.ln2_b, b.fc_w, b.fc_b,
                       b.fcproj_w, b.fcproj_b});
  t.push_back(p.lnf_w);
  t.push_back(p.lnf_b);
  return t;
}

/** @brief The view of param_count(c) contiguous elements laid out in param_specs() order. */
template <cpu::scalar T>
gpt_params<T> bind_params(const gpt_config& c, T* flat) {
  std::vector<T*> t;
  for (const auto& s : param_specs(c)) {
    t.push_back(flat);
    flat += s.numel();
  }
  return params_from_list<T>(c, t);
}

// ---------------------------------------------------------------------------------------------
// Initialisation: GPT-2's scheme (weights N(0, 0.02), the two projections into the residual
// stream scaled by 1/sqrt(2L) so its variance does not grow with depth, biases 0, LayerNorm
// gains 1). The random numbers come from a counter-based generator keyed by (seed, tensor index),
// so each tensor can be initialised on its own, in any order, with the same result everywhere.

namespace detail {
/** @brief Uniform in (0, 1), from the top 53 bits; never exactly 0 so log() is finite. */
inline double uniform01(std::uint64_t key) { return (static_cast<double>(splitmix64(key) >> 11) + 0.5) * 0x1p-53; }
inline bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
}  // namespace detail

/** @brief The initial value of element @p i of tensor number @p index of param_specs(c) (whose
 *  spec is @p s): a pure function of (seed, tensor, element), so a rank that holds only some
 *  elements of a tensor (RTP's shards) materialises exactly those, with the same values as a
 *  process that initialises the whole tensor. */
template <cpu::scalar T>
T init_value(const gpt_config& c, const chunkstar::tensor_spec& s, std::size_t index, std::size_t i, std::uint64_t seed,
             double std_dev = 0.02) {
  if (s.role == chunkstar::tensor_role::norm) return detail::ends_with(s.name, ".w") ? T(1) : T(0);
  if (s.role == chunkstar::tensor_role::bias) return T(0);
  double sd = std_dev;
  if (detail::ends_with(s.name, "attn.proj.w") || detail::ends_with(s.name, "mlp.proj.w"))
    sd /= std::sqrt(2.0 * c.layers);
  const std::uint64_t key = detail::splitmix64(seed ^ detail::splitmix64(index + 1));
  // Box-Muller, one normal per pair of uniforms
  const double u1 = detail::uniform01(key + 2 * i), u2 = detail::uniform01(key + 2 * i + 1);
  return static_cast<T>(sd * std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

/** @brief Initialises tensor number @p index of param_specs(c) (whose spec is @p s): init_value()
 *  of every element. */
template <cpu::scalar T>
void init_tensor(const gpt_config& c, const chunkstar::tensor_spec& s, std::size_t index, T* data, std::uint64_t seed,
                 double std_dev = 0.02) {
  const std::size_t n = s.numel();
  for (std::size_t i = 0; i < n; ++i) data[i] = init_value<T>(c, s, index, i, seed, std_dev);
}

/** @brief init_tensor() for every tensor of @p p. */
template <cpu::scalar T>
void init_params(const gpt_config& c, const gpt_params<T>& p, std::uint64_t seed, double std_dev = 0.02) {
  const auto specs = param_specs(c);
  const auto ptrs = param_list(p);
  for (std::size_t i = 0; i < specs.size(); ++i) init_tensor(c, specs[i], i, ptrs[i], seed, std_dev);
}

// ---------------------------------------------------------------------------------------------
// Activations for a batch of B sequences of Tn tokens (N = B*Tn rows), and the backward workspace.

/** @brief What one block keeps for its backward. Its input is the previous block's res3 (or the
 *         embedding output). */
template <cpu::scalar T>
struct block_activations {
  T* ln1;       ///< [N, C]
  T* ln1_mean;  ///< [N]
  T* ln1_rstd;  ///< [N]
  T* qkv;       ///< [N, 3C]
  T* atty;      ///< [N, C] attention output, before the projection
  T* att;       ///< [B, NH, Tn, Tn] attention probabilities
  T* res2;      ///< [N, C] input + attention branch
  T* ln2;       ///< [N, C]
  T* ln2_mean;  ///< [N]
  T* ln2_rstd;  ///< [N]
  T* fch;       ///< [N, 4C] before GELU
  T* fch_gelu;  ///< [N, 4C]
  T* res3;      ///< [N, C] block output
};

/** @brief What the head keeps: final LayerNorm, logits, probabilities and per-token losses. */
template <cpu::scalar T>
struct head_activations {
  T* lnf;       ///< [N, C]
  T* lnf_mean;  ///< [N]
  T* lnf_rstd;  ///< [N]
  T* logits;    ///< [N, V]
  T* probs;     ///< [N, V]
  T* losses;    ///< [N]
};

/** @brief Every activation of one forward. */
template <cpu::scalar T>
struct gpt_activations {
  T* encoded = nullptr;  ///< [N, C]
  std::vector<block_activations<T>> blocks;
  head_activations<T> head{};
  T* proj = nullptr;  ///< [N, C] projection outputs; consumed at once by the residual add, so shared
};

/** @brief Scratch for the backward, reused by every block. */
template <cpu::scalar T>
struct backward_workspace {
  T* dres;         ///< [N, C] gradient of the residual stream, updated in place block by block
  T* dln;          ///< [N, C]
  T* datty;        ///< [N, C]
  T* dqkv;         ///< [N, 3C]
  T* dfch;         ///< [N, 4C]
  T* dfch_gelu;    ///< [N, 4C]
  T* att_scratch;  ///< [B, NH, Tn]
  T* dlogits;      ///< [N, V]
};

/** @brief Element counts (not bytes) of everything a forward and backward of a [B, Tn] batch need. */
struct activation_sizes {
  std::size_t embedding = 0;  ///< gpt_activations::encoded
  std::size_t block = 0;      ///< one block_activations, all tensors
  std::size_t head = 0;       ///< head_activations, all tensors
  std::size_t scratch = 0;    ///< gpt_activations::proj
  std::size_t layers = 0;     ///< number of blocks
  std::size_t workspace = 0;  ///< backward_workspace, all tensors

  /** @brief Elements of the forward arena bind_activations() expects. */
  [[nodiscard]] std::size_t forward_total() const noexcept { return embedding + layers * block + head + scratch; }
};

/** @brief Sizes for batches of @p B sequences of @p Tn <= context tokens. */
inline activation_sizes compute_activation_sizes(const gpt_config& c, std::size_t B, std::size_t Tn) {
  validate(c);
  if (B == 0 || Tn == 0 || Tn > static_cast<std::size_t>(c.context))
    throw chunkstar::config_error("batch [" + std::to_string(B) + ", " + std::to_string(Tn) +
                                  "]: need B >= 1 and 1 <= T <= context (" + std::to_string(c.context) +
                                  "); shorten the sequence or raise the context");
  // The attention scores (B * heads * T^2 per block) dominate; refuse shapes whose sizes would not
  // even be representable rather than wrap.
  const double scores = static_cast<double>(B) * c.heads * static_cast<double>(Tn) * static_cast<double>(Tn);
  const double rows = static_cast<double>(B) * static_cast<double>(Tn) * (c.width + c.vocab);
  if (scores > 0x1p50 || rows > 0x1p50)
    throw chunkstar::config_error(
        "batch [" + std::to_string(B) + ", " + std::to_string(Tn) +
        "]: its activations would need more than 2^50 elements; use a smaller batch or sequence");
  const std::size_t N = B * Tn, C = c.width, V = c.vocab, NH = c.heads;
  activation_sizes s;
  s.embedding = N * C;
  s.block =
      N * C + 2 * N + 3 * N * C + N * C + B * NH * Tn * Tn + N * C + N * C + 2 * N + 4 * N * C + 4 * N * C + N * C;
  s.head = N * C + 2 * N + N * V + N * V + N;
  s.scratch = N * C;
  s.layers = static_cast<std::size_t>(c.layers);
  s.workspace = N * C + N * C + N * C + 3 * N * C + 4 * N * C + 4 * N * C + B * NH * Tn + N * V;
  return s;
}

namespace detail {
template <class T>
T* take(T*& cursor, std::size_t n) {
  T* p = cursor;
  cursor += n;
  return p;
}
}  // namespace detail

/** @brief Carves one block's activations from activation_sizes::block elements at @p base. */
template <cpu::scalar T>
block_activations<T> bind_block_activations(const gpt_config& c, std::size_t B, std::size_t Tn, T* base) {
  const std::size_t N = B * Tn, C = c.width, NH = c.heads;
  block_activations<T> a;
  a.ln1 = detail::take(base, N * C);
  a.ln1_mean = detail::take(base, N);
  a.ln1_rstd = detail::take(base, N);
  a.qkv = detail::take(base, 3 * N * C);
  a.atty = detail::take(base, N * C);
  a.att = detail::take(base, B * NH * Tn * Tn);
  a.res2 = detail::take(base, N * C);
  a.ln2 = detail::take(base, N * C);
  a.ln2_mean = detail::take(base, N);
  a.ln2_rstd = detail::take(base, N);
  a.fch = detail::take(base, 4 * N * C);
  a.fch_gelu = detail::take(base, 4 * N * C);
  a.res3 = detail::take(base, N * C);
  return a;
}

/** @brief Carves every activation from activation_sizes::forward_total() elements at @p arena. */
template <cpu::scalar T>
gpt_activations<T> bind_activations(const gpt_config& c, std::size_t B, std::size_t Tn, T* arena) {
  const activation_sizes s = compute_activation_sizes(c, B, Tn);
  const std::size_t N = B * Tn, C = c.width, V = c.vocab;
  gpt_activations<T> a;
  a.encoded = detail::take(arena, s.embedding);
  for (int l = 0; l < c.layers; ++l) a.blocks.push_back(bind_block_activations(c, B, Tn, detail::take(arena, s.block)));
  a.head.lnf = detail::take(arena, N * C);
  a.head.lnf_mean = detail::take(arena, N);
  a.head.lnf_rstd = detail::take(arena, N);
  a.head.logits = detail::take(arena, N * V);
  a.head.probs = detail::take(arena, N * V);
  a.head.losses = detail::take(arena, N);
  a.proj = detail::take(arena, s.scratch);
  return a;
}

/** @brief Carves the backward workspace from activation_sizes::workspace elements at @p base. */
template <cpu::scalar T>
backward_workspace<T> bind_backward_workspace(const gpt_config& c, std::size_t B, std::size_t Tn, T* base) {
  const std::size_t N = B * Tn, C = c.width, V = c.vocab, NH = c.heads;
  backward_workspace<T> w;
  w.dres = detail::take(base, N * C);
  w.dln = detail::take(base, N * C);
  w.datty = detail::take(base, N * C);
  w.dqkv = detail::take(base, 3 * N * C);
  w.dfch = detail::take(base, 4 * N * C);
  w.dfch_gelu = detail::take(base, 4 * N * C);
  w.att_scratch = detail::take(base, B * NH * Tn);
  w.dlogits = detail::take(base, N * V);
  return w;
}

// ---------------------------------------------------------------------------------------------
// Forward, stage by stage.

/** @brief encoded = wte[tokens] + wpe[position]. */
template <cpu::scalar T>
void embedding_forward(const gpt_config& c, std::size_t B, std::size_t Tn, const int* tokens, const T* wte,
                       const T* wpe, T* encoded) {
  cpu::encoder_forward(encoded, tokens, wte, wpe, B, Tn, static_cast<std::size_t>(c.width));
}

/** @brief One pre-LayerNorm block: x + attn(ln1(x)), then + mlp(ln2(.)). @p proj is [N, C] scratch. */
template <cpu::scalar T>
void block_forward(const gpt_config& c, std::size_t B, std::size_t Tn, const block_params<T>& p, const T* x,
                   const block_activations<T>& a, T* proj) {
  const std::size_t N = B * Tn, C = c.width, NH = c.heads;
  cpu::layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, x, p.ln1_w, p.ln1_b, N, C);
  cpu::matmul_forward(a.qkv, a.ln1, p.qkv_w, p.qkv_b, N, C, 3 * C);
  cpu::attention_forward(a.atty, a.att, a.qkv, B, Tn, C, NH);
  cpu::matmul_forward(proj, a.atty, p.proj_w, p.proj_b, N, C, C);
  cpu::residual_forward(a.res2, x, proj, N * C);
  cpu::layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, p.ln2_w, p.ln2_b, N, C);
  cpu::matmul_forward(a.fch, a.ln2, p.fc_w, p.fc_b, N, C, 4 * C);
  cpu::gelu_forward(a.fch_gelu, a.fch, 4 * N * C);
  cpu::matmul_forward(proj, a.fch_gelu, p.fcproj_w, p.fcproj_b, N, 4 * C, C);
  cpu::residual_forward(a.res3, a.res2, proj, N * C);
}

/** @brief Final LayerNorm, logits = lnf wte^T (the tied head), softmax and cross-entropy against
 *         @p targets. Returns the mean loss over the B*Tn tokens. */
template <cpu::scalar T>
double head_forward(const gpt_config& c, std::size_t B, std::size_t Tn, const T* wte, const T* lnf_w, const T* lnf_b,
                    const T* x, const head_activations<T>& a, const int* targets) {
  const std::size_t N = B * Tn, C = c.width, V = c.vocab;
  cpu::layernorm_forward(a.lnf, a.lnf_mean, a.lnf_rstd, x, lnf_w, lnf_b, N, C);
  cpu::matmul_forward(a.logits, a.lnf, wte, static_cast<const T*>(nullptr), N, C, V);
  cpu::softmax_crossentropy_forward(a.probs, a.losses, a.logits, targets, N, V);
  return cpu::mean_loss(a.losses, N);
}

namespace detail {
inline void check_tokens(const gpt_config& c, const int* tokens, std::size_t n, const char* what) {
  for (std::size_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= c.vocab)
      throw chunkstar::config_error(std::string(what) + "[" + std::to_string(i) + "] = " + std::to_string(tokens[i]) +
                                    " is outside the vocabulary [0, " + std::to_string(c.vocab) +
                                    "); byte-level data must be fed as values 0..255");
}
}  // namespace detail

/** @brief The whole forward: returns the mean cross-entropy of predicting @p targets [B*Tn] from
 *         @p tokens [B*Tn]. Activations land in @p a (bound for the same B, Tn). */
template <cpu::scalar T>
double gpt_forward(const gpt_config& c, const gpt_params<T>& p, const gpt_activations<T>& a, const int* tokens,
                   const int* targets, std::size_t B, std::size_t Tn) {
  compute_activation_sizes(c, B, Tn);  // validates the shape
  detail::check_tokens(c, tokens, B * Tn, "tokens");
  detail::check_tokens(c, targets, B * Tn, "targets");
  embedding_forward(c, B, Tn, tokens, p.wte, p.wpe, a.encoded);
  const T* x = a.encoded;
  for (int l = 0; l < c.layers; ++l) {
    block_forward(c, B, Tn, p.blocks[l], x, a.blocks[l], a.proj);
    x = a.blocks[l].res3;
  }
  return head_forward(c, B, Tn, p.wte, p.lnf_w, p.lnf_b, x, a.head, targets);
}

// ---------------------------------------------------------------------------------------------
// Backward, stage by stage, in reverse. Parameter gradients are ADDED to (zero them before the
// first micro-batch of a step); w.dres carries the residual stream's gradient between stages.

/** @brief Starts the backward: w.dres = d(loss_scale * mean loss) / d(last block's output);
 *         adds into g_wte (the head's share of the tied embedding) and g_lnf_*. */
template <cpu::scalar T>
void head_backward(const gpt_config& c, std::size_t B, std::size_t Tn, const T* wte, const T* lnf_w, const T* x,
                   const head_activations<T>& a, const int* targets, T* g_wte, T* g_lnf_w, T* g_lnf_b,
                   const backward_workspace<T>& w, T loss_scale = T(1)) {
  const std::size_t N = B * Tn, C = c.width, V = c.vocab;
  cpu::zero(w.dlogits, N * V);
  cpu::softmax_crossentropy_backward(w.dlogits, a.probs, targets, loss_scale / static_cast<T>(N), N, V);
  cpu::zero(w.dln, N * C);
  cpu::matmul_backward(w.dln, g_wte, static_cast<T*>(nullptr), w.dlogits, a.lnf, wte, N, C, V);
  cpu::zero(w.dres, N * C);
  cpu::layernorm_backward(w.dres, g_lnf_w, g_lnf_b, w.dln, x, lnf_w, a.lnf_mean, a.lnf_rstd, N, C);
}

/** @brief One block in reverse. On entry w.dres is the gradient of the block's output; on exit,
 *         of its input @p x. The residual adds pass the gradient through unchanged, so each
 *         branch's LayerNorm backward simply adds its share into w.dres. */
template <cpu::scalar T>
void block_backward(const gpt_config& c, std::size_t B, std::size_t Tn, const block_params<T>& p,
                    const block_params<T>& g, const T* x, const block_activations<T>& a,
                    const backward_workspace<T>& w) {
  const std::size_t N = B * Tn, C = c.width, NH = c.heads;
  // MLP branch
  cpu::zero(w.dfch_gelu, 4 * N * C);
  cpu::matmul_backward(w.dfch_gelu, g.fcproj_w, g.fcproj_b, w.dres, a.fch_gelu, p.fcproj_w, N, 4 * C, C);
  cpu::zero(w.dfch, 4 * N * C);
  cpu::gelu_backward(w.dfch, a.fch, w.dfch_gelu, 4 * N * C);
  cpu::zero(w.dln, N * C);
  cpu::matmul_backward(w.dln, g.fc_w, g.fc_b, w.dfch, a.ln2, p.fc_w, N, C, 4 * C);
  cpu::layernorm_backward(w.dres, g.ln2_w, g.ln2_b, w.dln, a.res2, p.ln2_w, a.ln2_mean, a.ln2_rstd, N, C);
  // attention branch
  cpu::zero(w.datty, N * C);
  cpu::matmul_backward(w.datty, g.proj_w, g.proj_b, w.dres, a.atty, p.proj_w, N, C, C);
  cpu::zero(w.dqkv, 3 * N * C);
  cpu::attention_backward(w.dqkv, w.att_scratch, w.datty, a.qkv, a.att, B, Tn, C, NH);
  cpu::zero(w.dln, N * C);
  cpu::matmul_backward(w.dln, g.qkv_w, g.qkv_b, w.dqkv, a.ln1, p.qkv_w, N, C, 3 * C);
  cpu::layernorm_backward(w.dres, g.ln1_w, g.ln1_b, w.dln, x, p.ln1_w, a.ln1_mean, a.ln1_rstd, N, C);
}

/** @brief Ends the backward: the embeddings' share, from w.dres. */
template <cpu::scalar T>
void embedding_backward(const gpt_config& c, std::size_t B, std::size_t Tn, const int* tokens, T* g_wte, T* g_wpe,
                        const backward_workspace<T>& w) {
  cpu::encoder_backward(g_wte, g_wpe, w.dres, tokens, B, Tn, static_cast<std::size_t>(c.width));
}

/** @brief The whole backward of the last gpt_forward() on @p a: adds d(loss_scale * mean loss)/dθ
 *         into @p g. */
template <cpu::scalar T>
void gpt_backward(const gpt_config& c, const gpt_params<T>& p, const gpt_params<T>& g, const gpt_activations<T>& a,
                  const backward_workspace<T>& w, const int* tokens, const int* targets, std::size_t B, std::size_t Tn,
                  T loss_scale = T(1)) {
  const auto input_of = [&](int l) -> const T* { return l == 0 ? a.encoded : a.blocks[l - 1].res3; };
  head_backward(c, B, Tn, p.wte, p.lnf_w, input_of(c.layers), a.head, targets, g.wte, g.lnf_w, g.lnf_b, w, loss_scale);
  for (int l = c.layers - 1; l >= 0; --l)
    block_backward(c, B, Tn, p.blocks[l], g.blocks[l], input_of(l), a.blocks[l], w);
  embedding_backward(c, B, Tn, tokens, g.wte, g.wpe, w);
}

/** @brief Owns every buffer of a CPU model: parameters, gradients, activations, workspace. For
 *         tests and the float64 reference only; the trainer takes all of these from chunkstar. */
template <cpu::scalar T>
struct gpt_reference {
  gpt_config config;
  std::size_t batch, seq;
  std::vector<T> param_data, grad_data, act_data, work_data;
  gpt_params<T> params, grads;
  gpt_activations<T> acts;
  backward_workspace<T> work;

  gpt_reference(const gpt_config& c, std::size_t B, std::size_t Tn)
      : config(c), batch(B), seq(Tn), param_data(param_count(c)), grad_data(param_count(c)) {
    const activation_sizes s = compute_activation_sizes(c, B, Tn);
    act_data.resize(s.forward_total());
    work_data.resize(s.workspace);
    params = bind_params(c, param_data.data());
    grads = bind_params(c, grad_data.data());
    acts = bind_activations(c, B, Tn, act_data.data());
    work = bind_backward_workspace(c, B, Tn, work_data.data());
  }
  gpt_reference(const gpt_reference&) = delete;  // the views point into this object's vectors
  gpt_reference& operator=(const gpt_reference&) = delete;

  /** @brief Mean loss of predicting @p targets from @p tokens. */
  double forward(const int* tokens, const int* targets) {
    return gpt_forward(config, params, acts, tokens, targets, batch, seq);
  }
  /** @brief Zeroes the gradients, then the backward of the last forward. */
  void backward(const int* tokens, const int* targets) {
    cpu::zero(grad_data.data(), grad_data.size());
    gpt_backward(config, params, grads, acts, work, tokens, targets, batch, seq);
  }
};

}  // namespace gpt
