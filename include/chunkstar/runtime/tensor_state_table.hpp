// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `tensor_state_table`: the state of every registered tensor (PatrickStar's FREE / COMPUTE /
 *         HOLD / HOLD_AFTER_FWD / HOLD_AFTER_BWD), with every change made through `transition()`,
 *         the whole state machine; scopes that use a tensor more than once (a tied embedding) are
 *         counted, so it stays in COMPUTE until the last closes.
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/tensor_spec.hpp>
#include <chunkstar/core/moment_kind.hpp>
#include <chunkstar/core/tensor_state.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace chunkstar {

/** @brief The tensor states of a runtime. Strong guarantee: an operation that throws (an illegal
 *  transition) changes nothing. */
class tensor_state_table {
 public:
  /** @brief Starts every one of @p count tensors in HOLD; @p names label errors. */
  void reset(std::span<const tensor_spec> specs) {
    specs_ = specs;
    states_.assign(specs.size(), tensor_state::hold);
    refs_.assign(specs.size(), 0);
  }

  [[nodiscard]] std::size_t size() const noexcept { return states_.size(); }
  [[nodiscard]] tensor_state operator[](std::size_t t) const { return states_.at(t); }

  /** @brief A scope opens on tensor @p t: COMPUTE (a nested use only counts). */
  void open(std::size_t t) {
    if (refs_.at(t) == 0) states_[t] = transition(states_[t], tensor_event::open_scope, specs_[t].name);
    ++refs_[t];
  }

  /** @brief A scope of @p kind closes on tensor @p t: HOLD_AFTER_FWD / HOLD_AFTER_BWD once the last
   *  scope using it closes. */
  void close(std::size_t t, moment_kind kind) {
    if (refs_.at(t) == 0)
      throw state_error("internal: closing a scope on tensor '" + specs_[t].name + "' that no scope opened");
    if (refs_[t] == 1)
      states_[t] = transition(
          states_[t], kind == moment_kind::backward ? tensor_event::close_backward : tensor_event::close_forward,
          specs_[t].name);
    --refs_[t];
  }

  /** @brief The iteration (or an untraced section) ends: HOLD_AFTER_* return to HOLD, FREE stays.
   *  @throws state_error, changing nothing, when a tensor is still in COMPUTE. */
  void end_iteration() {
    std::vector<tensor_state> next(states_.size());
    for (std::size_t t = 0; t < states_.size(); ++t)
      next[t] = transition(states_[t], tensor_event::end_iteration, specs_[t].name);
    states_ = std::move(next);
  }

  /** @brief Throws state_error naming the first tensor in COMPUTE, if any: @p what needs none. */
  void require_none_in_compute(const char* what) const {
    for (std::size_t t = 0; t < states_.size(); ++t)
      if (states_[t] == tensor_state::compute)
        throw state_error(std::string(what) + "() while parameter '" + specs_[t].name +
                          "' is in COMPUTE: close every open scope first");
  }

  /** @brief True when some tensor is in COMPUTE. */
  [[nodiscard]] bool any_in_compute() const noexcept {
    return std::find(states_.begin(), states_.end(), tensor_state::compute) != states_.end();
  }

  /** @brief A chunk's state, derived from its tensors @p tensors: COMPUTE if any is, else the
   *  lowest HOLD* state; FREE when the chunk has no payload (@p has_payload false) or no tensors. */
  [[nodiscard]] tensor_state chunk_state(std::span<const std::size_t> tensors, bool has_payload) const {
    if (!has_payload) return tensor_state::free;
    tensor_state best = tensor_state::free;
    for (auto t : tensors) {
      const auto s = states_.at(t);
      if (s == tensor_state::compute) return s;
      if (best == tensor_state::free || static_cast<int>(s) < static_cast<int>(best)) best = s;
    }
    return best;
  }

 private:
  std::span<const tensor_spec> specs_;
  std::vector<tensor_state> states_;
  std::vector<std::uint32_t> refs_;
};

}  // namespace chunkstar
