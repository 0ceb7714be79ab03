// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief `require_agreement`: checks that every rank of a communicator was configured alike (the
 *         same model, layout and options) before any rank relies on it, and names the first
 *         difference in a `config_error` raised on every rank.
 *
 *  Ranks that disagree on the model would otherwise fail much later and far from the cause: a
 *  collective of the wrong size, a gather into the wrong chunk, or a silently different model.
 */
#pragma once

#include <chunkstar/comm/communicator.hpp>
#include <chunkstar/comm/host_scalars.hpp>
#include <chunkstar/core/error.hpp>

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace chunkstar {

/** @brief One named part of a configuration, e.g. {"parameter 3", "'w3' [12, 12] f32 weight"}. */
struct config_field {
  std::string name;
  std::string value;
  friend bool operator==(const config_field&, const config_field&) = default;
};

/** @brief @p v as the shortest text that reads back to the same value ("0.003"): two ranks agree on
 *  a field exactly when their values are equal. */
template <class T>
requires std::is_arithmetic_v<T>
[[nodiscard]] std::string config_value(T v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}
[[nodiscard]] inline std::string config_value(bool v) { return v ? "on" : "off"; }

namespace detail {

/** @brief FNV-1a of a field (name and value), never 0 (0 marks a field a rank lacks). */
inline std::uint64_t field_hash(const config_field& f) noexcept {
  std::uint64_t h = 1469598103934665603ull;
  auto mix = [&](std::string_view s) {
    for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0xffu) * 1099511628211ull;  // separator: ("ab", "c") differs from ("a", "bc")
  };
  mix(f.name);
  mix(f.value);
  return h == 0 ? 1 : h;
}

}  // namespace detail

/** @brief Pure: the first field whose hash in @p own differs from @p reference (rank 0's), or
 *  `own.size()` when none does; both lists padded with 0 (no such field) to the same length. */
[[nodiscard]] inline std::size_t first_differing_field(std::span<const std::uint64_t> own,
                                                       std::span<const std::uint64_t> reference) noexcept {
  const auto d = std::mismatch(own.begin(), own.end(), reference.begin(), reference.end());
  return static_cast<std::size_t>(d.first - own.begin());
}

/** @brief Collective: every rank passes its own description of @p what; returns when all ranks'
 *  fields are equal, else throws the same `config_error` on every rank, naming the first field
 *  that differs (then the first rank that differs there) and both ranks' values. Fields should be
 *  listed in the same order on every rank (the same code builds them), the cheap fields (world
 *  size, counts) first. With one rank, nothing; else three allreduces of host doubles (two more
 *  when they differ), the largest 2 x fields, whatever the number of ranks: only
 *  `allreduce(span<double>)`, which every communicator runs on host memory (comm/host_scalars.hpp). */
template <Communicator C>
void require_agreement(C& comm, std::span<const config_field> fields, std::string_view what) {
  const int n = comm.size();
  if (n <= 1) return;
  // 1. The longest list: a rank with fewer fields has hash 0 (no such field) for the rest.
  double longest = static_cast<double>(fields.size());
  comm.allreduce(std::span<double>(&longest, 1), reduce_op::max);
  const auto width = static_cast<std::size_t>(longest);
  std::vector<std::uint64_t> own(width, 0), reference(width);
  for (std::size_t f = 0; f < fields.size(); ++f) own[f] = detail::field_hash(fields[f]);
  // 2. Rank 0's hashes on every rank, as 32-bit halves (exact in a double).
  std::vector<double> halves(2 * width);
  for (std::size_t f = 0; f < width; ++f) {
    halves[2 * f] = static_cast<double>(own[f] >> 32);
    halves[2 * f + 1] = static_cast<double>(own[f] & 0xffffffffu);
  }
  broadcast_scalars(comm, std::span<double>(halves), 0);
  for (std::size_t f = 0; f < width; ++f)
    reference[f] = (static_cast<std::uint64_t>(halves[2 * f]) << 32) | static_cast<std::uint64_t>(halves[2 * f + 1]);
  // 3. The first field that differs on any rank, then the first rank that differs there.
  double first = static_cast<double>(first_differing_field(own, reference));
  comm.allreduce(std::span<double>(&first, 1), reduce_op::min);
  const auto field = static_cast<std::size_t>(first);
  if (field >= width) return;
  double odd = own[field] != reference[field] ? comm.rank() : n;
  comm.allreduce(std::span<double>(&odd, 1), reduce_op::min);
  const int rank = static_cast<int>(odd);
  // 4. Both ranks' text of that field (fixed size, so every rank's call matches).
  constexpr std::size_t text_bytes = 240;
  std::string mine =
      field < fields.size() ? fields[field].name + " = " + fields[field].value : "(nothing: fewer fields)";
  if (mine.size() > text_bytes - 1) mine = mine.substr(0, text_bytes - 4) + "...";
  std::vector<double> texts(2 * text_bytes, 0.0);
  for (const std::size_t slot : {0u, 1u})
    if (comm.rank() == (slot == 0 ? 0 : rank))
      std::transform(mine.begin(), mine.end(), std::next(texts.begin(), static_cast<std::ptrdiff_t>(slot * text_bytes)),
                     [](char c) { return static_cast<double>(static_cast<unsigned char>(c)); });
  comm.allreduce(std::span<double>(texts), reduce_op::sum);
  auto text = [&](std::size_t slot) {
    std::string s;
    for (std::size_t i = 0; i < text_bytes && texts[slot * text_bytes + i] != 0.0; ++i)
      s += static_cast<char>(static_cast<unsigned char>(texts[slot * text_bytes + i]));
    return s;
  };
  throw config_error(std::string(what) + ": the ranks are not configured alike: rank 0 has " + text(0) + " but rank " +
                     std::to_string(rank) + " has " + text(1) +
                     "; every rank must build the same model with the same layout and options (the same binary, "
                     "command line and data)");
}

}  // namespace chunkstar
