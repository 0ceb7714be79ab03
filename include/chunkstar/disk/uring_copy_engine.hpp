// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `uring_copy_engine`: the disk engine contract of disk_copy_engine.hpp on io_uring.
 *         Only where this build found liburing (`CHUNKSTAR_HAS_URING()`; link `chunkstar::uring`,
 *         which `chunkstar::chunkstar` includes when found); otherwise this header declares nothing.
 *
 *  Design, the simplest correct one: one ring per engine; the lanes, pieces, bounce buffers,
 *  checksums and error mapping are `disk_copy_engine`'s, only the syscall differs. A lane worker
 *  puts its read or write on the ring under a submission lock and sleeps on its own request; one
 *  completion thread reaps the ring and wakes the worker. So at most `threads_per_direction`
 *  requests per lane are in flight (6 by default), with fewer syscalls per byte than pread/pwrite
 *  and no thread blocked in the kernel. Results map as before: a short transfer is continued,
 *  -EINTR/-EAGAIN resubmitted, any other -errno fails the copy with io_error naming
 *  "io_uring read"/"io_uring write", the offset, the bytes and the errno text.
 *
 *  Choosing an engine: the kernel may refuse io_uring (seccomp in containers, the
 *  kernel.io_uring_disabled sysctl, old kernels): the constructor then throws
 *  `io_uring_unavailable` (an io_error) before starting anything. `make_uring_or_pool_engine`
 *  does the fallback, or `io_uring_available()` asks first.
 */
#pragma once

#include <chunkstar/config.hpp>

#if CHUNKSTAR_HAS_URING()

#include <chunkstar/core/error.hpp>
#include <chunkstar/disk/disk_copy_engine.hpp>
#include <chunkstar/disk/disk_space.hpp>

#include <liburing.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <variant>

namespace chunkstar {

/** @brief The kernel refused io_uring (io_uring_queue_init failed): use `disk_copy_engine`. */
class io_uring_unavailable : public io_error {
 public:
  using io_error::io_error;
};

namespace detail {

/** @brief I/O back-end on one io_uring: submit under a lock, one completion thread reaps. */
class uring_io {
 public:
  static constexpr const char* engine_name = "uring_copy_engine";
  static constexpr const char* read_name = "io_uring read";
  static constexpr const char* write_name = "io_uring write";
  static constexpr unsigned entries = 64;  // > the most requests in flight (3 lanes x workers)

  uring_io() {
    const int rc = ::io_uring_queue_init(entries, &ring_, 0);
    if (rc < 0) {
      throw io_uring_unavailable(std::string("uring_copy_engine: the kernel refused io_uring (io_uring_queue_init: ") +
                                 std::strerror(-rc) +
                                 "); seccomp, a container policy or kernel.io_uring_disabled may forbid it: use "
                                 "disk_copy_engine (pread/pwrite) instead, or make_uring_or_pool_engine()");
    }
    try {
      reaper_ = std::thread([this] { reap(); });
    } catch (...) {
      ::io_uring_queue_exit(&ring_);
      throw;
    }
  }
  uring_io(const uring_io&) = delete;
  uring_io& operator=(const uring_io&) = delete;
  ~uring_io() {
    // A NOP without user data tells the reaper to stop; it comes after every request submitted
    // before it (the engine joined its workers first, so none is pending).
    bool sent = false;
    {
      const std::lock_guard lock(submit_mutex_);
      if (io_uring_sqe* sqe = get_sqe()) {
        ::io_uring_prep_nop(sqe);
        ::io_uring_sqe_set_data(sqe, nullptr);
        sent = ::io_uring_submit(&ring_) >= 1;
      }
    }
    if (!sent) stop_.store(true);  // the reaper polls the flag when it cannot be woken by the ring
    if (reaper_.joinable()) reaper_.join();
    ::io_uring_queue_exit(&ring_);
  }

  /** @brief One read or write; bytes moved or -errno. Blocks the calling worker only. */
  [[nodiscard]] long long rw(bool write, int fd, void* buf, std::size_t n, std::uint64_t off) noexcept {
    request r;
    {
      const std::lock_guard lock(submit_mutex_);
      io_uring_sqe* sqe = get_sqe();
      if (sqe == nullptr) return -EBUSY;
      if (write) ::io_uring_prep_write(sqe, fd, buf, static_cast<unsigned>(n), off);
      else ::io_uring_prep_read(sqe, fd, buf, static_cast<unsigned>(n), off);
      ::io_uring_sqe_set_data(sqe, &r);
      const int rc = ::io_uring_submit(&ring_);
      if (rc < 0) return rc;
    }
    std::unique_lock lock(r.mutex);
    r.cv.wait(lock, [&] { return r.done; });
    return r.res;
  }

 private:
  struct request {
    std::mutex mutex;
    std::condition_variable cv;
    bool done = false;
    int res = 0;
  };

  io_uring_sqe* get_sqe() noexcept {
    io_uring_sqe* sqe = ::io_uring_get_sqe(&ring_);
    if (sqe == nullptr && ::io_uring_submit(&ring_) >= 0) sqe = ::io_uring_get_sqe(&ring_);
    return sqe;
  }

  void reap() noexcept {
    for (;;) {
      io_uring_cqe* cqe = nullptr;
      __kernel_timespec ts{0, 100'000'000};
      const int rc = ::io_uring_wait_cqe_timeout(&ring_, &cqe, &ts);
      if (rc == -ETIME || rc == -EINTR) {
        if (stop_.load()) return;
        continue;
      }
      if (rc < 0) {
        if (stop_.load()) return;
        continue;
      }
      auto* r = static_cast<request*>(::io_uring_cqe_get_data(cqe));
      const int res = cqe->res;
      ::io_uring_cqe_seen(&ring_, cqe);
      if (r == nullptr) return;  // the destructor's NOP
      // The request's address came through the kernel's ring, which no happens-before tracker
      // (TSan) sees; taking the submission lock orders us after the submitter's unlock, a real
      // edge that costs an uncontended lock per completion.
      { const std::lock_guard sync(submit_mutex_); }
      {
        const std::lock_guard lock(r->mutex);
        r->res = res;
        r->done = true;
        r->cv.notify_one();  // under the lock: the request lives on the waiter's stack
      }
    }
  }

  io_uring ring_{};
  std::mutex submit_mutex_;
  std::atomic<bool> stop_{false};
  std::thread reaper_;
};

}  // namespace detail

/** @brief Copies between host memory and one `disk_space` on io_uring. Same contract, options and
 *  errors as `disk_copy_engine`; the constructor throws `io_uring_unavailable` where the kernel
 *  refuses io_uring. Models `CopyEngine`. */
using uring_copy_engine = detail::basic_disk_copy_engine<detail::uring_io>;

static_assert(CopyEngine<uring_copy_engine>);

/** @brief True when this kernel lets the process set up an io_uring. */
[[nodiscard]] inline bool io_uring_available() noexcept {
  io_uring ring{};
  if (::io_uring_queue_init(2, &ring, 0) < 0) return false;
  ::io_uring_queue_exit(&ring);
  return true;
}

/** @brief An io_uring engine where the kernel allows it, else the thread-pool engine. */
using any_disk_copy_engine = std::variant<std::unique_ptr<uring_copy_engine>, std::unique_ptr<disk_copy_engine>>;
[[nodiscard]] inline any_disk_copy_engine make_uring_or_pool_engine(disk_space& space,
                                                                    disk_copy_engine_options options = {}) {
  try {
    return std::make_unique<uring_copy_engine>(space, options);
  } catch (const io_uring_unavailable&) {
    return std::make_unique<disk_copy_engine>(space, options);
  }
}

}  // namespace chunkstar

#endif  // CHUNKSTAR_HAS_URING()
