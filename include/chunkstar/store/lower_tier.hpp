// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `lower_tier`: how a tier below the host (the disk) joins the chunk store's moves. The
 *         store keeps the slots, the residency counters and the device/host copies; a lower tier
 *         keeps its space and the copies between the host and itself, and the store calls it
 *         whenever a move, a wait or a retirement touches a chunk that is or was below the host.
 *
 *  Virtual because a lower-tier copy moves a whole chunk (MiBs) and costs a system call: one
 *  indirect call per move is nothing beside it, and the store's type does not change with the tier.
 *
 *  The contract that keeps the store's strong guarantee: a copy into or out of the lower tier keeps
 *  the payload it reads (`lower_move::source`, on `from`) until the copy is known to have succeeded
 *  (resolve); a failed copy puts the chunk back on `from` with its bytes, so a throw never loses a
 *  chunk or leaks a buffer.
 */
#pragma once

#include <chunkstar/core/chunk_id.hpp>
#include <chunkstar/core/tier.hpp>
#include <chunkstar/disk/disk_tier.hpp>
#include <chunkstar/memory/copy_engine.hpp>
#include <chunkstar/memory/memory_space.hpp>

#include <cstddef>
#include <string>

namespace chunkstar {

/** @brief A copy between the host and a lower tier into a chunk's payload, with the payload it
 *  reads (`source` on `from`), held until the copy succeeded (a slot's `disk_pending`). */
struct lower_move {
  disk_copy_handle done;
  void* source = nullptr;
  tier from = tier::free;
  double submitted_us = 0;
};

/** @brief A tier below the host (tier::disk), exchanging chunks with the host only. */
class lower_tier {
 public:
  virtual ~lower_tier() = default;

  /** @brief Where payloads on this tier are allocated. */
  [[nodiscard]] virtual memory_space_ref space() const noexcept = 0;
  /** @brief Starts moving chunk @p id's payload between the host and this tier (@p to: this tier
   *  or the host); the chunk's slot records the copy (`disk_pending`). Strong guarantee. */
  virtual void move(chunk_id id, tier to) = 0;
  /** @brief Ends chunk @p id's copy, waiting for it: on success the payload it read is freed; on
   *  failure the chunk is back on that payload and the error is rethrown naming it. */
  virtual void resolve(chunk_id id) = 0;
  /** @brief Resolves one copy still reading a payload on tier @p t; false when there is none. */
  virtual bool resolve_one(tier t) = 0;
  /** @brief Bytes on tier @p t that this tier's copies in flight still read. */
  [[nodiscard]] virtual std::size_t retiring(tier t) const noexcept = 0;
  /** @brief Ends chunk @p id's copy for a payload being dropped: waits, ignores a failure, frees
   *  the payload it read. */
  virtual void discard(chunk_id id) noexcept = 0;
  /** @brief Waits for every copy and frees every payload they read (the store is going away). */
  virtual void drain() noexcept = 0;
  /** @brief Zeroes @p n bytes at @p p on this tier, waiting. */
  virtual void zero(void* p, std::size_t n) = 0;
  /** @brief Why the host has no room for a chunk although this tier may (for an out-of-memory error). */
  [[nodiscard]] virtual std::string why_host_full() const = 0;
  /** @brief Copies @p n bytes between host memory and this tier, waiting (`to_host`: a write to
   *  this tier, `to_device`: a read, as the disk engines define them). */
  virtual void copy(void* dst, const void* src, std::size_t n, copy_direction d) = 0;
};

}  // namespace chunkstar
