// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `disk_moves`: the disk as the chunk store's lower tier — chunks move between the host and
 *         a file-backed space on the disk tier's own engine (`attach_disk` plugs it in).
 *
 *  A disk copy keeps the payload it copies from until the copy is known to have succeeded
 *  (resolve), so a failed or corrupted read or write leaves the chunk where it was, bytes intact,
 *  and says so in a typed error with the memory report.
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/units.hpp>
#include <chunkstar/disk/disk_tier.hpp>
#include <chunkstar/store/lower_tier.hpp>

#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <utility>

namespace chunkstar {

/** @brief The moves between the host and disk tier @p d for @p Store's chunks. */
template <class Store>
class disk_moves final : public lower_tier {
 public:
  disk_moves(Store& store, disk_tier d) noexcept : store_(store), disk_(d) {}

  [[nodiscard]] memory_space_ref space() const noexcept override { return disk_.space(); }

  /** A write waits on its lane, not here, for the device copy still filling its host buffer. */
  void move(chunk_id id, tier to) override {
    auto& s = store_.at(id);
    const bool write = to == tier::disk;
    if (write ? s.where != tier::host : to != tier::host)
      throw state_error("internal: chunk " + to_string(id) + " cannot move from the " +
                        std::string(tier_name(s.where)) + " to the " + std::string(tier_name(to)) +
                        " directly: the disk tier exchanges chunks with the host only");
    const std::size_t bytes = store_.bytes_of(id.kind);
    void* dst = store_.allocate(to, bytes);
    if (dst == nullptr)
      throw out_of_memory_error(
          write ? "no room on the disk tier for chunk " + to_string(id) + " (" + format_bytes(bytes) +
                      "): device, host and disk are full; raise the disk space's capacity (train_gpt: --disk-budget)"
                : "no room on the host for chunk " + to_string(id) + " (" + format_bytes(bytes) +
                      ") coming from the disk: raise the host space's capacity (train_gpt: --host-budget)",
          bytes, store_.report());
    const auto lane = write ? copy_direction::to_host : copy_direction::to_device;
    const double submitted_us = store_.now_us();
    disk_copy_handle h;
    try {
      if (s.user_done) disk_.order_after(*s.user_done, lane);
      if (s.pending) disk_.order_after(*s.pending, lane);
      h = disk_.copy_async(dst, s.data, store_.footprint(tier::disk, bytes),
                           lane);  // whole blocks: no read-modify-write
    } catch (...) {
      store_.deallocate(to, dst, bytes);
      throw;
    }
    s.disk_pending = lower_move{h, s.data, s.where, submitted_us};
    s.pending.reset();
    s.user_done.reset();
    store_.relocate(id, dst, to, true);
    auto& st = store_.stats();
    (write ? st.bytes_to_disk : st.bytes_from_disk) += bytes;
    ++(write ? st.disk_writes : st.disk_reads);
  }

  /** Stall time counted in disk_stall_s. */
  void resolve(chunk_id id) override {
    auto& s = store_.at(id);
    if (!s.disk_pending) return;
    auto& dm = *s.disk_pending;
    if (!dm.done.ready()) {
      const auto t0 = std::chrono::steady_clock::now();
      try {
        dm.done.wait();
      } catch (...) {  // handled below
      }
      store_.stats().disk_stall_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    const std::size_t bytes = store_.bytes_of(id.kind);
    const tier from = dm.from, to = s.where;
    try {
      dm.done.wait();
    } catch (const std::exception& e) {  // back to the payload the copy read
      void* failed = s.data;
      store_.relocate(id, dm.source, from, false);
      store_.deallocate(to, failed, bytes);
      s.disk_pending.reset();
      ++store_.stats().disk_failures;
      const std::string what = std::string(e.what()) + " [chunk " + to_string(id) + " stays on the " +
                               std::string(tier_name(from)) + " with its bytes as before the copy; memory now:\n" +
                               store_.report().to_string() + "]";
      if (dynamic_cast<const corruption_error*>(&e)) throw corruption_error(what);
      if (dynamic_cast<const io_error*>(&e)) throw io_error(what);
      throw;
    }
    const double submitted = dm.submitted_us;
    store_.deallocate(from, dm.source, bytes);
    s.disk_pending.reset();
    if (store_.on_copy_retired) {
      try {
        store_.on_copy_retired(submitted, from, to);
      } catch (...) {  // an observer must not break memory management
      }
    }
  }

  bool resolve_one(tier t) override {
    bool found = false;
    store_.for_each([&](chunk_id id, auto& s) {
      if (!found && s.disk_pending && s.disk_pending->from == t) {
        found = true;
        resolve(id);
      }
    });
    return found;
  }

  [[nodiscard]] std::size_t retiring(tier t) const noexcept override {
    std::size_t b = 0;
    std::as_const(store_).for_each([&](chunk_id id, const auto& s) {
      if (s.disk_pending && s.disk_pending->from == t) b += store_.footprint(t, store_.bytes_of(id.kind));
    });
    return b;
  }

  void discard(chunk_id id) noexcept override {
    auto& s = store_.at(id);
    try {
      s.disk_pending->done.wait();
    } catch (...) {  // the payload is discarded: its copy's failure no longer matters
    }
    store_.deallocate(s.disk_pending->from, s.disk_pending->source, store_.bytes_of(id.kind));
    s.disk_pending.reset();
  }

  void drain() noexcept override {
    try {
      disk_.synchronize();
    } catch (...) {  // a failed copy was (or will never be) reported by its handle; free anyway
    }
    store_.for_each([&](chunk_id id, auto& s) {
      if (s.disk_pending) store_.deallocate(s.disk_pending->from, s.disk_pending->source, store_.bytes_of(id.kind));
      s.disk_pending.reset();
    });
  }

  /** With a disk tier, chunks pass through the host on their way to and from the disk. */
  [[nodiscard]] std::string why_host_full() const override {
    return ": the host's " + format_bytes(store_.host().capacity()) +
           " hold chunks in use or in transit, none of which can go to the disk now (it holds " +
           format_bytes(store_.resident(tier::disk)) + " of its " + format_bytes(disk_.space().capacity()) +
           "); with a disk tier, chunks pass through the host on their way to and from the disk and a host-side "
           "optimizer step holds up "
           "to five chunks at once: raise the host space's capacity (train_gpt asks for 8 of the largest chunk)";
  }
  void zero(void* p, std::size_t n) override { disk_.zero_async(p, n).wait(); }
  void copy(void* dst, const void* src, std::size_t n, copy_direction d) override { disk_.copy(dst, src, n, d); }

 private:
  Store& store_;
  disk_tier disk_;
};

/** @brief Gives @p store the disk tier @p d as its lower tier (before any chunk has a payload). */
template <class Store>
void attach_disk(Store& store, disk_tier d) {
  store.attach_lower(std::make_unique<disk_moves<Store>>(store, d));
}

}  // namespace chunkstar
