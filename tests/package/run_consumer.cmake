# SPDX-License-Identifier: Apache-2.0
# Builds and runs one consumer project the way a user would, in a fresh directory of its own:
#   cmake -DMODE=install|build_tree|fetch_content -DWORK_DIR=... -DCHUNKSTAR_SOURCE_DIR=...
#         -DCHUNKSTAR_BUILD_DIR=... -DGENERATOR=... [-DMAKE_PROGRAM=...] -DCXX_COMPILER=...
#         -DBUILD_TYPE=... -DEXPECT_TIERS=core,cuda,mpi -DEXPECT_OUTPUT=<regex>
#         [-DCONSUMER_ARGS=-DCHUNKSTAR_ENABLE_CUDA=OFF,...] [-DEXPECT_NO_TIERS=cuda,nccl,mpi]
#         [-DCONSUMER_PROJECT=<subdirectory of tests/package>] [-DEXES=consumer,...]
#         [-DFORBID_NEEDED=<regex>] [-DREQUIRE_NEEDED=<regex>] [-DCCACHE=<ccache> -DCCACHE_BASEDIR=<dir>]
#         -P run_consumer.cmake
# Lists are comma-separated: a ';' would be split by add_test before it reaches this script
# (EXPECT_TIERS and EXPECT_NO_TIERS stay so all the way into the consumer project).
# CONSUMER_PROJECT picks the consumer project (default: find_package/ or fetch_content/, by MODE);
# EXES are the programs it builds, each run and matched against EXPECT_OUTPUT (default: consumer).
# FORBID_NEEDED / REQUIRE_NEEDED: regexes over the DT_NEEDED entries of each program (what it was
# linked against, from readelf -d, else objdump -p): none may match FORBID_NEEDED, one must match
# REQUIRE_NEEDED. Not an ELF toolchain: the check says so and is left out.
# Prints "SKIPPED:" (CTest's SKIP_REGULAR_EXPRESSION) when the mode cannot run here.
cmake_minimum_required(VERSION 3.24)

foreach(v MODE WORK_DIR CHUNKSTAR_SOURCE_DIR CHUNKSTAR_BUILD_DIR GENERATOR CXX_COMPILER EXPECT_OUTPUT)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "run_consumer.cmake: -D${v}=... is required")
  endif()
endforeach()
string(REPLACE "," ";" CONSUMER_ARGS "${CONSUMER_ARGS}")
string(REPLACE "," ";" EXES "${EXES}")
if(NOT EXES)
  set(EXES consumer)
endif()
if(NOT BUILD_TYPE)
  set(BUILD_TYPE Release)
endif()

# Runs a command, echoing it; stops the test with its output when it fails.
function(run_step what)
  string(REPLACE ";" " " shown "${ARGN}")
  message(STATUS "[${MODE}] ${what}: ${shown}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message("${out}")
    message(FATAL_ERROR "[${MODE}] ${what} failed (${rc})")
  endif()
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
set(here "${CMAKE_CURRENT_LIST_DIR}")
set(args -G "${GENERATOR}" -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_BUILD_TYPE=${BUILD_TYPE}
         "-DEXPECT_TIERS=${EXPECT_TIERS}" "-DEXPECT_NO_TIERS=${EXPECT_NO_TIERS}" ${CONSUMER_ARGS})
if(CCACHE)  # as the chunkstar build that runs this test (CMakeLists.txt: CHUNKSTAR_CCACHE)
  set(ENV{CCACHE_BASEDIR} "${CCACHE_BASEDIR}")
  set(ENV{CCACHE_NOHASHDIR} 1)
  set(ENV{CCACHE_DEPEND} 1)
  list(APPEND args "-DCMAKE_CXX_COMPILER_LAUNCHER=${CCACHE}")
endif()
if(MAKE_PROGRAM)
  list(APPEND args -DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM})
endif()

if(MODE STREQUAL "install")
  set(prefix "${WORK_DIR}/prefix")
  run_step("install" ${CMAKE_COMMAND} --install "${CHUNKSTAR_BUILD_DIR}" --prefix "${prefix}" --config ${BUILD_TYPE})
  foreach(f include/chunkstar/config_generated.hpp include/chunkstar/core/dtype.hpp)
    if(NOT EXISTS "${prefix}/${f}")
      message(FATAL_ERROR "[install] ${f} missing from the installed tree")
    endif()
  endforeach()
  set(project_dir "${here}/find_package")
  list(APPEND args "-DCMAKE_PREFIX_PATH=${prefix}")
elseif(MODE STREQUAL "build_tree")
  set(project_dir "${here}/find_package")
  list(APPEND args "-Dchunkstar_DIR=${CHUNKSTAR_BUILD_DIR}")
elseif(MODE STREQUAL "fetch_content")
  # FetchContent clones committed history: the test uses the commit checked out now (a clean
  # clone in CI); uncommitted edits in a working tree are not part of what it fetches.
  find_package(Git QUIET)
  if(NOT GIT_FOUND OR NOT EXISTS "${CHUNKSTAR_SOURCE_DIR}/.git")
    message("SKIPPED: FetchContent needs git and a git checkout of chunkstar at ${CHUNKSTAR_SOURCE_DIR}")
    return()
  endif()
  execute_process(COMMAND "${GIT_EXECUTABLE}" -C "${CHUNKSTAR_SOURCE_DIR}" rev-parse HEAD
                  RESULT_VARIABLE rc OUTPUT_VARIABLE commit OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(NOT rc EQUAL 0)
    message("SKIPPED: ${CHUNKSTAR_SOURCE_DIR} has no commit to fetch")
    return()
  endif()
  # Say so when the working tree differs from that commit: what is tested is the commit.
  execute_process(COMMAND ${CMAKE_COMMAND} -E env GIT_OPTIONAL_LOCKS=0
                          "${GIT_EXECUTABLE}" -C "${CHUNKSTAR_SOURCE_DIR}" diff --quiet HEAD --
                  RESULT_VARIABLE dirty OUTPUT_QUIET ERROR_QUIET)
  if(NOT dirty EQUAL 0)
    message("NOTE: ${CHUNKSTAR_SOURCE_DIR} has uncommitted changes; FetchContent fetches commit ${commit} without them")
  endif()
  set(project_dir "${here}/fetch_content")
  list(APPEND args "-DCHUNKSTAR_GIT_REPOSITORY=file://${CHUNKSTAR_SOURCE_DIR}" "-DCHUNKSTAR_GIT_TAG=${commit}"
       "-DFETCHCONTENT_BASE_DIR=${WORK_DIR}/deps")
else()
  message(FATAL_ERROR "unknown MODE '${MODE}' (install, build_tree or fetch_content)")
endif()

if(CONSUMER_PROJECT)
  set(project_dir "${here}/${CONSUMER_PROJECT}")
endif()

run_step("configure" ${CMAKE_COMMAND} -S "${project_dir}" -B "${WORK_DIR}/build" ${args})
run_step("build" ${CMAKE_COMMAND} --build "${WORK_DIR}/build" --config ${BUILD_TYPE})

# The shared libraries a program was linked against (its DT_NEEDED entries), into ${out_var};
# empty with a message when there is no ELF tool to read them.
function(needed_libraries exe out_var)
  set(${out_var} "" PARENT_SCOPE)
  find_program(READELF_EXECUTABLE NAMES readelf)
  find_program(OBJDUMP_EXECUTABLE NAMES objdump)
  if(READELF_EXECUTABLE)
    execute_process(COMMAND "${READELF_EXECUTABLE}" -d "${exe}" RESULT_VARIABLE rc OUTPUT_VARIABLE dyn ERROR_QUIET)
    set(pattern "\\(NEEDED\\)[^[]*\\[([^]]+)\\]")
  elseif(OBJDUMP_EXECUTABLE)
    execute_process(COMMAND "${OBJDUMP_EXECUTABLE}" -p "${exe}" RESULT_VARIABLE rc OUTPUT_VARIABLE dyn ERROR_QUIET)
    set(pattern "NEEDED[ \t]+([^ \t\n]+)")
  else()
    set(rc 1)
  endif()
  if(NOT rc EQUAL 0)
    message("[${MODE}] no readelf or objdump that reads ${exe}: its NEEDED libraries are not checked")
    return()
  endif()
  set(libs)
  string(REGEX MATCHALL "${pattern}" entries "${dyn}")
  foreach(e IN LISTS entries)
    string(REGEX REPLACE "${pattern}" "\\1" lib "${e}")
    list(APPEND libs "${lib}")
  endforeach()
  if(NOT libs)
    message(FATAL_ERROR "[${MODE}] found no NEEDED entry in ${exe} (not even libc): cannot check what it links")
  endif()
  set(${out_var} "${libs}" PARENT_SCOPE)
  set(needed_checked 1 PARENT_SCOPE)
endfunction()

foreach(name IN LISTS EXES)
  set(exe "${WORK_DIR}/build/${name}")
  if(NOT EXISTS "${exe}" AND EXISTS "${WORK_DIR}/build/${BUILD_TYPE}/${name}")
    set(exe "${WORK_DIR}/build/${BUILD_TYPE}/${name}")  # multi-config generators
  endif()
  if(FORBID_NEEDED OR REQUIRE_NEEDED)
    set(needed_checked 0)
    needed_libraries("${exe}" needed)
    if(needed_checked)
      string(REPLACE ";" " " shown "${needed}")
      message("[${MODE}] ${name} NEEDED: ${shown}")
      set(required_found 0)
      foreach(lib IN LISTS needed)
        if(FORBID_NEEDED AND lib MATCHES "${FORBID_NEEDED}")
          message(FATAL_ERROR "[${MODE}] ${name} links ${lib} (matches '${FORBID_NEEDED}'), which it never asked for")
        endif()
        if(REQUIRE_NEEDED AND lib MATCHES "${REQUIRE_NEEDED}")
          set(required_found 1)
        endif()
      endforeach()
      if(REQUIRE_NEEDED AND NOT required_found)
        message(FATAL_ERROR "[${MODE}] ${name} links no library matching '${REQUIRE_NEEDED}'")
      endif()
    endif()
  endif()
  run_step("run ${name}" "${exe}")
  message("${step_output}")
  if(NOT step_output MATCHES "${EXPECT_OUTPUT}")
    message(FATAL_ERROR "[${MODE}] ${name} output does not match '${EXPECT_OUTPUT}'")
  endif()
endforeach()
