// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Safetensors files: a streaming, atomic writer and a strict, validating reader.
 *
 *  Layout (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N, N
 *  bytes of JSON — `{"__metadata__": {string: string}, "<name>": {"dtype": "F32", "shape": [..],
 *  "data_offsets": [begin, end]}, ...}`, padded with spaces so the data starts 8-byte aligned — then
 *  the data section, every tensor's bytes (little-endian, row-major), contiguous, no gaps.
 *
 *  chunkstar adds one metadata key, `chunkstar.checksum` = "xxh64:<16 hex digits>": the XXH64 of the
 *  whole file with those 16 digits read as '0'. Other tools ignore it; our reader verifies it.
 *  Files are written to `<path>.tmp.<pid>.<n>`, fsynced, renamed over `<path>`, and the directory is
 *  fsynced, so a reader sees the old file or the new one, never a mixture.
 */
#pragma once

#include <chunkstar/checkpoint/detail/header_json.hpp>
#include <chunkstar/checkpoint/detail/posix_file.hpp>
#include <chunkstar/checkpoint/detail/xxh64.hpp>
#include <chunkstar/core/dtype.hpp>
#include <chunkstar/core/error.hpp>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <unistd.h>

namespace chunkstar {

/** @brief Element types of the safetensors format (the subset chunkstar reads and writes). */
enum class safetensors_dtype : std::uint8_t { f64, f32, f16, bf16, i64, i32, i16, i8, u8, boolean };

/** @brief The format's spelling: "F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL". */
constexpr std::string_view safetensors_dtype_name(safetensors_dtype t) noexcept {
  switch (t) {
    case safetensors_dtype::f64: return "F64";
    case safetensors_dtype::f32: return "F32";
    case safetensors_dtype::f16: return "F16";
    case safetensors_dtype::bf16: return "BF16";
    case safetensors_dtype::i64: return "I64";
    case safetensors_dtype::i32: return "I32";
    case safetensors_dtype::i16: return "I16";
    case safetensors_dtype::i8: return "I8";
    case safetensors_dtype::u8: return "U8";
    case safetensors_dtype::boolean: return "BOOL";
  }
  return "?";
}

/** @brief Bytes per element. */
constexpr std::size_t safetensors_dtype_size(safetensors_dtype t) noexcept {
  switch (t) {
    case safetensors_dtype::f64:
    case safetensors_dtype::i64: return 8;
    case safetensors_dtype::f32:
    case safetensors_dtype::i32: return 4;
    case safetensors_dtype::f16:
    case safetensors_dtype::bf16:
    case safetensors_dtype::i16: return 2;
    case safetensors_dtype::i8:
    case safetensors_dtype::u8:
    case safetensors_dtype::boolean: return 1;
  }
  return 0;
}

/** @brief Inverse of safetensors_dtype_name; empty for a dtype chunkstar does not know. */
constexpr std::optional<safetensors_dtype> parse_safetensors_dtype(std::string_view s) noexcept {
  for (auto t : {safetensors_dtype::f64, safetensors_dtype::f32, safetensors_dtype::f16, safetensors_dtype::bf16,
                 safetensors_dtype::i64, safetensors_dtype::i32, safetensors_dtype::i16, safetensors_dtype::i8,
                 safetensors_dtype::u8, safetensors_dtype::boolean})
    if (safetensors_dtype_name(t) == s) return t;
  return std::nullopt;
}

/** @brief The safetensors dtype that stores a chunkstar dtype bit for bit. */
constexpr safetensors_dtype to_safetensors_dtype(dtype t) noexcept {
  switch (t) {
    case dtype::f32: return safetensors_dtype::f32;
    case dtype::f16: return safetensors_dtype::f16;
    case dtype::bf16: return safetensors_dtype::bf16;
  }
  return safetensors_dtype::f32;
}

/** @brief True for the floating-point dtypes (what a parameter may be loaded from). */
constexpr bool is_floating(safetensors_dtype t) noexcept {
  return t == safetensors_dtype::f64 || t == safetensors_dtype::f32 || t == safetensors_dtype::f16 ||
         t == safetensors_dtype::bf16;
}

/** @brief One tensor of a safetensors file. Offsets are relative to the start of the data section. */
struct safetensors_tensor_info {
  std::string name;
  safetensors_dtype type = safetensors_dtype::f32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;

  /** @brief Elements (1 for a scalar). */
  [[nodiscard]] std::uint64_t numel() const noexcept {
    std::uint64_t n = 1;
    for (auto d : shape) n *= static_cast<std::uint64_t>(d);
    return n;
  }
  [[nodiscard]] std::uint64_t bytes() const noexcept { return end - begin; }
  /** @brief "[2, 3]". */
  [[nodiscard]] std::string shape_string() const {
    std::string s = "[";
    for (std::size_t i = 0; i < shape.size(); ++i) {
      if (i) s += ", ";  // not (i ? ", " : "") + ...: GCC 12 warns -Wrestrict on that at -O3
      s += std::to_string(shape[i]);
    }
    return s + "]";
  }
};

/** @brief Receives a tensor's bytes in order, in pieces of any size. */
using byte_sink = std::function<void(std::span<const std::byte>)>;
/** @brief Produces a tensor's bytes into a sink when the writer reaches it, so large tensors are
 *  never all in memory at once. Must emit exactly the tensor's byte size. */
using tensor_producer = std::function<void(const byte_sink&)>;

/** @brief The metadata key holding the checksum. */
inline constexpr std::string_view safetensors_checksum_key = "chunkstar.checksum";

namespace checkpoint_detail {

inline constexpr std::string_view checksum_prefix = "xxh64:";
inline constexpr std::size_t checksum_digits = 16;

inline std::string hex64(std::uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return std::string(buf, 16);
}

/** Bytes of @p shape with @p elem_size-byte elements, or empty on a negative dimension or overflow. */
inline std::optional<std::uint64_t> checked_bytes(std::span<const std::int64_t> shape, std::size_t elem_size) {
  std::uint64_t n = elem_size;
  for (auto d : shape) {
    if (d < 0) return std::nullopt;
    const auto u = static_cast<std::uint64_t>(d);
    if (u != 0 && n > UINT64_MAX / u) return std::nullopt;
    n *= u;
  }
  return n;
}

/** Converts @p n elements of @p t at @p src to float (exact for F16, BF16, F32; rounded for F64
 *  and 64/32-bit integers beyond 2^24). */
inline void to_floats(const std::byte* src, safetensors_dtype t, std::span<float> out) {
  auto each = [&](auto tag) {
    using T = decltype(tag);
    for (std::size_t i = 0; i < out.size(); ++i) {
      T v;
      std::memcpy(&v, src + i * sizeof(T), sizeof(T));
      if constexpr (std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>) out[i] = to_float(v);
      else out[i] = static_cast<float>(v);
    }
  };
  switch (t) {
    case safetensors_dtype::f32: std::memcpy(out.data(), src, out.size_bytes()); break;
    case safetensors_dtype::f64: each(double{}); break;
    case safetensors_dtype::f16: each(float16{}); break;
    case safetensors_dtype::bf16: each(bfloat16{}); break;
    case safetensors_dtype::i64: each(std::int64_t{}); break;
    case safetensors_dtype::i32: each(std::int32_t{}); break;
    case safetensors_dtype::i16: each(std::int16_t{}); break;
    case safetensors_dtype::i8: each(std::int8_t{}); break;
    case safetensors_dtype::u8: each(std::uint8_t{}); break;
    case safetensors_dtype::boolean:
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = src[i] != std::byte{0} ? 1.0f : 0.0f;
      break;
  }
}

}  // namespace checkpoint_detail

/** @brief Collects named tensors and metadata, then writes one safetensors file atomically.
 *
 *  Tensors are laid out by decreasing element size (then in the order added), so every tensor
 *  starts aligned to its element size; the header lists them in data order after `__metadata__`.
 *  The writer holds bytes given to `add` and calls producers only inside `write`. */
class safetensors_writer {
 public:
  /** @brief Adds a tensor from bytes (copied). @p data must be exactly shape × element size bytes.
   *  @throws checkpoint_error for an empty, reserved, non-UTF-8 or duplicate name, a negative
   *  dimension, or a size mismatch. */
  void add(std::string name, safetensors_dtype type, std::vector<std::int64_t> shape, std::span<const std::byte> data) {
    const auto bytes = check_entry(name, type, shape);
    if (data.size() != bytes)
      throw checkpoint_error("tensor '" + name + "': " + std::to_string(data.size()) + " bytes given for " +
                             std::string(safetensors_dtype_name(type)) + " shape " + shape_text(shape) +
                             " which needs " + std::to_string(bytes) + ": pass the tensor's full data");
    auto copy = std::make_shared<std::vector<std::byte>>(data.begin(), data.end());
    push(std::move(name), type, std::move(shape), bytes, [copy](const byte_sink& sink) { sink(*copy); });
  }

  /** @brief Adds a tensor of values whose storage type maps to a safetensors dtype (float, double,
   *  float16, bfloat16, the fixed-width integers, or bool); copied. */
  template <class T>
  void add_values(std::string name, std::vector<std::int64_t> shape, std::span<const T> values) {
    add(std::move(name), dtype_of_storage<T>(), std::move(shape), std::as_bytes(values));
  }

  /** @brief Adds a tensor whose bytes @p produce emits when the file is written. */
  void add_producer(std::string name, safetensors_dtype type, std::vector<std::int64_t> shape,
                    tensor_producer produce) {
    const auto bytes = check_entry(name, type, shape);
    if (!produce) throw checkpoint_error("tensor '" + name + "': empty producer: pass a function that emits its bytes");
    push(std::move(name), type, std::move(shape), bytes, std::move(produce));
  }

  /** @brief Sets a `__metadata__` entry (both strings must be UTF-8; `chunkstar.checksum` is reserved). */
  void set_metadata(std::string key, std::string value) {
    if (key == safetensors_checksum_key)
      throw checkpoint_error("metadata key '" + key + "' is reserved: the writer computes the checksum itself");
    if (!checkpoint_detail::is_valid_utf8(key) || !checkpoint_detail::is_valid_utf8(value))
      throw checkpoint_error(
          "metadata entry '" + key +
          "' is not valid UTF-8: safetensors headers are JSON; encode binary values (for example as hex)");
    metadata_[std::move(key)] = std::move(value);
  }

  /** @brief Number of tensors added. */
  [[nodiscard]] std::size_t size() const noexcept { return entries_.size(); }

  /** @brief The header JSON with the checksum digits as zeros, and where those digits start in it. */
  [[nodiscard]] std::pair<std::string, std::size_t> header() const {
    std::string h = "{\"__metadata__\":{";
    std::map<std::string, std::string> meta = metadata_;
    meta.emplace(std::string(safetensors_checksum_key), "");
    std::size_t digits_at = 0;
    bool first = true;
    for (const auto& [k, v] : meta) {
      if (!first) h += ',';
      first = false;
      checkpoint_detail::append_json_string(h, k);
      h += ':';
      if (k == safetensors_checksum_key) {
        h += '"';
        h += checkpoint_detail::checksum_prefix;
        digits_at = h.size();
        h.append(checkpoint_detail::checksum_digits, '0');
        h += '"';
      } else {
        checkpoint_detail::append_json_string(h, v);
      }
    }
    h += '}';
    std::uint64_t offset = 0;
    for (auto i : data_order()) {
      const auto& e = entries_[i];
      h += ',';
      checkpoint_detail::append_json_string(h, e.name);
      h += ":{\"dtype\":\"";
      h += safetensors_dtype_name(e.type);
      h += "\",\"shape\":";
      h += shape_json(e.shape);
      h += ",\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + e.bytes) + "]}";
      offset += e.bytes;
    }
    h += '}';
    // Pad so that the data section (after the 8-byte length) starts 8-byte aligned.
    h.append((8 - h.size() % 8) % 8, ' ');
    return {std::move(h), digits_at};
  }

  /** @brief Writes the file: to `<path>.tmp.<pid>.<n>`, fsync, rename over @p path, fsync the directory.
   *  On any failure the temporary file is removed and @p path is untouched.
   *  @returns the checksum stored in the file.
   *  @throws checkpoint_error naming the file and the failing operation. */
  std::uint64_t write(const std::filesystem::path& path) const {
    namespace cd = checkpoint_detail;
    const auto [h, digits_at] = header();
    auto created = cd::create_temporary(path);  // not a structured binding: lambdas below capture both
    cd::unique_fd& fd = created.first;
    const std::filesystem::path& tmp = created.second;
    try {
      cd::xxh64 hash;
      std::vector<std::byte> buf;
      buf.reserve(buffer_bytes);
      auto flush = [&] {
        hash.update(buf);
        cd::write_all(fd.get(), buf, tmp);
        buf.clear();
      };
      auto put = [&](std::span<const std::byte> b) {
        while (!b.empty()) {
          const std::size_t n = std::min(b.size(), buffer_bytes - buf.size());
          buf.insert(buf.end(), b.begin(), b.begin() + static_cast<std::ptrdiff_t>(n));
          b = b.subspan(n);
          if (buf.size() == buffer_bytes) flush();
        }
      };
      std::byte len[8];
      for (int i = 0; i < 8; ++i)
        len[i] = static_cast<std::byte>((static_cast<std::uint64_t>(h.size()) >> (8 * i)) & 0xff);
      put(len);
      put(std::as_bytes(std::span(h.data(), h.size())));
      for (auto i : data_order()) {
        const auto& e = entries_[i];
        std::uint64_t emitted = 0;
        e.produce([&](std::span<const std::byte> b) {
          if (b.size() > e.bytes - emitted)
            throw checkpoint_error("tensor '" + e.name + "': its producer emitted more than the " +
                                   std::to_string(e.bytes) + " bytes its dtype and shape need");
          emitted += b.size();
          put(b);
        });
        if (emitted != e.bytes)
          throw checkpoint_error("tensor '" + e.name + "': its producer emitted " + std::to_string(emitted) + " of " +
                                 std::to_string(e.bytes) + " bytes");
      }
      flush();
      const std::uint64_t sum = hash.digest();
      const std::string digits = cd::hex64(sum);
      cd::pwrite_all(fd.get(), std::as_bytes(std::span(digits.data(), digits.size())), 8 + digits_at, tmp);
      cd::fsync_fd(fd.get(), tmp);
      if (const int err = fd.close()) throw checkpoint_error(cd::errno_message("cannot close", tmp, err));
      if (::rename(tmp.c_str(), path.c_str()) != 0)
        throw checkpoint_error(cd::errno_message("cannot rename '" + tmp.string() + "' to", path, errno));
      cd::fsync_directory(path.parent_path());
      return sum;
    } catch (...) {
      fd.reset();
      ::unlink(tmp.c_str());
      throw;
    }
  }

 private:
  static constexpr std::size_t buffer_bytes = std::size_t{1} << 20;

  struct entry {
    std::string name;
    safetensors_dtype type;
    std::vector<std::int64_t> shape;
    std::uint64_t bytes;
    tensor_producer produce;
  };

  template <class T>
  static constexpr safetensors_dtype dtype_of_storage() {
    using U = std::remove_const_t<T>;
    if constexpr (std::is_same_v<U, double>) return safetensors_dtype::f64;
    else if constexpr (std::is_same_v<U, float>) return safetensors_dtype::f32;
    else if constexpr (std::is_same_v<U, float16>) return safetensors_dtype::f16;
    else if constexpr (std::is_same_v<U, bfloat16>) return safetensors_dtype::bf16;
    else if constexpr (std::is_same_v<U, bool>) return safetensors_dtype::boolean;
    else if constexpr (std::is_same_v<U, std::int64_t>) return safetensors_dtype::i64;
    else if constexpr (std::is_same_v<U, std::int32_t>) return safetensors_dtype::i32;
    else if constexpr (std::is_same_v<U, std::int16_t>) return safetensors_dtype::i16;
    else if constexpr (std::is_same_v<U, std::int8_t>) return safetensors_dtype::i8;
    else if constexpr (std::is_same_v<U, std::uint8_t>) return safetensors_dtype::u8;
    else static_assert(sizeof(U) == 0, "no safetensors dtype stores this type");
  }

  static std::string shape_json(std::span<const std::int64_t> shape) {
    std::string s = "[";
    for (std::size_t i = 0; i < shape.size(); ++i) {
      if (i) s += ',';
      s += std::to_string(shape[i]);
    }
    return s + "]";
  }
  static std::string shape_text(std::span<const std::int64_t> shape) {
    std::string s = "[";
    for (std::size_t i = 0; i < shape.size(); ++i) {
      if (i) s += ", ";  // not (i ? ", " : "") + ...: GCC 12 warns -Wrestrict on that at -O3
      s += std::to_string(shape[i]);
    }
    return s + "]";
  }

  std::uint64_t check_entry(const std::string& name, safetensors_dtype type,
                            std::span<const std::int64_t> shape) const {
    if (name.empty()) throw checkpoint_error("tensor with an empty name: give every tensor a name");
    if (name == "__metadata__")
      throw checkpoint_error("tensor name '__metadata__' is reserved by the safetensors format: rename the tensor");
    if (!checkpoint_detail::is_valid_utf8(name))
      throw checkpoint_error("tensor name is not valid UTF-8: safetensors names are JSON strings");
    if (index_.contains(name))
      throw checkpoint_error("tensor '" + name + "' added twice: names in a safetensors file are unique");
    const auto bytes = checkpoint_detail::checked_bytes(shape, safetensors_dtype_size(type));
    if (!bytes)
      throw checkpoint_error("tensor '" + name + "': shape " + shape_text(shape) +
                             " has a negative dimension or overflows: dimensions are sizes >= 0");
    return *bytes;
  }

  void push(std::string name, safetensors_dtype type, std::vector<std::int64_t> shape, std::uint64_t bytes,
            tensor_producer p) {
    index_.emplace(name, entries_.size());
    entries_.push_back({std::move(name), type, std::move(shape), bytes, std::move(p)});
  }

  [[nodiscard]] std::vector<std::size_t> data_order() const {
    std::vector<std::size_t> order(entries_.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return safetensors_dtype_size(entries_[a].type) > safetensors_dtype_size(entries_[b].type);
    });
    return order;
  }

  std::vector<entry> entries_;
  std::unordered_map<std::string, std::size_t> index_;
  std::map<std::string, std::string> metadata_;
};

/** @brief What `safetensors_file::open` checks beyond the structure (always fully validated). */
struct safetensors_open_options {
  bool verify_checksum = true;    ///< recompute and compare `chunkstar.checksum` when present
  bool require_checksum = false;  ///< reject files without one (chunkstar's own checkpoints)
  std::uint64_t max_header_bytes = std::uint64_t{100} << 20;  ///< larger headers are rejected as corrupt
};

/** @brief An opened, fully validated safetensors file; tensors are read on demand. Move-only. */
class safetensors_file {
 public:
  /** @brief Opens and validates @p path: header length against the file size, well-formed JSON of
   *  the right shape, known dtypes, shapes consistent with byte sizes, offsets in bounds, sorted,
   *  contiguous and non-overlapping, the data section exactly covered, no duplicate names, and the
   *  checksum when present.
   *  @throws checkpoint_error naming the file, what is wrong and what to do. */
  [[nodiscard]] static safetensors_file open(const std::filesystem::path& path, safetensors_open_options options = {}) {
    namespace cd = checkpoint_detail;
    safetensors_file f;
    f.path_ = path;
    // O_NONBLOCK: a FIFO or device in the checkpoint's place must not block the open (file_size
    // then rejects anything but a regular file); reads of regular files ignore the flag.
    f.fd_ = cd::open_file(path, O_RDONLY | O_NONBLOCK, "cannot open checkpoint file");
    const std::uint64_t size = cd::file_size(f.fd_.get(), path);
    f.file_size_ = size;
    if (size < 8)
      f.fail("file is " + std::to_string(size) +
             " bytes, shorter than the 8-byte header length: it is truncated (an interrupted write) or not a "
             "safetensors file; use the previous checkpoint");
    std::byte len_bytes[8];
    cd::pread_all(f.fd_.get(), len_bytes, 0, path);
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = n << 8 | std::to_integer<std::uint64_t>(len_bytes[i]);
    if (n > options.max_header_bytes)
      f.fail("header length " + std::to_string(n) + " exceeds the limit of " +
             std::to_string(options.max_header_bytes) +
             " bytes: the file is corrupt or not a safetensors file (raise safetensors_open_options::max_header_bytes "
             "only for a genuine header that large)");
    if (n > size - 8)
      f.fail("file truncated at " + std::to_string(size) + " bytes: its header alone needs " + std::to_string(8 + n) +
             " bytes; the write was interrupted or the file was cut short; use the previous checkpoint");
    if (n < 2) f.fail("header of " + std::to_string(n) + " bytes cannot hold a JSON object: the file is corrupt");
    std::string header(static_cast<std::size_t>(n), '\0');
    cd::pread_all(f.fd_.get(), std::as_writable_bytes(std::span(header.data(), header.size())), 8, path);
    f.data_offset_ = 8 + n;
    const std::uint64_t data_size = size - f.data_offset_;

    cd::json_value root;
    try {
      root = cd::json_reader::parse(header);
    } catch (const cd::json_error& e) {
      f.fail(std::string("malformed JSON header: ") + e.what() + "; the file is corrupt or not a safetensors file");
    }
    if (root.type != cd::json_value::kind::object)
      f.fail("header is " + std::string(cd::json_kind_name(root.type)) + ", not a JSON object: the file is corrupt");

    std::optional<std::pair<std::string, std::size_t>> checksum;  // value, position of the digits
    for (auto& [key, v] : root.members) {
      if (key == "__metadata__") {
        if (v.type != cd::json_value::kind::object)
          f.fail("\"__metadata__\" is " + std::string(cd::json_kind_name(v.type)) + ", must be an object of strings");
        for (auto& [mk, mv] : v.members) {
          if (mv.type != cd::json_value::kind::string)
            f.fail("metadata \"" + mk + "\" is " + std::string(cd::json_kind_name(mv.type)) + ", must be a string");
          if (mk == safetensors_checksum_key) {
            const bool form =
                mv.text.size() == cd::checksum_prefix.size() + cd::checksum_digits &&
                mv.end - mv.begin == mv.text.size() && mv.text.starts_with(cd::checksum_prefix) &&
                std::all_of(mv.text.begin() + static_cast<std::ptrdiff_t>(cd::checksum_prefix.size()), mv.text.end(),
                            [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
            if (!form)
              f.fail("metadata \"" + mk + "\" is \"" + mv.text +
                     "\", not \"xxh64:\" and 16 lower-case hex digits: the header is corrupt");
            checksum.emplace(mv.text, mv.begin + cd::checksum_prefix.size());
          }
          f.metadata_.emplace(mk, std::move(mv.text));
        }
        continue;
      }
      f.tensors_.push_back(f.tensor_entry(key, v));
    }

    // Offsets: in bounds first (the common failure is a cut-off file), then exactly tiling the data.
    std::sort(f.tensors_.begin(), f.tensors_.end(),
              [](const auto& a, const auto& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
    std::uint64_t max_end = 0;
    for (const auto& t : f.tensors_) max_end = std::max(max_end, t.end);
    if (max_end > data_size)
      f.fail("file truncated at " + std::to_string(size) + " of " + std::to_string(f.data_offset_ + max_end) +
             " bytes: the write was interrupted or the file was cut short; use the previous checkpoint");
    std::uint64_t expected = 0;
    for (const auto& t : f.tensors_) {
      if (t.begin < expected)
        f.fail("tensor '" + t.name + "' (bytes " + std::to_string(t.begin) + ".." + std::to_string(t.end) +
               ") overlaps the previous tensor ending at " + std::to_string(expected) + ": the header is corrupt");
      if (t.begin > expected)
        f.fail("gap in the data section before tensor '" + t.name + "' (bytes " + std::to_string(expected) + ".." +
               std::to_string(t.begin) + " belong to no tensor): the header is corrupt");
      expected = t.end;
    }
    if (expected != data_size)
      f.fail(std::to_string(data_size - expected) +
             " bytes after the last tensor belong to no tensor: the file has trailing data (corrupt, or two writes "
             "mixed)");
    for (std::size_t i = 0; i < f.tensors_.size(); ++i) f.index_.emplace(f.tensors_[i].name, i);

    if (checksum) {
      f.checksum_ = std::stoull(checksum->first.substr(cd::checksum_prefix.size()), nullptr, 16);
      if (options.verify_checksum) {
        const std::uint64_t got = f.compute_checksum(8 + checksum->second);
        if (got != *f.checksum_)
          f.fail("checksum mismatch: the header says " + cd::hex64(*f.checksum_) + ", the contents hash to " +
                 cd::hex64(got) + ": the file is corrupt (changed after it was written); use the previous checkpoint");
      }
    } else if (options.require_checksum) {
      f.fail(
          "no \"chunkstar.checksum\" in its metadata, so its integrity cannot be verified: it was not written by "
          "chunkstar (open it with require_checksum = false to accept it)");
    }
    return f;
  }

  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }
  /** @brief Tensors in data order. */
  [[nodiscard]] std::span<const safetensors_tensor_info> tensors() const noexcept { return tensors_; }
  /** @brief The tensor named @p name, or null. */
  [[nodiscard]] const safetensors_tensor_info* find(std::string_view name) const {
    const auto it = index_.find(std::string(name));
    return it == index_.end() ? nullptr : &tensors_[it->second];
  }
  /** @brief The tensor named @p name. @throws checkpoint_error if absent. */
  [[nodiscard]] const safetensors_tensor_info& at(std::string_view name) const {
    if (const auto* t = find(name)) return *t;
    fail("no tensor named '" + std::string(name) + "': check the name (tensors() lists them)");
  }
  /** @brief The `__metadata__` map (including `chunkstar.checksum` when present). */
  [[nodiscard]] const std::map<std::string, std::string>& metadata() const noexcept { return metadata_; }
  /** @brief The stored checksum (verified at open unless disabled), if the file has one. */
  [[nodiscard]] std::optional<std::uint64_t> checksum() const noexcept { return checksum_; }
  [[nodiscard]] std::uint64_t file_size() const noexcept { return file_size_; }
  /** @brief Byte offset of the data section in the file (8 + header length). */
  [[nodiscard]] std::uint64_t data_offset() const noexcept { return data_offset_; }

  /** @brief Copies the raw bytes of @p name into @p out (exactly its byte size). */
  void read_bytes(std::string_view name, std::span<std::byte> out) const {
    const auto& t = at(name);
    if (out.size() != t.bytes())
      throw checkpoint_error("buffer of " + std::to_string(out.size()) + " bytes for tensor '" + t.name + "' of " +
                             std::to_string(t.bytes()) + " bytes in '" + path_.string() +
                             "': pass a buffer of its size");
    checkpoint_detail::pread_all(fd_.get(), out, data_offset_ + t.begin, path_);
  }
  [[nodiscard]] std::vector<std::byte> read_bytes(std::string_view name) const {
    std::vector<std::byte> v(static_cast<std::size_t>(at(name).bytes()));
    read_bytes(name, v);
    return v;
  }

  /** @brief Reads @p name converted to float into @p out (exactly numel elements). Exact for F32,
   *  F16 and BF16. */
  void read_floats(std::string_view name, std::span<float> out) const {
    const auto& t = at(name);
    if (out.size() != t.numel())
      throw checkpoint_error("buffer of " + std::to_string(out.size()) + " elements for tensor '" + t.name + "' of " +
                             std::to_string(t.numel()) + " elements in '" + path_.string() +
                             "': pass a buffer of its size");
    if (t.type == safetensors_dtype::f32) {
      read_bytes(name, std::as_writable_bytes(out));
      return;
    }
    const auto bytes = read_bytes(name);
    checkpoint_detail::to_floats(bytes.data(), t.type, out);
  }
  [[nodiscard]] std::vector<float> read_floats(std::string_view name) const {
    std::vector<float> v(static_cast<std::size_t>(at(name).numel()));
    read_floats(name, v);
    return v;
  }

 private:
  safetensors_file() = default;

  [[noreturn]] void fail(const std::string& what) const {
    throw checkpoint_error("checkpoint file '" + path_.string() + "': " + what);
  }

  safetensors_tensor_info tensor_entry(const std::string& name, const checkpoint_detail::json_value& v) const {
    namespace cd = checkpoint_detail;
    using kind = cd::json_value::kind;
    if (v.type != kind::object)
      fail("entry '" + name + "' is " + std::string(cd::json_kind_name(v.type)) +
           ", must be an object with dtype, shape and data_offsets");
    const cd::json_value *dt = nullptr, *shape = nullptr, *offsets = nullptr;
    for (const auto& [k, m] : v.members) {
      if (k == "dtype") dt = &m;
      else if (k == "shape") shape = &m;
      else if (k == "data_offsets") offsets = &m;
      else
        fail("tensor '" + name + "' has an unknown field \"" + k +
             "\" (a safetensors entry has dtype, shape and data_offsets)");
    }
    if (!dt || !shape || !offsets)
      fail("tensor '" + name + "' lacks " +
           std::string(!dt      ? "dtype"
                       : !shape ? "shape"
                                : "data_offsets") +
           ": the header is corrupt");
    safetensors_tensor_info t;
    t.name = name;
    if (dt->type != kind::string)
      fail("tensor '" + name + "': dtype is " + std::string(cd::json_kind_name(dt->type)) + ", must be a string");
    const auto parsed = parse_safetensors_dtype(dt->text);
    if (!parsed)
      fail("tensor '" + name + "' has dtype \"" + dt->text +
           "\", which chunkstar does not read (F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL)");
    t.type = *parsed;
    if (shape->type != kind::array) fail("tensor '" + name + "': shape must be an array of integers");
    for (const auto& d : shape->items) {
      if (d.type != kind::integer || d.integer < 0) fail("tensor '" + name + "': shape must hold integers >= 0");
      t.shape.push_back(d.integer);
    }
    if (offsets->type != kind::array || offsets->items.size() != 2 || offsets->items[0].type != kind::integer ||
        offsets->items[1].type != kind::integer || offsets->items[0].integer < 0 ||
        offsets->items[1].integer < offsets->items[0].integer)
      fail("tensor '" + name + "': data_offsets must be [begin, end] with 0 <= begin <= end");
    t.begin = static_cast<std::uint64_t>(offsets->items[0].integer);
    t.end = static_cast<std::uint64_t>(offsets->items[1].integer);
    const auto bytes = cd::checked_bytes(t.shape, safetensors_dtype_size(t.type));
    if (!bytes || *bytes != t.end - t.begin)
      fail("tensor '" + name + "': " + std::string(safetensors_dtype_name(t.type)) + " shape " + t.shape_string() +
           " needs " + (bytes ? std::to_string(*bytes) : std::string("more than 2^64")) +
           " bytes but data_offsets span " + std::to_string(t.end - t.begin) + ": the header is corrupt");
    return t;
  }

  /** XXH64 of the whole file, reading the checksum's 16 digits at @p digits_at as '0'. */
  [[nodiscard]] std::uint64_t compute_checksum(std::uint64_t digits_at) const {
    checkpoint_detail::xxh64 hash;
    std::vector<std::byte> buf(std::size_t{1} << 20);
    for (std::uint64_t off = 0; off < file_size_;) {
      const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(buf.size(), file_size_ - off));
      std::span<std::byte> piece(buf.data(), n);
      checkpoint_detail::pread_all(fd_.get(), piece, off, path_);
      for (std::uint64_t i = std::max(off, digits_at);
           i < std::min(off + n, digits_at + checkpoint_detail::checksum_digits); ++i)
        piece[static_cast<std::size_t>(i - off)] = std::byte{'0'};
      hash.update(piece);
      off += n;
    }
    return hash.digest();
  }

  std::filesystem::path path_;
  checkpoint_detail::unique_fd fd_;
  std::uint64_t file_size_ = 0;
  std::uint64_t data_offset_ = 0;
  std::vector<safetensors_tensor_info> tensors_;
  std::unordered_map<std::string, std::size_t> index_;
  std::map<std::string, std::string> metadata_;
  std::optional<std::uint64_t> checksum_;
};

}  // namespace chunkstar
