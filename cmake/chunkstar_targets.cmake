# SPDX-License-Identifier: Apache-2.0
# The interface targets, one per tier. Included from the top-level CMakeLists.txt.

# Tier 0: plain C++20, no CUDA.
add_library(chunkstar_core INTERFACE)
add_library(chunkstar::core ALIAS chunkstar_core)
set_target_properties(chunkstar_core PROPERTIES EXPORT_NAME core)
target_compile_features(chunkstar_core INTERFACE cxx_std_20)
target_include_directories(chunkstar_core INTERFACE
  $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include>
  $<BUILD_INTERFACE:${_chunkstar_gen_dir}>
  $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
target_link_libraries(chunkstar_core INTERFACE Threads::Threads)

add_library(chunkstar_chunkstar INTERFACE)
add_library(chunkstar::chunkstar ALIAS chunkstar_chunkstar)
set_target_properties(chunkstar_chunkstar PROPERTIES EXPORT_NAME chunkstar)
target_link_libraries(chunkstar_chunkstar INTERFACE chunkstar_core)
set(_chunkstar_export_targets chunkstar_core chunkstar_chunkstar)

# Tier 1 (CUDA host API, any host compiler) and Tier 2 (.cuh kernels, nvcc).
if(CHUNKSTAR_HAS_CUDA)
  add_library(chunkstar_cuda INTERFACE)
  add_library(chunkstar::cuda ALIAS chunkstar_cuda)
  set_target_properties(chunkstar_cuda PROPERTIES EXPORT_NAME cuda)
  target_link_libraries(chunkstar_cuda INTERFACE chunkstar_core CUDA::cudart)
  target_link_libraries(chunkstar_chunkstar INTERFACE chunkstar_cuda)
  list(APPEND _chunkstar_export_targets chunkstar_cuda)
endif()

if(CHUNKSTAR_HAS_NCCL)
  add_library(chunkstar_nccl INTERFACE)
  add_library(chunkstar::nccl ALIAS chunkstar_nccl)
  set_target_properties(chunkstar_nccl PROPERTIES EXPORT_NAME nccl)
  target_link_libraries(chunkstar_nccl INTERFACE chunkstar_cuda NCCL::NCCL)
  target_link_libraries(chunkstar_chunkstar INTERFACE chunkstar_nccl)
  list(APPEND _chunkstar_export_targets chunkstar_nccl)
endif()

if(CHUNKSTAR_HAS_MPI)
  add_library(chunkstar_mpi INTERFACE)
  add_library(chunkstar::mpi ALIAS chunkstar_mpi)
  set_target_properties(chunkstar_mpi PROPERTIES EXPORT_NAME mpi)
  target_link_libraries(chunkstar_mpi INTERFACE chunkstar_core MPI::MPI_CXX)
  target_link_libraries(chunkstar_chunkstar INTERFACE chunkstar_mpi)
  list(APPEND _chunkstar_export_targets chunkstar_mpi)
endif()

# The io_uring disk engine (chunkstar/disk/uring_copy_engine.hpp). The thread-pool disk engine
# needs nothing beyond POSIX and is in chunkstar::core.
if(CHUNKSTAR_HAS_URING)
  add_library(chunkstar_uring INTERFACE)
  add_library(chunkstar::uring ALIAS chunkstar_uring)
  set_target_properties(chunkstar_uring PROPERTIES EXPORT_NAME uring)
  target_include_directories(chunkstar_uring INTERFACE $<BUILD_INTERFACE:${CHUNKSTAR_URING_INCLUDE_DIR}>)
  target_link_libraries(chunkstar_uring INTERFACE chunkstar_core
    $<BUILD_INTERFACE:${CHUNKSTAR_URING_LIBRARY}> $<INSTALL_INTERFACE:uring>)
  target_link_libraries(chunkstar_chunkstar INTERFACE chunkstar_uring)
  list(APPEND _chunkstar_export_targets chunkstar_uring)
endif()

# ISA helpers: compiler flags for the includer's own code. chunkstar's SIMD kernels (Adam, gradient
# scans, dtype conversions) no longer need them: every build compiles their portable, AVX2 and
# AVX-512 paths and chooses one at run time from the CPU (core/cpu_isa.hpp), so a default -O3
# build is as fast. Link one next to chunkstar::chunkstar to compile your own code for that ISA:
#   chunkstar::isa_native  -march=native: the build machine's widest ISA; the binary may not run on
#                          an older CPU
#   chunkstar::isa_avx2    -mavx2 -mfma -mf16c: any x86-64 CPU since 2013 (Haswell, Zen)
#   chunkstar::isa_avx512  -mavx512f -mavx2 -mfma -mf16c: Skylake-SP, Zen 4 and later
# GCC-compatible compilers only (GCC, Clang, IntelLLVM; nvcc passes them to its host compiler);
# others get no flag. avx2 and avx512 are x86-64 flags.
foreach(_isa native avx2 avx512)
  if(_isa STREQUAL "native")
    set(_flags -march=native)
  elseif(_isa STREQUAL "avx2")
    set(_flags -mavx2 -mfma -mf16c)
  else()
    set(_flags -mavx512f -mavx2 -mfma -mf16c)
  endif()
  add_library(chunkstar_isa_${_isa} INTERFACE)
  add_library(chunkstar::isa_${_isa} ALIAS chunkstar_isa_${_isa})
  set_target_properties(chunkstar_isa_${_isa} PROPERTIES EXPORT_NAME isa_${_isa})
  list(JOIN _flags "," _xcompiler)
  target_compile_options(chunkstar_isa_${_isa} INTERFACE
    "$<$<COMPILE_LANG_AND_ID:CXX,GNU,Clang,AppleClang,IntelLLVM>:${_flags}>"
    "$<$<COMPILE_LANG_AND_ID:CUDA,NVIDIA>:-Xcompiler=${_xcompiler}>")
  list(APPEND _chunkstar_export_targets chunkstar_isa_${_isa})
endforeach()
