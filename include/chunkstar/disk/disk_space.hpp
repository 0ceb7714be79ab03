// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `disk_space`: a `MemorySpace` over one preallocated file in a directory the user names,
 *         the storage of a disk tier (issue #14). Linux/POSIX only.
 *
 *  Pointers without memory. The space reserves an address range of `capacity` bytes with
 *  PROT_NONE (mmap, never touched, MAP_NORESERVE: no memory is committed) and hands out addresses
 *  inside it; `address - base` is the file offset. So the `MemorySpace` concept holds unchanged,
 *  the runtime can keep one `void*` per chunk whatever tier holds it, and host code can never read
 *  disk memory by accident: a dereference faults at once (hence `can_access_v<host_exec,
 *  disk_space>` is false). Bytes move only through a disk copy engine (disk_copy_engine.hpp), which
 *  maps a pointer to an offset with `offset_of`.
 *
 *  Allocation is a first-fit free list over file offsets, coalesced on free, under one lock:
 *  addresses are aligned to max(requested alignment, block alignment), and so are file offsets
 *  for alignments up to `base_alignment` (2 MiB; the range starts there), sizes
 *  are rounded up to the block, so two blocks never share a disk block (O_DIRECT read-modify-write
 *  of one block cannot clobber another). `used()` counts the rounded sizes and never exceeds the
 *  capacity.
 */
#pragma once

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/memory_report.hpp>
#include <chunkstar/core/units.hpp>
#include <chunkstar/memory/detail/space_accounting.hpp>
#include <chunkstar/memory/memory_space.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace chunkstar {

/** @brief Knobs of a `disk_space`. */
struct disk_space_options {
  /** @brief Existing, writable directory that receives the backing file (required). */
  std::string directory;
  /** @brief Bytes of the backing file, preallocated at construction (required, > 0; rounded up to
   *  the block alignment). */
  std::size_t capacity = 0;
  /** @brief Granule of offsets and sizes, a power of two >= 512; O_DIRECT needs buffers, offsets
   *  and sizes aligned to the device's logical block, which 4096 covers on every current disk. */
  std::size_t block_alignment = 4096;
  /** @brief Name in reports and errors. */
  std::string name = "disk";
  /** @brief Open the file with O_DIRECT (no page-cache copy). Where the filesystem refuses it
   *  (tmpfs on older kernels, some overlay setups) the space falls back to buffered I/O and says so
   *  in `note()`. */
  bool use_direct_io = true;
};

/** @brief A file-backed memory space. Thread-safe. Models `MemorySpace` (kind `file`).
 *
 *  Construction creates a file without a name in `directory` (O_TMPFILE; where the filesystem
 *  lacks it, `chunkstar-<name>-XXXXXX.swap` unlinked as soon as it is open), preallocates
 *  `capacity` bytes (fallocate; posix_fallocate where the filesystem lacks it) and reserves the
 *  address range. Nothing outlives the process: the kernel frees the blocks when the descriptor
 *  closes, on any exit (kill -9 included), and no other process can find or open the file.
 *  Errors: an empty directory option, a capacity of 0 or a bad alignment -> config_error; a
 *  directory that does not exist or is not a directory -> config_error naming it; no permission,
 *  a read-only filesystem or too little free space (ENOSPC, EDQUOT) -> io_error naming the
 *  directory, the bytes and what to do. After a throw nothing is left behind (no file, no mapping).
 *  The destructor closes the file (its space returns to the filesystem) and unmaps the range.
 */
class disk_space {
 public:
  static constexpr memory_kind kind = memory_kind::file;
  /** @brief Alignment of `base()`: up to this (or the block, if larger) an address's alignment is
   *  its file offset's. Larger alignments are honoured in the address only. */
  static constexpr std::size_t base_alignment = std::size_t{2} << 20;

  explicit disk_space(disk_space_options options)
      : options_(std::move(options)), capacity_(validated_capacity(options_)), accounting_(capacity_) {
    const std::string& dir = options_.directory;
    const std::size_t b = options_.block_alignment;
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0) {
      const int e = errno;
      if (e == ENOENT || e == ENOTDIR) {
        throw config_error(options_.name + ": directory '" + dir + "' does not exist; create it or point " +
                           "disk_space_options::directory at an existing one");
      }
      throw io_error(options_.name + ": cannot stat directory '" + dir + "': " + std::strerror(e));
    }
    if (!S_ISDIR(st.st_mode)) {
      throw config_error(options_.name + ": '" + dir + "' is not a directory; disk_space_options::directory " +
                         "must name a directory (the space creates its own file in it)");
    }

    // The file never has a name another process could see or a crash could leave behind:
    // O_TMPFILE makes it nameless in the directory's filesystem; where that filesystem lacks it,
    // a named file is created and unlinked at once. Either way the kernel frees its blocks when
    // the last descriptor closes: after any exit, kill -9 included.
    int fd0 = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd0 < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
      std::string tmpl = dir + (dir.back() == '/' ? "" : "/") + "chunkstar-" + options_.name + "-XXXXXX.swap";
      std::vector<char> buf(tmpl.begin(), tmpl.end());
      buf.push_back('\0');
      fd0 = ::mkostemps(buf.data(), 5, O_CLOEXEC);
      if (fd0 >= 0) ::unlink(buf.data());
    }
    if (fd0 < 0) {
      const int e = errno;
      throw io_error(options_.name + ": cannot create a file in '" + dir + "': " + std::strerror(e) +
                     (e == EACCES || e == EPERM ? "; make the directory writable for this user or choose another"
                      : e == EROFS              ? "; the filesystem is read-only, choose a writable directory"
                                                : ""));
    }
    fd_owned_ = fd0;
    cleanup guard{this};

    if (options_.use_direct_io) {
      const int flags = ::fcntl(fd_owned_, F_GETFL);
      if (flags >= 0 && ::fcntl(fd_owned_, F_SETFL, flags | O_DIRECT) == 0) {
        direct_ = true;
      } else {
        note_ = "O_DIRECT refused by the filesystem of '" + dir + "' (" + std::strerror(errno) +
                "); using buffered I/O through the page cache";
      }
    }

    int rc = ::fallocate(fd_owned_, 0, 0, static_cast<off_t>(capacity_));
    if (rc != 0 && (errno == EOPNOTSUPP || errno == ENOSYS))
      rc = ::posix_fallocate(fd_owned_, 0, static_cast<off_t>(capacity_));
    else if (rc != 0) rc = errno;
    if (rc != 0) {
      const std::string what = options_.name + ": cannot preallocate " + format_bytes(capacity_) + " (" +
                               std::to_string(capacity_) + " bytes) in '" + dir + "': " + std::strerror(rc);
      if (rc == ENOSPC || rc == EDQUOT) {
        throw io_error(what +
                       "; free space on that filesystem, lower disk_space_options::capacity, or choose a "
                       "directory on a larger disk");
      }
      throw io_error(what);
    }

    // Reserve the address range with its start aligned to max(block, 2 MiB), so that for any
    // alignment up to that, an aligned address is an equally aligned file offset.
    const std::size_t base_align = std::max(b, base_alignment);
    map_bytes_ = capacity_ + base_align;
    void* m = ::mmap(nullptr, map_bytes_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
      throw io_error(options_.name + ": cannot reserve " + format_bytes(capacity_) +
                     " of address space: " + std::strerror(errno) + "; lower disk_space_options::capacity");
    }
    map_ = static_cast<unsigned char*>(m);
    base_ = reinterpret_cast<unsigned char*>(detail::round_up_pow2(reinterpret_cast<std::uintptr_t>(map_), base_align));
    free_.emplace(0, capacity_);
    fd_.store(fd_owned_, std::memory_order_relaxed);
    guard.self = nullptr;
  }

  disk_space(const disk_space&) = delete;
  disk_space& operator=(const disk_space&) = delete;
  /** @brief Closes the file (its blocks return to the filesystem), releases the address range.
   *  Blocks still allocated are simply gone; engines using this space must be destroyed (or
   *  synchronized) first. */
  ~disk_space() { release(); }

  /** @brief `n` bytes at an address (and file offset) aligned to max(`a`, the block); throws
   *  out_of_memory_error with this space's usage. */
  [[nodiscard]] void* allocate(std::size_t n, std::size_t a = 1) {
    if (void* p = try_allocate(n, a)) return p;
    throw detail::make_oom(options_.name, n, a, usage(),
                           "free disk blocks first or raise disk_space_options::capacity");
  }

  /** @brief As allocate(), but nullptr when no free extent fits. */
  [[nodiscard]] void* try_allocate(std::size_t n, std::size_t a = 1) {
    detail::check_alignment(a, options_.name);
    const std::size_t b = options_.block_alignment;
    const std::size_t size = rounded(n);
    const std::size_t align = std::max(a, b);
    if (size == std::numeric_limits<std::size_t>::max() || size > capacity_) return nullptr;
    const std::lock_guard lock(mutex_);
    const auto base = reinterpret_cast<std::uintptr_t>(base_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      const std::size_t off = it->first, len = it->second;
      const std::uintptr_t addr = detail::round_up_pow2(base + off, align);
      if (addr == std::numeric_limits<std::uintptr_t>::max()) continue;
      const std::size_t start = addr - base;
      if (start - off > len || len - (start - off) < size) continue;
      const std::size_t tail_off = start + size, tail_len = off + len - tail_off;
      if (start > off) it->second = start - off;  // the head stays free
      else free_.erase(it);
      if (tail_len > 0) free_.emplace(tail_off, tail_len);
      (void)accounting_.try_reserve(size);  // cannot fail: the free extents never exceed the capacity
      return base_ + start;
    }
    return nullptr;
  }

  /** @brief Return a block; `n` and `a` as passed to allocate. Pointers not from this space are ignored. */
  void deallocate(void* p, std::size_t n, std::size_t /*a*/ = 1) noexcept {
    if (p == nullptr || !contains(p)) return;
    std::size_t off = offset_of(p), size = rounded(n);
    const std::lock_guard lock(mutex_);
    accounting_.release(size);
    auto next = free_.lower_bound(off);
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == off) {  // merge into the extent before
        off = prev->first;
        size += prev->second;
        free_.erase(prev);
      }
    }
    if (next != free_.end() && off + size == next->first) {
      size += next->second;
      free_.erase(next);
    }
    free_.emplace(off, size);
  }

  /** @brief True when `p` lies inside this space's address range (allocated or not). */
  [[nodiscard]] bool contains(const void* p) const noexcept {
    const auto* c = static_cast<const unsigned char*>(p);
    return base_ != nullptr && c >= base_ && c < base_ + capacity_;
  }
  /** @brief File offset of `p`; `p` must satisfy `contains(p)` or be one past the end. */
  [[nodiscard]] std::uint64_t offset_of(const void* p) const noexcept {
    return static_cast<std::uint64_t>(static_cast<const unsigned char*>(p) - base_);
  }
  /** @brief First address of the range (file offset 0). Never dereference it. */
  [[nodiscard]] const void* base() const noexcept { return base_; }
  /** @brief The backing file's descriptor, open read-write (with O_DIRECT when `direct()`). */
  [[nodiscard]] int fd() const noexcept { return fd_.load(std::memory_order_acquire); }
  /** @brief True when the file is open with O_DIRECT: engines must then align buffers, offsets
   *  and sizes to `block_alignment()` (they bounce through an aligned buffer when the caller's are not). */
  [[nodiscard]] bool direct() const noexcept { return direct_; }
  /** @brief Why O_DIRECT is off although asked for; empty otherwise. */
  [[nodiscard]] const std::string& note() const noexcept { return note_; }
  /** @brief A path by which this process (only) can open the backing file, which has no name in
   *  its directory: `/proc/self/fd/<fd>` (for tests and tools that inspect it). */
  [[nodiscard]] std::string path() const { return "/proc/self/fd/" + std::to_string(fd_owned_); }
  [[nodiscard]] std::size_t block_alignment() const noexcept { return options_.block_alignment; }

  /** @brief Test hook: makes `fd()` return -1 from now on, as if the descriptor were lost, so every
   *  later I/O fails with EBADF (the real descriptor is still closed by the destructor). */
  void invalidate_fd_for_testing() noexcept { fd_.store(-1, std::memory_order_release); }

  /** @brief The capacity in bytes (the option rounded up to the block). */
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }
  [[nodiscard]] std::size_t used() const noexcept { return accounting_.used(); }
  /** @brief Highest `used()` since construction or reset_peak(). */
  [[nodiscard]] std::size_t peak() const noexcept { return accounting_.peak(); }
  void reset_peak() noexcept { accounting_.reset_peak(); }
  /** @brief Usage; `largest_free_block` is the largest free extent (the file can fragment). */
  [[nodiscard]] space_usage usage() const {
    const std::lock_guard lock(mutex_);
    space_usage u = accounting_.snapshot(options_.name);
    u.largest_free_block = 0;
    for (const auto& [off, len] : free_) u.largest_free_block = std::max(u.largest_free_block, len);
    return u;
  }
  [[nodiscard]] const std::string& name() const noexcept { return options_.name; }
  [[nodiscard]] const disk_space_options& options() const noexcept { return options_; }

 private:
  struct cleanup {  // undoes a half-built constructor
    disk_space* self;
    ~cleanup() {
      if (self) self->release();
    }
  };

  /** The options checked (directory named, capacity > 0, block a power of two >= 512) and the
   *  capacity rounded up to the block. */
  static std::size_t validated_capacity(const disk_space_options& o) {
    if (o.directory.empty()) {
      throw config_error(o.name +
                         ": disk_space_options::directory is empty; name an existing, writable "
                         "directory on the disk that should hold the swap file");
    }
    if (o.capacity == 0) {
      throw config_error(o.name +
                         ": disk_space_options::capacity is 0; set the bytes of disk to use (for "
                         "example 64 GiB)");
    }
    const std::size_t b = o.block_alignment;
    if (b < 512 || (b & (b - 1)) != 0) {
      throw config_error(o.name + ": block_alignment " + std::to_string(b) +
                         " must be a power of two >= 512 (default 4096)");
    }
    return detail::round_up_pow2(o.capacity, b);
  }

  [[nodiscard]] std::size_t rounded(std::size_t n) const noexcept {
    return detail::round_up_pow2(n == 0 ? 1 : n, options_.block_alignment);
  }

  void release() noexcept {
    if (map_ != nullptr) ::munmap(map_, map_bytes_);
    map_ = base_ = nullptr;
    if (fd_owned_ >= 0) ::close(fd_owned_);
    fd_owned_ = -1;
    fd_.store(-1);
  }

  disk_space_options options_;
  std::size_t capacity_ = 0;
  std::string note_;
  int fd_owned_ = -1;
  std::atomic<int> fd_{-1};
  bool direct_ = false;
  unsigned char* map_ = nullptr;  // the whole reservation
  std::size_t map_bytes_ = 0;
  unsigned char* base_ = nullptr;            // block-aligned start inside it: file offset 0
  detail::space_accounting accounting_;      // used and peak bytes
  mutable std::mutex mutex_;                 // the free list (taken before accounting_'s own lock)
  std::map<std::size_t, std::size_t> free_;  // offset -> length, disjoint, coalesced
};

// can_access_v<host_exec, disk_space> stays false (the primary template): the range is PROT_NONE.
// copy_traits stay "not possible" too: no memcpy can reach a file; bytes move only through a disk
// copy engine, which checks which pointer is on disk.

static_assert(MemorySpace<disk_space>);

}  // namespace chunkstar
