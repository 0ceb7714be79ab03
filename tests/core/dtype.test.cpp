// SPDX-License-Identifier: Apache-2.0
// dtype: every fp16 and bf16 bit pattern against references computed independently in double
// (value from the sign/exponent/mantissa fields with ldexp; rounding by finding the nearest
// representable value with ties to even), cross-checked with the F16C instructions where the CPU
// has them, plus a randomised sweep of float inputs.
#include <chunkstar/core/dtype.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ios>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

namespace dtype_test {

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define CHUNKSTAR_TEST_F16C 1
namespace {
// Compiled for F16C per function, so the test needs no special flags; used only after a runtime
// check that the CPU has the instructions. Immediate 0 = round to nearest even, whatever MXCSR says.
__attribute__((target("f16c"))) std::uint16_t hw_float_to_f16(float x) {
  return static_cast<std::uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT));
}
__attribute__((target("f16c"))) float hw_f16_to_float(std::uint16_t h) { return _cvtsh_ss(h); }
// CPUID.1:ECX bit 29 = F16C; the VEX encoding also needs the OS to save AVX state (OSXSAVE,
// bit 27, and XCR0 bits 1-2).
bool cpu_has_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  if (!(c & (1u << 29)) || !(c & (1u << 27))) return false;
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0u));
  return (lo & 6u) == 6u;
}
}  // namespace
#endif

using namespace chunkstar;

namespace {

// A 16-bit float format: 1 sign bit, `exp_bits` exponent bits, the rest mantissa.
struct format16 {
  int exp_bits;
  int man_bits;
  [[nodiscard]] int bias() const { return (1 << (exp_bits - 1)) - 1; }
  [[nodiscard]] std::uint16_t inf_bits() const {
    return static_cast<std::uint16_t>(((1u << exp_bits) - 1u) << man_bits);
  }
};
constexpr format16 f16_format{5, 10};
constexpr format16 bf16_format{8, 7};

// The value of a bit pattern, straight from the IEEE definition.
double reference_value(format16 f, std::uint16_t bits) {
  const bool neg = bits & 0x8000u;
  const unsigned e = (bits >> f.man_bits) & ((1u << f.exp_bits) - 1u);
  const unsigned m = bits & ((1u << f.man_bits) - 1u);
  double v;
  if (e == (1u << f.exp_bits) - 1u)
    v = m == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  else if (e == 0) v = std::ldexp(static_cast<double>(m), 1 - f.bias() - f.man_bits);
  else v = std::ldexp(static_cast<double>((1u << f.man_bits) + m), static_cast<int>(e) - f.bias() - f.man_bits);
  return neg ? -v : v;
}

// Magnitudes of every non-negative finite pattern, indexed by pattern, plus one more entry: the
// value the next pattern (the infinity encoding) would have with an unbounded exponent. IEEE
// rounding overflows exactly when the nearest-even choice is that value.
std::vector<double> magnitude_table(format16 f) {
  std::vector<double> t;
  for (std::uint32_t b = 0; b < f.inf_bits(); ++b) t.push_back(reference_value(f, static_cast<std::uint16_t>(b)));
  t.push_back(std::ldexp(1.0, f.bias() + 1));
  return t;
}

// float -> 16-bit with round to nearest, ties to even, by search in the table. All differences
// below are exact in double (both operands lie within one 16-bit ulp and have few bits).
std::uint16_t reference_round(const std::vector<double>& mags, float x) {
  const std::uint16_t sign = std::signbit(x) ? 0x8000u : 0u;
  const std::uint16_t inf = static_cast<std::uint16_t>(mags.size() - 1);
  if (std::isinf(x)) return sign | inf;
  const double a = std::fabs(static_cast<double>(x));
  const auto up = std::upper_bound(mags.begin(), mags.end(), a);  // first entry > a; mags[0] = 0 <= a
  std::size_t lo = static_cast<std::size_t>(up - mags.begin()) - 1;
  if (lo >= inf) return sign | inf;
  if (mags[lo] != a) {
    const double dlo = a - mags[lo], dhi = mags[lo + 1] - a;
    if (dhi < dlo || (dhi == dlo && (lo & 1u))) ++lo;
  }
  return static_cast<std::uint16_t>(sign | lo);
}

bool same_float(float a, float b) { return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b); }

// Inputs for rounding: every pattern widened, every midpoint between neighbours (including the
// one between the largest finite value and the overflow value) and the floats just either side of
// each, both signs; then the special values of both formats.
std::vector<float> rounding_inputs(const std::vector<double>& mags) {
  std::vector<float> in;
  for (std::size_t i = 0; i + 1 < mags.size(); ++i) {
    const double mid = (mags[i] + mags[i + 1]) / 2;
    const float fmid = static_cast<float>(mid);
    REQUIRE(static_cast<double>(fmid) == mid);  // midpoints need one more bit: exact in float
    for (float s : {1.0f, -1.0f}) {
      in.push_back(s * static_cast<float>(mags[i]));
      in.push_back(s * fmid);
      in.push_back(s * std::nextafter(fmid, 0.0f));
      in.push_back(s * std::nextafter(fmid, std::numeric_limits<float>::infinity()));
    }
  }
  const float specials[] = {0.0f,
                            65504.0f,
                            65519.99f,
                            std::nextafter(65520.0f, 0.0f),
                            65520.0f,
                            std::nextafter(65520.0f, 1e9f),
                            65536.0f,
                            1e6f,
                            std::ldexp(1.0f, -24),
                            std::ldexp(1.0f, -25),
                            std::nextafter(std::ldexp(1.0f, -25), 1.0f),
                            std::nextafter(std::ldexp(1.0f, -25), 0.0f),
                            std::ldexp(1.5f, -25),
                            std::ldexp(1.0f, -26),
                            std::ldexp(1.0f, -14),
                            std::nextafter(std::ldexp(1.0f, -14), 0.0f),
                            std::ldexp(1023.5f, -24),  // between the largest subnormal half and the smallest normal
                            std::numeric_limits<float>::denorm_min(),
                            std::numeric_limits<float>::min(),
                            std::nextafter(std::numeric_limits<float>::min(), 0.0f),
                            std::numeric_limits<float>::max(),
                            std::ldexp(1.0f, 127) * 1.99609375f,
                            std::nextafter(std::ldexp(1.0f, 127) * 1.99609375f, 0.0f),
                            std::numeric_limits<float>::infinity()};
  for (float s : specials) {
    in.push_back(s);
    in.push_back(-s);
  }
  return in;
}

std::vector<float> nan_inputs() {
  std::vector<float> in;
  for (std::uint32_t payload : {0x400000u, 0x000001u, 0x001000u, 0x002000u, 0x3fffffu, 0x7fffffu, 0x000fffu, 0x123456u})
    for (std::uint32_t sign : {0u, 0x80000000u}) in.push_back(std::bit_cast<float>(sign | 0x7f800000u | payload));
  return in;
}

// ~10 million float patterns: half uniform over all 2^32, half with exponents where fp16 rounding
// is interesting (around 2^-26 .. 2^17). Fixed seed: the sweep is reproducible.
template <class Fn>
void random_floats(std::size_t n, Fn&& fn) {
  std::mt19937_64 rng(0x5eed1234abcdULL);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t r = rng();
    std::uint32_t bits = static_cast<std::uint32_t>(r);
    if (i & 1) bits = (bits & 0x807fffffu) | (static_cast<std::uint32_t>(101 + (r >> 32) % 44) << 23);
    fn(std::bit_cast<float>(bits));
  }
}

}  // namespace

static_assert(float_to_f16_bits(1.0f) == 0x3c00 && float_to_f16_bits(-2.0f) == 0xc000);
static_assert(float_to_f16_bits(65504.0f) == 0x7bff && float_to_f16_bits(65520.0f) == 0x7c00);
static_assert(f16_bits_to_float(0x0001) == 0x1p-24f && f16_bits_to_float(0x3555) == 0x1.554p-2f);
static_assert(float_to_bf16_bits(1.0f) == 0x3f80 && bf16_bits_to_float(0xc040) == -3.0f);
static_assert(std::is_same_v<dtype_storage_t<dtype::f16>, float16> &&
              std::is_same_v<dtype_storage_t<dtype::bf16>, bfloat16> &&
              std::is_same_v<dtype_storage_t<dtype::f32>, float>);
static_assert(dtype_of_v<float> == dtype::f32 && dtype_of_v<float16> == dtype::f16 &&
              dtype_of_v<bfloat16> == dtype::bf16);
static_assert(!is_element_type_v<double> && !is_element_type_v<std::uint16_t>);

TEST_CASE("dtype sizes and names") {
  CHECK(dtype_size(dtype::f32) == sizeof(float));
  CHECK(dtype_size(dtype::f16) == sizeof(float16));
  CHECK(dtype_size(dtype::bf16) == sizeof(bfloat16));
  CHECK(dtype_name(dtype::f32) == "f32");
  CHECK(dtype_name(dtype::f16) == "f16");
  CHECK(dtype_name(dtype::bf16) == "bf16");
}

TEST_CASE("f16 -> float: all 65536 patterns against the field-by-field reference") {
  std::size_t bad = 0;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto h = static_cast<std::uint16_t>(b);
    const double want = reference_value(f16_format, h);
    const float got = f16_bits_to_float(h);
    bool ok;
    if (std::isnan(want)) {
      // NaN stays NaN with its sign and its payload (the quiet bit aside).
      const std::uint32_t g = std::bit_cast<std::uint32_t>(got);
      ok = std::isnan(got) && std::signbit(got) == static_cast<bool>(h & 0x8000u) &&
           ((g >> 13) & 0x1ffu) == (h & 0x1ffu) && (g & 0x1fffu) == 0;
    } else {
      ok = static_cast<double>(got) == want && std::signbit(got) == std::signbit(want);
    }
    ok = ok && same_float(to_float(float16::from_bits(h)), got) &&
         same_float(static_cast<float>(float16::from_bits(h)), got);
    if (!ok && ++bad <= 10) FAIL_CHECK("pattern 0x" << std::hex << b << ": got " << got << ", want " << want);
  }
  CHECK(bad == 0);
}

TEST_CASE("bf16 -> float: all 65536 patterns against the field-by-field reference") {
  std::size_t bad = 0;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto h = static_cast<std::uint16_t>(b);
    const double want = reference_value(bf16_format, h);
    const float got = bf16_bits_to_float(h);
    bool ok = std::isnan(want) ? std::isnan(got) && std::signbit(got) == static_cast<bool>(h & 0x8000u)
                               : static_cast<double>(got) == want && std::signbit(got) == std::signbit(want);
    ok = ok && same_float(to_float(bfloat16::from_bits(h)), got) &&
         same_float(static_cast<float>(bfloat16::from_bits(h)), got);
    if (!ok && ++bad <= 10) FAIL_CHECK("pattern 0x" << std::hex << b << ": got " << got << ", want " << want);
  }
  CHECK(bad == 0);
}

TEST_CASE("float -> f16 rounds to nearest even: widened patterns, midpoints, neighbours, thresholds") {
  const auto mags = magnitude_table(f16_format);
  REQUIRE(mags.size() == 0x7c01);
  REQUIRE(mags[0x7bff] == 65504.0);
  std::size_t bad = 0, checked = 0;
  for (float x : rounding_inputs(mags)) {
    const std::uint16_t want = reference_round(mags, x);
    const std::uint16_t got = float_to_f16_bits(x);
    ++checked;
    if ((got != want || float16(x).bits != got || from_float<float16>(x).bits != got) && ++bad <= 10)
      FAIL_CHECK("x = " << x << " (0x" << std::hex << std::bit_cast<std::uint32_t>(x) << "): got 0x" << got
                        << ", want 0x" << want);
  }
  CHECK(bad == 0);
  CHECK(checked > 8 * 31744);
  // The thresholds the brief names, spelled out.
  CHECK(float_to_f16_bits(65519.99f) == 0x7bff);
  CHECK(float_to_f16_bits(65520.0f) == 0x7c00);
  CHECK(float_to_f16_bits(-65520.0f) == 0xfc00);
  CHECK(float_to_f16_bits(std::ldexp(1.0f, -25)) == 0x0000);  // tie: to even (zero)
  CHECK(float_to_f16_bits(std::nextafter(std::ldexp(1.0f, -25), 1.0f)) == 0x0001);
  CHECK(float_to_f16_bits(std::ldexp(1.5f, -24)) == 0x0002);     // tie: to even
  CHECK(float_to_f16_bits(std::ldexp(1023.5f, -24)) == 0x0400);  // up into the normals
  CHECK(float_to_f16_bits(-0.0f) == 0x8000);
}

TEST_CASE("float -> bf16 rounds to nearest even: widened patterns, midpoints, neighbours, thresholds") {
  const auto mags = magnitude_table(bf16_format);
  REQUIRE(mags.size() == 0x7f81);
  std::size_t bad = 0;
  for (float x : rounding_inputs(mags)) {
    const std::uint16_t want = reference_round(mags, x);
    const std::uint16_t got = float_to_bf16_bits(x);
    if ((got != want || bfloat16(x).bits != got || from_float<bfloat16>(x).bits != got) && ++bad <= 10)
      FAIL_CHECK("x = " << x << " (0x" << std::hex << std::bit_cast<std::uint32_t>(x) << "): got 0x" << got
                        << ", want 0x" << want);
  }
  CHECK(bad == 0);
  CHECK(float_to_bf16_bits(std::numeric_limits<float>::max()) == 0x7f80);  // above the last midpoint
  CHECK(float_to_bf16_bits(-std::numeric_limits<float>::infinity()) == 0xff80);
}

TEST_CASE("NaN stays NaN with its sign in both narrowings") {
  for (float x : nan_inputs()) {
    const std::uint16_t h = float_to_f16_bits(x);
    const std::uint16_t b = float_to_bf16_bits(x);
    CAPTURE(std::bit_cast<std::uint32_t>(x));
    CHECK(std::isnan(f16_bits_to_float(h)));
    CHECK(std::isnan(bf16_bits_to_float(b)));
    CHECK(static_cast<bool>(h & 0x8000u) == std::signbit(x));
    CHECK(static_cast<bool>(b & 0x8000u) == std::signbit(x));
  }
}

TEST_CASE("16 -> 32 -> 16 is the identity for every non-NaN pattern") {
  std::size_t bad = 0;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto h = static_cast<std::uint16_t>(b);
    if (!std::isnan(f16_bits_to_float(h)) && float_to_f16_bits(f16_bits_to_float(h)) != h && ++bad <= 10)
      FAIL_CHECK("f16 0x" << std::hex << b);
    if (!std::isnan(bf16_bits_to_float(h)) && float_to_bf16_bits(bf16_bits_to_float(h)) != h && ++bad <= 10)
      FAIL_CHECK("bf16 0x" << std::hex << b);
    if (!std::isnan(f16_bits_to_float(h)) &&
        !(from_float<float16>(to_float(float16::from_bits(h))) == float16::from_bits(h)) && ++bad <= 10)
      FAIL_CHECK("float16 0x" << std::hex << b);
  }
  CHECK(bad == 0);
  CHECK(from_float<float>(1.25f) == 1.25f);
  CHECK(to_float(2.5f) == 2.5f);
}

TEST_CASE("randomised sweep: 10 million floats against the references") {
  const auto f16_mags = magnitude_table(f16_format);
  const auto bf16_mags = magnitude_table(bf16_format);
  std::size_t bad = 0, nans = 0;
  random_floats(10'000'000, [&](float x) {
    if (std::isnan(x)) {
      ++nans;
      const bool ok = std::isnan(f16_bits_to_float(float_to_f16_bits(x))) &&
                      std::isnan(bf16_bits_to_float(float_to_bf16_bits(x))) &&
                      static_cast<bool>(float_to_f16_bits(x) & 0x8000u) == std::signbit(x) &&
                      static_cast<bool>(float_to_bf16_bits(x) & 0x8000u) == std::signbit(x);
      if (!ok && ++bad <= 10) FAIL_CHECK("NaN 0x" << std::hex << std::bit_cast<std::uint32_t>(x));
      return;
    }
    const std::uint16_t h = float_to_f16_bits(x), hw = reference_round(f16_mags, x);
    const std::uint16_t b = float_to_bf16_bits(x), bw = reference_round(bf16_mags, x);
    if ((h != hw || b != bw) && ++bad <= 10)
      FAIL_CHECK("x = 0x" << std::hex << std::bit_cast<std::uint32_t>(x) << ": f16 0x" << h << " want 0x" << hw
                          << ", bf16 0x" << b << " want 0x" << bw);
  });
  CHECK(bad == 0);
  CHECK(nans > 0);  // the uniform half hits NaNs (about 1 in 256)
}

TEST_CASE("fp16 conversions agree with the F16C instructions bit for bit") {
#ifdef CHUNKSTAR_TEST_F16C
  if (!cpu_has_f16c()) {
    MESSAGE("CPU without F16C: hardware cross-check skipped");
    return;
  }
  std::size_t bad = 0;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto h = static_cast<std::uint16_t>(b);
    const float sw = f16_bits_to_float(h), hw = hw_f16_to_float(h);
    // The hardware quietens signalling NaNs on widening; the library widens NaNs unchanged.
    const bool ok = std::isnan(hw) ? std::isnan(sw) && std::signbit(sw) == std::signbit(hw) : same_float(sw, hw);
    if (!ok && ++bad <= 10) FAIL_CHECK("widening 0x" << std::hex << b);
  }
  const auto mags = magnitude_table(f16_format);
  auto compare = [&](float x) {
    if (float_to_f16_bits(x) != hw_float_to_f16(x) && ++bad <= 10)
      FAIL_CHECK("x = 0x" << std::hex << std::bit_cast<std::uint32_t>(x) << ": library 0x" << float_to_f16_bits(x)
                          << ", F16C 0x" << hw_float_to_f16(x));
  };
  for (float x : rounding_inputs(mags)) compare(x);
  for (float x : nan_inputs()) compare(x);  // quietened, sign and top payload bits kept, as the hardware does
  random_floats(10'000'000, compare);
  CHECK(bad == 0);
#else
  MESSAGE("not an x86 GCC/Clang build: hardware cross-check skipped");
#endif
}

TEST_CASE("bulk widen_to_float / narrow_from_float: every path of this build gives the scalar conversions' bits") {
  // Every 16-bit pattern (signalling NaNs included: widening keeps them as they are), at an odd
  // byte offset (unaligned), and a length that leaves a tail after the vectors.
  std::vector<std::uint16_t> patterns(65536);
  for (std::uint32_t b = 0; b < 65536; ++b) patterns[b] = static_cast<std::uint16_t>(b);
  std::vector<float> floats = rounding_inputs(magnitude_table(f16_format));
  for (float x : nan_inputs()) floats.push_back(x);
  random_floats(200'003, [&](float x) { floats.push_back(x); });
  for (cpu_isa isa : {cpu_isa::portable, cpu_isa::avx2, cpu_isa::avx512}) {
    if (!cpu_isa_supported(isa)) {
      MESSAGE(cpu_isa_name(isa) << ": not supported by this CPU, skipped");
      continue;
    }
    const scoped_cpu_isa forced(isa);
    CAPTURE(cpu_isa_name(isa));
    for (dtype t : {dtype::f16, dtype::bf16}) {
      CAPTURE(dtype_name(t));
      std::vector<std::byte> src(1 + 4 * patterns.size());  // room for f32 too: GCC's -Warray-bounds checks every case
      std::memcpy(src.data() + 1, patterns.data(), 2 * patterns.size());
      std::vector<float> wide(patterns.size());
      widen_to_float(src.data() + 1, t, wide);
      std::size_t bad = 0;
      for (std::size_t i = 0; i < patterns.size(); ++i) {
        const float want = t == dtype::f16 ? f16_bits_to_float(patterns[i]) : bf16_bits_to_float(patterns[i]);
        bad += !same_float(wide[i], want);
      }
      CHECK(bad == 0);
      std::vector<std::byte> dst(1 + 4 * floats.size());
      narrow_from_float(floats, t, dst.data() + 1);
      bad = 0;
      for (std::size_t i = 0; i < floats.size(); ++i) {
        std::uint16_t got;
        std::memcpy(&got, dst.data() + 1 + 2 * i, 2);
        bad += got != (t == dtype::f16 ? float_to_f16_bits(floats[i]) : float_to_bf16_bits(floats[i]));
      }
      CHECK(bad == 0);
    }
  }
}

}  // namespace dtype_test
