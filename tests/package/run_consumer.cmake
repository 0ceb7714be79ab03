# Builds and runs one consumer project the way a user would, in a fresh directory of its own:
#   cmake -DMODE=install|build_tree|fetch_content -DWORK_DIR=... -DCHUNKSTAR_SOURCE_DIR=...
#         -DCHUNKSTAR_BUILD_DIR=... -DGENERATOR=... [-DMAKE_PROGRAM=...] -DCXX_COMPILER=...
#         -DBUILD_TYPE=... -DEXPECT_TIERS=core,cuda,mpi -DEXPECT_OUTPUT=<regex>
#         [-DCONSUMER_ARGS=-DCHUNKSTAR_ENABLE_CUDA=OFF,...] -P run_consumer.cmake
# Lists are comma-separated: a ';' would be split by add_test before it reaches this script
# (EXPECT_TIERS stays so all the way into the consumer project).
# Prints "SKIPPED:" (CTest's SKIP_REGULAR_EXPRESSION) when the mode cannot run here.
cmake_minimum_required(VERSION 3.24)

foreach(v MODE WORK_DIR CHUNKSTAR_SOURCE_DIR CHUNKSTAR_BUILD_DIR GENERATOR CXX_COMPILER EXPECT_OUTPUT)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "run_consumer.cmake: -D${v}=... is required")
  endif()
endforeach()
string(REPLACE "," ";" CONSUMER_ARGS "${CONSUMER_ARGS}")
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
         "-DEXPECT_TIERS=${EXPECT_TIERS}" ${CONSUMER_ARGS})
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
  set(project_dir "${here}/fetch_content")
  list(APPEND args "-DCHUNKSTAR_GIT_REPOSITORY=file://${CHUNKSTAR_SOURCE_DIR}" "-DCHUNKSTAR_GIT_TAG=${commit}"
       "-DFETCHCONTENT_BASE_DIR=${WORK_DIR}/deps")
else()
  message(FATAL_ERROR "unknown MODE '${MODE}' (install, build_tree or fetch_content)")
endif()

run_step("configure" ${CMAKE_COMMAND} -S "${project_dir}" -B "${WORK_DIR}/build" ${args})
run_step("build" ${CMAKE_COMMAND} --build "${WORK_DIR}/build" --config ${BUILD_TYPE})
set(exe "${WORK_DIR}/build/consumer")
if(NOT EXISTS "${exe}" AND EXISTS "${WORK_DIR}/build/${BUILD_TYPE}/consumer")
  set(exe "${WORK_DIR}/build/${BUILD_TYPE}/consumer")  # multi-config generators
endif()
run_step("run" "${exe}")
message("${step_output}")
if(NOT step_output MATCHES "${EXPECT_OUTPUT}")
  message(FATAL_ERROR "[${MODE}] consumer output does not match '${EXPECT_OUTPUT}'")
endif()
