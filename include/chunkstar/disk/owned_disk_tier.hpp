// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `owned_disk_tier`: a third tier that owns what a `disk_tier` refers to — the file-backed
 *         space and the copy engine, io_uring where the kernel allows it or a pread/pwrite thread
 *         pool — so a trainer attaches a disk in three lines:
 *
 *  ```cpp
 *  owned_disk_tier disk({.directory = "/scratch", .capacity = 64ull << 30});  // engine: automatic
 *  rt.attach_disk(disk.tier());                                             // before finalize
 *  std::printf("disk tier: %s\n", disk.describe().c_str());
 *  ```
 *
 *  It must outlive every runtime given its tier. Not copyable or movable (the tier refers into it).
 */
#pragma once

#include <chunkstar/config.hpp>
#include <chunkstar/core/error.hpp>
#include <chunkstar/core/units.hpp>
#include <chunkstar/disk/disk_copy_engine.hpp>
#include <chunkstar/disk/disk_space.hpp>
#include <chunkstar/disk/disk_tier.hpp>
#include <chunkstar/disk/uring_copy_engine.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace chunkstar {

/** @brief Which engine moves a disk tier's chunks: io_uring where this build and the kernel allow
 *  it, else the thread pool (`automatic`); io_uring only (`uring`); the thread pool (`pool`). */
enum class disk_engine_kind : std::uint8_t { automatic, uring, pool };

/** @brief The kind a command line names: "auto", "uring" or "pool"; config_error otherwise. */
[[nodiscard]] inline disk_engine_kind disk_engine_kind_named(std::string_view name) {
  if (name == "auto") return disk_engine_kind::automatic;
  if (name == "uring") return disk_engine_kind::uring;
  if (name == "pool") return disk_engine_kind::pool;
  throw config_error("disk engine '" + std::string(name) + "': use auto, uring or pool");
}

/** @brief A disk tier with its space and engine (see the file comment). */
class owned_disk_tier {
 public:
  /** @brief Creates the space (@p space: directory, capacity...) and the engine @p kind picks,
   *  with @p engine's options (checksums...). @throws io_error when the space cannot be created
   *  (the directory cannot hold it); config_error for `uring` where this build has no liburing or
   *  the kernel refuses io_uring, saying which and to use `pool`. */
  explicit owned_disk_tier(disk_space_options space, disk_engine_kind kind = disk_engine_kind::automatic,
                           disk_copy_engine_options engine = {})
      : space_(std::move(space)) {
#if CHUNKSTAR_HAS_URING()
    if (kind != disk_engine_kind::pool) {
      try {
        uring_.emplace(space_, engine);
        return;
      } catch (const io_uring_unavailable& e) {
        if (kind == disk_engine_kind::uring)
          throw config_error(std::string("io_uring is not available: ") + e.what() +
                             "; use disk_engine_kind::pool (pread/pwrite threads)");
      }
    }
#else
    if (kind == disk_engine_kind::uring)
      throw config_error(
          "io_uring is not available: this build has no liburing (install liburing-dev and rebuild); use "
          "disk_engine_kind::pool (pread/pwrite threads)");
#endif
    pool_.emplace(space_, engine);
  }
  owned_disk_tier(const owned_disk_tier&) = delete;
  owned_disk_tier& operator=(const owned_disk_tier&) = delete;

  /** @brief The tier to attach (`chunk_runtime::attach_disk`). */
  [[nodiscard]] disk_tier tier() noexcept {
#if CHUNKSTAR_HAS_URING()
    if (uring_) return {space_, *uring_};
#endif
    return {space_, *pool_};
  }
  [[nodiscard]] disk_space& space() noexcept { return space_; }
  [[nodiscard]] const disk_space& space() const noexcept { return space_; }
  /** @brief True when io_uring moves the chunks, false for the thread pool. */
  [[nodiscard]] bool uses_uring() const noexcept { return !pool_; }
  /** @brief "io_uring" or "pread/pwrite threads". */
  [[nodiscard]] std::string_view engine_name() const noexcept {
    return uses_uring() ? "io_uring" : "pread/pwrite threads";
  }
  /** @brief What the engine moved. */
  [[nodiscard]] copy_stats stats() const {
#if CHUNKSTAR_HAS_URING()
    if (uring_) return uring_->stats();
#endif
    return pool_->stats();
  }
  /** @brief One line for a log: its size, where, the engine and whether the file is O_DIRECT. */
  [[nodiscard]] std::string describe() const {
    return format_bytes(space_.capacity()) + " in a file without a name in " + space_.options().directory + ", " +
           std::string(engine_name()) + (space_.direct() ? ", O_DIRECT" : ", buffered (" + space_.note() + ")");
  }

 private:
  disk_space space_;
  std::optional<disk_copy_engine> pool_;
#if CHUNKSTAR_HAS_URING()
  std::optional<uring_copy_engine> uring_;
#endif
};

}  // namespace chunkstar
