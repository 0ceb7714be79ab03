// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief The SIMD instruction sets of the CPU optimizer kernels (Adam, gradient scans): every path
 *         is compiled into every build and the widest the CPU has is chosen at run time (see
 *         core/cpu_isa.hpp: cpu_isa, active_cpu_isa, force_cpu_isa, cpu_isa_report).
 *
 *  Compiler flags are no longer needed for speed: a default `-O3` build runs the AVX-512 kernels
 *  on a CPU that has AVX-512F and the AVX2 ones on any x86-64 CPU since Haswell or Zen. The CMake
 *  helpers `chunkstar::isa_native`, `isa_avx2` and `isa_avx512` still add `-march=native` or the
 *  `-m` flags (for the includer's own code); the kernels' choice does not depend on them.
 */
#pragma once

#include <chunkstar/core/cpu_isa.hpp>

namespace chunkstar {

/** @brief The widest ISA this translation unit's own flags enable (what the kernels used before
 *         run-time dispatch). The kernels no longer depend on it: they run active_cpu_isa(). */
inline constexpr cpu_isa native_cpu_isa =
#if defined(__AVX512F__)
    cpu_isa::avx512;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    cpu_isa::avx2;
#else
    cpu_isa::portable;
#endif

}  // namespace chunkstar
