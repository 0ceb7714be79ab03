// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief A strict, bounds-checked reader for the JSON subset a safetensors header uses: objects,
 *         arrays, strings (all escapes, UTF-8 validated) and integers. Anything else — floats,
 *         `true`/`false`/`null`, duplicate keys, trailing garbage, nesting deeper than a header
 *         needs — is rejected with the byte position, so a corrupt header never parses by accident.
 */
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace chunkstar::checkpoint_detail {

/** @brief A malformed header; `position` is the byte offset in the JSON text. */
class json_error : public std::runtime_error {
 public:
  json_error(const std::string& what, std::size_t position)
      : std::runtime_error(what + " at byte " + std::to_string(position)), position_(position) {}
  [[nodiscard]] std::size_t position() const noexcept { return position_; }

 private:
  std::size_t position_;
};

struct json_member;

/** @brief A parsed value. `begin`/`end` delimit its raw text; for strings, the text between the
 *  quotes (still escaped), which is what lets the checksum locate its own digits. */
struct json_value {
  enum class kind : std::uint8_t { object, array, string, integer };
  kind type = kind::object;
  std::string text;                  ///< string value (unescaped)
  std::int64_t integer = 0;          ///< integer value
  std::vector<json_member> members;  ///< object members, in file order
  std::vector<json_value> items;     ///< array items
  std::size_t begin = 0, end = 0;
};

/** @brief One key and value of an object. */
struct json_member {
  std::string key;
  json_value value;
};

/** @brief Name of a kind, for messages. */
constexpr std::string_view json_kind_name(json_value::kind k) noexcept {
  switch (k) {
    case json_value::kind::object: return "an object";
    case json_value::kind::array: return "an array";
    case json_value::kind::string: return "a string";
    case json_value::kind::integer: return "an integer";
  }
  return "?";
}

/** @brief Parses one JSON document from @p text (surrounding whitespace allowed, nothing else).
 *  @throws json_error on anything outside the subset or malformed. */
class json_reader {
 public:
  static constexpr int max_depth = 8;  // a safetensors header nests 3 deep

  [[nodiscard]] static json_value parse(std::string_view text) {
    json_reader r(text);
    r.skip_ws();
    json_value v = r.value(0);
    r.skip_ws();
    if (r.pos_ != text.size()) r.fail("unexpected data after the JSON document");
    return v;
  }

 private:
  explicit json_reader(std::string_view t) : s_(t) {}

  [[noreturn]] void fail(const std::string& what) const { throw json_error(what, pos_); }

  [[nodiscard]] bool at_end() const noexcept { return pos_ >= s_.size(); }
  [[nodiscard]] char peek() const {
    if (at_end()) fail("unexpected end of the header");
    return s_[pos_];
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++pos_;
  }
  void skip_ws() noexcept {
    while (!at_end() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
  }

  json_value value(int depth) {
    if (depth > max_depth) fail("JSON nested deeper than " + std::to_string(max_depth) + " levels");
    const char c = peek();
    if (c == '{') return object(depth);
    if (c == '[') return array(depth);
    if (c == '"') return string_value();
    if (c == '-' || (c >= '0' && c <= '9')) return integer();
    fail(std::string("unexpected character '") + printable(c) +
         "' (only objects, arrays, strings and integers belong in a safetensors header)");
  }

  static std::string printable(char c) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7f) return std::string(1, c);
    static constexpr char hex[] = "0123456789abcdef";
    return std::string("\\x") + hex[u >> 4] + hex[u & 15];
  }

  json_value object(int depth) {
    json_value v;
    v.type = json_value::kind::object;
    v.begin = pos_;
    expect('{');
    skip_ws();
    if (peek() == '}') {
      ++pos_;
      v.end = pos_;
      return v;
    }
    for (;;) {
      skip_ws();
      if (peek() != '"') fail("expected a string key");
      const std::size_t key_pos = pos_;
      std::string key = string_value().text;
      for (const auto& m : v.members)
        if (m.key == key) {
          pos_ = key_pos;
          fail("duplicate key \"" + key + "\"");
        }
      skip_ws();
      expect(':');
      skip_ws();
      v.members.push_back({std::move(key), value(depth + 1)});
      skip_ws();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      expect('}');
      break;
    }
    v.end = pos_;
    return v;
  }

  json_value array(int depth) {
    json_value v;
    v.type = json_value::kind::array;
    v.begin = pos_;
    expect('[');
    skip_ws();
    if (peek() == ']') {
      ++pos_;
      v.end = pos_;
      return v;
    }
    for (;;) {
      skip_ws();
      v.items.push_back(value(depth + 1));
      skip_ws();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      expect(']');
      break;
    }
    v.end = pos_;
    return v;
  }

  json_value integer() {
    json_value v;
    v.type = json_value::kind::integer;
    v.begin = pos_;
    const bool negative = peek() == '-';
    if (negative) ++pos_;
    if (at_end() || s_[pos_] < '0' || s_[pos_] > '9') fail("expected a digit");
    if (s_[pos_] == '0' && pos_ + 1 < s_.size() && s_[pos_ + 1] >= '0' && s_[pos_ + 1] <= '9')
      fail("leading zero in a number");
    // Accumulate the magnitude as unsigned so INT64_MIN parses and anything larger is caught.
    std::uint64_t mag = 0;
    const std::uint64_t limit =
        negative ? std::uint64_t{1} << 63 : static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
    while (!at_end() && s_[pos_] >= '0' && s_[pos_] <= '9') {
      const auto d = static_cast<std::uint64_t>(s_[pos_] - '0');
      if (mag > (limit - d) / 10) fail("integer out of the 64-bit range");
      mag = mag * 10 + d;
      ++pos_;
    }
    if (!at_end() && (s_[pos_] == '.' || s_[pos_] == 'e' || s_[pos_] == 'E'))
      fail("non-integer number (shapes and offsets are integers)");
    v.integer = negative ? static_cast<std::int64_t>(0 - mag) : static_cast<std::int64_t>(mag);
    v.end = pos_;
    return v;
  }

  unsigned hex4() {
    unsigned u = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = peek();
      u <<= 4;
      if (c >= '0' && c <= '9') u |= static_cast<unsigned>(c - '0');
      else if (c >= 'a' && c <= 'f') u |= static_cast<unsigned>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') u |= static_cast<unsigned>(c - 'A' + 10);
      else fail("bad \\u escape (expected 4 hex digits)");
      ++pos_;
    }
    return u;
  }

  static void append_utf8(std::string& out, std::uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xc0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xe0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else {
      out += static_cast<char>(0xf0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    }
  }

  /** Copies one well-formed UTF-8 sequence (RFC 3629: no overlongs, no surrogates, <= U+10FFFF). */
  void utf8_sequence(std::string& out) {
    const auto b0 = static_cast<unsigned char>(s_[pos_]);
    std::size_t len;
    std::uint32_t cp;
    if (b0 >= 0xc2 && b0 <= 0xdf) len = 2, cp = b0 & 0x1fu;
    else if (b0 >= 0xe0 && b0 <= 0xef) len = 3, cp = b0 & 0x0fu;
    else if (b0 >= 0xf0 && b0 <= 0xf4) len = 4, cp = b0 & 0x07u;
    else fail("invalid UTF-8 in a string");
    if (s_.size() - pos_ < len) fail("truncated UTF-8 sequence in a string");
    for (std::size_t i = 1; i < len; ++i) {
      const auto b = static_cast<unsigned char>(s_[pos_ + i]);
      if ((b & 0xc0) != 0x80) fail("invalid UTF-8 in a string");
      cp = cp << 6 | (b & 0x3fu);
    }
    if ((len == 3 && (cp < 0x800 || (cp >= 0xd800 && cp <= 0xdfff))) || (len == 4 && (cp < 0x10000 || cp > 0x10ffff)))
      fail("invalid UTF-8 in a string");
    out.append(s_.substr(pos_, len));
    pos_ += len;
  }

  json_value string_value() {
    json_value v;
    v.type = json_value::kind::string;
    expect('"');
    v.begin = pos_;
    for (;;) {
      const char c = peek();
      const auto u = static_cast<unsigned char>(c);
      if (c == '"') break;
      if (u < 0x20) fail("unescaped control character in a string");
      if (u >= 0x80) {
        utf8_sequence(v.text);
        continue;
      }
      ++pos_;
      if (c != '\\') {
        v.text += c;
        continue;
      }
      const char e = peek();
      ++pos_;
      switch (e) {
        case '"': v.text += '"'; break;
        case '\\': v.text += '\\'; break;
        case '/': v.text += '/'; break;
        case 'b': v.text += '\b'; break;
        case 'f': v.text += '\f'; break;
        case 'n': v.text += '\n'; break;
        case 'r': v.text += '\r'; break;
        case 't': v.text += '\t'; break;
        case 'u': {
          std::uint32_t cp = hex4();
          if (cp >= 0xdc00 && cp <= 0xdfff) fail("unpaired low surrogate in a \\u escape");
          if (cp >= 0xd800 && cp <= 0xdbff) {
            if (s_.size() - pos_ < 2 || s_[pos_] != '\\' || s_[pos_ + 1] != 'u')
              fail("unpaired high surrogate in a \\u escape");
            pos_ += 2;
            const std::uint32_t lo = hex4();
            if (lo < 0xdc00 || lo > 0xdfff) fail("high surrogate not followed by a low surrogate");
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
          }
          append_utf8(v.text, cp);
          break;
        }
        default: --pos_; fail(std::string("bad escape '\\") + printable(e) + "'");
      }
    }
    v.end = pos_;
    ++pos_;  // closing quote
    return v;
  }

  std::string_view s_;
  std::size_t pos_ = 0;
};

/** @brief True if @p s is well-formed UTF-8 (what the reader accepts inside strings). */
inline bool is_valid_utf8(std::string_view s) noexcept {
  for (std::size_t i = 0; i < s.size();) {
    const auto b0 = static_cast<unsigned char>(s[i]);
    if (b0 < 0x80) {
      ++i;
      continue;
    }
    std::size_t len;
    std::uint32_t cp;
    if (b0 >= 0xc2 && b0 <= 0xdf) len = 2, cp = b0 & 0x1fu;
    else if (b0 >= 0xe0 && b0 <= 0xef) len = 3, cp = b0 & 0x0fu;
    else if (b0 >= 0xf0 && b0 <= 0xf4) len = 4, cp = b0 & 0x07u;
    else return false;
    if (s.size() - i < len) return false;
    for (std::size_t k = 1; k < len; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if ((b & 0xc0) != 0x80) return false;
      cp = cp << 6 | (b & 0x3fu);
    }
    if ((len == 3 && (cp < 0x800 || (cp >= 0xd800 && cp <= 0xdfff))) || (len == 4 && (cp < 0x10000 || cp > 0x10ffff)))
      return false;
    i += len;
  }
  return true;
}

/** @brief Appends @p s to @p out as a JSON string literal (quotes, backslashes and control
 *  characters escaped; other bytes, UTF-8 included, copied). */
inline void append_json_string(std::string& out, std::string_view s) {
  static constexpr char hex[] = "0123456789abcdef";
  out += '"';
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (u < 0x20) {
      out += "\\u00";
      out += hex[u >> 4];
      out += hex[u & 15];
    } else {
      out += c;
    }
  }
  out += '"';
}

}  // namespace chunkstar::checkpoint_detail
