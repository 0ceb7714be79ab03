// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief What a registered tensor is: name, shape, element type and role.
 */
#pragma once

#include <chunkstar/core/dtype.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace chunkstar {

/** @brief What a parameter is for. Parameter groups key on it (no weight decay on biases and
 *         norms by default); it never changes how the bytes are laid out. */
enum class tensor_role : std::uint8_t { weight, bias, norm, embedding, other };

/** @brief Name of a role, for messages and checkpoints. */
constexpr std::string_view role_name(tensor_role r) noexcept {
  switch (r) {
    case tensor_role::weight: return "weight";
    case tensor_role::bias: return "bias";
    case tensor_role::norm: return "norm";
    case tensor_role::embedding: return "embedding";
    case tensor_role::other: return "other";
  }
  return "?";
}

/** @brief A tensor as registered: the layout only needs `numel()`; the rest names it in messages,
 *         checkpoints and parameter groups. */
struct tensor_spec {
  std::string name;
  std::vector<std::int64_t> shape;
  dtype type = dtype::f32;  ///< the low-precision (compute) type of the parameter
  tensor_role role = tensor_role::weight;

  /** @brief Number of elements (1 for a scalar with an empty shape). */
  [[nodiscard]] std::size_t numel() const noexcept {
    std::size_t n = 1;
    for (auto d : shape) n *= static_cast<std::size_t>(d);
    return n;
  }
  /** @brief Bytes in its own dtype. */
  [[nodiscard]] std::size_t bytes() const noexcept { return numel() * dtype_size(type); }
  /** @brief "[768, 3072]". */
  [[nodiscard]] std::string shape_string() const {
    std::string s = "[";
    for (std::size_t i = 0; i < shape.size(); ++i) {
      if (i) s += ", ";  // not (i ? ", " : "") + ...: GCC 12 warns -Wrestrict on that at -O3
      s += std::to_string(shape[i]);
    }
    return s + "]";
  }
};

}  // namespace chunkstar
