// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief The few POSIX file operations checkpoints need, with complete reads and writes (EINTR and
 *         short transfers retried) and errors that name the file: durability needs fsync on the
 *         file and on its directory, which the standard library does not offer.
 */
#pragma once

#include <chunkstar/core/error.hpp>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <system_error>
#include <utility>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace chunkstar::checkpoint_detail {

/** @brief "<what> '<path>': <strerror(err)>". */
inline std::string errno_message(const std::string& what, const std::filesystem::path& p, int err) {
  return what + " '" + p.string() + "': " + std::system_category().message(err);
}

/** @brief An open file descriptor, closed on destruction. */
class unique_fd {
 public:
  unique_fd() = default;
  explicit unique_fd(int fd) noexcept : fd_(fd) {}
  unique_fd(unique_fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  unique_fd& operator=(unique_fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  unique_fd(const unique_fd&) = delete;
  unique_fd& operator=(const unique_fd&) = delete;
  ~unique_fd() { reset(); }

  [[nodiscard]] int get() const noexcept { return fd_; }
  [[nodiscard]] explicit operator bool() const noexcept { return fd_ >= 0; }
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  /** @brief Closes and reports a failed close (on some file systems the last write error shows here). */
  [[nodiscard]] int close() noexcept {
    const int rc = fd_ >= 0 ? ::close(fd_) : 0;
    fd_ = -1;
    return rc == 0 ? 0 : errno;
  }

 private:
  int fd_ = -1;
};

inline unique_fd open_file(const std::filesystem::path& p, int flags, const char* what, mode_t mode = 0644) {
  int fd;
  do fd = ::open(p.c_str(), flags | O_CLOEXEC, mode);
  while (fd < 0 && errno == EINTR);
  if (fd < 0) throw checkpoint_error(errno_message(what, p, errno));
  return unique_fd(fd);
}

/** Creates `<path>.tmp.<pid>.<n>`, a file no one else has: O_EXCL (never an existing file, never
 *  through a symbolic link); the next n when one is left over. */
inline std::pair<unique_fd, std::filesystem::path> create_temporary(const std::filesystem::path& path) {
  static std::atomic<unsigned> serial{0};  // two writers in one process never share a temporary
  for (int attempt = 0;; ++attempt) {
    std::filesystem::path tmp = path;
    tmp += ".tmp." + std::to_string(::getpid()) + "." + std::to_string(serial++);
    int fd;
    do fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    while (fd < 0 && errno == EINTR);
    if (fd >= 0) return {unique_fd(fd), tmp};
    if (errno != EEXIST || attempt > 1000) throw checkpoint_error(errno_message("cannot create", tmp, errno));
  }
}

inline void write_all(int fd, std::span<const std::byte> data, const std::filesystem::path& p) {
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      throw checkpoint_error(errno_message("cannot write", p, n < 0 ? errno : EIO) +
                             ": free disk space or choose another directory");
    data = data.subspan(static_cast<std::size_t>(n));
  }
}

inline void pwrite_all(int fd, std::span<const std::byte> data, std::uint64_t offset, const std::filesystem::path& p) {
  while (!data.empty()) {
    const ssize_t n = ::pwrite(fd, data.data(), data.size(), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw checkpoint_error(errno_message("cannot write", p, n < 0 ? errno : EIO));
    data = data.subspan(static_cast<std::size_t>(n));
    offset += static_cast<std::uint64_t>(n);
  }
}

/** @brief Reads exactly @p out.size() bytes at @p offset; a short file is reported as truncation. */
inline void pread_all(int fd, std::span<std::byte> out, std::uint64_t offset, const std::filesystem::path& p) {
  while (!out.empty()) {
    const ssize_t n = ::pread(fd, out.data(), out.size(), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw checkpoint_error(errno_message("cannot read", p, errno));
    if (n == 0)
      throw checkpoint_error(
          "checkpoint file '" + p.string() + "' ended at byte " + std::to_string(offset) +
          " while reading: it shrank after it was opened; do not modify checkpoints while loading them");
    out = out.subspan(static_cast<std::size_t>(n));
    offset += static_cast<std::uint64_t>(n);
  }
}

inline void fsync_fd(int fd, const std::filesystem::path& p) {
  int rc;
  do rc = ::fsync(fd);
  while (rc != 0 && errno == EINTR);
  // Directories on some file systems refuse fsync (EINVAL): there is nothing more to flush then.
  if (rc != 0 && errno != EINVAL) throw checkpoint_error(errno_message("cannot fsync", p, errno));
}

/** @brief Makes the directory entries of @p dir durable (a rename is only durable after this). */
inline void fsync_directory(const std::filesystem::path& dir) {
  const auto d = dir.empty() ? std::filesystem::path(".") : dir;
  auto fd = open_file(d, O_RDONLY | O_DIRECTORY, "cannot open directory");
  fsync_fd(fd.get(), d);
}

/** @brief Size of the open file. */
inline std::uint64_t file_size(int fd, const std::filesystem::path& p) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw checkpoint_error(errno_message("cannot stat", p, errno));
  if (!S_ISREG(st.st_mode))
    throw checkpoint_error("checkpoint file '" + p.string() +
                           "' is not a regular file: pass the path of a .safetensors file");
  return static_cast<std::uint64_t>(st.st_size);
}

}  // namespace chunkstar::checkpoint_detail
