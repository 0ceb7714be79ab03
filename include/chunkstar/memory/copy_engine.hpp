// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief The `CopyEngine` concept (and its `CopyHandle`), copy directions, the modelled link
 *         `copy_model` and the per-direction `copy_stats` every engine reports.
 *
 *  Models: `host_copy_engine` (host_copy_engine.hpp: worker threads, optional modelled link),
 *  `cuda::cuda_copy_engine` (chunkstar/cuda/cuda_copy_engine.hpp: one CUDA stream per direction).
 */
#pragma once

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace chunkstar {

/** @brief Which link a copy uses. Copies in one direction run in order (like one CUDA stream);
 *  different directions run concurrently (like the two halves of a full-duplex PCIe link). */
enum class copy_direction : unsigned char { to_device, to_host, host_to_host };

/** @brief Number of `copy_direction` values, for per-direction arrays. */
inline constexpr std::size_t copy_direction_count = 3;

/** @brief "to_device", "to_host" or "host_to_host". */
[[nodiscard]] constexpr std::string_view to_string(copy_direction d) noexcept {
  switch (d) {
    case copy_direction::to_device: return "to_device";
    case copy_direction::to_host: return "to_host";
    case copy_direction::host_to_host: return "host_to_host";
  }
  return "?";
}

/** @brief The stream of a host platform: user work on host-accessible memory runs on the calling
 *  thread, so it is complete when the call that did it returns, and nothing needs ordering.
 *  Engines of such platforms offer `record(host_stream)`, an already ready handle. */
struct host_stream {};

/** @brief A modelled link between host and (simulated) device: a copy of `b` bytes takes at least
 *  `latency_s + b / bandwidth_bytes_per_s`. A zero bandwidth means "not modelled". */
struct copy_model {
  double bandwidth_bytes_per_s = 0;  ///< 0 = unmodelled (copies take what memcpy takes)
  double latency_s = 0;              ///< fixed cost per copy, in seconds

  /** @brief True when copies are slowed down to the model. */
  [[nodiscard]] constexpr bool modelled() const noexcept { return bandwidth_bytes_per_s > 0; }
  /** @brief Modelled seconds for `bytes` (0 when unmodelled). */
  [[nodiscard]] constexpr double seconds(std::size_t bytes) const noexcept {
    return modelled() ? latency_s + static_cast<double>(bytes) / bandwidth_bytes_per_s : 0.0;
  }
};

/** @brief What an engine moved, per direction. */
struct copy_stats {
  /** @brief One direction's totals. */
  struct direction {
    std::uint64_t bytes = 0;   ///< bytes of copies completed successfully
    std::uint64_t copies = 0;  ///< copies completed successfully
    double busy_s = 0;         ///< seconds the link spent on completed copies
  };
  std::array<direction, copy_direction_count> per_direction{};

  [[nodiscard]] direction& operator[](copy_direction d) noexcept { return per_direction[static_cast<std::size_t>(d)]; }
  [[nodiscard]] const direction& operator[](copy_direction d) const noexcept {
    return per_direction[static_cast<std::size_t>(d)];
  }
  /** @brief Bytes over every direction. */
  [[nodiscard]] std::uint64_t total_bytes() const noexcept {
    std::uint64_t t = 0;
    for (const auto& d : per_direction) t += d.bytes;
    return t;
  }
};

/** @brief The `CopyHandle` concept: the result of an asynchronous copy.
 *
 *  Required expressions, for `h` a `const H&`:
 *  1. `h.ready()` → `bool`: non-blocking; true once the copy has finished (or failed).
 *  2. `h.wait()`: blocks until the copy finished; rethrows the copy's error if it failed. Waiting
 *     again, or on a default-constructed handle, returns at once.
 *  Handles are cheap to copy (shared state) and may be waited on from any thread.
 */
template <class H>
concept CopyHandle = std::copyable<H> && std::default_initializable<H> && requires(const H& h) {
  { h.ready() } -> std::same_as<bool>;
  h.wait();
};

/** @brief The `CopyEngine` concept: moves bytes between spaces, synchronously or not.
 *
 *  Required expressions, for `e` an `E&`, `ce` a `const E&`, `dst` a `void*`, `src` a
 *  `const void*`, `n` a `std::size_t`, `d` a `copy_direction`:
 *  1. `e.copy(dst, src, n, d)`: copies `n` bytes and returns when they have arrived; ordered after
 *     every copy already submitted in direction `d`, and paced like them when the link is modelled.
 *  2. `e.copy_async(dst, src, n, d)` → a `CopyHandle`: queues the copy behind earlier ones in `d`
 *     and returns at once; `src` and `dst` must stay valid until the handle is ready. Errors of the
 *     copy itself surface from the handle's `wait()`.
 *  3. `e.zero_async(dst, n)` → a `CopyHandle`: fills `n` bytes at `dst` (memory of either space)
 *     with zero bytes and returns at once; queued behind earlier `host_to_host` jobs, never paced
 *     and not counted in stats: it writes inside one space, it does not cross the link (a gradient
 *     chunk is zeroed this way while the previous layer computes, like cudaMemsetAsync).
 *  4. `e.order_after(h, d)`, `h` a handle from this engine: jobs submitted to `d` from now on start
 *     only once `h` is ready; the caller does not wait (cudaStreamWaitEvent). A load can so reuse
 *     the device buffer an eviction is still reading. A failure of `h` surfaces from `h` alone.
 *  5. `e.synchronize()`: waits until every submitted job, in every direction, has finished.
 *  6. `ce.stats()` → `copy_stats`: bytes and copies per direction and the link's busy time.
 *  Engines own threads or streams, so they are not copyable; all members are thread-safe.
 */
template <class E>
concept CopyEngine = requires(E& e, const E& ce, void* dst, const void* src, std::size_t n, copy_direction d) {
  e.copy(dst, src, n, d);
  { e.copy_async(dst, src, n, d) } -> CopyHandle;
  { e.zero_async(dst, n) } -> std::same_as<decltype(e.copy_async(dst, src, n, d))>;
  e.order_after(e.copy_async(dst, src, n, d), d);
  e.synchronize();
  { ce.stats() } -> std::same_as<copy_stats>;
}
&&!std::copyable<E>;

}  // namespace chunkstar
