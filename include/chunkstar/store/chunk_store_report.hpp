// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief What a chunk store reports of itself, from its public state only: the memory report that
 *         out-of-memory errors carry (`chunk_store_report`) and the bookkeeping audit
 *         (`chunk_store_violations`, behind chunk_runtime::invariant_violations).
 */
#pragma once

#include <chunkstar/core/chunk_id.hpp>
#include <chunkstar/core/memory_report.hpp>
#include <chunkstar/core/tier.hpp>

#include <array>
#include <cstddef>
#include <string>
#include <vector>

namespace chunkstar {

/** @brief The spaces of @p s and its payloads on each tier, with the buffers copies and collectives hold. */
template <class Store>
[[nodiscard]] memory_report chunk_store_report(const Store& s) {
  memory_report r;
  const auto& st = s.stats();
  const auto* lower = s.lower();
  r.spaces.push_back(s.device().usage());
  r.spaces.push_back(s.host().usage());
  if (lower) r.spaces.push_back(lower->space().usage());
  r.spaces.push_back(
      {"chunk payloads on device", s.device().capacity(), s.resident(tier::device), st.peak_device_chunk_bytes, 0});
  r.spaces.push_back(
      {"chunk payloads on host", s.host().capacity(), s.resident(tier::host), st.peak_host_chunk_bytes, 0});
  if (lower)
    r.spaces.push_back(
        {"chunk payloads on disk", s.disk_capacity(), s.resident(tier::disk), st.peak_disk_chunk_bytes, 0});
  if (const auto b = s.retiring(tier::device))
    r.spaces.push_back({"buffers in-flight copies read", s.device().capacity(), b, b, 0});
  if (const auto u = s.unslotted())
    r.spaces.push_back({"collective buffers on device (ZeRO)", s.device().capacity(), u, u, 0});
  return r;
}

/** @brief What is wrong with @p s's bookkeeping (empty: nothing). @p pins_allowed: scopes or a step
 *  are open, so chunks may be pinned; @p sole_user: nothing else allocates from the device space,
 *  so its use must equal what the store accounts for (no leak). */
template <class Store>
[[nodiscard]] std::vector<std::string> chunk_store_violations(const Store& s, bool pins_allowed, std::size_t non_model,
                                                              bool sole_user) {
  std::vector<std::string> v;
  std::array<std::size_t, num_tiers> sum{};
  s.for_each([&](chunk_id id, const auto& c) {
    if (holds_payload(c.where) != (c.data != nullptr)) v.push_back(to_string(id) + ": payload and tier disagree");
    if (holds_payload(c.where)) sum[static_cast<std::size_t>(c.where)] += s.footprint(c.where, s.bytes_of(id.kind));
    if (c.pinned > (c.group ? 1u : 0u) && !pins_allowed)
      v.push_back(to_string(id) + " is pinned with no scope or step open");
  });
  for (auto t : {tier::device, tier::host, tier::disk})
    if (sum[static_cast<std::size_t>(t)] != s.resident(t))
      v.push_back("resident bytes on the " + std::string(tier_name(t)) + " disagree with the slots");
  const std::size_t used = s.device().used(),
                    accounted = s.resident(tier::device) + s.retiring(tier::device) + s.unslotted() + non_model;
  if (used < accounted || (sole_user && used != accounted))
    v.push_back("the device space holds " + std::to_string(used) + " bytes, the runtime accounts for " +
                std::to_string(accounted));
  return v;
}

}  // namespace chunkstar
