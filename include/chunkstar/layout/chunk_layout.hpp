// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief The `ChunkLayout` concept and `chunk_plan`, the value every layout produces: where each
 *         registered tensor lives (chunk, offset), and the parallel chunk lists built from it.
 *
 *  Models: `fixed_chunk_layout` (fixed_chunk_layout.hpp), `searched_chunk_layout`
 *  (searched_chunk_layout.hpp).
 */
#pragma once

#include <chunkstar/core/chunk_kind.hpp>
#include <chunkstar/core/dtype.hpp>
#include <chunkstar/core/error.hpp>
#include <chunkstar/core/tensor_spec.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace chunkstar {

/** @brief Where one tensor lives. Offsets and sizes count elements, so the same slot is valid in
 *  every parallel list whatever its dtype (an fp16 param and its fp32 master share the offset). */
struct tensor_slot {
  std::size_t chunk = 0;   ///< index of the chunk in every list
  std::size_t offset = 0;  ///< first element inside the chunk; a multiple of the plan's alignment
  std::size_t numel = 0;   ///< elements of the tensor
};

/** @brief The result of laying out a set of tensors: every chunk has `chunk_elems` capacity; each
 *  tensor occupies `[offset, offset + numel)` of exactly one chunk; nothing overlaps. */
struct chunk_plan {
  std::size_t chunk_elems = 0;  ///< capacity of each chunk, in elements
  std::size_t align_elems = 1;  ///< every offset is a multiple of this
  std::size_t num_chunks = 0;
  std::vector<tensor_slot> slots;                       ///< indexed like the specs passed to plan()
  std::vector<std::vector<std::size_t>> chunk_tensors;  ///< per chunk, its tensors in offset order

  /** @brief Elements that hold tensor data. */
  [[nodiscard]] std::size_t used_elems() const noexcept {
    std::size_t n = 0;
    for (const auto& s : slots) n += s.numel;
    return n;
  }
  /** @brief Elements allocated over all chunks of one list. */
  [[nodiscard]] std::size_t total_elems() const noexcept { return chunk_elems * num_chunks; }
  /** @brief Elements allocated but holding no tensor (alignment gaps and chunk tails). */
  [[nodiscard]] std::size_t waste_elems() const noexcept { return total_elems() - used_elems(); }
  /** @brief waste / total, in [0, 1]; 1 only when every tensor is empty. */
  [[nodiscard]] double waste_fraction() const noexcept {
    return total_elems() == 0 ? 0.0 : static_cast<double>(waste_elems()) / static_cast<double>(total_elems());
  }
};

/** @brief The `ChunkLayout` concept.
 *
 *  Required expressions, for `l` a `const L&` and `specs` a `std::span<const tensor_spec>`:
 *  1. `l.plan(specs)` → `chunk_plan`: a tensor never straddles chunks; offsets are multiples of
 *     `align_elems`; tensors keep registration order within and across chunks (chunk order is
 *     use order for layered models, which is what prefetch relies on); a tensor larger than the
 *     largest chunk the layout allows throws `config_error` naming the tensor and the sizes.
 *     Deterministic: the same specs give the same plan.
 *  2. `l.name()` → convertible to `std::string_view`, for reports.
 */
template <class L>
concept ChunkLayout = requires(const L& l, std::span<const tensor_spec> specs) {
  { l.plan(specs) } -> std::same_as<chunk_plan>;
  { l.name() } -> std::convertible_to<std::string_view>;
};

/** @brief Gradients in their own chunks (default: allows accumulation and multi-use parameters)
 *  or in the param chunk's slot after the last backward use (PatrickStar's memory saving). */
enum class grad_storage : std::uint8_t { separate, shared_with_param };

/** @brief The optimizer-state lists that accompany the parameters — fp32 lists with the param
 *  list's slots — as a description: which ones exist is the optimizer's choice, not fixed.
 *  `true` converts to Adam's lists, `false` to none. */
struct optimizer_state_lists {
  bool master = true;        ///< an fp32 master for 16-bit params (an fp32 param is its own master)
  std::uint8_t moments = 2;  ///< moment lists: 0 (SGD), 1 (momentum: SGD with momentum), 2 (momentum, variance: Adam)

  constexpr optimizer_state_lists() noexcept = default;
  constexpr optimizer_state_lists(bool master_list, std::uint8_t moment_lists) noexcept
      : master(master_list), moments(moment_lists) {}
  /** @brief `true`: Adam's lists (master, momentum, variance); `false`: none (inference, tests). */
  constexpr optimizer_state_lists(bool adam) noexcept  // NOLINT(google-explicit-constructor): a flag reads naturally
      : master(adam), moments(adam ? 2 : 0) {}
  static constexpr optimizer_state_lists adam() noexcept { return {true, 2}; }
  static constexpr optimizer_state_lists sgd_momentum() noexcept { return {true, 1}; }
  static constexpr optimizer_state_lists none() noexcept { return {false, 0}; }

  /** @brief True when any state list exists. */
  [[nodiscard]] constexpr bool any() const noexcept { return master || moments > 0; }
  /** @brief True when list @p k exists for parameters of type @p param_type. */
  [[nodiscard]] constexpr bool has(chunk_kind k, dtype param_type) const noexcept {
    switch (k) {
      case chunk_kind::param:
      case chunk_kind::grad: return true;
      case chunk_kind::master: return master && param_type != dtype::f32;
      case chunk_kind::momentum: return moments >= 1;
      case chunk_kind::variance: return moments >= 2;
    }
    return false;
  }
};

/** @brief Which lists to build and with which element types. */
struct chunk_list_options {
  dtype param_type = dtype::f32;  ///< compute precision; grads use it too
  grad_storage grads = grad_storage::separate;
  optimizer_state_lists optimizer_state{};  ///< default: Adam's (master for 16-bit params, momentum, variance)
};

/** @brief One list of the parallel family: `num_chunks` chunks of `chunk_bytes` each, sharing
 *  `chunk_plan::slots`. */
struct chunk_list_desc {
  chunk_kind kind = chunk_kind::param;
  dtype type = dtype::f32;
  std::size_t chunk_bytes = 0;
  std::size_t num_chunks = 0;
  bool aliases_param = false;  ///< grad list stored in the param chunks (grad_storage::shared_with_param)
};

/** @brief The parallel lists for @p plan: param, grad, then the optimizer-state lists the options
 *  describe (master — an fp32 param list needs no separate master —, momentum, variance); all with
 *  identical slots. */
inline std::vector<chunk_list_desc> make_chunk_lists(const chunk_plan& plan, const chunk_list_options& o) {
  std::vector<chunk_list_desc> lists;
  for (auto k : all_chunk_kinds) {
    if (!o.optimizer_state.has(k, o.param_type)) continue;
    const dtype t = k == chunk_kind::param || k == chunk_kind::grad ? o.param_type : dtype::f32;
    lists.push_back({k, t, plan.chunk_elems * dtype_size(t), plan.num_chunks,
                     k == chunk_kind::grad && o.grads == grad_storage::shared_with_param});
  }
  return lists;
}

}  // namespace chunkstar
