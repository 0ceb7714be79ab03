// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `chunk_pins`: a set of chunks pinned for its lifetime (a scope, a step's chunk index, a
 *         collective), so an exception on the way out can never leave a chunk pinned.
 */
#pragma once

#include <chunkstar/core/chunk_id.hpp>

#include <span>
#include <utility>
#include <vector>

namespace chunkstar {

/** @brief Pins @p ids in @p Store (its `pin` / `unpin`) until destroyed or reset. Move-only. */
template <class Store>
class chunk_pins {
 public:
  chunk_pins() = default;
  chunk_pins(Store& store, std::vector<chunk_id> ids) : store_(&store), ids_(std::move(ids)) {
    for (auto id : ids_) store_->pin(id);
  }
  chunk_pins(chunk_pins&& o) noexcept : store_(std::exchange(o.store_, nullptr)), ids_(std::move(o.ids_)) {}
  chunk_pins& operator=(chunk_pins&& o) noexcept {
    if (this != &o) {
      reset();
      store_ = std::exchange(o.store_, nullptr);
      ids_ = std::move(o.ids_);
    }
    return *this;
  }
  ~chunk_pins() { reset(); }
  void reset() noexcept {
    if (store_)
      for (auto id : ids_) store_->unpin(id);
    store_ = nullptr;
  }
  [[nodiscard]] std::span<const chunk_id> ids() const noexcept { return ids_; }

 private:
  Store* store_ = nullptr;
  std::vector<chunk_id> ids_;
};

}  // namespace chunkstar
