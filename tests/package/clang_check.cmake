# SPDX-License-Identifier: Apache-2.0
# The package_clang test: chunkstar with clang++ (CI compiles everything else with g++).
#   cmake -DCLANGXX=<clang++> -DSOURCE_DIR=<chunkstar source> -DGEN_DIR=<generated include dir>
#         -DSNIPPET=<readme_snippet.cpp> -DWORK_DIR=<scratch dir> -P clang_check.cmake
# 1. every public header under include/chunkstar that needs no CUDA, NCCL, MPI or liburing (all but
#    chunkstar/{cuda,nccl,mpi}/, chunkstar/disk/uring_* and the .cuh kernels) compiles, all in one
#    unit, each included twice: clang++ -std=c++20 -fsyntax-only -Wall -Wextra -Werror (each on its
#    own is tests/compile's check, with the main compiler);
# 2. the README snippet (extracted by tests/package/CMakeLists.txt) compiles, links and runs;
# 3. consumer/clang.cpp (the default construction `patrickstar_runtime rt(device, host, copier);`,
#    a few Adam steps, every SIMD path against the portable one) compiles with -O2, once with no ISA
#    flag (the run-time dispatch's target regions under clang) and once, where clang accepts it,
#    with -march=native, links and runs.
# Every failure is reported, then the test fails. Prints "SKIPPED:" without clang++.
cmake_minimum_required(VERSION 3.24)

foreach(v SOURCE_DIR GEN_DIR SNIPPET WORK_DIR)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "clang_check.cmake: -D${v}=... is required")
  endif()
endforeach()
# Through ccache when the chunkstar build uses it (-DCCACHE=<ccache> -DCCACHE_BASEDIR=<dir>).
set(cc "${CLANGXX}")
if(CCACHE)
  set(ENV{CCACHE_BASEDIR} "${CCACHE_BASEDIR}")
  set(ENV{CCACHE_NOHASHDIR} 1)
  set(cc "${CCACHE}" "${CLANGXX}")
endif()
if(NOT CLANGXX OR NOT EXISTS "${CLANGXX}")
  message("SKIPPED: no clang++ (install Debian's clang package: cmake/install_deps.sh lists it)")
  return()
endif()

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}/headers")
set(includes -I "${SOURCE_DIR}/include" -I "${GEN_DIR}")
set(warnings -Wall -Wextra -Werror)
set(failures)

execute_process(COMMAND "${CLANGXX}" --version OUTPUT_VARIABLE version ERROR_QUIET)
string(REGEX MATCH "^[^\n]*" version "${version}")
message(STATUS "clang_check: ${CLANGXX}: ${version}")

# Runs a command; on failure records @p what and prints the compiler's output.
function(check what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " shown "${ARGN}")
    message("FAILED: ${what} (${rc})\n  ${shown}\n${out}")
    set(failures ${failures} "${what}" PARENT_SCOPE)
  endif()
  set(check_output "${out}" PARENT_SCOPE)
endfunction()

# 1. The headers, all in one translation unit, each included twice (include guards). That each
#    compiles on its own is tests/compile's check (the same standard library); here clang parses
#    every one, in 8 s instead of 5 min for a unit each.
file(GLOB_RECURSE headers RELATIVE "${SOURCE_DIR}/include" "${SOURCE_DIR}/include/chunkstar/*.hpp")
list(FILTER headers EXCLUDE REGEX "^chunkstar/(cuda|nccl|mpi)/|^chunkstar/disk/uring_")
list(SORT headers)
list(LENGTH headers n)
if(n EQUAL 0)
  message(FATAL_ERROR "clang_check: no header under ${SOURCE_DIR}/include/chunkstar")
endif()
set(tu "${WORK_DIR}/headers/all_headers.cpp")
set(body "")
foreach(pass IN ITEMS 1 2)
  foreach(h IN LISTS headers)
    string(APPEND body "#include <${h}>\n")
  endforeach()
endforeach()
file(WRITE "${tu}" "${body}")
check("the ${n} headers" ${cc} -std=c++20 -fsyntax-only ${warnings} ${includes} "${tu}")
if(failures)
  message(STATUS "clang_check: the ${n} headers do not compile together")
else()
  message(STATUS "clang_check: the ${n} headers compile, each included twice")
endif()

# 2 and 3. Programs: compile, link, run.
execute_process(COMMAND "${CLANGXX}" -march=native -E -x c++ /dev/null
                RESULT_VARIABLE native_rc OUTPUT_QUIET ERROR_QUIET)
set(native)
if(native_rc EQUAL 0)
  set(native -march=native)
endif()
foreach(prog IN ITEMS "readme_snippet|${SNIPPET}|-O1" "clang_consumer_default|${CMAKE_CURRENT_LIST_DIR}/consumer/clang.cpp|-O2"
                      "clang_consumer|${CMAKE_CURRENT_LIST_DIR}/consumer/clang.cpp|-O2")
  string(REPLACE "|" ";" prog "${prog}")
  list(GET prog 0 name)
  list(GET prog 1 src)
  list(GET prog 2 opt)
  set(flags ${opt})
  if(name STREQUAL "clang_consumer")
    list(APPEND flags ${native})
  endif()
  set(exe "${WORK_DIR}/${name}")
  # Compile and link apart: ccache caches compiles, never a compile-and-link.
  check("${name}: compile" ${cc} -std=c++20 ${flags} ${warnings} ${includes} -c "${src}" -o "${exe}.o")
  if(EXISTS "${exe}.o")
    check("${name}: link" "${CLANGXX}" "${exe}.o" -pthread -o "${exe}")
  endif()
  if(EXISTS "${exe}")
    check("${name}: run" "${exe}")
    message("${name}: ${check_output}")
  endif()
endforeach()

if(failures)
  list(JOIN failures "\n  " shown)
  message(FATAL_ERROR "clang_check: failed:\n  ${shown}")
endif()
message("clang_check: OK")
