// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `group_buffers`: ZeRO's collective buffers on the device — several chunks' payloads in one
 *         contiguous buffer a collective reads or writes at once, and scratch buffers outside any
 *         chunk — built on the chunk store's unslotted buffers (allocate_unslotted, place, unplace).
 *
 *  Every buffer is counted by the store (unslotted, collective), so the budget and the memory
 *  report see it. The destructor gives back what is still attached and never throws.
 */
#pragma once

#include <chunkstar/core/chunk_id.hpp>
#include <chunkstar/core/error.hpp>
#include <chunkstar/core/tier.hpp>
#include <chunkstar/core/units.hpp>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace chunkstar {

/** @brief The group and scratch buffers of @p Store (a chunk_store) in use. */
template <class Store>
class group_buffers {
 public:
  explicit group_buffers(Store& store) noexcept : store_(store) {}
  group_buffers(const group_buffers&) = delete;
  group_buffers& operator=(const group_buffers&) = delete;
  ~group_buffers() {
    try {
      if (!groups_.empty()) store_.copier().synchronize();  // no collective still reads them
    } catch (...) {                                         // freed anyway: a failed copy is reported by its handle
    }
    while (!groups_.empty()) detach(groups_.back().base, tier::free);
  }

  /** @brief Gives @p members (chunks without a payload: FREE or remote) payloads inside one new
   *  device buffer of @p positions chunk-sized positions, member i at position @p at_position[i].
   *  Members are pinned until detach; positions without a member are counted as scratch.
   *  Zero-filled when @p zero. @return the buffer. @throws out_of_memory_error (nothing changed)
   *  when the device has no room. */
  void* attach(std::span<const chunk_id> members, std::span<const std::size_t> at_position, std::size_t positions,
               bool zero) {
    const std::size_t b = store_.bytes_of(members.front().kind), total = positions * b;
    groups_.reserve(groups_.size() + 1);
    group g{nullptr, total, std::vector<chunk_id>(members.begin(), members.end())};
    g.base = store_.allocate_unslotted(total);
    if (g.base == nullptr)
      throw out_of_memory_error("no room on the device for a group of " + std::to_string(positions) + " chunks (" +
                                    format_bytes(total) +
                                    ") to gather or reduce: raise the device space's capacity, or use smaller chunks",
                                total, store_.report());
    if (zero) {
      if constexpr (Store::device_is_host_accessible) {
        std::memset(g.base, 0, total);
      } else {
        try {
          store_.copier().zero_async(g.base, total).wait();
        } catch (...) {
          store_.free_unslotted(g.base, total);
          throw;
        }
      }
    }
    for (std::size_t i = 0; i < members.size(); ++i) {
      store_.place(members[i], static_cast<std::byte*>(g.base) + at_position[i] * b);
      store_.at(members[i]).group = g.base;
      store_.pin(members[i]);
    }
    groups_.push_back(std::move(g));
    return groups_.back().base;
  }

  /** @brief Ends the group buffer @p base: its members become @p after (remote, or free), lose
   *  their pin, and the buffer is freed. */
  void detach(void* base, tier after) noexcept {
    const auto it = find(base);
    if (it == groups_.end()) return;
    for (auto id : it->members) {
      store_.unplace(id, after);
      store_.at(id).group = nullptr;
      store_.unpin(id);
    }
    store_.free_unslotted(base, it->bytes);
    groups_.erase(it);
  }

  /** @brief Ends the one-chunk group buffer @p base (one member at position 0) by making it that
   *  member's own device payload: it stays on the device, unpinned, outside any group. */
  void ungroup(void* base) noexcept {
    const auto it = find(base);
    if (it == groups_.end() || it->members.size() != 1 || it->bytes != store_.bytes_of(it->members.front().kind))
      return;
    const chunk_id id = it->members.front();
    store_.own(id);
    store_.at(id).group = nullptr;
    store_.unpin(id);
    groups_.erase(it);
  }

  /** @brief A device buffer outside any chunk (a collective's receive buffer), counted as scratch
   *  until free_scratch or adopt. @throws out_of_memory_error when there is no room. */
  void* allocate_scratch(std::size_t bytes) {
    void* p = store_.allocate_unslotted(bytes);
    if (p == nullptr)
      throw out_of_memory_error("no room on the device for " + format_bytes(bytes) + " of collective buffers", bytes,
                                store_.report());
    return p;
  }
  void free_scratch(void* p, std::size_t bytes) noexcept { store_.free_unslotted(p, bytes); }
  /** @brief Makes scratch buffer @p p (chunk-sized) chunk @p id's own device payload; @p id must
   *  have none. */
  void adopt(chunk_id id, void* p) noexcept {
    store_.own(id);  // first: the peaks never count it as both collective and a payload
    store_.place(id, p);
  }

 private:
  struct group {
    void* base = nullptr;
    std::size_t bytes = 0;
    std::vector<chunk_id> members;
  };
  auto find(void* base) {
    return std::find_if(groups_.begin(), groups_.end(), [&](const group& g) { return g.base == base; });
  }

  Store& store_;
  std::vector<group> groups_;  // group buffers in use
};

}  // namespace chunkstar
