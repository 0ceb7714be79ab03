// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `retiring_buffers`: the payload buffers a chunk left behind that a copy in flight (or the
 *         user's work) still reads, oldest first; each is freed once what reads it is done. A load
 *         may take one over instead (the chunk store's buffer reuse), ordered after its copy.
 */
#pragma once

#include <chunkstar/core/tier.hpp>

#include <cstddef>
#include <utility>
#include <vector>

namespace chunkstar {

/** @brief Buffers still read by work that completes through @p Handle (a copy handle). */
template <class Handle>
class retiring_buffers {
 public:
  struct entry {
    Handle done;
    void* buffer = nullptr;  // null once a load took it over
    tier where = tier::free;
    std::size_t bytes = 0;
    double submitted_us = 0;
    bool user = false;  // `done` is the user's work, not a copy
  };

  /** @brief Room for @p n more, so that add() after it cannot throw. */
  void reserve(std::size_t n) { v_.reserve(v_.size() + n); }
  void add(entry e) { v_.push_back(std::move(e)); }
  [[nodiscard]] std::size_t size() const noexcept { return v_.size(); }

  /** @brief Bytes on tier @p t still read, each as @p footprint(t, bytes) counts it. */
  template <class Footprint>
  [[nodiscard]] std::size_t bytes_on(tier t, Footprint footprint) const noexcept {
    std::size_t b = 0;
    for (const auto& r : v_)
      if (r.buffer != nullptr && r.where == t) b += footprint(t, r.bytes);
    return b;
  }
  /** @brief The oldest entry still holding a buffer on @p t (of @p bytes, when not 0), or null. */
  [[nodiscard]] entry* oldest_on(tier t, std::size_t bytes = 0) noexcept {
    for (auto& r : v_)
      if (r.buffer != nullptr && r.where == t && (bytes == 0 || r.bytes == bytes)) return &r;
    return nullptr;
  }
  /** @brief Calls @p release(entry&) for every entry whose reader is done, and forgets it; never waits. */
  template <class Release>
  void release_done(Release release) {
    std::erase_if(v_, [&](entry& r) {
      if (!r.done.ready()) return false;
      release(r);
      return true;
    });
  }
  /** @brief Waits for the user's work (copies were waited for by the caller) and releases them all. */
  template <class Release>
  void drain(Release release) noexcept {
    for (auto& r : v_) {
      try {
        if (r.user) r.done.wait();
      } catch (...) {  // freed anyway: the work's failure is the user's to see
      }
      release(r);
    }
    v_.clear();
  }

 private:
  std::vector<entry> v_;
};

}  // namespace chunkstar
