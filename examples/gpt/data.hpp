// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Byte-level text data: loading (a file, or the embedded default corpus), a train /
 *         validation split, and batches that are a pure function of (seed, step, micro-batch), so
 *         resuming needs nothing but the step number.
 */
#pragma once

#include "splitmix64.hpp"

#include <chunkstar/core/error.hpp>
#include <chunkstar/core/units.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

// The embedded default corpus (generated from data/corpus.txt at build time).
extern const unsigned char gpt_default_corpus[];
extern const std::size_t gpt_default_corpus_size;

namespace gpt {

/** @brief A corpus split into training and held-out bytes. */
struct text_data {
  std::string source;  ///< file name, or "embedded default corpus"
  std::vector<std::uint8_t> train;
  std::vector<std::uint8_t> val;
};

/** @brief Largest --data file load_text reads (the whole corpus is held in memory). */
inline constexpr std::size_t max_text_bytes = std::size_t{4} << 30;

/** @brief Loads @p path (all of it, as bytes), or the embedded corpus when @p path is empty, and
 *  holds out the last @p val_fraction for validation. Throws config_error, naming the file and
 *  what to do, when it is not a regular file (a directory, a FIFO, a device: none of them could
 *  be read to an end, and opening a FIFO never blocks here), cannot be read, is larger than
 *  @p max_bytes, or is too short for sequences of @p seq tokens. */
inline text_data load_text(const std::string& path, std::size_t seq, double val_fraction = 0.1,
                           std::size_t max_bytes = max_text_bytes) {
  std::vector<std::uint8_t> bytes;
  text_data d;
  if (path.empty()) {
    bytes.assign(gpt_default_corpus, gpt_default_corpus + gpt_default_corpus_size);
    d.source = "embedded default corpus (GPL-3, Apache-2.0 and GFDL-1.3 license texts)";
  } else {
    const auto fail = [&](const std::string& why) -> void {
      throw chunkstar::config_error("cannot use --data '" + path + "': " + why);
    };
    int fd;
    do fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    while (fd < 0 && errno == EINTR);
    if (fd < 0) fail(std::string(std::strerror(errno)) + "; check the path and permissions");
    struct closer {
      int fd;
      ~closer() { ::close(fd); }
    } close_fd{fd};
    struct stat st {};
    if (::fstat(fd, &st) != 0) fail(std::strerror(errno));
    if (!S_ISREG(st.st_mode))
      fail(std::string(S_ISDIR(st.st_mode)    ? "it is a directory"
                       : S_ISFIFO(st.st_mode) ? "it is a FIFO"
                                              : "it is a device or socket") +
           ", not a regular file; pass a text file");
    if (static_cast<std::uint64_t>(st.st_size) > max_bytes)
      fail("it has " + chunkstar::format_bytes(static_cast<std::size_t>(st.st_size)) + ", more than the " +
           chunkstar::format_bytes(max_bytes) + " train_gpt reads into memory; train on a part of it");
    // Read to the end (files in /proc report size 0), never past the cap.
    bytes.resize(static_cast<std::size_t>(st.st_size));
    std::size_t used = 0;
    for (;;) {
      if (used == bytes.size()) {
        if (bytes.size() > max_bytes)
          fail("it grew past the " + chunkstar::format_bytes(max_bytes) + " train_gpt reads into memory");
        bytes.resize(std::max<std::size_t>(2 * bytes.size(), 1 << 16));
      }
      const ssize_t n = ::read(fd, bytes.data() + used, bytes.size() - used);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) fail(std::string("reading it failed: ") + std::strerror(errno));
      if (n == 0) break;
      used += static_cast<std::size_t>(n);
    }
    bytes.resize(used);
    d.source = path;
  }
  const auto val = static_cast<std::size_t>(static_cast<double>(bytes.size()) * val_fraction);
  if (bytes.size() - val < 2 * (seq + 1) || val < seq + 1)
    throw chunkstar::config_error("--data '" + d.source + "' has " + std::to_string(bytes.size()) +
                                  " bytes: too short for sequences of " + std::to_string(seq) +
                                  " tokens; use a longer text or a smaller --seq");
  d.train.assign(bytes.begin(), bytes.end() - static_cast<std::ptrdiff_t>(val));
  d.val.assign(bytes.end() - static_cast<std::ptrdiff_t>(val), bytes.end());
  return d;
}

/** @brief Fills a [B, T] batch: sequence b starts at a position drawn from (seed, key, first + b);
 *  targets are the next bytes. @p key identifies the batch (step and micro-batch, or a validation
 *  index); @p first selects a slice of a larger batch (rank r of N fills sequences r·B .. r·B+B-1
 *  of the global batch of N·B sequences, so N ranks train on exactly what one process would). */
inline void fill_batch(const std::vector<std::uint8_t>& data, std::uint64_t seed, std::uint64_t key, std::size_t B,
                       std::size_t T, int* tokens, int* targets, std::size_t first = 0) {
  const std::size_t span = data.size() - T - 1;
  for (std::size_t b = 0; b < B; ++b) {
    const std::size_t start =
        detail::splitmix64(seed ^ detail::splitmix64(key * 0x100000001b3ull + first + b)) % (span + 1);
    for (std::size_t t = 0; t < T; ++t) {
      tokens[b * T + t] = data[start + t];
      targets[b * T + t] = data[start + t + 1];
    }
  }
}

/** @brief The batch key of micro-batch @p micro of optimizer step @p step (1-based). */
inline std::uint64_t train_key(std::int64_t step, int micro) {
  return (static_cast<std::uint64_t>(step) << 16) | static_cast<std::uint64_t>(micro);
}

}  // namespace gpt
