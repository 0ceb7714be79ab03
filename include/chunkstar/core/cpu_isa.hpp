// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Which SIMD instruction set the CPU kernels run, chosen once at run time from the CPU.
 *
 *  Every build with GCC or Clang on x86-64 compiles each SIMD kernel three times into the same
 *  program, whatever the flags of the including translation unit: portable (plain C++), AVX2
 *  (+FMA +F16C, 8 floats per vector) and AVX-512F (16 floats), each with its own per-function
 *  target attribute (core/simd_target.hpp). The first kernel call asks the CPU (cpuid, and xgetbv
 *  for the operating system's support of the vector registers) and from then on every kernel runs
 *  the widest path the CPU has, so a plain `-O3` build needs no `-march` flag to be fast. Every path
 *  gives the same bits (each kernel documents its operation order), which tests prove by forcing
 *  each path in one program.
 *
 *  The choice, in order: force_cpu_isa() (tests, benchmarks), else the environment variable
 *  `CHUNKSTAR_CPU_ISA=portable|avx2|avx512` read at the first call (ignored, and reported so, when
 *  it names a path this CPU cannot run or no path at all), else the widest path this CPU supports.
 *  cpu_isa_report() says which was chosen and why (train_gpt prints it).
 *
 *  Elsewhere (other architectures and compilers, CUDA with a Clang host) only the portable path is
 *  compiled (CHUNKSTAR_ISA_DISPATCH is 0); the API is the same.
 */
#pragma once

#include <chunkstar/core/error.hpp>

#include <atomic>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

/// 1 when the AVX2 and AVX-512 paths are compiled into every translation unit: x86 with GCC or
/// Clang, and nvcc with a GCC host compiler (tested: nvcc 13.0 over GCC 12); not CUDA with a Clang
/// host or as Clang's own CUDA mode. Define it to 0 before including chunkstar (for every
/// translation unit of a program alike) to compile the portable path only.
#if !defined(CHUNKSTAR_ISA_DISPATCH)
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && \
    !(defined(__CUDACC__) && defined(__clang__))
#define CHUNKSTAR_ISA_DISPATCH 1
#else
#define CHUNKSTAR_ISA_DISPATCH 0
#endif
#endif

#if CHUNKSTAR_ISA_DISPATCH
#include <cpuid.h>
#endif

namespace chunkstar {

/** @brief A SIMD instruction set for the CPU kernels. Every ISA gives the same bits. */
enum class cpu_isa : unsigned char {
  portable,  ///< plain C++ (std::fma), one element at a time
  avx2,      ///< AVX2 + FMA + F16C, 8 floats per vector
  avx512,    ///< AVX-512F (with AVX2 + FMA + F16C), 16 floats per vector
};

/** @brief "portable", "avx2" or "avx512", for logs and benchmark records. */
constexpr std::string_view cpu_isa_name(cpu_isa isa) noexcept {
  switch (isa) {
    case cpu_isa::portable: return "portable";
    case cpu_isa::avx2: return "avx2";
    case cpu_isa::avx512: return "avx512";
  }
  return "?";
}

/** @brief The ISA called @p name ("portable", "avx2", "avx512"), or nothing. */
constexpr std::optional<cpu_isa> parse_cpu_isa(std::string_view name) noexcept {
  for (cpu_isa isa : {cpu_isa::portable, cpu_isa::avx2, cpu_isa::avx512})
    if (name == cpu_isa_name(isa)) return isa;
  return std::nullopt;
}

/** @brief Whether @p Isa's kernels are compiled into this build (all three where
 *         CHUNKSTAR_ISA_DISPATCH is 1, else the portable path only). Whether the CPU can run them
 *         is cpu_isa_supported(). */
template <cpu_isa Isa>
inline constexpr bool cpu_isa_available_v = Isa == cpu_isa::portable || CHUNKSTAR_ISA_DISPATCH;

namespace detail {

/** What the CPU and the operating system support, asked once. */
struct cpu_isa_probe {
  bool avx2 = false;    ///< AVX2, FMA and F16C, with the ymm state enabled by the OS
  bool avx512 = false;  ///< and AVX-512F, with the zmm and mask state enabled
};

inline cpu_isa_probe probe_cpu() noexcept {
  cpu_isa_probe p;
#if CHUNKSTAR_ISA_DISPATCH
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(0, &a, &b, &c, &d) == 0) return p;
  const unsigned max_leaf = a;
  __cpuid(1, a, b, c, d);
  const bool fma = (c >> 12) & 1u, osxsave = (c >> 27) & 1u, avx = (c >> 28) & 1u, f16c = (c >> 29) & 1u;
  if (!osxsave || !avx || max_leaf < 7) return p;
  unsigned xcr0_lo = 0, xcr0_hi = 0;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  const unsigned long long xcr0 = (static_cast<unsigned long long>(xcr0_hi) << 32) | xcr0_lo;
  const bool ymm_state = (xcr0 & 0x6u) == 0x6u;    // SSE and AVX state
  const bool zmm_state = (xcr0 & 0xe6u) == 0xe6u;  // and opmask, ZMM_Hi256, Hi16_ZMM
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx2 = (b >> 5) & 1u, avx512f = (b >> 16) & 1u;
  p.avx2 = ymm_state && avx2 && fma && f16c;
  p.avx512 = p.avx2 && zmm_state && avx512f;
#endif
  return p;
}

inline const cpu_isa_probe& cpu_probe() noexcept {
  static const cpu_isa_probe p = probe_cpu();
  return p;
}

/** -1: not forced; else the forced cpu_isa. One object per program (an inline function's static). */
inline std::atomic<int>& forced_cpu_isa() noexcept {
  static std::atomic<int> forced{-1};
  return forced;
}

/** What CHUNKSTAR_CPU_ISA asked for, read once, and whether it was honoured. */
struct cpu_isa_env {
  std::string value;                ///< the variable's text; empty if unset
  std::optional<cpu_isa> honoured;  ///< the ISA it selects, if valid and supported
};

}  // namespace detail

/** @brief Whether this CPU (and its operating system) can run @p isa's kernels, and they are
 *         compiled into this build. */
inline bool cpu_isa_supported(cpu_isa isa) noexcept {
  switch (isa) {
    case cpu_isa::portable: return true;
    case cpu_isa::avx2: return cpu_isa_available_v<cpu_isa::avx2> && detail::cpu_probe().avx2;
    case cpu_isa::avx512: return cpu_isa_available_v<cpu_isa::avx512> && detail::cpu_probe().avx512;
  }
  return false;
}

/** @brief The widest ISA compiled into this build that this CPU supports (detected once). */
inline cpu_isa detected_cpu_isa() noexcept {
  if (cpu_isa_supported(cpu_isa::avx512)) return cpu_isa::avx512;
  if (cpu_isa_supported(cpu_isa::avx2)) return cpu_isa::avx2;
  return cpu_isa::portable;
}

namespace detail {
inline const cpu_isa_env& cpu_env() noexcept {
  static const cpu_isa_env env = [] {
    cpu_isa_env e;
    if (const char* v = std::getenv("CHUNKSTAR_CPU_ISA")) {
      e.value = v;
      const auto isa = parse_cpu_isa(e.value);
      if (isa && cpu_isa_supported(*isa)) e.honoured = isa;
    }
    return e;
  }();
  return env;
}
}  // namespace detail

/** @brief The ISA every dispatching kernel runs now: force_cpu_isa()'s, else CHUNKSTAR_CPU_ISA's
 *         (when this CPU supports it), else detected_cpu_isa(). Cheap: an atomic load after the
 *         first call. */
inline cpu_isa active_cpu_isa() noexcept {
  const int forced = detail::forced_cpu_isa().load(std::memory_order_relaxed);
  if (forced >= 0) return static_cast<cpu_isa>(forced);
  if (const auto& env = detail::cpu_env(); env.honoured) return *env.honoured;
  return detected_cpu_isa();
}

/** @brief Makes every kernel run @p isa from now on, in every thread (tests compare paths; a
 *         kernel already running finishes on the path it started with). Throws config_error when
 *         this CPU cannot run it or it is not compiled in. */
inline void force_cpu_isa(cpu_isa isa) {
  if (!cpu_isa_supported(isa))
    throw config_error("force_cpu_isa: this CPU or build cannot run the " + std::string(cpu_isa_name(isa)) +
                       " kernels (detected: " + std::string(cpu_isa_name(detected_cpu_isa())) +
                       "); pick one that cpu_isa_supported() accepts");
  detail::forced_cpu_isa().store(static_cast<int>(isa), std::memory_order_relaxed);
}

/** @brief Undoes force_cpu_isa(): back to CHUNKSTAR_CPU_ISA or the detected ISA. */
inline void reset_cpu_isa() noexcept { detail::forced_cpu_isa().store(-1, std::memory_order_relaxed); }

/** @brief force_cpu_isa() for a scope; restores the previous choice on destruction. */
class scoped_cpu_isa {
 public:
  explicit scoped_cpu_isa(cpu_isa isa) : previous_(detail::forced_cpu_isa().load(std::memory_order_relaxed)) {
    force_cpu_isa(isa);
  }
  scoped_cpu_isa(const scoped_cpu_isa&) = delete;
  scoped_cpu_isa& operator=(const scoped_cpu_isa&) = delete;
  ~scoped_cpu_isa() { detail::forced_cpu_isa().store(previous_, std::memory_order_relaxed); }

 private:
  int previous_;
};

/** @brief One line for logs: the ISA in use and why, e.g. "avx512 (detected)",
 *         "avx2 (CHUNKSTAR_CPU_ISA=avx2; detected avx512)",
 *         "avx512 (detected; CHUNKSTAR_CPU_ISA=sse ignored: not portable, avx2 or avx512)". */
inline std::string cpu_isa_report() {
  const cpu_isa active = active_cpu_isa(), detected = detected_cpu_isa();
  const auto& env = detail::cpu_env();
  std::string s(cpu_isa_name(active));
  if (detail::forced_cpu_isa().load(std::memory_order_relaxed) >= 0)
    s += " (forced by force_cpu_isa; detected " + std::string(cpu_isa_name(detected)) + ")";
  else if (env.honoured)
    s += " (CHUNKSTAR_CPU_ISA=" + env.value + "; detected " + std::string(cpu_isa_name(detected)) + ")";
  else {
    s += " (detected";
    if (!env.value.empty())
      s += "; CHUNKSTAR_CPU_ISA=" + env.value + " ignored: " +
           (parse_cpu_isa(env.value) ? "this CPU or build cannot run it" : "not portable, avx2 or avx512");
    s += ")";
  }
  return s;
}

/** @brief Calls @p f with `std::integral_constant<cpu_isa, I>{}` for @p isa, instantiating @p f
 *         only for the ISAs compiled into this build (so kernels written as templates on the ISA
 *         can be chosen at run time: `with_cpu_isa(active_cpu_isa(), [&](auto i) { k<i()>(); })`). */
template <class F>
decltype(auto) with_cpu_isa(cpu_isa isa, F&& f) {
#if CHUNKSTAR_ISA_DISPATCH
  if (isa == cpu_isa::avx512) return f(std::integral_constant<cpu_isa, cpu_isa::avx512>{});
  if (isa == cpu_isa::avx2) return f(std::integral_constant<cpu_isa, cpu_isa::avx2>{});
#else
  (void)isa;
#endif
  return f(std::integral_constant<cpu_isa, cpu_isa::portable>{});
}

}  // namespace chunkstar
