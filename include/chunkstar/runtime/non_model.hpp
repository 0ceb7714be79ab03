// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Non-model memory on the compute tier — activations, workspaces, staging — allocated
 *         through the runtime so that its accounting and the tracer see it (the "tide" the
 *         placement budgets against), and `non_model_buffer`, the RAII handle users hold it by.
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/units.hpp>
#include <chunkstar/memory/memory_space.hpp>

#include <chunkstar/runtime/chunk_id.hpp>

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <utility>

namespace chunkstar {

/** @brief What the compute tier holds beside chunks, and where the iteration is: the inputs of
 *  every budget. Written by the non-model allocator (the first two) and the runtime. */
struct compute_level {
  std::size_t non_model = 0;     ///< non-model bytes live now
  std::size_t changes = 0;       ///< non-model changes in the current moment
  bool untraced = false;         ///< inside an untraced section: no trace answers
  moment_kind kind = moment_kind::forward;  ///< the current moment's kind
  std::size_t releasing = never; ///< chunk index whose gradient the current moment (a step) frees at its end
  bool sharded = false;          ///< ZeRO: gradients live in group buffers, never zero-filled chunk by chunk
};

/** @brief A block of non-model memory on the compute tier, freed on destruction (or `reset()`).
 *  Obtained from a runtime's `allocate_buffer<T>(count)`; valid on the compute tier for work on
 *  the runtime's stream contract (see `chunk_runtime::scope`). Move-only. @tparam Runtime any
 *  runtime with `deallocate_non_model(void*, bytes, alignment)`. */
template <class T, class Runtime>
class non_model_buffer {
 public:
  non_model_buffer() = default;
  non_model_buffer(Runtime& rt, std::size_t count, std::size_t alignment = 64)
      : rt_(&rt), count_(count), alignment_(alignment),
        data_(static_cast<T*>(rt.allocate_non_model(count * sizeof(T), alignment))) {}
  non_model_buffer(non_model_buffer&& o) noexcept
      : rt_(std::exchange(o.rt_, nullptr)), count_(std::exchange(o.count_, 0)), alignment_(o.alignment_),
        data_(std::exchange(o.data_, nullptr)) {}
  non_model_buffer& operator=(non_model_buffer&& o) noexcept {
    if (this != &o) {
      reset();
      rt_ = std::exchange(o.rt_, nullptr);
      count_ = std::exchange(o.count_, 0);
      alignment_ = o.alignment_;
      data_ = std::exchange(o.data_, nullptr);
    }
    return *this;
  }
  non_model_buffer(const non_model_buffer&) = delete;
  non_model_buffer& operator=(const non_model_buffer&) = delete;
  ~non_model_buffer() { reset(); }

  /** @brief Frees the block now (the budget of the rest of the moment may rise). */
  void reset() noexcept {
    if (data_ != nullptr) rt_->deallocate_non_model(data_, count_ * sizeof(T), alignment_);
    data_ = nullptr;
    count_ = 0;
  }
  [[nodiscard]] T* data() const noexcept { return data_; }
  [[nodiscard]] std::size_t size() const noexcept { return count_; }
  [[nodiscard]] std::span<T> span() const noexcept { return {data_, count_}; }
  [[nodiscard]] explicit operator bool() const noexcept { return data_ != nullptr; }

 private:
  Runtime* rt_ = nullptr;
  std::size_t count_ = 0;
  std::size_t alignment_ = 64;
  T* data_ = nullptr;
};

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
  void* allocate(std::size_t bytes, std::size_t alignment, MakeRoom&& make_room, Report&& report, std::string_view who) {
    void* p = space_.try_allocate(bytes, alignment);
    while (p == nullptr) {
      if (!make_room())
        throw out_of_memory_error("cannot allocate " + format_bytes(bytes) + " of non-model memory on the compute tier" +
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
