// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Typed errors. Every message says what was wrong and what would fix it.
 */
#pragma once

#include <chunkstar/core/memory_report.hpp>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>

namespace chunkstar {

/** @brief Base of every error chunkstar throws. */
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/** @brief A configuration the library cannot honour (chunk too small for a tensor, bad option). */
class config_error : public error {
 public:
  using error::error;
};

/** @brief An operation illegal in the current state (for example moving a chunk in COMPUTE). */
class state_error : public error {
 public:
  using error::error;
};

/** @brief A memory space could not satisfy a request, even after eviction. Carries a report of
 *         every space the thrower knew about. */
class out_of_memory_error : public error {
 public:
  out_of_memory_error(const std::string& what, std::size_t requested, memory_report report)
      : error(what + "\n" + report.to_string()), requested_(requested), report_(std::move(report)) {}

  /** @brief Bytes the failed request asked for. */
  [[nodiscard]] std::size_t requested_bytes() const noexcept { return requested_; }
  /** @brief Capacity, use and largest free block of every space at the time of failure. */
  [[nodiscard]] const memory_report& report() const noexcept { return report_; }

 private:
  std::size_t requested_;
  memory_report report_;
};

/** @brief A collective failed, mismatched across ranks, or a peer went away. */
class communication_error : public error {
 public:
  using error::error;
};

/** @brief A file could not be read or written (disk full, permissions, a path that cannot work). */
class io_error : public error {
 public:
  using error::error;
};

/** @brief Bytes read back differ from the bytes written (a checksum mismatch): the storage or
 *         something outside chunkstar changed them. The message names the offset. */
class corruption_error : public io_error {
 public:
  using io_error::io_error;
};

/** @brief A checkpoint could not be written, or one being read is corrupt, truncated or foreign. */
class checkpoint_error : public io_error {
 public:
  using io_error::io_error;
};

}  // namespace chunkstar
