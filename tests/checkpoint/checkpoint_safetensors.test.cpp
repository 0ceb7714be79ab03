// SPDX-License-Identifier: Apache-2.0
// Safetensors writer and reader: XXH64 against libxxhash's values, the strict JSON subset, round
// trips of every dtype and shape, the byte layout against hand-built files, and a corruption fuzzer
// (every truncation, every byte flipped, garbage headers) that must end in data or checkpoint_error.
#include <chunkstar/checkpoint/safetensors.hpp>

#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

using namespace chunkstar;

namespace checkpoint_safetensors_test {
namespace fs = std::filesystem;
namespace cd = chunkstar::checkpoint_detail;

namespace {

struct temp_dir {
  fs::path path;
  temp_dir() {
    static int counter = 0;
    path = fs::temp_directory_path() / ("chunkstar_st_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::vector<std::byte> read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::vector<char> c((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> b(c.size());
  std::memcpy(b.data(), c.data(), c.size());
  return b;
}

void write_file(const fs::path& p, std::span<const std::byte> b) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

std::vector<std::byte> bytes_of(std::string_view s) {
  std::vector<std::byte> b(s.size());
  if (!s.empty()) std::memcpy(b.data(), s.data(), s.size());  // memcpy(nullptr, ..., 0) is UB
  return b;
}

/** A safetensors file from a header text and data, as any writer would lay it out. */
std::vector<std::byte> make_file(std::string_view header, std::span<const std::byte> data) {
  std::vector<std::byte> f(8);
  const std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) f[static_cast<std::size_t>(i)] = static_cast<std::byte>((n >> (8 * i)) & 0xff);
  const auto h = bytes_of(header);
  f.insert(f.end(), h.begin(), h.end());
  f.insert(f.end(), data.begin(), data.end());
  return f;
}

std::string message_of(const fs::path& p, safetensors_open_options o = {}) {
  try {
    (void)safetensors_file::open(p, o);
  } catch (const checkpoint_error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("xxh64 matches libxxhash 0.8 on every tail length, in one call and streamed") {
  // Reference digits computed with libxxhash (XXH64, seed 0) over bytes (i * 131 + 7) & 255.
  const std::pair<std::size_t, std::uint64_t> expected[] = {
      {0, 0xef46db3751d8e999ull},   {1, 0xa96c7f0ce858bbb7ull},  {3, 0xbed43740ee6332bbull},
      {4, 0xfa212ae44b3bb23dull},   {7, 0x2744460dd675d2c0ull},  {8, 0x994b676b71ce94ddull},
      {31, 0x6711d55e306b5d8full},  {32, 0x07f7b8e3bc5d6e25ull}, {33, 0x09f85eeb4e1cbe9full},
      {63, 0xb7c9968c066cb6a5ull},  {64, 0x50d4159a0411632eull}, {100, 0x9ddada11d3dc2d8full},
      {1000, 0x0bf0bdbcc82eb373ull}};
  std::vector<std::byte> d(1000);
  for (std::size_t i = 0; i < d.size(); ++i) d[i] = static_cast<std::byte>((i * 131 + 7) & 255);
  for (const auto& e : expected) {
    const std::size_t n = e.first;
    const std::uint64_t h = e.second;
    CAPTURE(n);
    CHECK(cd::xxh64::hash(std::span(d).first(n)) == h);
    for (std::size_t piece : {1u, 5u, 31u, 33u}) {
      cd::xxh64 s;
      for (std::size_t i = 0; i < n; i += piece) s.update(std::span(d).subspan(i, std::min(piece, n - i)));
      CHECK(s.digest() == h);
    }
  }
  CHECK(cd::xxh64::hash(bytes_of("abc")) == 0x44bc2cf5ad770999ull);
  CHECK(cd::xxh64::hash(bytes_of("a")) == 0xd24ec4f1a98c6e5bull);
}

TEST_CASE("JSON subset: accepted forms") {
  const auto v = cd::json_reader::parse(
      R"( {"a\"b\\c\/\n\t\u00e9\ud83d\ude00": [0, -5, 9223372036854775807, -9223372036854775808], "k": {}, "e": []} )");
  REQUIRE(v.type == cd::json_value::kind::object);
  REQUIRE(v.members.size() == 3);
  CHECK(v.members[0].key == "a\"b\\c/\n\t\xc3\xa9\xf0\x9f\x98\x80");
  const auto& arr = v.members[0].value.items;
  REQUIRE(arr.size() == 4);
  CHECK(arr[0].integer == 0);
  CHECK(arr[1].integer == -5);
  CHECK(arr[2].integer == INT64_MAX);
  CHECK(arr[3].integer == INT64_MIN);
  CHECK(cd::json_reader::parse("\"\xc3\xa9\"").text == "\xc3\xa9");
}

TEST_CASE("JSON subset: everything else is rejected with a position") {
  for (const char* bad : {"",
                          "{",
                          "{\"a\":1,}",
                          "{\"a\":1 \"b\":2}",
                          "{\"a\":1}x",
                          "{\"a\":1.5}",
                          "{\"a\":1e3}",
                          "{\"a\":01}",
                          "{\"a\":-}",
                          "{\"a\":true}",
                          "{\"a\":null}",
                          "{\"a\":1,\"a\":2}",
                          "{a:1}",
                          "{\"a\":\"\x01\"}",
                          "{\"a\":\"\\x\"}",
                          "{\"a\":\"\\u12g4\"}",
                          "{\"a\":\"\\ud800\"}",
                          "{\"a\":\"\\udc00\"}",
                          "{\"a\":\"\xff\"}",
                          "{\"a\":\"\xc0\x80\"}",
                          "{\"a\":\"\xed\xa0\x80\"}",
                          "{\"a\":\"\xe2\x82\"}",
                          "{\"a\":9223372036854775808}",
                          "{\"a\":-9223372036854775809}",
                          "[[[[[[[[[[1]]]]]]]]]]",
                          "\"abc",
                          "{\"a\":[1,2}",
                          "+1"}) {
    CAPTURE(bad);
    CHECK_THROWS_AS((void)cd::json_reader::parse(bad), cd::json_error);
  }
}

TEST_CASE("writer and reader round-trip every dtype, scalars and zero-size tensors") {
  temp_dir tmp;
  std::mt19937 gen(3);
  std::uniform_int_distribution<int> byte(0, 255);
  struct item {
    std::string name;
    safetensors_dtype type;
    std::vector<std::int64_t> shape;
    std::vector<std::byte> data;
  };
  std::vector<item> items;
  const std::vector<std::vector<std::int64_t>> shapes = {{}, {0}, {1}, {7}, {3, 5}, {2, 0, 4}, {2, 3, 4}};
  for (auto t : {safetensors_dtype::f64, safetensors_dtype::f32, safetensors_dtype::f16, safetensors_dtype::bf16,
                 safetensors_dtype::i64, safetensors_dtype::i32, safetensors_dtype::i16, safetensors_dtype::i8,
                 safetensors_dtype::u8, safetensors_dtype::boolean})
    for (std::size_t s = 0; s < shapes.size(); ++s) {
      item it{std::string(safetensors_dtype_name(t)) + "/" + std::to_string(s), t, shapes[s], {}};
      const auto n = *cd::checked_bytes(shapes[s], safetensors_dtype_size(t));
      for (std::uint64_t i = 0; i < n; ++i)
        it.data.push_back(static_cast<std::byte>(t == safetensors_dtype::boolean ? byte(gen) & 1 : byte(gen)));
      items.push_back(std::move(it));
    }
  safetensors_writer w;
  for (const auto& it : items) w.add(it.name, it.type, it.shape, it.data);
  w.set_metadata("step", "42");
  w.set_metadata("quote\"and\\slash", "line\nbreak \xc3\xa9");
  const auto path = tmp.path / "all.safetensors";
  const std::uint64_t sum = w.write(path);

  const auto f = safetensors_file::open(path, {.require_checksum = true});
  CHECK(f.checksum() == sum);
  CHECK(f.tensors().size() == items.size());
  CHECK(f.metadata().at("step") == "42");
  CHECK(f.metadata().at("quote\"and\\slash") == "line\nbreak \xc3\xa9");
  for (const auto& it : items) {
    CAPTURE(it.name);
    const auto& info = f.at(it.name);
    CHECK(info.type == it.type);
    CHECK(info.shape == it.shape);
    CHECK(f.read_bytes(it.name) == it.data);
    // Element size alignment within the file: larger types first.
    CHECK((f.data_offset() + info.begin) % safetensors_dtype_size(it.type) == 0);
  }
  // Conversions to float, against an independent per-type decode.
  for (const auto& it : items) {
    if (it.type == safetensors_dtype::f32 || it.type == safetensors_dtype::f64)
      continue;  // NaN patterns compared below
    const auto got = f.read_floats(it.name);
    for (std::size_t i = 0; i < got.size(); ++i) {
      const std::byte* p = it.data.data() + i * safetensors_dtype_size(it.type);
      float want = 0;
      switch (it.type) {
        case safetensors_dtype::f16:
          want = f16_bits_to_float(
              static_cast<std::uint16_t>(std::to_integer<unsigned>(p[0]) | std::to_integer<unsigned>(p[1]) << 8));
          break;
        case safetensors_dtype::bf16:
          want = bf16_bits_to_float(
              static_cast<std::uint16_t>(std::to_integer<unsigned>(p[0]) | std::to_integer<unsigned>(p[1]) << 8));
          break;
        case safetensors_dtype::i8:
          want = static_cast<float>(static_cast<std::int8_t>(std::to_integer<unsigned>(p[0])));
          break;
        case safetensors_dtype::u8:
        case safetensors_dtype::boolean: want = static_cast<float>(std::to_integer<unsigned>(p[0])); break;
        case safetensors_dtype::i16:
          want = static_cast<float>(
              static_cast<std::int16_t>(std::to_integer<unsigned>(p[0]) | std::to_integer<unsigned>(p[1]) << 8));
          break;
        case safetensors_dtype::i32: {
          std::uint32_t u = 0;
          for (int k = 3; k >= 0; --k) u = u << 8 | std::to_integer<std::uint32_t>(p[k]);
          want = static_cast<float>(static_cast<std::int32_t>(u));
          break;
        }
        case safetensors_dtype::i64: {
          std::uint64_t u = 0;
          for (int k = 7; k >= 0; --k) u = u << 8 | std::to_integer<std::uint64_t>(p[k]);
          want = static_cast<float>(static_cast<std::int64_t>(u));
          break;
        }
        default: break;
      }
      if (std::isnan(want)) CHECK(std::isnan(got[i]));
      else CHECK(std::bit_cast<std::uint32_t>(got[i]) == std::bit_cast<std::uint32_t>(want));
    }
  }
  // F32 bits are copied as they are, NaN payloads included.
  const auto& f32 = items[static_cast<std::size_t>(1 * shapes.size() + 6)];
  REQUIRE(f32.type == safetensors_dtype::f32);
  const auto v = f.read_floats(f32.name);
  CHECK(std::memcmp(v.data(), f32.data.data(), f32.data.size()) == 0);
}

TEST_CASE("writer output: exact header text, length prefix, padding, offsets and checksum") {
  temp_dir tmp;
  safetensors_writer w;
  const std::vector<std::uint8_t> u8 = {1, 2, 3};
  const std::vector<float> f32 = {1.5f, -2.0f};
  const std::vector<double> f64 = {0.25};
  w.add_values<std::uint8_t>("u", {3}, u8);
  w.add_values<float>("w", {2, 1}, f32);
  w.add_values<double>("s", {}, f64);
  w.set_metadata("format", "pt");
  const auto path = tmp.path / "x.safetensors";
  const auto sum = w.write(path);
  const auto file = read_file(path);

  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | std::to_integer<std::uint64_t>(file[static_cast<std::size_t>(i)]);
  const std::string header(reinterpret_cast<const char*>(file.data() + 8), n);
  const std::string digits = cd::hex64(sum);
  // Metadata keys sorted; tensors by decreasing element size (F64, F32, U8), offsets contiguous.
  std::string want = R"({"__metadata__":{"chunkstar.checksum":"xxh64:)" + digits + R"(","format":"pt"},)" +
                     R"("s":{"dtype":"F64","shape":[],"data_offsets":[0,8]},)" +
                     R"("w":{"dtype":"F32","shape":[2,1],"data_offsets":[8,16]},)" +
                     R"("u":{"dtype":"U8","shape":[3],"data_offsets":[16,19]}})";
  want.append((8 - want.size() % 8) % 8, ' ');
  CHECK(header == want);
  CHECK((8 + n) % 8 == 0);
  REQUIRE(file.size() == 8 + n + 19);
  CHECK(std::memcmp(file.data() + 8 + n, f64.data(), 8) == 0);
  CHECK(std::memcmp(file.data() + 8 + n + 8, f32.data(), 8) == 0);
  CHECK(std::memcmp(file.data() + 8 + n + 16, u8.data(), 3) == 0);
  // The checksum: XXH64 of the file with its own digits read as '0'.
  auto zeroed = file;
  const auto at = header.find("xxh64:") + 6;
  for (std::size_t i = 0; i < 16; ++i) zeroed[8 + at + i] = std::byte{'0'};
  CHECK(cd::xxh64::hash(zeroed) == sum);
  CHECK(!fs::exists(tmp.path / ("x.safetensors.tmp." + std::to_string(::getpid()))));
}

TEST_CASE("reader accepts a hand-built file as other tools write it (no checksum, any key order, no padding)") {
  temp_dir tmp;
  const float a[2] = {3.0f, -0.5f};
  const std::uint16_t b = 0x3c00;  // 1.0 in F16
  std::vector<std::byte> data(10);
  std::memcpy(data.data(), a, 8);
  std::memcpy(data.data() + 8, &b, 2);
  const std::string header =
      R"({"b":{"dtype":"F16","shape":[1,1],"data_offsets":[8,10]}, "a" : {"shape":[2],"data_offsets":[0,8],"dtype":"F32"},"__metadata__":{"format":"pt"}})";
  const auto path = tmp.path / "foreign.safetensors";
  write_file(path, make_file(header, data));
  const auto f = safetensors_file::open(path);
  CHECK(!f.checksum());
  CHECK(f.metadata().at("format") == "pt");
  REQUIRE(f.tensors().size() == 2);
  CHECK(f.tensors()[0].name == "a");  // data order
  CHECK(f.read_floats("a") == std::vector<float>{3.0f, -0.5f});
  CHECK(f.read_floats("b") == std::vector<float>{1.0f});
  CHECK(f.at("b").shape == std::vector<std::int64_t>{1, 1});
  CHECK_THROWS_AS((void)f.at("c"), checkpoint_error);
  CHECK(message_of(path, {.require_checksum = true}).find("no \"chunkstar.checksum\"") != std::string::npos);
  // The empty file: no tensors, "{}".
  write_file(tmp.path / "empty.safetensors", make_file("{}", {}));
  CHECK(safetensors_file::open(tmp.path / "empty.safetensors").tensors().empty());
}

TEST_CASE("reader rejects structurally bad files with a message that names the problem") {
  temp_dir tmp;
  const auto p = tmp.path / "bad.safetensors";
  const std::vector<std::byte> d8(8), d16(16);
  auto expect = [&](std::vector<std::byte> file, std::string_view needle) {
    write_file(p, file);
    const auto m = message_of(p);
    CAPTURE(m);
    CHECK(m.find(needle) != std::string::npos);
    CHECK(m.find(p.string()) != std::string::npos);
  };
  const auto t = [](std::string name, std::string dt, std::string shape, std::string off) {
    return "\"" + name + "\":{\"dtype\":\"" + dt + "\",\"shape\":" + shape + ",\"data_offsets\":" + off + "}";
  };
  expect(make_file("{" + t("a", "F32", "[2]", "[0,8]") + "," + t("b", "F32", "[2]", "[4,12]") + "}", d16), "overlaps");
  expect(make_file("{" + t("a", "F32", "[1]", "[0,4]") + "," + t("b", "F32", "[2]", "[8,16]") + "}", d16), "gap");
  expect(make_file("{" + t("a", "F32", "[2]", "[0,8]") + "}", d16), "belong to no tensor");
  expect(make_file("{" + t("a", "F32", "[4]", "[0,16]") + "}", d8), "truncated");
  expect(make_file("{" + t("a", "F32", "[3]", "[0,8]") + "}", d8), "needs 12 bytes");
  expect(make_file("{" + t("a", "F32", "[-2]", "[0,8]") + "}", d8), "integers >= 0");
  expect(make_file("{" + t("a", "F32", "[2]", "[8,0]") + "}", d8), "0 <= begin <= end");
  expect(make_file("{" + t("a", "Q7", "[2]", "[0,8]") + "}", d8), "Q7");
  expect(make_file("{" + t("a", "F32", "[2]", "[0,8]") + "," + t("a", "F32", "[2]", "[0,8]") + "}", d8),
         "duplicate key");
  expect(make_file(R"({"a":{"dtype":"F32","shape":[2]}})", d8), "lacks data_offsets");
  expect(make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", d8), "unknown field");
  expect(make_file(R"({"__metadata__":{"k":1}})", {}), "must be a string");
  expect(make_file(R"({"__metadata__":{"chunkstar.checksum":"crc:1234"}})", {}), "xxh64");
  expect(make_file(R"([1,2])", {}), "not a JSON object");
  expect(make_file(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", d8),
         "more than 2^64");
  expect(make_file("{" + t("a", "F32", "[2]", "[0,8]"), d8), "malformed JSON");
  expect(bytes_of("abc"), "shorter than the 8-byte header length");
  {
    auto f = make_file("{}", {});
    f[7] = std::byte{0x7f};  // header length near 2^63
    expect(f, "exceeds the limit");
  }
  {
    auto f = make_file("{}    ", {});
    f[0] = std::byte{200};  // header longer than the file, below the limit
    expect(f, "truncated");
  }
  CHECK(message_of(tmp.path / "missing.safetensors").find("cannot open") != std::string::npos);
  CHECK(message_of(tmp.path).find("not a regular file") != std::string::npos);
}

TEST_CASE("writer rejects bad input and a failed write leaves the previous file intact") {
  temp_dir tmp;
  safetensors_writer w;
  const std::vector<float> two = {1, 2};
  CHECK_THROWS_AS(w.add("", safetensors_dtype::f32, {2}, std::as_bytes(std::span(two))), checkpoint_error);
  CHECK_THROWS_AS(w.add("__metadata__", safetensors_dtype::f32, {2}, std::as_bytes(std::span(two))), checkpoint_error);
  CHECK_THROWS_AS(w.add("a", safetensors_dtype::f32, {3}, std::as_bytes(std::span(two))), checkpoint_error);
  CHECK_THROWS_AS(w.add("a", safetensors_dtype::f32, {-2}, std::as_bytes(std::span(two))), checkpoint_error);
  CHECK_THROWS_AS(w.add("\xff", safetensors_dtype::f32, {2}, std::as_bytes(std::span(two))), checkpoint_error);
  CHECK_THROWS_AS(w.set_metadata("chunkstar.checksum", "x"), checkpoint_error);
  w.add_values<float>("a", {2}, two);
  CHECK_THROWS_AS(w.add_values<float>("a", {2}, two), checkpoint_error);

  const auto path = tmp.path / "keep.safetensors";
  w.write(path);
  const auto before = read_file(path);

  for (int mode = 0; mode < 3; ++mode) {
    safetensors_writer bad;
    bad.add_values<float>("a", {2}, two);
    bad.add_producer("big", safetensors_dtype::f32, {1000}, [mode](const byte_sink& sink) {
      std::vector<float> v(mode == 1 ? 999 : mode == 2 ? 1001 : 500, 1.0f);
      sink(std::as_bytes(std::span(v)));
      if (mode == 0) throw std::runtime_error("disk on fire");
    });
    CHECK_THROWS(bad.write(path));
    CHECK(read_file(path) == before);
  }
  safetensors_writer unwritable;
  unwritable.add_values<float>("a", {2}, two);
  CHECK_THROWS_AS(unwritable.write(tmp.path / "no" / "such" / "dir.safetensors"), checkpoint_error);
  for (const auto& e : fs::directory_iterator(tmp.path)) CHECK(e.path().filename() == "keep.safetensors");

  // A producer may stream in pieces of any size.
  safetensors_writer streamed;
  streamed.add_producer("s", safetensors_dtype::u8, {5000}, [](const byte_sink& sink) {
    for (int i = 0; i < 5000; i += 7) {
      std::vector<std::byte> piece(static_cast<std::size_t>(std::min(7, 5000 - i)));
      for (std::size_t k = 0; k < piece.size(); ++k) piece[k] = static_cast<std::byte>((i + static_cast<int>(k)) % 251);
      sink(piece);
    }
  });
  streamed.write(tmp.path / "s.safetensors");
  const auto s = safetensors_file::open(tmp.path / "s.safetensors").read_bytes("s");
  for (std::size_t i = 0; i < s.size(); ++i) CHECK(std::to_integer<std::size_t>(s[i]) == i % 251);
}

namespace {

/** Opens a (possibly corrupt) file: either it throws checkpoint_error, or it opens and every tensor
 *  reads; returns whether it opened, and the tensors' bytes by name. */
bool open_and_read(const fs::path& p, safetensors_open_options o, std::map<std::string, std::vector<std::byte>>& out) {
  out.clear();
  try {
    const auto f = safetensors_file::open(p, o);
    for (const auto& t : f.tensors()) {
      out[t.name] = f.read_bytes(t.name);
      (void)f.read_floats(t.name);
    }
    return true;
  } catch (const checkpoint_error&) {
    return false;
  }
}

}  // namespace

TEST_CASE("fuzz: every truncation, every byte flipped, garbage headers: data or checkpoint_error") {
  temp_dir tmp;
  safetensors_writer w;
  const std::vector<float> a = {1, 2, 3, 4, 5, 6};
  const std::vector<bfloat16> b = {bfloat16(0.5f), bfloat16(-1.0f), bfloat16(3.0f)};
  const std::vector<std::uint8_t> c = {9};
  w.add_values<float>("a", {2, 3}, a);
  w.add_values<bfloat16>("b", {3}, b);
  w.add_values<std::uint8_t>("c", {}, c);
  w.set_metadata("step", "7");
  const auto good_path = tmp.path / "good.safetensors";
  w.write(good_path);
  const auto good = read_file(good_path);
  std::map<std::string, std::vector<std::byte>> reference, got;
  REQUIRE(open_and_read(good_path, {}, reference));
  const auto p = tmp.path / "fuzz.safetensors";

  // Every truncation fails (with or without checksum verification).
  for (std::size_t len = 0; len < good.size(); ++len) {
    write_file(p, std::span(good).first(len));
    CHECK_FALSE(open_and_read(p, {}, got));
    CHECK_FALSE(open_and_read(p, {.verify_checksum = false}, got));
  }
  // Every byte flipped (several patterns): when the checksum is required, always detected; by
  // default a flip may only rename a metadata key (the checksum's own key: then the file counts as
  // foreign) and the data must be the original; without verification, the structural checks either
  // reject the file or it opens and reads without crashing.
  std::size_t structural_rejects = 0;
  for (std::size_t i = 0; i < good.size(); ++i)
    for (unsigned x : {0x01u, 0x20u, 0x80u, 0xffu}) {
      auto bad = good;
      bad[i] ^= static_cast<std::byte>(x);
      write_file(p, bad);
      CAPTURE(i);
      CAPTURE(x);
      CHECK_FALSE(open_and_read(p, {.require_checksum = true}, got));
      if (open_and_read(p, {}, got)) CHECK(got == reference);
      if (!open_and_read(p, {.verify_checksum = false}, got)) ++structural_rejects;
    }
  CHECK(structural_rejects > 0);
  // Extra bytes appended are caught by the exact-coverage rule.
  auto longer = good;
  longer.push_back(std::byte{0});
  write_file(p, longer);
  CHECK_FALSE(open_and_read(p, {.verify_checksum = false}, got));

  // Random garbage headers of every small length, and random mutations of a valid header text.
  std::mt19937 gen(11);
  std::uniform_int_distribution<int> byte(0, 255);
  const std::string alphabet = "{}[]\":,0123456789-.eE \\uFabcdef_BIU";
  std::uniform_int_distribution<std::size_t> pick(0, alphabet.size() - 1);
  for (int iter = 0; iter < 3000; ++iter) {
    std::string h;
    const int len = iter % 60;
    for (int k = 0; k < len; ++k) h += iter % 2 ? static_cast<char>(byte(gen)) : alphabet[pick(gen)];
    std::vector<std::byte> data(static_cast<std::size_t>(byte(gen) % 24));
    write_file(p, make_file(h, data));
    (void)open_and_read(p, {}, got);  // must not crash; any outcome is fine
  }
  const std::string valid =
      R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"b":{"dtype":"BF16","shape":[3],"data_offsets":[24,30]}})";
  std::vector<std::byte> data30(30);
  for (int iter = 0; iter < 5000; ++iter) {
    std::string h = valid;
    for (int k = 0; k < 1 + iter % 3; ++k) {
      const std::size_t at = std::uniform_int_distribution<std::size_t>(0, h.size() - 1)(gen);
      switch (byte(gen) % 3) {
        case 0: h[at] = alphabet[pick(gen)]; break;
        case 1: h.erase(at, 1); break;
        default: h.insert(at, 1, alphabet[pick(gen)]); break;
      }
    }
    write_file(p, make_file(h, data30));
    if (open_and_read(p, {}, got)) {
      // Whatever parsed must be in bounds: reads succeeded and sizes add up to the data.
      std::size_t total = 0;
      for (const auto& [n, v] : got) total += v.size();
      CHECK(total == 30);
    }
  }
}

}  // namespace checkpoint_safetensors_test
