// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief The checkpoint directory's life cycle, kept apart from the tensors: recognising a
 *         chunkstar checkpoint by its own metadata, the advisory lock that serialises writers, a
 *         temporary directory unique to each writer, and the swap of a complete directory into
 *         place. Everything here deletes only what this writer created, or a checkpoint it replaces.
 */
#pragma once

#include <chunkstar/checkpoint/detail/posix_file.hpp>
#include <chunkstar/checkpoint/safetensors.hpp>
#include <chunkstar/core/error.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <map>
#include <optional>
#include <random>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

namespace chunkstar {

/** @brief File names inside a checkpoint directory. One process writes the first two; N sharded
 *  ranks write `model-<r>-of-<N>.safetensors` and `optimizer-<r>-of-<N>.safetensors` (r from 1,
 *  five digits, as Hugging Face shards are named) and the index. */
inline constexpr std::string_view checkpoint_model_file = "model.safetensors";
inline constexpr std::string_view checkpoint_optimizer_file = "optimizer.safetensors";
inline constexpr std::string_view checkpoint_index_file = "model.safetensors.index.json";

namespace checkpoint_detail {

inline constexpr std::string_view checkpoint_model_stem = "model";
inline constexpr std::string_view checkpoint_optimizer_stem = "optimizer";
/// The metadata entry every file of one save carries alike (new_save_id), so that a load can tell
/// files of two saves apart even when each file is whole and each pair matches.
inline constexpr const char* save_id_key = "chunkstar.save_id";

/** A fresh identity for one save: random bits, the pid and the time, as 32 hex digits. */
inline std::string new_save_id() {
  std::random_device rd;
  const std::uint64_t a = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
  const std::uint64_t b = static_cast<std::uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()) ^
                          (static_cast<std::uint64_t>(::getpid()) << 40);
  return hex64(a) + hex64(b);
}

/** "<stem>-00002-of-00004.safetensors" for rank 1 of 4. */
inline std::string shard_file_name(std::string_view stem, int rank, int world) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "-%05d-of-%05d.safetensors", rank + 1, world);
  return std::string(stem) + buf;
}

/** (rank, world) when @p name is a shard file of @p stem, else nullopt. */
inline std::optional<std::pair<int, int>> parse_shard_name(std::string_view name, std::string_view stem) {
  int r = 0, w = 0;
  char tail[32] = {};
  const std::string fmt = std::string(stem) + "-%5d-of-%5d%31s";
  if (std::sscanf(std::string(name).c_str(), fmt.c_str(), &r, &w, tail) != 3 ||
      std::string_view(tail) != ".safetensors")
    return std::nullopt;
  if (r < 1 || w < 1 || r > w || shard_file_name(stem, r - 1, w) != name) return std::nullopt;
  return std::pair{r - 1, w};
}

/** True when @p name is a file a checkpoint directory holds. */
inline bool checkpoint_entry(std::string_view name) {
  return name == checkpoint_model_file || name == checkpoint_optimizer_file || name == checkpoint_index_file ||
         parse_shard_name(name, checkpoint_model_stem) || parse_shard_name(name, checkpoint_optimizer_stem);
}

/** "<dir><suffix>" beside @p dir ("ckpt/" names the directory "ckpt"). */
inline std::filesystem::path with_suffix(const std::filesystem::path& dir, std::string_view suffix) {
  std::filesystem::path p = dir;
  if (!p.has_filename()) p = p.parent_path();
  p += suffix;
  return p;
}

inline std::filesystem::path parent_of(const std::filesystem::path& dir) {
  auto p = with_suffix(dir, "").parent_path();
  return p.empty() ? std::filesystem::path(".") : p;
}

/** Why @p file is not a safetensors file written by chunkstar, or empty when it is one: it opens
 *  and validates (the checksum is not recomputed) and carries chunkstar's own metadata. */
inline std::string not_chunkstar_file(const std::filesystem::path& file) {
  try {
    const auto f = safetensors_file::open(file, {.verify_checksum = false});
    const auto& m = f.metadata();
    if (!m.contains(std::string(safetensors_checksum_key)) || !m.contains("chunkstar.param_type"))
      return "'" + file.filename().string() + "' has no chunkstar metadata (written by another tool)";
    return {};
  } catch (const error& e) {
    return e.what();
  }
}

/** Why save_checkpoint may not replace the existing @p dir, or empty when it may: @p dir is an
 *  empty directory, or holds nothing but the two checkpoint files, each written by chunkstar. */
inline std::string not_replaceable(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const auto st = fs::symlink_status(dir, ec);
  if (ec) return "cannot inspect it: " + ec.message();
  if (!fs::is_directory(st)) return fs::is_symlink(st) ? "it is a symbolic link" : "it is not a directory";
  std::vector<std::string> foreign;
  int ours = 0;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const auto name = it->path().filename().string();
    if (checkpoint_entry(name) && it->is_regular_file(ec)) {
      if (name == checkpoint_index_file) continue;  // it names the shards; the shards are checked
      if (auto why = not_chunkstar_file(it->path()); !why.empty()) return why;
      ++ours;
    } else {
      foreign.push_back("'" + name + "'");
    }
  }
  if (ec) return "cannot list it: " + ec.message();
  if (!foreign.empty()) {
    std::string list;
    for (std::size_t i = 0; i < foreign.size() && i < 5; ++i) list += (i ? ", " : "") + foreign[i];
    if (foreign.size() > 5) list += " and " + std::to_string(foreign.size() - 5) + " more";
    return "it holds " + list + ", which a chunkstar checkpoint does not" + (ours ? " (besides checkpoint files)" : "");
  }
  return {};
}

/** Throws checkpoint_error when @p dir exists and save_checkpoint may not replace it. */
inline void refuse_unless_replaceable(const std::filesystem::path& dir) {
  std::error_code ec;
  if (!std::filesystem::exists(std::filesystem::symlink_status(dir, ec))) return;
  if (const auto why = not_replaceable(dir); !why.empty())
    throw checkpoint_error(
        "refusing to replace '" + dir.string() + "' with a checkpoint: " + why +
        "; a save replaces only an empty directory or a chunkstar checkpoint, so choose another path or move it away");
}

/** An exclusive (writers) or shared (readers) advisory lock on `<dir>.lock`, a small file beside
 *  the checkpoint that holds the last writer's pid. The kernel drops the lock when its holder dies,
 *  so a killed writer never blocks the next one; the file itself stays (deleting a lock file races
 *  with the next locker). Waits at most @p timeout, then throws naming the holder. */
class directory_lock {
 public:
  directory_lock() = default;
  directory_lock(const std::filesystem::path& dir, bool exclusive, std::chrono::milliseconds timeout,
                 bool optional_if_unwritable = false) {
    path_ = with_suffix(dir, ".lock");
    fd_ = open_lock_file(path_, optional_if_unwritable);
    if (!fd_) return;  // read-only media
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if (::flock(fd_.get(), (exclusive ? LOCK_EX : LOCK_SH) | LOCK_NB) == 0) break;
      if (errno == EINTR) continue;
      if (errno != EWOULDBLOCK)
        throw checkpoint_error(errno_message("cannot lock", path_, errno) +
                               ": the file system may not support flock; save elsewhere");
      if (std::chrono::steady_clock::now() >= deadline)
        throw checkpoint_error(
            "another process (" + holder() + ") has held '" + path_.string() + "' for more than " +
            std::to_string(timeout.count() / 1000.0).substr(0, 5) +
            " s while saving or loading this checkpoint: wait for it to finish, or use another path");
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (exclusive) {  // for the message a waiting writer prints; failure to record it is harmless
      const std::string pid = std::to_string(::getpid()) + "\n";
      if (::ftruncate(fd_.get(), 0) == 0) (void)!::pwrite(fd_.get(), pid.data(), pid.size(), 0);
    }
  }
  [[nodiscard]] bool held() const noexcept { return static_cast<bool>(fd_); }

  /** Throws now what taking the lock of @p dir would throw for the file itself (a link, not a
   *  regular file, not writable), without creating or locking it. */
  static void check_path(const std::filesystem::path& dir) {
    const auto path = with_suffix(dir, ".lock");
    struct stat st {};
    if (::lstat(path.c_str(), &st) != 0) return;  // missing: created by the save, beside the probe made before
    (void)open_lock_file(path, false);
  }

  /** O_NOFOLLOW, and a regular file only: a lock never writes through a link, nor into a FIFO or
   *  a device. An empty descriptor when @p optional_if_unwritable and the medium is read-only. */
  static unique_fd open_lock_file(const std::filesystem::path& path, bool optional_if_unwritable) {
    int fd;
    do fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW, 0644);
    while (fd < 0 && errno == EINTR);
    if (fd < 0) {
      if (errno == ELOOP)
        throw checkpoint_error(
            "the checkpoint lock file '" + path.string() +
            "' is a symbolic link, which a lock never follows (it would write into the link's target): "
            "remove the link or choose another checkpoint path");
      if (optional_if_unwritable && (errno == EACCES || errno == EROFS || errno == EPERM))
        return {};  // read-only media
      throw checkpoint_error(errno_message("cannot open the checkpoint lock file", path, errno) +
                             ": make the directory that holds the checkpoint writable or choose another path");
    }
    unique_fd owned(fd);
    struct stat st {};
    if (::fstat(owned.get(), &st) != 0 || !S_ISREG(st.st_mode))
      throw checkpoint_error("the checkpoint lock file '" + path.string() +
                             "' is not a regular file: remove it or choose another checkpoint path");
    return owned;
  }

 private:
  [[nodiscard]] std::string holder() const {
    char buf[32] = {};
    const ssize_t n = ::pread(fd_.get(), buf, sizeof buf - 1, 0);
    const std::string s = n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string();
    const auto digits = s.substr(0, s.find_first_not_of("0123456789"));
    return digits.empty() ? "pid unknown" : "pid " + digits;
  }

  std::filesystem::path path_;
  unique_fd fd_;  // closing it releases the lock
};

/** The prefix of every temporary directory of a save to @p dir: `<dir>.tmp.` then pid and serial. */
inline std::string temp_prefix(const std::filesystem::path& dir) {
  return with_suffix(dir, ".tmp.").filename().string();
}

/** Creates a new, empty temporary directory beside @p dir that no one else uses: `<dir>.tmp.<pid>.<n>`
 *  made with mkdir, which fails rather than reuse an existing path. */
inline std::filesystem::path make_temp_directory(const std::filesystem::path& dir) {
  static std::atomic<unsigned> serial{0};
  for (int attempt = 0;; ++attempt) {
    const auto p = with_suffix(dir, ".tmp." + std::to_string(::getpid()) + "." + std::to_string(serial++));
    if (::mkdir(p.c_str(), 0755) == 0) return p;
    if (errno != EEXIST || attempt > 1000)
      throw checkpoint_error(errno_message("cannot create the temporary directory", p, errno) +
                             ": make the parent directory writable or choose another path");
  }
}

/** True when @p name is one of the files save_checkpoint writes into its temporary directory. */
inline bool own_temp_entry(std::string_view name) {
  if (checkpoint_entry(name)) return true;
  const auto tmp = name.find(".tmp.");  // a file being written: "<entry>.tmp.<pid>.<n>"
  return tmp != std::string_view::npos && checkpoint_entry(name.substr(0, tmp));
}

/** The shard files of @p stem in @p dir, in rank order; empty when there are none.
 *  @throws checkpoint_error when shards are missing or of different world sizes. */
inline std::vector<std::filesystem::path> shard_files(const std::filesystem::path& dir, std::string_view stem) {
  namespace fs = std::filesystem;
  std::error_code ec;
  int world = 0;
  std::vector<std::filesystem::path> found;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const auto name = it->path().filename().string();
    const auto rw = parse_shard_name(name, stem);
    if (!rw) continue;
    if (world != 0 && rw->second != world)
      throw checkpoint_error("checkpoint '" + dir.string() + "' mixes shards of " + std::to_string(world) + " and " +
                             std::to_string(rw->second) +
                             " ranks: its files come from different saves; use a complete checkpoint directory");
    world = rw->second;
    found.resize(static_cast<std::size_t>(world));
    found[static_cast<std::size_t>(rw->first)] = it->path();
  }
  for (std::size_t r = 0; r < found.size(); ++r)
    if (found[r].empty())
      throw checkpoint_error("checkpoint '" + dir.string() + "' lacks " +
                             shard_file_name(stem, static_cast<int>(r), world) +
                             ": a shard is missing; use a complete checkpoint directory");
  return found;
}

/** The files of one list of a checkpoint (one, or one per rank of a sharded save) read as one:
 *  every tensor name in exactly one file. */
class file_set {
 public:
  explicit file_set(std::vector<safetensors_file> files) : files_(std::move(files)) {
    for (std::size_t k = 0; k < files_.size(); ++k)
      for (const auto& t : files_[k].tensors())
        if (!where_.emplace(t.name, k).second)
          throw checkpoint_error("checkpoint tensor '" + t.name + "' is in both " +
                                 files_[where_[t.name]].path().filename().string() + " and " +
                                 files_[k].path().filename().string() + ": the files come from different saves");
  }
  [[nodiscard]] const safetensors_tensor_info* find(std::string_view name) const {
    const auto it = where_.find(std::string(name));
    return it == where_.end() ? nullptr : files_[it->second].find(name);
  }
  void read_floats(std::string_view name, std::span<float> out) const {
    files_[where_.at(std::string(name))].read_floats(name, out);
  }
  [[nodiscard]] const std::map<std::string, std::string>& metadata() const { return files_.front().metadata(); }
  [[nodiscard]] const std::filesystem::path& first_path() const { return files_.front().path(); }
  [[nodiscard]] std::string description() const {
    return files_.size() == 1
               ? files_.front().path().filename().string()
               : std::to_string(files_.size()) + " shards (" + files_.front().path().filename().string() + ", ...)";
  }
  [[nodiscard]] std::vector<std::string> names() const {
    std::vector<std::string> v;
    for (const auto& [n, k] : where_) v.push_back(n);
    return v;
  }
  [[nodiscard]] const std::vector<safetensors_file>& files() const noexcept { return files_; }

 private:
  std::vector<safetensors_file> files_;
  std::map<std::string, std::size_t> where_;
};

/** Opens and verifies the model and optimizer files of the checkpoint @p dir (one process's, or
 *  every shard of a sharded save), each optimizer file paired with its model file by checksum. */
inline std::pair<file_set, file_set> open_checkpoint_files(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<fs::path> models, opts;
  if (fs::exists(dir / checkpoint_model_file, ec) || !fs::exists(dir / checkpoint_index_file, ec)) {
    models = {dir / checkpoint_model_file};
    opts = {dir / checkpoint_optimizer_file};
  } else {
    models = shard_files(dir, checkpoint_model_stem);
    opts = shard_files(dir, checkpoint_optimizer_stem);
    if (models.empty() || models.size() != opts.size())
      throw checkpoint_error("checkpoint '" + dir.string() + "' has " + std::to_string(models.size()) + " model and " +
                             std::to_string(opts.size()) +
                             " optimizer shards: it is incomplete; use a complete checkpoint directory");
  }
  const safetensors_open_options strict{.verify_checksum = true, .require_checksum = true};
  std::vector<safetensors_file> m, o;
  // Every file of one save: the first file's identity (none: a checkpoint older than identities,
  // then none may have one) must be every other file's.
  std::optional<std::string> save_id;
  std::filesystem::path first_file;
  const auto same_save = [&](const safetensors_file& f) {
    const auto it = f.metadata().find(save_id_key);
    const std::string id = it == f.metadata().end() ? std::string("(none)") : it->second;
    if (!save_id) {
      save_id = id;
      first_file = f.path();
      return;
    }
    if (id != *save_id)
      throw checkpoint_error(
          "checkpoint '" + dir.string() + "' mixes the files of two saves: " + f.path().filename().string() +
          " belongs to a different save than " + first_file.filename().string() + " (save " + id + ", not " + *save_id +
          "; a shard copied from another checkpoint?); use a complete checkpoint directory");
  };
  for (std::size_t k = 0; k < models.size(); ++k) {
    m.push_back(safetensors_file::open(models[k], strict));
    o.push_back(safetensors_file::open(opts[k], strict));
    same_save(m.back());
    same_save(o.back());
    const auto it = o.back().metadata().find("chunkstar.model_checksum");
    if (it == o.back().metadata().end())
      throw checkpoint_error("checkpoint file '" + opts[k].string() +
                             "' has no \"chunkstar.model_checksum\" metadata: it was not written by save_checkpoint");
    if (it->second != hex64(*m.back().checksum()))
      throw checkpoint_error("checkpoint '" + dir.string() + "': " + opts[k].filename().string() +
                             " belongs to a different save than " + models[k].filename().string() +
                             " (model checksum mismatch): the files were mixed; use a complete checkpoint directory");
  }
  return {file_set(std::move(m)), file_set(std::move(o))};
}

/** Removes temporary directories that killed writers left beside @p dir. Call with the exclusive
 *  lock held, so no live writer is using one. Only `<dir>.tmp.<pid>.<n>` directories whose pid is
 *  not running and that hold nothing but the files a save writes are touched. */
inline void remove_stale_temps(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const auto prefix = temp_prefix(dir);
  for (fs::directory_iterator it(parent_of(dir), ec), end; !ec && it != end; it.increment(ec)) {
    const auto name = it->path().filename().string();
    if (!name.starts_with(prefix) || !it->is_directory(ec)) continue;
    const auto rest = name.substr(prefix.size());
    const auto dot = rest.find('.');
    if (dot == 0 || dot == std::string::npos || rest.find_first_not_of("0123456789.") != std::string::npos) continue;
    const long pid = std::strtol(rest.substr(0, dot).c_str(), nullptr, 10);
    if (pid <= 0 || (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH))
      continue;  // alive, or not ours to judge
    bool only_ours = true;
    std::error_code ec2;
    for (fs::directory_iterator f(it->path(), ec2), fend; !ec2 && f != fend; f.increment(ec2))
      only_ours = only_ours && own_temp_entry(f->path().filename().string()) && f->is_regular_file(ec2);
    if (only_ours && !ec2) fs::remove_all(it->path(), ec2);
  }
}

/** Replaces @p dir by the complete directory @p fresh (which the caller created). The previous
 *  @p dir must be absent or replaceable (checked by the caller under the lock). An atomic exchange
 *  where the OS offers it (Linux renameat2; @p try_exchange = false skips it, for tests of the
 *  portable path); else rename the old one aside to a new unique name, the new one in, and delete
 *  the old. */
inline void swap_into_place(const std::filesystem::path& fresh, const std::filesystem::path& dir,
                            bool try_exchange = true) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const auto parent = parent_of(dir);
  if (!fs::exists(fs::symlink_status(dir, ec))) {
    if (::rename(fresh.c_str(), dir.c_str()) != 0)
      throw checkpoint_error(errno_message("cannot rename '" + fresh.string() + "' to", dir, errno));
    fsync_directory(parent);
    return;
  }
#if defined(__linux__) && defined(RENAME_EXCHANGE)
  if (try_exchange && ::renameat2(AT_FDCWD, fresh.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0) {
    fsync_directory(parent);
    fs::remove_all(fresh, ec);  // now the previous checkpoint; a leftover is harmless
    return;
  }
#else
  (void)try_exchange;
#endif
  // A name nothing else has: rename() would replace an existing empty directory.
  fs::path old;
  for (unsigned n = 0;; ++n) {
    old = with_suffix(dir, ".old." + std::to_string(::getpid()) + "." + std::to_string(n));
    if (!fs::exists(fs::symlink_status(old, ec))) break;
  }
  if (::rename(dir.c_str(), old.c_str()) != 0)
    throw checkpoint_error(errno_message("cannot move the previous checkpoint aside to", old, errno));
  if (::rename(fresh.c_str(), dir.c_str()) != 0) {
    const int err = errno;
    (void)::rename(old.c_str(), dir.c_str());
    throw checkpoint_error(errno_message("cannot rename '" + fresh.string() + "' to", dir, err));
  }
  fsync_directory(parent);
  fs::remove_all(old, ec);
}

/** Directories beside @p dir that an interrupted portable swap left: `<dir>.old.*` and `<dir>.tmp.*`. */
inline std::vector<std::filesystem::path> interrupted_swap_leftovers(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::vector<fs::path> out;
  std::error_code ec;
  const auto old_prefix = with_suffix(dir, ".old.").filename().string(), tmp_prefix = temp_prefix(dir);
  for (fs::directory_iterator it(parent_of(dir), ec), end; !ec && it != end; it.increment(ec)) {
    const auto name = it->path().filename().string();
    if ((name.starts_with(old_prefix) || name.starts_with(tmp_prefix)) && it->is_directory(ec))
      out.push_back(it->path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace checkpoint_detail
}  // namespace chunkstar
