# The optimizer kernels are header-only and pick their SIMD path from the ISA flags of the
# including translation unit, so the optim tests are built for this machine's ISA (and so test
# the SIMD path against the portable one), through the helper targets a consumer would link
# (chunkstar::isa_native, chunkstar::isa_avx512: cmake/chunkstar_targets.cmake).
# test_optim_avx512 is built for AVX-512 whatever the machine, so CI always compiles that path; it
# runs only where the CPU has AVX-512F.
include(CheckCXXCompilerFlag)
check_cxx_compiler_flag(-march=native CHUNKSTAR_CXX_HAS_MARCH_NATIVE)
check_cxx_compiler_flag(-mavx512f CHUNKSTAR_CXX_HAS_MAVX512F)
foreach(_t test_optim_adam test_optim_grad_check test_optim_loss_scaler test_optim_clip test_optim_schedule)
  if(TARGET ${_t} AND CHUNKSTAR_CXX_HAS_MARCH_NATIVE)
    target_link_libraries(${_t} PRIVATE chunkstar::isa_native)  # -march=native
  endif()
endforeach()
if(TARGET test_optim_avx512 AND CHUNKSTAR_CXX_HAS_MAVX512F)
  # -mavx512f -mavx2 -mfma -mf16c. No -Wno-maybe-uninitialized: optim/detail/simd.hpp silences
  # GCC 12's false positives from its own AVX-512 intrinsics itself.
  target_link_libraries(test_optim_avx512 PRIVATE chunkstar::isa_avx512)
endif()
