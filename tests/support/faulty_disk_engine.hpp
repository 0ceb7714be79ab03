// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief A disk copy engine for fault tests: the real thread-pool engine, except that chosen
 *         copies fail (the n-th read or write, counted from 0) or land and are then corrupted on
 *         disk behind the engine's back, as a failing drive or another process would.
 */
#pragma once

#include <chunkstar/disk/disk_copy_engine.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <exception>
#include <future>
#include <vector>

namespace chunkstar::test {

class faulty_disk_engine {
 public:
  struct faults {
    long fail_read = -1;      ///< this read (0: the first) fails with io_error, nothing read
    long fail_write = -1;     ///< this write fails with io_error, nothing written
    long corrupt_write = -1;  ///< this write lands, then one byte of it is flipped in the file
  };
  faulty_disk_engine(disk_space& space, disk_copy_engine_options options, faults f)
      : space_(space), inner_(space, options), faults_(f) {}
  faulty_disk_engine(const faulty_disk_engine&) = delete;
  faulty_disk_engine& operator=(const faulty_disk_engine&) = delete;

  disk_copy_handle copy_async(void* dst, const void* src, std::size_t n, copy_direction d) {
    const bool read = space_.contains(src);
    const long i = (read ? reads_ : writes_).fetch_add(1);
    if (read ? i == faults_.fail_read : i == faults_.fail_write) {
      ++injected_;
      std::promise<void> p;
      p.set_exception(
          std::make_exception_ptr(io_error(std::string("injected ") + (read ? "read" : "write") + " failure")));
      return disk_copy_handle(p.get_future().share());
    }
    auto h = inner_.copy_async(dst, src, n, d);
    if (!read && i == faults_.corrupt_write) {
      ++injected_;
      h.wait();
      flip_byte(space_.offset_of(dst) + n / 2);
    }
    return h;
  }
  void copy(void* dst, const void* src, std::size_t n, copy_direction d) { copy_async(dst, src, n, d).wait(); }
  disk_copy_handle zero_async(void* dst, std::size_t n) { return inner_.zero_async(dst, n); }
  template <CopyHandle H>
  void order_after(const H& h, copy_direction d) {
    inner_.order_after(h, d);
  }
  void synchronize() { inner_.synchronize(); }
  [[nodiscard]] copy_stats stats() const { return inner_.stats(); }
  [[nodiscard]] disk_io_stats io_stats() const { return inner_.io_stats(); }
  [[nodiscard]] long injected() const noexcept { return injected_.load(); }

 private:
  void flip_byte(std::uint64_t offset) {
    const int fd = ::open(space_.path().c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return;
    unsigned char b = 0;
    if (::pread(fd, &b, 1, static_cast<off_t>(offset)) == 1) {
      b ^= 0x5a;
      (void)!::pwrite(fd, &b, 1, static_cast<off_t>(offset));
      ::fsync(fd);
    }
    ::close(fd);
  }
  disk_space& space_;
  disk_copy_engine inner_;
  faults faults_;
  std::atomic<long> reads_{0}, writes_{0}, injected_{0};
};

static_assert(CopyEngine<faulty_disk_engine>);

}  // namespace chunkstar::test
