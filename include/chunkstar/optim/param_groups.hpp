// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Parameter groups: per-role optimizer settings (by default no weight decay on biases and
 *         norms). A group overrides the base hyper-parameters of a step; the runtime applies the
 *         group of each tensor slot when it runs the chunk's step.
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/tensor_spec.hpp>
#include <chunkstar/optim/adam.hpp>

#include <array>
#include <cmath>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace chunkstar {

/** @brief One group's settings, relative to the step's base hyper-parameters. */
struct param_group {
  std::string name;
  float weight_decay = 0.0f;   ///< replaces adam_hyper::weight_decay for this group
  float lr_multiplier = 1.0f;  ///< the group's lr = base lr (from the schedule) * this
};

/** @brief Groups keyed by tensor_role. Every role maps to exactly one group. */
class param_groups {
 public:
  static constexpr std::size_t role_count = 5;

  /** @brief The usual split: "decay" (weights, embeddings, other) with @p weight_decay, and
   *         "no_decay" (biases and norms) with none. */
  static param_groups with_default_decay(float weight_decay) {
    param_groups g;
    const std::size_t decay = g.add({.name = "decay", .weight_decay = weight_decay});
    const std::size_t no_decay = g.add({.name = "no_decay", .weight_decay = 0.0f});
    g.assign(tensor_role::weight, decay);
    g.assign(tensor_role::embedding, decay);
    g.assign(tensor_role::other, decay);
    g.assign(tensor_role::bias, no_decay);
    g.assign(tensor_role::norm, no_decay);
    return g;
  }

  /** @brief Adds a group and returns its index. The first group added receives every role not
   *         assigned elsewhere. Throws config_error on a duplicate name or bad values. */
  std::size_t add(param_group group) {
    if (!(group.weight_decay >= 0.0f) || !std::isfinite(group.weight_decay) || !(group.lr_multiplier >= 0.0f) ||
        !std::isfinite(group.lr_multiplier))
      throw config_error("param_groups: group '" + group.name +
                         "' needs weight_decay >= 0 and lr_multiplier >= 0, both finite");
    for (const auto& g : groups_)
      if (g.name == group.name)
        throw config_error("param_groups: a group named '" + group.name + "' exists already; names must be unique");
    groups_.push_back(std::move(group));
    return groups_.size() - 1;
  }

  /** @brief Makes tensors of @p role use group @p index. Throws config_error on a bad index. */
  void assign(tensor_role role, std::size_t index) {
    if (index >= groups_.size())
      throw config_error("param_groups::assign: no group " + std::to_string(index) + " (there are " +
                         std::to_string(groups_.size()) + "); add() it first");
    role_to_group_[static_cast<std::size_t>(role)] = index;
  }

  /** @brief Index of the group of @p role. Throws state_error when no group exists yet. */
  [[nodiscard]] std::size_t group_of(tensor_role role) const {
    if (groups_.empty()) throw state_error("param_groups: no groups; add() one or use with_default_decay()");
    return role_to_group_[static_cast<std::size_t>(role)];
  }
  /** @brief The group of @p role. */
  [[nodiscard]] const param_group& group_for(tensor_role role) const { return groups_[group_of(role)]; }
  /** @brief All groups, by index. */
  [[nodiscard]] const std::vector<param_group>& groups() const noexcept { return groups_; }

  /** @brief The hyper-parameters for a tensor of @p role this step: @p base with the group's
   *         weight decay and learning-rate multiplier applied. */
  [[nodiscard]] adam_hyper hyper_for(tensor_role role, const adam_hyper& base) const {
    const param_group& g = group_for(role);
    adam_hyper h = base;
    h.weight_decay = g.weight_decay;
    h.lr = base.lr * g.lr_multiplier;
    return h;
  }
  /** @brief hyper_for(spec.role, base). */
  [[nodiscard]] adam_hyper hyper_for(const tensor_spec& spec, const adam_hyper& base) const {
    return hyper_for(spec.role, base);
  }

 private:
  std::vector<param_group> groups_;
  std::array<std::size_t, role_count> role_to_group_{};
};

}  // namespace chunkstar
