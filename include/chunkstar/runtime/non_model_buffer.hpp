// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `non_model_buffer`: the RAII handle a user holds non-model memory on the compute tier by (from a runtime's
 *         `allocate_buffer<T>(count)`).
 */
#pragma once

#include <cstddef>
#include <span>
#include <utility>

namespace chunkstar {

/** @brief A block of non-model memory on the compute tier, freed on destruction (or `reset()`).
 *  Obtained from a runtime's `allocate_buffer<T>(count)`; valid on the compute tier for work on
 *  the runtime's stream contract (see `chunk_runtime::scope`). Move-only. @tparam Runtime any
 *  runtime with `deallocate_non_model(void*, bytes, alignment)`. On a device the host does not
 *  wait for (CUDA), destroy or `reset()` it only once the kernels that use it are done: the
 *  runtime may hand the memory to an arriving chunk at once. */
template <class T, class Runtime>
class non_model_buffer {
 public:
  non_model_buffer() = default;
  non_model_buffer(Runtime& rt, std::size_t count, std::size_t alignment = 64)
      : rt_(&rt),
        count_(count),
        alignment_(alignment),
        data_(static_cast<T*>(rt.allocate_non_model(count * sizeof(T), alignment))) {}
  non_model_buffer(non_model_buffer&& o) noexcept
      : rt_(std::exchange(o.rt_, nullptr)),
        count_(std::exchange(o.count_, 0)),
        alignment_(o.alignment_),
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

}  // namespace chunkstar
