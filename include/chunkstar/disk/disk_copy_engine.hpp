// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `disk_copy_engine`: moves bytes between host memory and a `disk_space` with pread/pwrite
 *         on a small thread pool per direction. The portable disk engine; `uring_copy_engine`
 *         (uring_copy_engine.hpp) is the io_uring one with the same contract.
 *
 *  Directions keep the runtime's meaning, "toward the compute tier" and "away from it": for a disk
 *  tier the compute side is host memory, so `copy_direction::to_device` is a load (disk -> host)
 *  and `copy_direction::to_host` an eviction (host -> disk). Which of the two a copy does is
 *  decided by its pointers, not by the direction: exactly one of `dst`, `src` must lie in the
 *  engine's space (config_error from wait() otherwise). The direction picks the lane: jobs in one
 *  lane run in submission order (a stream), the three lanes run concurrently.
 *
 *  Threads: `threads_per_direction` workers (default 2) per lane, so 6 by default. A copy is cut
 *  into pieces at file offsets that are multiples of `piece_bytes` (default 1 MiB) and the lane's
 *  workers run the pieces of the job at the front of the lane concurrently (two requests in flight
 *  keep an NVMe queue busier than one); the next job starts only when every piece of the previous
 *  one has finished, so per-lane order holds as on a CUDA stream.
 *
 *  O_DIRECT (when the space has it) needs the host buffer, the file offset and the size aligned to
 *  the block. When a piece is not, it goes through the worker's aligned bounce buffer (whole blocks
 *  read, modified and written back for a partial write); counted in `io_stats().bounced_pieces`,
 *  never a failure. Two pieces never share a block (piece boundaries are block multiples and
 *  disk_space blocks never share one), so the read-modify-write is safe unless the caller itself
 *  races two unordered writes into one block.
 *
 *  Errors: short transfers are continued and EINTR retried; any other errno (EIO, ENOSPC, EBADF...)
 *  fails the copy: its handle's wait() throws io_error naming the operation, the offset, the bytes
 *  and the errno text. The lane goes on with the next job. A failed write leaves its range's bytes
 *  unspecified; other ranges are untouched.
 *
 *  Checksums (option `verify_checksums`, on by default without NDEBUG): each successful write to
 *  disk records CRC32C of its bytes keyed by (offset, size); a later read of exactly that range
 *  verifies and fails with `corruption_error` naming the offset on a mismatch. Writes and zero fills
 *  forget the checksums of ranges they overlap; reads of other ranges are not checked.
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/disk/detail/crc32c.hpp>
#include <chunkstar/disk/disk_space.hpp>
#include <chunkstar/memory/copy_engine.hpp>
#include <chunkstar/memory/host_copy_engine.hpp>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace chunkstar {

/** @brief Knobs of a disk copy engine (shared by `disk_copy_engine` and `uring_copy_engine`). */
struct disk_copy_engine_options {
  /** @brief Workers per lane (thread-pool engine) or requests in flight per lane (io_uring). */
  unsigned threads_per_direction = 2;
  /** @brief Copies are cut into pieces at file offsets that are multiples of this (a power of two,
   *  at least the space's block); also the size of each worker's bounce buffer. */
  std::size_t piece_bytes = std::size_t{1} << 20;
#ifdef NDEBUG
  bool verify_checksums = false;
#else
  /** @brief Record CRC32C of every write and verify reads of the same range (debug builds). */
  bool verify_checksums = true;
#endif
  /** @brief Test hook: each read or write syscall moves at most this many bytes (0: no limit;
   *  rounded down to the block, at least one, under O_DIRECT), which exercises the retry loop. */
  std::size_t max_io_bytes = 0;
};

/** @brief Disk-specific counters, beside the `copy_stats` every engine reports. */
struct disk_io_stats {
  std::uint64_t bounced_pieces = 0;   ///< pieces that went through an aligned bounce buffer
  std::uint64_t short_transfers = 0;  ///< syscalls that moved fewer bytes than asked (then continued)
  std::uint64_t verified_reads = 0;   ///< reads whose checksum was checked
  std::uint64_t io_calls = 0;         ///< read and write syscalls (or io_uring requests) completed
};

/** @brief Completion of one disk job: the host engine's shared-future handle. Models `CopyHandle`. */
using disk_copy_handle = host_copy_handle;

namespace detail {

/** @brief Checksums of written ranges, keyed by offset; forgets whatever a write overlaps. */
class range_checksums {
 public:
  void forget(std::uint64_t off, std::uint64_t n) {
    const std::lock_guard lock(mutex_);
    erase_overlapping(off, n);
  }
  void record(std::uint64_t off, std::uint64_t n, std::uint32_t crc) {
    const std::lock_guard lock(mutex_);
    erase_overlapping(off, n);
    map_[off] = {n, crc};
  }
  /** @brief True and the crc when exactly [off, off+n) was recorded. */
  bool find(std::uint64_t off, std::uint64_t n, std::uint32_t& crc) const {
    const std::lock_guard lock(mutex_);
    const auto it = map_.find(off);
    if (it == map_.end() || it->second.first != n) return false;
    crc = it->second.second;
    return true;
  }

 private:
  void erase_overlapping(std::uint64_t off, std::uint64_t n) {
    auto it = map_.lower_bound(off);
    if (it != map_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + std::max<std::uint64_t>(prev->second.first, 1) > off) it = prev;
    }
    while (it != map_.end() && it->first < off + std::max<std::uint64_t>(n, 1)) it = map_.erase(it);
  }
  mutable std::mutex mutex_;
  std::map<std::uint64_t, std::pair<std::uint64_t, std::uint32_t>> map_;
};

/** @brief Aligned bytes owned by one worker. */
struct aligned_buffer {
  aligned_buffer(std::size_t n, std::size_t a)
      : align(a), p(static_cast<unsigned char*>(::operator new (n, std::align_val_t{a}))) {}
  ~aligned_buffer() { ::operator delete (p, std::align_val_t{align}); }
  aligned_buffer(const aligned_buffer&) = delete;
  aligned_buffer& operator=(const aligned_buffer&) = delete;
  std::size_t align;
  unsigned char* p;
};

/** @brief One disk or host job as both engines see it. */
enum class disk_job_kind : unsigned char { read, write, zero_disk, zero_host, wait };

/** @brief Context for error messages: "pwrite of 4096 bytes at offset 8192 of <path>". */
[[nodiscard]] inline std::string disk_io_what(const char* op, std::size_t n, std::uint64_t off, const std::string& path,
                                              int err) {
  return "disk copy: " + std::string(op) + " of " + std::to_string(n) + " bytes at offset " + std::to_string(off) +
         " of '" + path + "' failed: " + std::strerror(err);
}

/** @brief The I/O back-end of `disk_copy_engine`: one pread or pwrite. Returns the bytes moved
 *  or -errno; the engine retries EINTR and continues short transfers. */
struct posix_io {
  static constexpr const char* engine_name = "disk_copy_engine";
  static constexpr const char* read_name = "pread";
  static constexpr const char* write_name = "pwrite";
  [[nodiscard]] long long rw(bool write, int fd, void* buf, std::size_t n, std::uint64_t off) noexcept {
    const ssize_t r =
        write ? ::pwrite(fd, buf, n, static_cast<off_t>(off)) : ::pread(fd, buf, n, static_cast<off_t>(off));
    return r < 0 ? -static_cast<long long>(errno) : static_cast<long long>(r);
  }
};

/** @brief The engine over an I/O back-end `Io` (posix_io, uring_io): lanes, pieces, bounce
 *  buffers, checksums and error mapping are the same for every back-end. Use the aliases
 *  `disk_copy_engine` and `uring_copy_engine`. */
template <class Io>
class basic_disk_copy_engine {
 public:
  explicit basic_disk_copy_engine(disk_space& space, disk_copy_engine_options options = {})
      : space_(space), options_(options) {
    const std::size_t b = space_.block_alignment();
    if (options_.threads_per_direction == 0) {
      throw config_error(std::string(Io::engine_name) + ": threads_per_direction must be >= 1 (default 2)");
    }
    if (options_.piece_bytes < b || (options_.piece_bytes & (options_.piece_bytes - 1)) != 0) {
      throw config_error(std::string(Io::engine_name) + ": piece_bytes " + std::to_string(options_.piece_bytes) +
                         " must be a power of two >= the space's block (" + std::to_string(b) + ")");
    }
    max_io_ = options_.max_io_bytes;
    if (max_io_ != 0 && space_.direct()) max_io_ = std::max(b, max_io_ / b * b);
    try {
      for (std::size_t l = 0; l < copy_direction_count; ++l) {
        for (unsigned t = 0; t < options_.threads_per_direction; ++t) {
          lanes_[l].workers.emplace_back([this, l] { run(lanes_[l]); });
        }
      }
    } catch (...) {
      stop();
      throw;
    }
  }
  basic_disk_copy_engine(const basic_disk_copy_engine&) = delete;
  basic_disk_copy_engine& operator=(const basic_disk_copy_engine&) = delete;
  /** @brief Finishes every queued job, then joins the workers. */
  ~basic_disk_copy_engine() { stop(); }

  /** @brief Copies and returns once done (rethrows the copy's error); ordered like copy_async in `d`. */
  void copy(void* dst, const void* src, std::size_t bytes, copy_direction d) { copy_async(dst, src, bytes, d).wait(); }

  /** @brief Queues a copy in lane `d`: a load when `src` is in the space, an eviction when `dst`
   *  is. Neither or both, a null host pointer or a range past the space's end: config_error from wait(). */
  disk_copy_handle copy_async(void* dst, const void* src, std::size_t bytes, copy_direction d) {
    const bool src_disk = space_.contains(src), dst_disk = space_.contains(dst);
    if (src_disk == dst_disk) {
      return failed(config_error(std::string(std::string(Io::engine_name) + ": a copy of ") + std::to_string(bytes) +
                                 " bytes with " + (src_disk ? "both pointers" : "neither pointer") +
                                 " in disk space '" + space_.name() +
                                 "'; exactly one side must be a block of the engine's disk_space"));
    }
    const void* disk_ptr = src_disk ? src : dst;
    if (auto bad = check_range(disk_ptr, bytes, src_disk ? dst : src)) return failed(config_error(*bad));
    auto j = std::make_shared<job>();
    j->kind = src_disk ? detail::disk_job_kind::read : detail::disk_job_kind::write;
    j->offset = space_.offset_of(disk_ptr);
    j->host = static_cast<unsigned char*>(src_disk ? dst : const_cast<void*>(src));
    j->bytes = bytes;
    j->is_copy = true;
    return enqueue(d, std::move(j));
  }

  /** @brief Zeroes `bytes` at `dst` on the `host_to_host` lane: a disk range (pwrite of zeros) or
   *  host memory (memset). Not counted in copy stats. */
  disk_copy_handle zero_async(void* dst, std::size_t bytes) {
    auto j = std::make_shared<job>();
    j->bytes = bytes;
    if (space_.contains(dst)) {
      if (auto bad = check_range(dst, bytes, this)) return failed(config_error(*bad));
      j->kind = detail::disk_job_kind::zero_disk;
      j->offset = space_.offset_of(dst);
    } else {
      if (dst == nullptr && bytes > 0) {
        return failed(config_error(std::string(Io::engine_name) + ": zero_async of " + std::to_string(bytes) +
                                   " bytes at a null address"));
      }
      j->kind = detail::disk_job_kind::zero_host;
      j->host = static_cast<unsigned char*>(dst);
    }
    return enqueue(copy_direction::host_to_host, std::move(j));
  }

  /** @brief Jobs submitted to `d` from now on start only after `h` is ready; the caller does not
   *  wait. A failure of `h` is reported by `h` alone. `h` may come from another engine (a device
   *  copy still filling the host buffer a disk write reads): the lane's worker waits for it. */
  template <CopyHandle H>
  void order_after(const H& h, copy_direction d) {
    if (h.ready()) return;
    auto j = std::make_shared<job>();
    j->kind = detail::disk_job_kind::wait;
    j->after = [h] { h.wait(); };
    (void)enqueue(d, std::move(j));
  }

  /** @brief Host work is complete when its call returns: a ready handle (so this engine can serve
   *  a host platform). */
  [[nodiscard]] disk_copy_handle record(host_stream) const noexcept { return {}; }

  /** @brief Waits until every job submitted so far, in every lane, has finished. */
  void synchronize() {
    for (auto& l : lanes_) {
      std::unique_lock lock(l.mutex);
      l.idle.wait(lock, [&] { return l.queue.empty(); });
    }
  }

  /** @brief Bytes, copies and busy seconds of the completed copies per lane. */
  [[nodiscard]] copy_stats stats() const {
    copy_stats s;
    for (std::size_t i = 0; i < copy_direction_count; ++i) {
      const std::lock_guard lock(lanes_[i].mutex);
      s.per_direction[i] = lanes_[i].stats;
    }
    return s;
  }
  /** @brief Bounce, short-transfer and checksum counters. */
  [[nodiscard]] disk_io_stats io_stats() const {
    const std::lock_guard lock(io_mutex_);
    return io_stats_;
  }
  [[nodiscard]] const disk_copy_engine_options& options() const noexcept { return options_; }
  [[nodiscard]] disk_space& space() const noexcept { return space_; }

 private:
  struct job {
    detail::disk_job_kind kind = detail::disk_job_kind::wait;
    std::uint64_t offset = 0;
    unsigned char* host = nullptr;
    std::size_t bytes = 0;
    bool is_copy = false;
    std::function<void()> after;  // a wait job's: blocks until what the lane is ordered after is done
    std::promise<void> done;
    // Guarded by the lane's mutex:
    std::size_t pieces = 1, claimed = 0, finished = 0;
    std::exception_ptr failure;
    std::chrono::steady_clock::time_point start;
  };
  struct lane {
    mutable std::mutex mutex;
    std::condition_variable wake;
    std::condition_variable idle;
    std::deque<std::shared_ptr<job>> queue;  // front: the job whose pieces run now
    bool stopping = false;
    copy_stats::direction stats;
    std::vector<std::thread> workers;
  };

  /** Why [p, p+n) is not a valid disk range for this space, or nothing. */
  std::unique_ptr<std::string> check_range(const void* p, std::size_t n, const void* host) const {
    const std::uint64_t off = space_.offset_of(p);
    if (n > space_.capacity() - off) {
      return std::make_unique<std::string>(
          std::string(Io::engine_name) + ": " + std::to_string(n) + " bytes at offset " + std::to_string(off) +
          " run past the end of disk space '" + space_.name() + "' (" + std::to_string(space_.capacity()) + " bytes)");
    }
    if (host == nullptr && n > 0) {
      return std::make_unique<std::string>(std::string(Io::engine_name) + ": a copy of " + std::to_string(n) +
                                           " bytes with a null host pointer");
    }
    return nullptr;
  }

  template <class E>
  static disk_copy_handle failed(E e) {
    std::promise<void> p;
    p.set_exception(std::make_exception_ptr(std::move(e)));
    return disk_copy_handle(p.get_future().share());
  }

  disk_copy_handle enqueue(copy_direction d, std::shared_ptr<job> j) {
    const auto i = static_cast<std::size_t>(d);
    if (i >= copy_direction_count)
      return failed(config_error(std::string(Io::engine_name) + ": unknown copy_direction"));
    if (j->kind != detail::disk_job_kind::wait && j->kind != detail::disk_job_kind::zero_host && j->bytes > 0) {
      const std::uint64_t p = options_.piece_bytes;
      j->pieces = static_cast<std::size_t>((j->offset + j->bytes - 1) / p - j->offset / p + 1);
    }
    disk_copy_handle handle(j->done.get_future().share());
    lane& l = lanes_[i];
    {
      const std::lock_guard lock(l.mutex);
      l.queue.push_back(std::move(j));
    }
    l.wake.notify_all();
    return handle;
  }

  void run(lane& l) {
    detail::aligned_buffer bounce(options_.piece_bytes, space_.block_alignment());
    std::unique_lock lock(l.mutex);
    for (;;) {
      l.wake.wait(lock, [&] {
        return (l.stopping && l.queue.empty()) ||
               (!l.queue.empty() && l.queue.front()->claimed < l.queue.front()->pieces);
      });
      if (l.queue.empty()) return;  // stopping, and drained
      std::shared_ptr<job> j = l.queue.front();
      const std::size_t piece = j->claimed++;
      if (piece == 0) j->start = std::chrono::steady_clock::now();
      const bool skip = j->failure != nullptr;
      lock.unlock();
      std::exception_ptr failure;
      if (!skip) {
        try {
          run_piece(*j, piece, bounce.p);
        } catch (...) {
          failure = std::current_exception();
        }
      }
      lock.lock();
      if (failure && !j->failure) j->failure = failure;
      if (++j->finished < j->pieces) continue;
      // The last piece: finish the job while it still blocks the lane (the next job, even a read
      // of the same range, must see its checksum).
      lock.unlock();
      finish(*j);
      const double busy = std::chrono::duration<double>(std::chrono::steady_clock::now() - j->start).count();
      lock.lock();
      if (j->is_copy && !j->failure) {  // before the handle turns ready: a waiter then sees the stats
        l.stats.bytes += j->bytes;
        l.stats.copies += 1;
        l.stats.busy_s += busy;
      }
      lock.unlock();
      if (j->failure) j->done.set_exception(j->failure);
      else j->done.set_value();
      lock.lock();
      l.queue.pop_front();  // after the handle is ready: synchronize() returns only then
      l.wake.notify_all();
      l.idle.notify_all();
    }
  }

  void finish(job& j) {
    if (!options_.verify_checksums) return;
    using k = detail::disk_job_kind;
    if (j.kind == k::zero_disk || (j.kind == k::write && j.failure)) checksums_.forget(j.offset, j.bytes);
    else if (j.kind == k::write) checksums_.record(j.offset, j.bytes, detail::crc32c(j.host, j.bytes));
    else if (j.kind == k::read && !j.failure) {
      std::uint32_t expect = 0;
      if (!checksums_.find(j.offset, j.bytes, expect)) return;
      const std::uint32_t got = detail::crc32c(j.host, j.bytes);
      {
        const std::lock_guard lock(io_mutex_);
        ++io_stats_.verified_reads;
      }
      if (got != expect) {
        j.failure = std::make_exception_ptr(
            corruption_error(std::string(Io::engine_name) + ": checksum mismatch reading " + std::to_string(j.bytes) +
                             " bytes at offset " + std::to_string(j.offset) + " of '" + space_.path() +
                             "' (written crc32c " + std::to_string(expect) + ", read " + std::to_string(got) +
                             "): the file was changed outside the engine or the disk corrupted it"));
      }
    }
  }

  void run_piece(job& j, std::size_t piece, unsigned char* bounce) {
    using k = detail::disk_job_kind;
    if (j.kind == k::wait) {
      try {
        if (j.after) j.after();
      } catch (...) {  // the job that failed reports it through its own handle
      }
      return;
    }
    if (j.kind == k::zero_host) {
      if (j.bytes > 0) std::memset(j.host, 0, j.bytes);
      return;
    }
    if (j.bytes == 0) return;
    const std::uint64_t p = options_.piece_bytes;
    const std::uint64_t lo = std::max<std::uint64_t>(j.offset, (j.offset / p + piece) * p);
    const std::uint64_t hi = std::min<std::uint64_t>(j.offset + j.bytes, (j.offset / p + piece + 1) * p);
    unsigned char* host = j.host == nullptr ? nullptr : j.host + (lo - j.offset);
    if (j.kind == k::read) read_range(lo, host, static_cast<std::size_t>(hi - lo), bounce);
    else write_range(lo, j.kind == k::write ? host : nullptr, static_cast<std::size_t>(hi - lo), bounce);
  }

  [[nodiscard]] bool aligned(std::uint64_t off, const void* host, std::size_t n) const noexcept {
    const std::size_t b = space_.block_alignment();
    return off % b == 0 && n % b == 0 && reinterpret_cast<std::uintptr_t>(host) % b == 0;
  }

  void read_range(std::uint64_t off, unsigned char* dst, std::size_t n, unsigned char* bounce) {
    if (!space_.direct() || aligned(off, dst, n)) {
      transfer(false, dst, n, off);
      return;
    }
    const std::size_t b = space_.block_alignment();
    const std::uint64_t alo = off / b * b, ahi = (off + n + b - 1) / b * b;
    transfer(false, bounce, static_cast<std::size_t>(ahi - alo), alo);
    std::memcpy(dst, bounce + (off - alo), n);
    count_bounce();
  }

  /** Writes `n` bytes from `src`, or zeros when `src` is null. */
  void write_range(std::uint64_t off, const unsigned char* src, std::size_t n, unsigned char* bounce) {
    if (src != nullptr && (!space_.direct() || aligned(off, src, n))) {
      transfer(true, const_cast<unsigned char*>(src), n, off);
      return;
    }
    const std::size_t b = space_.block_alignment();
    std::uint64_t alo = off, ahi = off + n;
    if (space_.direct()) {
      alo = off / b * b;
      ahi = (off + n + b - 1) / b * b;
      if (alo != off) transfer(false, bounce, b, alo);  // keep the bytes before the range
      if (ahi != off + n && (ahi - b != alo || alo == off)) transfer(false, bounce + (ahi - b - alo), b, ahi - b);
    }
    if (src != nullptr) {
      std::memcpy(bounce + (off - alo), src, n);
      count_bounce();
    } else {
      std::memset(bounce + (off - alo), 0, n);
    }
    transfer(true, bounce, static_cast<std::size_t>(ahi - alo), alo);
  }

  /** pread/pwrite until all `n` bytes moved; EINTR retried, short transfers continued. */
  void transfer(bool write, unsigned char* buf, std::size_t n, std::uint64_t off) {
    std::size_t done = 0;
    while (done < n) {
      std::size_t want = n - done;
      if (max_io_ != 0) want = std::min(want, max_io_);
      const long long r = io_.rw(write, space_.fd(), buf + done, want, off + done);
      const char* op = write ? Io::write_name : Io::read_name;
      if (r < 0) {
        if (r == -EINTR || r == -EAGAIN) continue;
        throw io_error(detail::disk_io_what(op, want, off + done, space_.path(), static_cast<int>(-r)));
      }
      if (r == 0) {
        throw io_error(detail::disk_io_what(op, want, off + done, space_.path(), EIO) + " (no progress: end of file)");
      }
      {
        const std::lock_guard lock(io_mutex_);
        ++io_stats_.io_calls;
        if (static_cast<std::size_t>(r) < want) ++io_stats_.short_transfers;
      }
      done += static_cast<std::size_t>(r);
    }
  }

  void count_bounce() {
    const std::lock_guard lock(io_mutex_);
    ++io_stats_.bounced_pieces;
  }

  void stop() noexcept {
    for (auto& l : lanes_) {
      {
        const std::lock_guard lock(l.mutex);
        l.stopping = true;
      }
      l.wake.notify_all();
    }
    for (auto& l : lanes_) {
      for (auto& w : l.workers) {
        if (w.joinable()) w.join();
      }
    }
  }

  disk_space& space_;
  disk_copy_engine_options options_;
  Io io_;  // before the lanes: workers use it until stop() joins them
  std::size_t max_io_ = 0;
  detail::range_checksums checksums_;
  mutable std::mutex io_mutex_;
  disk_io_stats io_stats_;
  std::array<lane, copy_direction_count> lanes_;
};

}  // namespace detail

/** @brief Copies between host memory and one `disk_space` with pread/pwrite on
 *  `threads_per_direction` workers per lane. Thread-safe. Models `CopyEngine`. The destructor
 *  waits for every queued job and never throws. */
using disk_copy_engine = detail::basic_disk_copy_engine<detail::posix_io>;

static_assert(CopyEngine<disk_copy_engine>);

}  // namespace chunkstar
