// SPDX-License-Identifier: Apache-2.0
/** @file
 *  @brief Includes a kernel file once per compiled ISA, each time inside that ISA's target region.
 *
 *  @code
 *    #define CHUNKSTAR_SIMD_KERNELS "my_kernels.inc"   // or <dir/my_kernels.inc>
 *    #include <chunkstar/core/simd_foreach_isa.hpp>
 *  @endcode
 *  The name is looked up as an #include in this header would look it up, so give a path that the
 *  include directories find (the including file's own directory is not searched).
 *  The kernel file is included first for the portable path, then (where CHUNKSTAR_ISA_DISPATCH is 1)
 *  inside CHUNKSTAR_SIMD_BEGIN_AVX2 and CHUNKSTAR_SIMD_BEGIN_AVX512 regions, with
 *  - `CHUNKSTAR_SIMD_ISA`     the pass's `chunkstar::cpu_isa` value (for `template <> struct k<ISA>`),
 *  - `CHUNKSTAR_SIMD_ISA_ID`  0, 1 or 2 (portable, avx2, avx512), for `#if` around intrinsics,
 *  - `CHUNKSTAR_SIMD_NS`      a namespace name for the pass: isa_portable, isa_avx2, isa_avx512.
 *  Each pass must declare its functions in its own namespace or specialisation, and include no
 *  header (include them before): what is declared inside a region is compiled for its ISA.
 *  Choose among the passes at run time with active_cpu_isa() and with_cpu_isa() (core/cpu_isa.hpp).
 *  CHUNKSTAR_SIMD_KERNELS is undefined afterwards. This header has no include guard on purpose;
 *  included without CHUNKSTAR_SIMD_KERNELS it does nothing.
 */
#include <chunkstar/core/simd_target.hpp>

#if defined(CHUNKSTAR_SIMD_KERNELS)

#define CHUNKSTAR_SIMD_ISA_ID 0
#define CHUNKSTAR_SIMD_ISA ::chunkstar::cpu_isa::portable
#define CHUNKSTAR_SIMD_NS isa_portable
#include CHUNKSTAR_SIMD_KERNELS
#undef CHUNKSTAR_SIMD_NS
#undef CHUNKSTAR_SIMD_ISA
#undef CHUNKSTAR_SIMD_ISA_ID

#if CHUNKSTAR_ISA_DISPATCH
CHUNKSTAR_SIMD_BEGIN_AVX2
#define CHUNKSTAR_SIMD_ISA_ID 1
#define CHUNKSTAR_SIMD_ISA ::chunkstar::cpu_isa::avx2
#define CHUNKSTAR_SIMD_NS isa_avx2
#include CHUNKSTAR_SIMD_KERNELS
#undef CHUNKSTAR_SIMD_NS
#undef CHUNKSTAR_SIMD_ISA
#undef CHUNKSTAR_SIMD_ISA_ID
CHUNKSTAR_SIMD_END

CHUNKSTAR_SIMD_BEGIN_AVX512
#define CHUNKSTAR_SIMD_ISA_ID 2
#define CHUNKSTAR_SIMD_ISA ::chunkstar::cpu_isa::avx512
#define CHUNKSTAR_SIMD_NS isa_avx512
#include CHUNKSTAR_SIMD_KERNELS
#undef CHUNKSTAR_SIMD_NS
#undef CHUNKSTAR_SIMD_ISA
#undef CHUNKSTAR_SIMD_ISA_ID
CHUNKSTAR_SIMD_END
#endif

#undef CHUNKSTAR_SIMD_KERNELS
#endif
