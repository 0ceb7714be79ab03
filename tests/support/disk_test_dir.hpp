// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief A scratch directory under /tmp for the disk-tier tests, removed with everything in it.
 */
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

namespace chunkstar::test {

/** @brief mkdtemp("/tmp/chunkstar-disk-test-XXXXXX"); the destructor removes the tree. */
class scratch_dir {
 public:
  scratch_dir() {
    std::string t = "/tmp/chunkstar-disk-test-XXXXXX";
    std::vector<char> buf(t.begin(), t.end());
    buf.push_back('\0');
    if (::mkdtemp(buf.data()) == nullptr) std::abort();
    path_ = buf.data();
  }
  ~scratch_dir() {
    std::error_code ec;
    std::filesystem::permissions(path_, std::filesystem::perms::owner_all, ec);
    std::filesystem::remove_all(path_, ec);
  }
  scratch_dir(const scratch_dir&) = delete;
  scratch_dir& operator=(const scratch_dir&) = delete;
  [[nodiscard]] const std::string& path() const noexcept { return path_; }
  /** @brief Entries in the directory now (the space's file while one lives). */
  [[nodiscard]] std::size_t entries() const {
    std::size_t n = 0;
    for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(path_)) ++n;
    return n;
  }

 private:
  std::string path_;
};

}  // namespace chunkstar::test
