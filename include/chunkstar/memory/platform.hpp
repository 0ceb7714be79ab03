// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief The `Platform` concept: the memory back-end a runtime runs on — its compute (device)
 *         space, its host space, the copy engine between them, and the stream type through which
 *         user work on the compute tier is handed back to the runtime (the stream contract).
 *
 *  Models: `simulated_platform` (here), `cuda::cuda_platform` (chunkstar/cuda/cuda_platform.hpp).
 */
#pragma once

#include <chunkstar/memory/copy_engine.hpp>
#include <chunkstar/memory/host_copy_engine.hpp>
#include <chunkstar/memory/host_space.hpp>
#include <chunkstar/memory/memory_space.hpp>
#include <chunkstar/memory/simulated_device_space.hpp>

#include <concepts>
#include <type_traits>
#include <utility>

namespace chunkstar {

/** @brief The `Platform` concept.
 *
 *  Required, for `P` a platform type, `e` a `typename P::copy_engine&` and `s` a
 *  `const typename P::stream_type&`:
 *  1. `P::device_space`, `P::host_space`: `MemorySpace`s (the compute tier and the host tier).
 *  2. `P::copy_engine`: a `CopyEngine` between them.
 *  3. `P::stream_type`: where user work on compute-tier memory runs (`host_stream` on CPU platforms,
 *     `cudaStream_t` on CUDA); copyable.
 *  4. `e.record(s)` → the engine's copy handle: ready once every piece of work submitted to `s`
 *     before the call has finished, so the engine can order its later copies after it
 *     (`order_after`) without blocking the host. For `host_stream` it is an already ready handle.
 */
template <class P>
concept Platform = requires {
  typename P::device_space;
  typename P::host_space;
  typename P::copy_engine;
  typename P::stream_type;
}
&&MemorySpace<typename P::device_space>&& MemorySpace<typename P::host_space>&& CopyEngine<typename P::copy_engine>&&
    std::copyable<typename P::stream_type>&& requires(typename P::copy_engine& e, const typename P::stream_type& s,
                                                      const void* src, void* dst, std::size_t n) {
  { e.record(s) } -> std::same_as<decltype(e.copy_async(dst, src, n, copy_direction::to_device))>;
};

/** @brief A platform assembled from its parts. @tparam Stream defaults to `host_stream`. */
template <MemorySpace Device, MemorySpace Host, CopyEngine Copier, class Stream = host_stream>
struct platform {
  using device_space = Device;
  using host_space = Host;
  using copy_engine = Copier;
  using stream_type = Stream;
};

/** @brief CPU-only platform: a simulated device with a hard capacity and an optional modelled link. */
using simulated_platform = platform<simulated_device_space, host_space, host_copy_engine>;

static_assert(Platform<simulated_platform>);

}  // namespace chunkstar
