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
