// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Vocabulary shared by the runtime and its policies: chunk ids, tiers, moments, tensor states.
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/layout/chunk_layout.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <string_view>

namespace chunkstar {

/** @brief One chunk of one parallel list. */
struct chunk_id {
  chunk_kind kind = chunk_kind::param;
  std::uint32_t index = 0;
  // Written out rather than defaulted: nvcc 13 leaves defaulted friend comparisons undefined at link time.
  friend constexpr bool operator==(const chunk_id& a, const chunk_id& b) noexcept {
    return a.kind == b.kind && a.index == b.index;
  }
  friend constexpr bool operator<(const chunk_id& a, const chunk_id& b) noexcept {
    return a.kind != b.kind ? a.kind < b.kind : a.index < b.index;
  }
};

/** @brief "param#3". */
inline std::string to_string(chunk_id c) { return std::string(chunk_kind_name(c.kind)) + "#" + std::to_string(c.index); }

/** @brief Where a chunk's payload lives.
 *  - `free`: no payload yet, or dropped (a gradient before its first backward use, or after the
 *    step); reading it is reading zeros.
 *  - `remote`: this rank holds no payload, another rank does (ZeRO: a parameter chunk of another
 *    owner between uses); reading it needs a gather, it is never zeros.
 *  - `device`, `host`, `disk`: the payload is in that tier's memory space. */
enum class tier : std::uint8_t { free, remote, device, host, disk };

/** @brief Number of `tier` values, for per-tier arrays. */
inline constexpr std::size_t num_tiers = 5;

constexpr std::string_view tier_name(tier t) noexcept {
  switch (t) {
    case tier::free: return "free";
    case tier::remote: return "remote";
    case tier::device: return "device";
    case tier::host: return "host";
    case tier::disk: return "disk";
  }
  return "?";
}

/** @brief True for the tiers that hold a payload in a memory space of this rank. */
constexpr bool holds_payload(tier t) noexcept { return t == tier::device || t == tier::host || t == tier::disk; }

/** @brief What a moment is: an access scope in forward or backward, or the optimizer step. */
enum class moment_kind : std::uint8_t { forward, backward, optimizer };

constexpr std::string_view moment_kind_name(moment_kind k) noexcept {
  switch (k) {
    case moment_kind::forward: return "forward";
    case moment_kind::backward: return "backward";
    case moment_kind::optimizer: return "optimizer";
  }
  return "?";
}

/** @brief "Never used again" for next-use distances. */
inline constexpr std::size_t never = std::numeric_limits<std::size_t>::max();

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
    throw state_error("cannot " + std::string(events[static_cast<int>(e)]) + " for tensor '" + std::string(tensor_name) +
                      "' in state " + std::string(tensor_state_name(s)) +
                      (s == tensor_state::compute ? ": close the scope that uses it first"
                                                  : ": open a scope on it first"));
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

template <>
struct std::hash<chunkstar::chunk_id> {
  std::size_t operator()(const chunkstar::chunk_id& c) const noexcept {
    return (static_cast<std::size_t>(c.index) << 3) ^ static_cast<std::size_t>(c.kind);
  }
};
