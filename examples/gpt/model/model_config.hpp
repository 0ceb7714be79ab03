// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Shape of the flagship GPT-2-style model: the config, named presets, and the list of its
 *         parameter tensors in execution order (what the trainer registers with chunkstar).
 */
#pragma once

#include <chunkstar/core/dtype.hpp>
#include <chunkstar/core/error.hpp>
#include <chunkstar/core/tensor_spec.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace gpt {

/** @brief Shape of the model. Byte-level tokens, so the vocabulary is 256 unless a test wants
 *         something smaller; the LM head is tied to the token embedding. */
struct gpt_config {
  int vocab = 256;  ///< V: token ids are 0..V-1
  int context = 0;  ///< T_max: longest sequence (rows of the position embedding)
  int layers = 0;   ///< L: transformer blocks
  int heads = 0;    ///< NH: attention heads; must divide width
  int width = 0;    ///< C: channels of the residual stream
};

/** @brief Largest vocab, context and width validate() accepts (2^20), and largest layer count (2^16). */
inline constexpr int max_dimension = 1 << 20;
inline constexpr int max_layers = 1 << 16;

/** @brief Throws chunkstar::config_error unless every dimension is positive and within bounds and
 *  heads divide width. */
inline void validate(const gpt_config& c) {
  const auto bad = [&](const std::string& why) {
    throw chunkstar::config_error("gpt_config {vocab=" + std::to_string(c.vocab) +
                                  ", context=" + std::to_string(c.context) + ", layers=" + std::to_string(c.layers) +
                                  ", heads=" + std::to_string(c.heads) + ", width=" + std::to_string(c.width) +
                                  "}: " + why);
  };
  if (c.vocab <= 0 || c.context <= 0 || c.layers <= 0 || c.heads <= 0 || c.width <= 0)
    bad("every dimension must be positive; pick a preset or set all five");
  // Bounds far above any trainable shape, so that no size computed from them overflows.
  if (c.vocab > max_dimension || c.context > max_dimension || c.width > max_dimension || c.layers > max_layers)
    bad("a dimension is too large: vocab, context and width may be at most " + std::to_string(max_dimension) +
        ", layers at most " + std::to_string(max_layers));
  if (c.width % c.heads != 0) bad("width must be a multiple of heads (each head gets width/heads channels)");
}

/** @brief A named shape. */
struct gpt_preset {
  std::string_view name;
  gpt_config config;
  std::string_view note;
};

/** @brief The presets, smallest first. GPT-2/GPT-3 shapes with a 256-token vocabulary, so each
 *         has fewer parameters than its namesake (the 50257-row embedding is gone). */
inline constexpr std::array<gpt_preset, 7> presets{{
    {"tiny", {.vocab = 256, .context = 128, .layers = 4, .heads = 4, .width = 64}, "~0.2M params, for tests"},
    {"mini",
     {.vocab = 256, .context = 128, .layers = 6, .heads = 8, .width = 256},
     "~4.8M params, train_gpt's default"},
    {"small", {.vocab = 256, .context = 256, .layers = 6, .heads = 6, .width = 384}, "~11M params"},
    {"gpt2",
     {.vocab = 256, .context = 1024, .layers = 12, .heads = 12, .width = 768},
     "GPT-2 124M shapes, ~86M params"},
    {"350m",
     {.vocab = 256, .context = 1024, .layers = 24, .heads = 16, .width = 1024},
     "GPT-2 medium shapes, ~303M params"},
    {"760m",
     {.vocab = 256, .context = 1024, .layers = 36, .heads = 20, .width = 1280},
     "GPT-2 large shapes, ~710M params"},
    {"1.3b",
     {.vocab = 256, .context = 1024, .layers = 24, .heads = 16, .width = 2048},
     "GPT-3 XL shapes, ~1.2B params"},
}};

/** @brief The preset called @p name; throws chunkstar::config_error listing the valid names. */
inline gpt_config parse_preset(std::string_view name) {
  std::string valid;
  for (const auto& p : presets) {
    if (p.name == name) return p.config;
    valid += (valid.empty() ? "" : ", ") + std::string(p.name);
  }
  throw chunkstar::config_error("unknown model preset '" + std::string(name) + "'; valid presets: " + valid);
}

/** @brief The parameter tensors of one stage of the model, in the order it uses them. */
struct layer_specs {
  std::string name;  ///< "embedding", "h.0", ..., "final"
  std::vector<chunkstar::tensor_spec> tensors;
};

/** @brief Tensors per transformer block, in the order block_params lists them. */
inline constexpr std::size_t tensors_per_block = 12;

/** @brief Every parameter tensor, grouped by stage, in execution order: the embeddings, then each
 *         block (ln1, qkv, attention projection, ln2, fc, fc projection; weight then bias), then
 *         the final LayerNorm. The LM head reuses wte, so it has no tensor of its own. Linear
 *         weights are [out, in]. */
inline std::vector<layer_specs> param_layers(const gpt_config& c, chunkstar::dtype type = chunkstar::dtype::f32) {
  validate(c);
  using chunkstar::tensor_role;
  const std::int64_t V = c.vocab, T = c.context, C = c.width;
  const auto spec = [&](std::string name, std::vector<std::int64_t> shape, tensor_role role) {
    return chunkstar::tensor_spec{std::move(name), std::move(shape), type, role};
  };
  std::vector<layer_specs> out;
  out.push_back(
      {"embedding", {spec("wte", {V, C}, tensor_role::embedding), spec("wpe", {T, C}, tensor_role::embedding)}});
  for (int l = 0; l < c.layers; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    out.push_back({"h." + std::to_string(l),
                   {
                       spec(p + "ln1.w", {C}, tensor_role::norm),
                       spec(p + "ln1.b", {C}, tensor_role::norm),
                       spec(p + "attn.qkv.w", {3 * C, C}, tensor_role::weight),
                       spec(p + "attn.qkv.b", {3 * C}, tensor_role::bias),
                       spec(p + "attn.proj.w", {C, C}, tensor_role::weight),
                       spec(p + "attn.proj.b", {C}, tensor_role::bias),
                       spec(p + "ln2.w", {C}, tensor_role::norm),
                       spec(p + "ln2.b", {C}, tensor_role::norm),
                       spec(p + "mlp.fc.w", {4 * C, C}, tensor_role::weight),
                       spec(p + "mlp.fc.b", {4 * C}, tensor_role::bias),
                       spec(p + "mlp.proj.w", {C, 4 * C}, tensor_role::weight),
                       spec(p + "mlp.proj.b", {C}, tensor_role::bias),
                   }});
  }
  out.push_back({"final", {spec("lnf.w", {C}, tensor_role::norm), spec("lnf.b", {C}, tensor_role::norm)}});
  return out;
}

/** @brief param_layers() flattened: the registration order. */
inline std::vector<chunkstar::tensor_spec> param_specs(const gpt_config& c,
                                                       chunkstar::dtype type = chunkstar::dtype::f32) {
  std::vector<chunkstar::tensor_spec> out;
  for (auto& layer : param_layers(c, type))
    for (auto& t : layer.tensors) out.push_back(std::move(t));
  return out;
}

/** @brief Number of parameters, counted in closed form (the tests check it against the specs). */
inline std::size_t param_count(const gpt_config& c) {
  validate(c);
  const std::size_t V = c.vocab, T = c.context, C = c.width, L = c.layers;
  const std::size_t per_block = 2 * C                // ln1
                                + 3 * C * C + 3 * C  // qkv
                                + C * C + C          // attention projection
                                + 2 * C              // ln2
                                + 4 * C * C + 4 * C  // fc
                                + 4 * C * C + C;     // fc projection
  return V * C + T * C + L * per_block + 2 * C;
}

}  // namespace gpt
