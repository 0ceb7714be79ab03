// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `tensor_state` and the state machine that drives it (PatrickStar's tensor states).
 */
#pragma once

#include <chunkstar/core/error.hpp>

#include <cstdint>
#include <string>
#include <string_view>

namespace chunkstar {

/** @brief A tensor's state; a chunk's state is derived from its tensors' (PatrickStar's model).
 *  COMPUTE: in use by an open scope, the chunk must not move. HOLD*: may move, must not be freed.
 *  FREE: no payload needed (a gradient before its first backward use). */
enum class tensor_state : std::uint8_t { free, compute, hold, hold_after_fwd, hold_after_bwd };

constexpr std::string_view tensor_state_name(tensor_state s) noexcept {
  switch (s) {
    case tensor_state::free: return "FREE";
    case tensor_state::compute: return "COMPUTE";
    case tensor_state::hold: return "HOLD";
    case tensor_state::hold_after_fwd: return "HOLD_AFTER_FWD";
    case tensor_state::hold_after_bwd: return "HOLD_AFTER_BWD";
  }
  return "?";
}

/** @brief The events that drive tensor states. */
enum class tensor_event : std::uint8_t { open_scope, close_forward, close_backward, end_iteration, release };

/** @brief The state machine: the state after @p e in state @p s, or a state_error naming the
 *  tensor and both states when the transition is illegal.
 *  open_scope:     FREE, HOLD, HOLD_AFTER_FWD, HOLD_AFTER_BWD -> COMPUTE
 *  close_forward:  COMPUTE -> HOLD_AFTER_FWD;  close_backward: COMPUTE -> HOLD_AFTER_BWD
 *  end_iteration:  HOLD, HOLD_AFTER_FWD, HOLD_AFTER_BWD, FREE -> HOLD (FREE stays FREE)
 *  release:        HOLD* -> FREE (payload dropped: a gradient after the step, a remote shard) */
inline tensor_state transition(tensor_state s, tensor_event e, std::string_view tensor_name = {}) {
  auto illegal = [&]() -> tensor_state {
    static constexpr std::string_view events[] = {"open a scope", "close a forward scope", "close a backward scope",
                                                  "end the iteration", "release"};
    throw state_error(
        "cannot " + std::string(events[static_cast<int>(e)]) + " for tensor '" + std::string(tensor_name) +
        "' in state " + std::string(tensor_state_name(s)) +
        (s == tensor_state::compute ? ": close the scope that uses it first" : ": open a scope on it first"));
  };
  switch (e) {
    case tensor_event::open_scope: return s == tensor_state::compute ? illegal() : tensor_state::compute;
    case tensor_event::close_forward: return s == tensor_state::compute ? tensor_state::hold_after_fwd : illegal();
    case tensor_event::close_backward: return s == tensor_state::compute ? tensor_state::hold_after_bwd : illegal();
    case tensor_event::end_iteration:
      return s == tensor_state::compute ? illegal() : s == tensor_state::free ? tensor_state::free : tensor_state::hold;
    case tensor_event::release: return s == tensor_state::compute ? illegal() : tensor_state::free;
  }
  return illegal();
}

}  // namespace chunkstar
