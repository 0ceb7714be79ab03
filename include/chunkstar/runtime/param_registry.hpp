// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `param_registry`: the registered parameters (specs and initialisers, unique names), laid
 *         out into a validated chunk plan; and the model-data estimates a user can compute before
 *         creating any memory space (`estimate_model_bytes`, `default_layout_options`).
 */
#pragma once

#include <chunkstar/comm/rank_agreement.hpp>
#include <chunkstar/core/dtype.hpp>
#include <chunkstar/core/error.hpp>
#include <chunkstar/core/tensor_spec.hpp>
#include <chunkstar/layout/chunk_layout.hpp>
#include <chunkstar/layout/plan_validation.hpp>
#include <chunkstar/layout/searched_chunk_layout.hpp>
#include <chunkstar/runtime/runtime_options.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace chunkstar {

/** @brief Handle of a registered parameter. */
struct param_id {
  std::uint32_t value = 0;
  friend constexpr bool operator==(const param_id& a, const param_id& b) noexcept { return a.value == b.value; }
};

/** @brief Fills a parameter's initial values (fp32; the runtime narrows them to the param dtype). */
using param_initializer = std::function<void(std::span<float>)>;

/** @brief Bytes of model data (every chunk of every list) that @p specs take when laid out by
 *  @p layout with lists @p lists — what device + host must hold. Callable before any space exists,
 *  to size budgets. */
template <ChunkLayout Layout>
[[nodiscard]] std::size_t estimate_model_bytes(std::span<const tensor_spec> specs, const Layout& layout,
                                               const chunk_list_options& lists = {}) {
  std::size_t bytes = 0;
  for (const auto& l : make_chunk_lists(layout.plan(specs), lists))
    if (!l.aliases_param) bytes += l.chunk_bytes * l.num_chunks;
  return bytes;
}

/** @brief Searched-layout bounds that fit the tensors @p specs: chunks from the largest tensor
 *  (rounded up to @p align_elems) to @p spread times that — what a default-constructed
 *  `searched_chunk_layout` uses (see searched_layout_options::fitted_to). */
[[nodiscard]] inline searched_layout_options default_layout_options(std::span<const tensor_spec> specs,
                                                                    std::size_t align_elems = 32,
                                                                    std::size_t spread = 4) {
  return searched_layout_options{.align_elems = align_elems, .spread = spread}.fitted_to(specs);
}

/** @brief The parameters of a runtime, in registration order (`param_id{i}` is the i-th). */
class param_registry {
 public:
  /** @brief Registers @p spec; @p init fills its fp32 initial values (zeros when empty).
   *  @throws config_error for a duplicate name or a dtype other than @p param_type. */
  param_id add(tensor_spec spec, param_initializer init, dtype param_type) {
    if (spec.type != param_type)
      throw config_error("parameter '" + spec.name + "' is " + std::string(dtype_name(spec.type)) +
                         " but the runtime's param_type is " + std::string(dtype_name(param_type)) +
                         ": register it with that dtype or change runtime_options::param_type");
    if (names_.contains(spec.name))
      throw config_error("parameter '" + spec.name +
                         "' registered twice: parameter names must be unique (tie parameters by reusing the param_id)");
    names_.emplace(spec.name, specs_.size());
    specs_.push_back(std::move(spec));
    inits_.push_back(std::move(init));
    return {static_cast<std::uint32_t>(specs_.size() - 1)};
  }

  /** @brief Lays the parameters out with @p layout and validates the plan, whoever wrote the
   *  layout: a plan that breaks a law (a tensor past its chunk, overlapping tensors...) is a
   *  config_error naming the tensor and the chunk, never memory corruption. */
  template <ChunkLayout Layout>
  [[nodiscard]] chunk_plan plan(const Layout& layout) const {
    chunk_plan p = layout.plan(specs_);
    validate_plan(specs_, p, layout.name());
    return p;
  }

  [[nodiscard]] std::span<const tensor_spec> specs() const noexcept { return specs_; }
  [[nodiscard]] std::size_t size() const noexcept { return specs_.size(); }
  [[nodiscard]] const tensor_spec& spec(param_id p) const {
    if (p.value >= specs_.size())
      throw config_error("unknown param_id " + std::to_string(p.value) + ": " + std::to_string(specs_.size()) +
                         " parameters are registered");
    return specs_[p.value];
  }
  /** @brief The initialiser of parameter @p t (empty: zeros). */
  [[nodiscard]] const param_initializer& initializer(std::size_t t) const { return inits_.at(t); }
  /** @brief Drops the initialisers (after finalize: they may hold large captured values). */
  void clear_initializers() noexcept { inits_.clear(); }

 private:
  std::vector<tensor_spec> specs_;
  std::vector<param_initializer> inits_;
  std::unordered_map<std::string, std::size_t> names_;
};

/** @brief What every rank of one job must agree on (see require_agreement): the options that shape
 *  the model data or decide the sequence of collectives (sharding and its modes, the gradient
 *  mode), the layout's plan, and each parameter's name, shape, dtype and role. Options that only
 *  move memory on one rank (budgets, prefetch depths, the disk tier) may differ. */
[[nodiscard]] inline std::vector<config_field> describe_configuration(std::span<const tensor_spec> specs,
                                                                      const chunk_plan& plan, std::string_view layout,
                                                                      const runtime_options& o) {
  auto flag = [](bool b) { return b ? std::string("on") : std::string("off"); };
  std::vector<config_field> f = {
      {"parameters", std::to_string(specs.size())},
      {"parameter dtype", std::string(dtype_name(o.param_type))},
      {"optimizer state",
       "master " + flag(o.optimizer_state.master) + ", " + std::to_string(o.optimizer_state.moments) + " moment lists"},
      {"sharding", flag(o.sharding.enabled) + ", keep_gathered " + flag(o.sharding.keep_gathered) +
                       ", reduce_in_fp32 " + flag(o.sharding.reduce_in_fp32) + ", gather_ahead " +
                       flag(o.sharding.gather_ahead) + ", gather_depth " + std::to_string(o.sharding.gather_depth) +
                       ", gather_at_step " + flag(o.sharding.gather_at_step) + ", memory_saving " +
                       flag(o.sharding.memory_saving) + ", micro_batches " + std::to_string(o.sharding.micro_batches)},
      {"gradient mode", o.gradients == gradient_mode::local        ? "local"
                        : o.gradients == gradient_mode::replicated ? "replicated"
                                                                   : "sharded"},
      {"chunk layout", std::string(layout) + ": " + std::to_string(plan.num_chunks) + " chunks of " +
                           std::to_string(plan.chunk_elems) + " elements"},
  };
  for (std::size_t t = 0; t < specs.size(); ++t)
    f.push_back({"parameter " + std::to_string(t), "'" + specs[t].name + "' " + specs[t].shape_string() + " " +
                                                       std::string(dtype_name(specs[t].type)) + " " +
                                                       std::string(role_name(specs[t].role))});
  return f;
}

}  // namespace chunkstar
