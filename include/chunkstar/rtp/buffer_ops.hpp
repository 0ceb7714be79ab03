// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `rtp::BufferOps`: how a rotation touches the memory of its shard buffers, and
 *         `rtp::host_buffer_ops`, for buffers in host memory.
 *
 *  A rotation fills, sums and copies shard buffers between shifts. On the host these are loops
 *  that finish before they return. On an accelerator the buffers are device memory: the operations
 *  are kernels or copies queued on the stream the user's kernels run on, and a shift (which the
 *  communicator runs on its own, and may read or write the buffers from the host) must not start
 *  before that stream has finished with the buffers it sends or overwrites. So an implementation
 *  gives, for buffers of `T`:
 *  - `zero(p, n)`, `add(acc, x, n)` (acc += x, element by element in index order, so a sum's bits
 *    do not depend on the memory it lives in), `copy(dst, src, n)`: queued or done at once;
 *  - `settle()`: returns once every operation queued so far, and every kernel the user queued on
 *    the same stream, has finished. A rotation calls it before each shift and before it returns
 *    from a pass that failed (quietly: the first exception is the one that propagates).
 *  - `host_memory`: whether the host may read the buffers directly (a rotation that owns its shard
 *    keeps it in a host vector, so it needs this; a rotation with an external shard does not).
 */
#pragma once

#include <algorithm>
#include <concepts>
#include <cstddef>

namespace chunkstar::rtp {

/** @brief What a rotation needs of the memory its shard buffers live in (see the file comment). */
template <class O, class T>
concept BufferOps = std::copy_constructible<O> && requires(O& o, T* p, const T* c, std::size_t n) {
  { O::host_memory } -> std::convertible_to<bool>;
  o.zero(p, n);
  o.add(p, c, n);
  o.copy(p, c, n);
  o.settle();
};

/** @brief Buffers in host memory: every operation is done when it returns; nothing to settle. */
template <std::floating_point T = float>
struct host_buffer_ops {
  static constexpr bool host_memory = true;
  void zero(T* p, std::size_t n) const noexcept { std::fill(p, p + n, T{}); }
  void add(T* acc, const T* x, std::size_t n) const noexcept {
    for (std::size_t i = 0; i < n; ++i) acc[i] += x[i];
  }
  void copy(T* dst, const T* src, std::size_t n) const noexcept { std::copy(src, src + n, dst); }
  void settle() const noexcept {}
};

static_assert(BufferOps<host_buffer_ops<float>, float>);

}  // namespace chunkstar::rtp
