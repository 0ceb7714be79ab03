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
#include <chunkstar/core/error.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace chunkstar {

/** @brief One named part of a configuration, e.g. {"parameter 3", "'w3' [12, 12] f32 weight"}. */
struct config_field {
  std::string name;
  std::string value;
};

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

/** @brief Where the ranks' fields first differ: field @p field, between rank 0 and rank @p rank. */
struct disagreement {
  std::size_t field = 0;
  int rank = 0;
  friend bool operator==(const disagreement&, const disagreement&) = default;
};

/** @brief Pure: the first field (then the first rank) whose hash differs from rank 0's, given
 *  @p ranks rows of @p fields hashes each (row r = rank r; 0 = the rank has no such field). */
[[nodiscard]] inline std::optional<disagreement> first_disagreement(std::span<const std::uint64_t> hashes, int ranks,
                                                                    std::size_t fields) {
  for (std::size_t f = 0; f < fields; ++f)
    for (int r = 1; r < ranks; ++r)
      if (hashes[static_cast<std::size_t>(r) * fields + f] != hashes[f]) return disagreement{f, r};
  return std::nullopt;
}

/** @brief Collective: every rank passes its own description of @p what; returns when all ranks'
 *  fields are equal, else throws the same `config_error` on every rank, naming the first field
 *  that differs and both ranks' values. Costs two allgathers of 8 bytes per field (three when
 *  they differ); with one rank, nothing. Fields should be listed in the same order on every rank
 *  (the same code builds them), the cheap fields (world size, counts) first. */
template <Communicator C>
void require_agreement(C& comm, std::span<const config_field> fields, std::string_view what) {
  const int n = comm.size();
  if (n <= 1) return;
  const auto ranks = static_cast<std::size_t>(n);
  // 1. How many fields each rank has (they differ when, e.g., the parameter counts do).
  std::uint64_t mine = fields.size();
  std::vector<std::uint64_t> counts(ranks);
  comm.allgather(&mine, counts.data(), sizeof mine);
  const std::size_t width = *std::max_element(counts.begin(), counts.end());
  // 2. Their hashes, padded with 0 (no such field) to the longest list.
  std::vector<std::uint64_t> row(width, 0), all(width * ranks);
  for (std::size_t f = 0; f < fields.size(); ++f) row[f] = detail::field_hash(fields[f]);
  if (width > 0) comm.allgather(row.data(), all.data(), width * sizeof(std::uint64_t));
  const auto diff = first_disagreement(all, n, width);
  if (!diff) return;
  // 3. Every rank knows the same difference; exchange its text (fixed size, so the call matches).
  constexpr std::size_t text_bytes = 240;
  auto text_of = [&](std::size_t f) {
    std::string s = f < fields.size() ? fields[f].name + " = " + fields[f].value : "(nothing: fewer fields)";
    if (s.size() > text_bytes - 1) s = s.substr(0, text_bytes - 4) + "...";
    return s;
  };
  std::vector<char> text(text_bytes, '\0'), texts(text_bytes * ranks);
  const std::string own = text_of(diff->field);
  std::memcpy(text.data(), own.data(), own.size());
  comm.allgather(text.data(), texts.data(), text_bytes);
  auto at = [&](int r) { return std::string(texts.data() + static_cast<std::size_t>(r) * text_bytes); };
  throw config_error(std::string(what) + ": the ranks are not configured alike: rank 0 has " + at(0) + " but rank " +
                     std::to_string(diff->rank) + " has " + at(diff->rank) +
                     "; every rank must build the same model with the same layout and options (the same binary, "
                     "command line and data)");
}

}  // namespace chunkstar
