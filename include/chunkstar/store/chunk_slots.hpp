// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `chunk_slots`: the slot table of a chunk store — one slot per chunk of every list (its
 *         tier, payload, copies, pins, ticks) — with the logical byte counts decisions read
 *         (payload bytes per tier, device bytes outside payloads) and the stats' peaks they drive.
 *         `chunk_store` derives from it and adds the mechanics that change slots.
 */
#pragma once

#include <chunkstar/core/chunk_id.hpp>
#include <chunkstar/core/chunk_kind.hpp>
#include <chunkstar/core/tier.hpp>
#include <chunkstar/layout/chunk_layout.hpp>
#include <chunkstar/memory/copy_engine.hpp>
#include <chunkstar/memory/platform.hpp>
#include <chunkstar/observe/runtime_stats.hpp>
#include <chunkstar/store/lower_tier.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace chunkstar {

/** @brief The slots and counters of the chunks of a runtime on platform @p P. */
template <Platform P>
class chunk_slots {
 public:
  using device_space_type = typename P::device_space;
  using copy_engine_type = typename P::copy_engine;
  using copy_handle =
      decltype(std::declval<copy_engine_type&>().copy_async(nullptr, nullptr, 0, copy_direction::to_device));

  /** @brief One chunk. `last_use` / `loaded_at` are ticks (see eviction_candidate). */
  struct slot {
    tier where = tier::free;               ///< logical tier; decisions use only logical state
    void* data = nullptr;                  ///< payload in `where` (valid once `pending` is ready)
    std::optional<copy_handle> pending;    ///< the copy (or zero fill) into `data`, until seen complete
    std::optional<copy_handle> user_done;  ///< the user's work on this payload (scope closed on a stream)
    std::size_t last_use = 0;              ///< LRU tick of the latest access
    std::size_t loaded_at = 0;             ///< tick of its arrival on its tier
    std::uint32_t pinned = 0;              ///< open scopes / steps / collectives using it: never moves while > 0
    bool prefetched = false;               ///< loaded ahead of its use and not used since
    int owner = 0;                         ///< the rank that owns it (ZeRO)
    void* group = nullptr;                 ///< the group buffer its payload lives in (ZeRO), or null: its own
    using disk_move = lower_move;
    std::optional<lower_move> disk_pending;  ///< a copy to or from the lower tier, until resolved
  };

  chunk_slots(device_space_type& device, std::size_t alignment, runtime_stats& stats)
      : device_(device), alignment_(alignment), stats_(stats) {}

  /** @brief Creates the slots of @p lists (all FREE); chunk c is owned by rank c mod @p world. */
  void build(std::span<const chunk_list_desc> lists, int world) {
    for (const auto& d : lists) {
      auto& l = lists_[static_cast<std::size_t>(d.kind)];
      l.present = true;
      l.desc = d;
      l.chunks.resize(d.num_chunks);
      for (std::size_t c = 0; c < d.num_chunks; ++c)
        l.chunks[c].owner = static_cast<int>(c % static_cast<std::size_t>(world));
      num_chunks_ = d.num_chunks;
    }
  }
  /** @brief Bytes a payload of @p bytes occupies on tier @p t: with a lower tier, host and disk
   *  payloads are whole 4 KiB blocks (O_DIRECT moves whole blocks, so a chunk's last block needs no
   *  read-modify-write); what resident() counts. */
  [[nodiscard]] std::size_t footprint(tier t, std::size_t bytes) const noexcept {
    const std::size_t b = std::max<std::size_t>(alignment_, 4096);
    return !whole_blocks_ || t == tier::device ? bytes : (bytes + b - 1) / b * b;
  }
  [[nodiscard]] bool has(chunk_kind k) const noexcept { return lists_[static_cast<std::size_t>(k)].present; }
  [[nodiscard]] const chunk_list_desc& desc(chunk_kind k) const { return lists_[static_cast<std::size_t>(k)].desc; }
  [[nodiscard]] std::size_t bytes_of(chunk_kind k) const { return desc(k).chunk_bytes; }
  [[nodiscard]] std::size_t num_chunks() const noexcept { return num_chunks_; }
  [[nodiscard]] slot& at(chunk_id id) { return lists_[static_cast<std::size_t>(id.kind)].chunks.at(id.index); }
  [[nodiscard]] const slot& at(chunk_id id) const {
    return lists_[static_cast<std::size_t>(id.kind)].chunks.at(id.index);
  }
  /** @brief Calls `f(chunk_id, slot&)` for every chunk of every list, kinds in enum order. */
  template <class F>
  void for_each(F&& f) {
    for_each_in(*this, f);
  }
  template <class F>
  void for_each(F&& f) const {
    for_each_in(*this, f);
  }
  /** @brief Bytes of every list's chunks (what device + host hold). */
  [[nodiscard]] std::size_t model_bytes() const noexcept {
    std::size_t b = 0;
    for (const auto& l : lists_)
      if (l.present && !l.desc.aliases_param) b += l.desc.chunk_bytes * l.desc.num_chunks;
    return b;
  }

  /** @brief Logical chunk payload bytes on tier @p t (a payload with a copy in flight counts where it goes). */
  [[nodiscard]] std::size_t resident(tier t) const noexcept { return resident_[static_cast<std::size_t>(t)]; }
  /** @brief Bytes on the device outside chunk payloads: scratch and unused group positions. */
  [[nodiscard]] std::size_t unslotted() const noexcept { return unslotted_; }
  /** @brief What the chunk budget governs on the device: payloads plus collective buffers. */
  [[nodiscard]] std::size_t device_in_use() const noexcept { return resident(tier::device) + unslotted_; }
  /** @brief A new tick (accesses and arrivals share it, so ticks order events). */
  std::size_t tick() noexcept { return ++tick_; }
  [[nodiscard]] std::size_t current_tick() const noexcept { return tick_; }
  /** @brief Chunk @p id is used now (LRU). */
  void touch(chunk_id id) { at(id).last_use = tick(); }
  void pin(chunk_id id) { ++at(id).pinned; }
  void unpin(chunk_id id) noexcept { --lists_[static_cast<std::size_t>(id.kind)].chunks[id.index].pinned; }

  /** @brief Zeroes the stats' counters; the peaks restart from the current levels (@p non_model:
   *  the non-model bytes live now). */
  void reset_stats(std::size_t non_model) noexcept {
    stats_ = {};
    stats_.peak_non_model_bytes = non_model;
    restart_peaks();
  }
  /** @brief Restarts the chunk and device peaks of the stats from the current levels. */
  void restart_peaks() noexcept {
    stats_.peak_device_bytes = device_.used();
    stats_.peak_device_chunk_bytes = resident(tier::device);
    stats_.peak_host_chunk_bytes = resident(tier::host);
    stats_.peak_disk_chunk_bytes = resident(tier::disk);
    stats_.peak_model_bytes = resident(tier::device) + resident(tier::host) + unslotted_;
    stats_.peak_collective_bytes = 0;
    note_model_peak();
  }
  /** @brief Records the device space's use in `peak_device_bytes` (call after allocating from it). */
  void note_device_peak() noexcept { stats_.peak_device_bytes = std::max(stats_.peak_device_bytes, device_.used()); }
  [[nodiscard]] runtime_stats& stats() noexcept { return stats_; }
  [[nodiscard]] const runtime_stats& stats() const noexcept { return stats_; }

 protected:
  /** Adds (@p sign > 0) or removes chunk payload @p bytes on tier @p t, and moves the peaks. */
  void count(tier t, std::size_t bytes, int sign) noexcept {
    bytes = footprint(t, bytes);
    auto& r = resident_[static_cast<std::size_t>(t)];
    r = sign > 0 ? r + bytes : r - bytes;
    stats_.peak_device_chunk_bytes = std::max(stats_.peak_device_chunk_bytes, resident(tier::device));
    stats_.peak_host_chunk_bytes = std::max(stats_.peak_host_chunk_bytes, resident(tier::host));
    stats_.peak_disk_chunk_bytes = std::max(stats_.peak_disk_chunk_bytes, resident(tier::disk));
    note_device_peak();
    note_model_peak();
  }
  void note_model_peak() noexcept {
    stats_.peak_collective_bytes = std::max(stats_.peak_collective_bytes, collective_);
    stats_.peak_model_bytes =
        std::max(stats_.peak_model_bytes, resident(tier::device) + resident(tier::host) + unslotted_);
  }
  /** The id of slot @p s (slots live in the lists' vectors). */
  [[nodiscard]] chunk_id id_of(const slot& s) const noexcept {
    for (std::size_t k = 0; k < num_chunk_kinds; ++k) {
      const auto& v = lists_[k].chunks;
      if (!v.empty() && &s >= v.data() && &s < v.data() + v.size())
        return {static_cast<chunk_kind>(k), static_cast<std::uint32_t>(&s - v.data())};
    }
    return {};
  }

  struct list {
    bool present = false;
    chunk_list_desc desc;
    std::vector<slot> chunks;
  };
  device_space_type& device_;
  std::size_t alignment_;
  runtime_stats& stats_;
  std::array<list, num_chunk_kinds> lists_;
  std::array<std::size_t, num_tiers> resident_{};
  std::size_t unslotted_ = 0;   // device bytes outside payloads: scratch, unused group positions
  std::size_t collective_ = 0;  // bytes of unslotted buffers no chunk owns (group buffers, scratch)
  bool whole_blocks_ = false;   // a lower tier is attached: host and disk payloads are whole blocks
  std::size_t num_chunks_ = 0;
  std::size_t tick_ = 0;

 private:
  template <class Self, class F>
  static void for_each_in(Self& self, F& f) {
    for (std::size_t k = 0; k < num_chunk_kinds; ++k) {
      if (!self.lists_[k].present) continue;
      for (std::uint32_t c = 0; c < self.lists_[k].chunks.size(); ++c)
        f(chunk_id{static_cast<chunk_kind>(k), c}, self.lists_[k].chunks[c]);
    }
  }
};

}  // namespace chunkstar
