# SPDX-License-Identifier: Apache-2.0
# Install rules, the package config and version file, and a build-tree export.

install(DIRECTORY include/chunkstar DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(FILES LICENSE DESTINATION ${CMAKE_INSTALL_DATADIR}/doc/chunkstar)
install(FILES "${_chunkstar_gen_dir}/chunkstar/config_generated.hpp"
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/chunkstar)
install(TARGETS ${_chunkstar_export_targets} EXPORT chunkstarTargets)

set(_chunkstar_cmake_dir ${CMAKE_INSTALL_DATADIR}/cmake/chunkstar)
install(EXPORT chunkstarTargets NAMESPACE chunkstar:: DESTINATION ${_chunkstar_cmake_dir})

configure_package_config_file(cmake/chunkstarConfig.cmake.in
  "${CMAKE_CURRENT_BINARY_DIR}/chunkstarConfig.cmake"
  INSTALL_DESTINATION ${_chunkstar_cmake_dir})
# A header-only library has no architecture: the version file must accept any.
write_basic_package_version_file("${CMAKE_CURRENT_BINARY_DIR}/chunkstarConfigVersion.cmake"
  COMPATIBILITY SameMinorVersion ARCH_INDEPENDENT)
install(FILES
  "${CMAKE_CURRENT_BINARY_DIR}/chunkstarConfig.cmake"
  "${CMAKE_CURRENT_BINARY_DIR}/chunkstarConfigVersion.cmake"
  cmake/FindNCCL.cmake
  DESTINATION ${_chunkstar_cmake_dir})

# Build-tree export: find_package(chunkstar) can point chunkstar_DIR at this build directory.
export(EXPORT chunkstarTargets NAMESPACE chunkstar::
       FILE "${CMAKE_CURRENT_BINARY_DIR}/chunkstarTargets.cmake")
file(COPY cmake/FindNCCL.cmake DESTINATION "${CMAKE_CURRENT_BINARY_DIR}")
