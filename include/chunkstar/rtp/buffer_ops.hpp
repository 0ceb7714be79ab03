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
 *
 *  Shards may be 16-bit (`bfloat16`, `float16`: a model in mixed precision rotates half the
 *  bytes); their sums are done in float and rounded once per add. The kernels still see float:
 *  `WideningOps` adds `widen(float* dst, const T* src, n)`, `narrow(T* dst, const float* src, n)`
 *  (round to nearest even) and `accumulate(T* acc, const float* x, n)` (acc = round(acc + x)).
 */
#pragma once

#include <chunkstar/core/dtype.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <type_traits>

namespace chunkstar::rtp {

/** @brief What a shard's elements may be: float, or a 16-bit float computed in float. */
template <class T>
concept shard_element = is_element_type_v<T>;

/** @brief What a rotation needs of the memory its shard buffers live in (see the file comment). */
template <class O, class T>
concept BufferOps = std::copy_constructible<O> && requires(O& o, T* p, const T* c, std::size_t n) {
  { O::host_memory } -> std::convertible_to<bool>;
  o.zero(p, n);
  o.add(p, c, n);
  o.copy(p, c, n);
  o.settle();
};

/** @brief BufferOps for 16-bit shards of `T` that also convert to and from the kernels' floats
 *  (see the file comment). */
template <class O, class T>
concept WideningOps = BufferOps<O, T> && BufferOps<O, float> &&
    requires(O& o, float* f, const float* cf, T* p, const T* c, std::size_t n) {
  o.widen(f, c, n);
  o.narrow(p, cf, n);
  o.accumulate(p, cf, n);
};

/** @brief Buffers in host memory: every operation is done when it returns; nothing to settle.
 *  Works on every shard element type (@p T names the one a rotation is declared with). */
template <shard_element T = float>
struct host_buffer_ops {
  static constexpr bool host_memory = true;
  template <shard_element U>
  void zero(U* p, std::size_t n) const noexcept {
    std::fill(p, p + n, U{});
  }
  template <shard_element U>
  void add(U* acc, const U* x, std::size_t n) const noexcept {
    if constexpr (std::is_same_v<U, float>)
      for (std::size_t i = 0; i < n; ++i) acc[i] += x[i];
    else
      for (std::size_t i = 0; i < n; ++i) acc[i] = from_float<U>(to_float(acc[i]) + to_float(x[i]));
  }
  template <shard_element U>
  void copy(U* dst, const U* src, std::size_t n) const noexcept {
    std::copy(src, src + n, dst);
  }
  template <shard_element U>
  void widen(float* dst, const U* src, std::size_t n) const noexcept {
    for (std::size_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
  }
  template <shard_element U>
  void narrow(U* dst, const float* src, std::size_t n) const noexcept {
    for (std::size_t i = 0; i < n; ++i) dst[i] = from_float<U>(src[i]);
  }
  template <shard_element U>
  void accumulate(U* acc, const float* x, std::size_t n) const noexcept {
    for (std::size_t i = 0; i < n; ++i) acc[i] = from_float<U>(to_float(acc[i]) + x[i]);
  }
  void settle() const noexcept {}
};

static_assert(BufferOps<host_buffer_ops<float>, float>);
static_assert(WideningOps<host_buffer_ops<float>, bfloat16> && WideningOps<host_buffer_ops<float>, float16>);

}  // namespace chunkstar::rtp
