// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `non_model_allocator`: non-model memory (activations, workspaces, staging) from the compute tier's space,
 *         making room by asking the caller, with the live total in the `compute_level` the placement budgets against.
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/units.hpp>
#include <chunkstar/memory/memory_space.hpp>
#include <chunkstar/store/compute_level.hpp>

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <utility>

namespace chunkstar {

/** @brief Allocates non-model memory from the compute tier's space, asking @p make_room (evict a
 *  chunk, retire a finished copy) until it fits, and keeps the live total. Mechanism only: what to
 *  evict is the caller's decision. Keeps the live total in the runtime's `compute_level`. */
template <MemorySpace Space>
class non_model_allocator {
 public:
  non_model_allocator(Space& space, compute_level& level) : space_(space), level_(level) {}

  /** @brief @p bytes aligned to @p alignment; while the space has no room, calls `make_room()`
   *  (→ bool: something was freed). @p who names the open scope in the error.
   *  @throws out_of_memory_error with @p report() when nothing more can be freed. */
  template <class MakeRoom, class Report>
  void* allocate(std::size_t bytes, std::size_t alignment, MakeRoom&& make_room, Report&& report,
                 std::string_view who) {
    void* p = space_.try_allocate(bytes, alignment);
    while (p == nullptr) {
      if (!make_room())
        throw out_of_memory_error(
            "cannot allocate " + format_bytes(bytes) + " of non-model memory on the compute tier" +
                (who.empty() ? std::string(" outside any scope") : " in scope '" + std::string(who) + "'") +
                ": every chunk there is in use. Give the device space more capacity, shrink the "
                "micro-batch, or use smaller chunks (fixed_layout_options::chunk_elems, "
                "searched_layout_options::max_chunk_elems)",
            bytes, report());
      p = space_.try_allocate(bytes, alignment);
    }
    level_.non_model += bytes;
    return p;
  }

  /** @brief Frees memory from allocate(). */
  void deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept {
    space_.deallocate(p, bytes, alignment);
    level_.non_model -= bytes;
  }

 private:
  Space& space_;
  compute_level& level_;
};

}  // namespace chunkstar
