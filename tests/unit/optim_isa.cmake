# The SIMD kernels (optim/adam.hpp, optim/grad_check.hpp, core/dtype.hpp) compile every ISA's path
# into every build and choose at run time (core/cpu_isa.hpp), so the optim tests are built with the
# default flags, as a consumer's -O3 build would be, and each test forces every path the CPU can
# run and compares its bits with the portable path's.
# test_optim_avx512 is additionally built through the chunkstar::isa_avx512 helper target
# (-mavx512f -mavx2 -mfma -mf16c), so a translation unit with those flags is covered too; it runs
# only where the CPU has AVX-512F (else it exits 77: skipped).
include(CheckCXXCompilerFlag)
check_cxx_compiler_flag(-mavx512f CHUNKSTAR_CXX_HAS_MAVX512F)
if(TARGET test_optim_avx512 AND CHUNKSTAR_CXX_HAS_MAVX512F)
  # No -Wno-maybe-uninitialized: core/simd_target.hpp silences GCC 12's false positives from its
  # own AVX-512 intrinsics inside the target regions.
  target_link_libraries(test_optim_avx512 PRIVATE chunkstar::isa_avx512)
endif()
# The dispatch honours CHUNKSTAR_CPU_ISA (the test reads it to know what to expect), and an
# unknown or unsupported value is ignored and reported.
if(TARGET test_cpu_isa)
  add_test(NAME cpu_isa_env_avx2 COMMAND test_cpu_isa)
  add_test(NAME cpu_isa_env_portable COMMAND test_cpu_isa)
  add_test(NAME cpu_isa_env_bogus COMMAND test_cpu_isa)
  set_tests_properties(cpu_isa_env_avx2 PROPERTIES LABELS unit ENVIRONMENT CHUNKSTAR_CPU_ISA=avx2)
  set_tests_properties(cpu_isa_env_portable PROPERTIES LABELS unit ENVIRONMENT CHUNKSTAR_CPU_ISA=portable)
  set_tests_properties(cpu_isa_env_bogus PROPERTIES LABELS unit ENVIRONMENT CHUNKSTAR_CPU_ISA=sse9)
endif()
