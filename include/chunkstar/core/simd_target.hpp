// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Compiling SIMD kernels for several instruction sets in one translation unit, whatever its
 *         flags: target regions and a per-ISA include of a kernel file.
 *
 *  Code between `CHUNKSTAR_SIMD_BEGIN_AVX2` and `CHUNKSTAR_SIMD_END` is compiled as if with
 *  `-mavx2 -mfma -mf16c`, between `CHUNKSTAR_SIMD_BEGIN_AVX512` and `CHUNKSTAR_SIMD_END` as if with
 *  `-mavx512f` as well (GCC: `#pragma GCC target`, Clang: `#pragma clang attribute` with a target
 *  attribute on every function, template and lambda declared there). Intrinsics (`<immintrin.h>`,
 *  included here) inline only into functions of a region that has their ISA, so a kernel and
 *  everything it calls must be declared inside one region: core/simd_foreach_isa.hpp includes a
 *  kernel file once per region for that. Code outside the regions keeps the translation unit's
 *  own flags; it calls a region's functions like any others (not inlined) and only after asking
 *  active_cpu_isa() (core/cpu_isa.hpp) which one the CPU can run.
 *
 *  Same bits on every path: GCC contracts `a * b + c` into a fused multiply-add where the target
 *  has FMA (its default -ffp-contract=fast in GNU modes, which also applies to intrinsics such as
 *  `_mm256_add_ps(_mm256_mul_ps(a, b), c)`), and Clang within one expression. Kernels that must
 *  give the same bits on every path therefore never add a product: they write `fma` where they
 *  mean one, and otherwise keep products and sums in separate, non-contractible steps (an
 *  operand of an add that is not a product, or an fma).
 *
 *  Where CHUNKSTAR_ISA_DISPATCH is 0 the macros are empty and only the portable path exists.
 */
#pragma once

#include <chunkstar/core/cpu_isa.hpp>

#if CHUNKSTAR_ISA_DISPATCH
#include <immintrin.h>

#if defined(__clang__)
#define CHUNKSTAR_SIMD_BEGIN_AVX2 \
  _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,f16c\"))), apply_to = function)")
#define CHUNKSTAR_SIMD_BEGIN_AVX512 \
  _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx2,fma,f16c\"))), apply_to = function)")
#define CHUNKSTAR_SIMD_END _Pragma("clang attribute pop")
#else
// GCC 12's AVX-512 intrinsics (_mm512_sqrt_ps, _mm512_srli_epi32, _mm512_cvtps_ph,
// _mm512_extractf64x4_pd, ...) pass a deliberately self-initialised `_mm*_undefined_*()` as the
// unused merge source of their masked builtins; once inlined into a region's function,
// -W(maybe-)uninitialized reports it (a false positive, GCC bug 105593; no lane of that value is
// ever read: every call is unmasked). Both are silenced inside the regions only, not in the
// includer (-march=native -Wall -Werror stays clean).
#define CHUNKSTAR_SIMD_BEGIN_AVX2                                                                     \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c\")") _Pragma("GCC diagnostic push") \
      _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"")                                     \
          _Pragma("GCC diagnostic ignored \"-Wuninitialized\"")
#define CHUNKSTAR_SIMD_BEGIN_AVX512                                                                           \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx2,fma,f16c\")") _Pragma("GCC diagnostic push") \
      _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"")                                             \
          _Pragma("GCC diagnostic ignored \"-Wuninitialized\"")
#define CHUNKSTAR_SIMD_END _Pragma("GCC diagnostic pop") _Pragma("GCC pop_options")
#endif

#else
#define CHUNKSTAR_SIMD_BEGIN_AVX2
#define CHUNKSTAR_SIMD_BEGIN_AVX512
#define CHUNKSTAR_SIMD_END
#endif
