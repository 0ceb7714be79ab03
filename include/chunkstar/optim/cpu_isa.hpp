/** @file
 *  @brief Which SIMD instruction set the CPU optimizer kernels use: chosen at compile time from
 *         the ISA flags of the translation unit (-mavx512f, -mavx2 -mfma -mf16c, -march=native).
 *
 *  chunkstar is header-only, so the kernels are compiled with the flags of the code that includes
 *  them. Without AVX2/FMA/F16C (or AVX-512F) flags the portable scalar path is used: correct and
 *  bit-identical, but several times slower. Build training code with `-march=native` or explicit
 *  `-mavx2 -mfma -mf16c` to get the fast path; from CMake, link `chunkstar::isa_native`,
 *  `chunkstar::isa_avx2` or `chunkstar::isa_avx512`, which add those flags.
 */
#pragma once

#include <string_view>

namespace chunkstar {

/** @brief A SIMD instruction set for the CPU kernels. Every ISA gives the same bits. */
enum class cpu_isa : unsigned char {
  portable,  ///< plain C++ (std::fma), one element at a time
  avx2,      ///< AVX2 + FMA + F16C, 8 floats per vector
  avx512,    ///< AVX-512F, 16 floats per vector
};

/** @brief Whether this translation unit was compiled with the flags that @p Isa needs. */
template <cpu_isa Isa>
inline constexpr bool cpu_isa_available_v =
    Isa == cpu_isa::portable
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    || Isa == cpu_isa::avx2
#endif
#if defined(__AVX512F__)
    || Isa == cpu_isa::avx512
#endif
    ;

/** @brief The widest ISA this translation unit was compiled for; what the kernels use by default. */
inline constexpr cpu_isa native_cpu_isa =
#if defined(__AVX512F__)
    cpu_isa::avx512;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    cpu_isa::avx2;
#else
    cpu_isa::portable;
#endif

/** @brief "portable", "avx2" or "avx512", for logs and benchmark records. */
constexpr std::string_view cpu_isa_name(cpu_isa isa) noexcept {
  switch (isa) {
    case cpu_isa::portable: return "portable";
    case cpu_isa::avx2: return "avx2";
    case cpu_isa::avx512: return "avx512";
  }
  return "?";
}

}  // namespace chunkstar
