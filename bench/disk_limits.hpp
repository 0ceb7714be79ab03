// SPDX-License-Identifier: Apache-2.0
// The disk's own limits, for the benchmarks that put a disk tier under the runtime (bench_disk,
// bench_overlap): sequential O_DIRECT write and read bandwidth for chunk-sized blocks (the best of
// 1 to `queue` requests in flight, pwrite/pread, each its own aligned buffer), and the disk engine
// moving the same blocks (its own overhead, beside the limit).
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/disk/owned_disk_tier.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <new>
#include <string>
#include <thread>
#include <vector>

namespace chunkstar::bench {

/** What the disk does at its best for blocks of `block` bytes. */
struct disk_limits {
  std::size_t block = 0;
  double write_gbs = 0, read_gbs = 0;                // pwrite/pread, O_DIRECT where the space has it
  double engine_write_gbs = 0, engine_read_gbs = 0;  // the disk engine moving the same blocks
  bool direct = false;
  /** Seconds the disk needs for @p read and @p written bytes at these limits (one disk: serialised). */
  [[nodiscard]] double seconds(double read, double written) const {
    return (read_gbs > 0 ? read / (read_gbs * 1e9) : 0) + (write_gbs > 0 ? written / (write_gbs * 1e9) : 0);
  }
};

/** A page-aligned buffer (O_DIRECT needs one). */
struct aligned_block {
  explicit aligned_block(std::size_t n)
      : p(static_cast<unsigned char*>(::operator new (n, std::align_val_t{4096}))), n(n) {}
  ~aligned_block() { ::operator delete (p, std::align_val_t{4096}); }
  aligned_block(const aligned_block&) = delete;
  aligned_block& operator=(const aligned_block&) = delete;
  unsigned char* p;
  std::size_t n;
};

/** Seconds for every block of [0, total) written (or read) by @p queue threads, block i by thread
 *  i mod queue. */
inline double raw_pass(int fd, std::size_t block, std::size_t total, unsigned queue, bool write) {
  std::vector<std::thread> threads;
  std::atomic<bool> failed{false};
  std::atomic<int> error{0};
  const auto t0 = std::chrono::steady_clock::now();
  for (unsigned q = 0; q < queue; ++q) {
    threads.emplace_back([&, q] {
      aligned_block buf(block);
      std::memset(buf.p, 0x5a + static_cast<int>(q), block);
      for (std::size_t off = q * block; off + block <= total; off += queue * block) {
        for (std::size_t done = 0; done < block;) {
          const ssize_t r = write ? ::pwrite(fd, buf.p + done, block - done, static_cast<off_t>(off + done))
                                  : ::pread(fd, buf.p + done, block - done, static_cast<off_t>(off + done));
          if (r <= 0) {
            if (r < 0 && errno == EINTR) continue;
            failed = true;
            error = r < 0 ? errno : EIO;
            return;
          }
          done += static_cast<std::size_t>(r);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  if (write) ::fdatasync(fd);
  if (failed)
    throw io_error("a " + std::string(write ? "pwrite" : "pread") +
                   " of the limit measurement failed: " + std::strerror(error.load()));
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/** The limits of disk @p d (its space at least @p total bytes) for blocks of @p block bytes, with
 *  1 .. @p queue requests in flight, twice each (the first pass also allocates the file's extents). */
inline disk_limits measure_disk_limits(owned_disk_tier& d, std::size_t block, std::size_t total, unsigned queue) {
  disk_limits l;
  l.block = block;
  total = std::max(total / block, std::size_t{4}) * block;
  l.direct = d.space().direct();
  const double gb = static_cast<double>(total) / 1e9;
  for (int rep = 0; rep < 2; ++rep)
    for (unsigned q = 1; q <= queue; q *= 2) {
      l.write_gbs = std::max(l.write_gbs, gb / raw_pass(d.space().fd(), block, total, q, true));
      l.read_gbs = std::max(l.read_gbs, gb / raw_pass(d.space().fd(), block, total, q, false));
    }
  // The engine moving the same blocks: every block submitted at once, then waited for.
  const disk_tier tier = d.tier();
  aligned_block host(total > (std::size_t{256} << 20) ? std::size_t{256} << 20 : total);
  const std::size_t blocks = host.n / block;
  std::vector<void*> at;
  for (std::size_t i = 0; i < blocks; ++i)
    at.push_back(const_cast<unsigned char*>(static_cast<const unsigned char*>(d.space().base())) + i * block);
  std::memset(host.p, 1, host.n);
  const double egb = static_cast<double>(blocks * block) / 1e9;
  for (int rep = 0; rep < 2; ++rep) {
    std::vector<disk_copy_handle> hs;
    auto t0 = std::chrono::steady_clock::now();
    for (std::size_t i = 0; i < blocks; ++i)
      hs.push_back(tier.copy_async(at[i], host.p + i * block, block, copy_direction::to_host));
    for (auto& h : hs) h.wait();
    ::fdatasync(d.space().fd());
    l.engine_write_gbs = std::max(l.engine_write_gbs,
                                  egb / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    hs.clear();
    t0 = std::chrono::steady_clock::now();
    for (std::size_t i = 0; i < blocks; ++i)
      hs.push_back(tier.copy_async(host.p + i * block, at[i], block, copy_direction::to_device));
    for (auto& h : hs) h.wait();
    l.engine_read_gbs =
        std::max(l.engine_read_gbs, egb / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return l;
}

}  // namespace chunkstar::bench
