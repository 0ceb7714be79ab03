// SPDX-License-Identifier: Apache-2.0
// Core value types: tensor_spec, byte-size parsing and printing, and the error hierarchy.
#include <chunkstar/core/error.hpp>
#include <chunkstar/core/memory_report.hpp>
#include <chunkstar/core/tensor_spec.hpp>
#include <chunkstar/core/units.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>

using namespace chunkstar;

namespace core_types_test {

TEST_CASE("tensor_spec: numel, bytes and shape_string") {
  const tensor_spec w{"h.0.attn.c_attn.weight", {768, 2304}, dtype::f16, tensor_role::weight};
  CHECK(w.numel() == 768u * 2304u);
  CHECK(w.bytes() == 768u * 2304u * 2u);
  CHECK(w.shape_string() == "[768, 2304]");

  const tensor_spec scalar{"scale", {}, dtype::f32, tensor_role::other};
  CHECK(scalar.numel() == 1);  // the empty product
  CHECK(scalar.bytes() == 4);
  CHECK(scalar.shape_string() == "[]");

  const tensor_spec empty{"unused", {4, 0, 7}, dtype::bf16, tensor_role::bias};
  CHECK(empty.numel() == 0);
  CHECK(empty.bytes() == 0);
  CHECK(empty.shape_string() == "[4, 0, 7]");

  // numel is the product of the dimensions, whatever their number.
  std::mt19937 rng(7);
  for (int i = 0; i < 200; ++i) {
    tensor_spec s{"r", {}, dtype::bf16, tensor_role::weight};
    std::size_t want = 1;
    std::string str = "[";
    const int rank = static_cast<int>(rng() % 5);
    for (int d = 0; d < rank; ++d) {
      const auto n = static_cast<std::int64_t>(rng() % 50);
      s.shape.push_back(n);
      want *= static_cast<std::size_t>(n);
      str += (d ? ", " : "") + std::to_string(n);
    }
    CHECK(s.numel() == want);
    CHECK(s.bytes() == 2 * want);
    CHECK(s.shape_string() == str + "]");
  }
  CHECK(role_name(tensor_role::norm) == "norm");
  CHECK(role_name(tensor_role::embedding) == "embedding");
}

TEST_CASE("parse_bytes accepts plain, SI and IEC sizes") {
  CHECK(parse_bytes("4096") == 4096u);
  CHECK(parse_bytes("0") == 0u);
  CHECK(parse_bytes("17B") == 17u);
  CHECK(parse_bytes("64KiB") == 64u * 1024u);
  CHECK(parse_bytes("256MiB") == 256u << 20);
  CHECK(parse_bytes("1.5GiB") == (3u << 30) / 2);
  CHECK(parse_bytes("2TiB") == std::size_t{2} << 40);
  CHECK(parse_bytes("8G") == std::size_t{8} << 30);
  CHECK(parse_bytes("3K") == 3072u);
  CHECK(parse_bytes("256MB") == 256'000'000u);
  CHECK(parse_bytes("2kB") == 2000u);
  CHECK(parse_bytes("2KB") == 2000u);
  CHECK(parse_bytes("1.5GB") == 1'500'000'000u);
  CHECK(parse_bytes("  12 MiB  ") == 12u << 20);
  CHECK(parse_bytes("0.5KiB") == 512u);
}

TEST_CASE("parse_bytes rejects what is not a size") {
  for (const char* bad : {"", "   ", "abc", "MiB", "-5", "-5MiB", "12XB", "12 mib", "1.2.3", ".", "1e3", "5 5", "0x10",
                          "1,024", "64KiBs", "99999999999999999999TiB"}) {
    CAPTURE(bad);
    CHECK_FALSE(parse_bytes(bad).has_value());
  }
}

TEST_CASE("format_bytes: three significant figures in IEC units") {
  CHECK(format_bytes(0) == "0 B");
  CHECK(format_bytes(512) == "512 B");
  CHECK(format_bytes(1023) == "1023 B");
  CHECK(format_bytes(1024) == "1.00 KiB");
  CHECK(format_bytes(1536u << 20) == "1.50 GiB");
  CHECK(format_bytes(12u << 20) == "12.0 MiB");
  CHECK(format_bytes(100u << 20) == "100 MiB");
  CHECK(format_bytes(std::size_t{3} << 40) == "3.00 TiB");
  CHECK(format_bytes(std::size_t{5} << 50) == "5.00 PiB");

  // Printing then parsing comes back within the printed precision (3 significant figures).
  // Below 1 PiB: parse_bytes has no PiB unit.
  std::mt19937_64 rng(11);
  for (int i = 0; i < 2000; ++i) {
    const std::size_t n = rng() >> (14 + rng() % 50);
    const std::string s = format_bytes(n);
    const auto back = parse_bytes(s.substr(0, s.find(' ')) + s.substr(s.find(' ') + 1));
    REQUIRE_MESSAGE(back.has_value(), s);
    const double rel =
        std::fabs(static_cast<double>(*back) - static_cast<double>(n)) / std::max(1.0, static_cast<double>(n));
    CHECK_MESSAGE(rel <= 0.005, n << " -> " << s << " -> " << *back);
  }
}

TEST_CASE("every error type is a chunkstar::error and keeps its message") {
  static_assert(std::is_base_of_v<std::runtime_error, error>);
  static_assert(std::is_base_of_v<error, config_error>);
  static_assert(std::is_base_of_v<error, state_error>);
  static_assert(std::is_base_of_v<error, out_of_memory_error>);
  static_assert(std::is_base_of_v<error, communication_error>);
  static_assert(std::is_base_of_v<error, checkpoint_error>);
  static_assert(!std::is_base_of_v<config_error, state_error>);

  auto caught_as_error = [](auto&& thrower) -> std::string {
    try {
      thrower();
    } catch (const error& e) {
      return e.what();
    }
    return "not caught";
  };
  CHECK(caught_as_error([] { throw config_error("bad chunk size"); }) == "bad chunk size");
  CHECK(caught_as_error([] { throw state_error("chunk is in COMPUTE"); }) == "chunk is in COMPUTE");
  CHECK(caught_as_error([] { throw communication_error("rank 3 went away"); }) == "rank 3 went away");
  CHECK(caught_as_error([] { throw checkpoint_error("truncated"); }) == "truncated");
  CHECK(caught_as_error([] { throw out_of_memory_error("x", 1, {}); }).rfind("x", 0) == 0);
  CHECK_THROWS_AS(throw config_error("c"), config_error);
  CHECK_THROWS_AS(throw checkpoint_error("c"), std::runtime_error);
}

TEST_CASE("out_of_memory_error carries the report and names what failed") {
  memory_report r;
  r.spaces.push_back(
      {"cuda:0", std::size_t{80} << 30, std::size_t{79} << 30, std::size_t{80} << 30, std::size_t{256} << 20});
  r.spaces.push_back(
      {"host", std::numeric_limits<std::size_t>::max(), 12u << 20, 20u << 20, std::numeric_limits<std::size_t>::max()});
  const out_of_memory_error e("allocating chunk 7 of the param list (512 MiB) on cuda:0", std::size_t{512} << 20, r);

  CHECK(e.requested_bytes() == std::size_t{512} << 20);
  REQUIRE(e.report().spaces.size() == 2);
  CHECK(e.report().spaces[0].name == "cuda:0");
  CHECK(e.report().spaces[1].largest_free_block == std::numeric_limits<std::size_t>::max());

  const std::string m = e.what();
  CHECK(m.rfind("allocating chunk 7 of the param list (512 MiB) on cuda:0", 0) == 0);
  CHECK(m.find("cuda:0: used 79.0 GiB of 80.0 GiB") != std::string::npos);
  CHECK(m.find("largest free block 256 MiB") != std::string::npos);
  CHECK(m.find("host: used 12.0 MiB of unlimited") != std::string::npos);
  CHECK(m.find("peak 20.0 MiB") != std::string::npos);
  CHECK(m.find("largest free block unlimited") != std::string::npos);
  CHECK(r.to_string() == m.substr(m.find('\n') + 1));
}

}  // namespace core_types_test
