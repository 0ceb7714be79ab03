#!/usr/bin/env bash
# THE test command: bash tests/run.sh [--quick] [--with-slow] [--jobs N]
#
# Installs missing Debian packages (cmake/install_deps.sh), then runs two stages, each in its own
# build directory under build/ (or $CHUNKSTAR_BUILD_ROOT):
#   main   RelWithDebInfo; CUDA tests compiled by nvcc when it exists (they skip without a GPU);
#          ctest on every label but `slow` (all labels with --with-slow; only `unit` with --quick).
#   asan   ASan+UBSan, no CUDA tests, examples or benchmarks; ctest label `unit` (and `slow` with
#          --with-slow). Skipped by --quick.
#   asan-gpt  ASan+UBSan on the GPT example's RTP tests (model, chunk offload, checkpoints, MPI at
#          2 ranks). Skipped by --quick.
#   tsan   ThreadSanitizer on the threaded suites (copy engines, spaces, rank groups, runtime, ZeRO, RTP).
#          Skipped by --quick.
# Every stage runs even when an earlier one failed; the exit code is non-zero if any failed.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=../cmake/install_deps.sh
source "$repo/cmake/install_deps.sh"

quick=0
with_slow=0
jobs=$(nproc)
while (($#)); do
  case $1 in
    --quick) quick=1 ;;
    --with-slow) with_slow=1 ;;
    --jobs) jobs=$2; shift ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "tests/run.sh: unknown option '$1' (--quick, --with-slow, --jobs N)" >&2; exit 2 ;;
  esac
  shift
done

chunkstar_install_deps
chunkstar_mpi_env
chunkstar_cuda_path

build_root=${CHUNKSTAR_BUILD_ROOT:-$repo/build}
summary=()
failed=0

# stage <name> <build dir> <ctest args...> -- <cmake args...>
stage() {
  local name=$1 dir=$2
  shift 2
  local ctest_args=()
  while (($#)) && [[ $1 != -- ]]; do ctest_args+=("$1"); shift; done
  shift
  local start=$SECONDS result=passed
  echo "=== stage $name: configure + build in $dir"
  if ! cmake -S "$repo" -B "$dir" -G Ninja "$@"; then
    result="FAILED (configure)"
  else
    # -k 0 and testing what did build: one broken target should not hide every other result.
    local build_ok=1
    local targets=()
    for t in ${stage_targets:-}; do targets+=(--target "$t"); done
    cmake --build "$dir" --parallel "$jobs" "${targets[@]}" -- -k 0 || build_ok=0
    echo "=== stage $name: ctest ${ctest_args[*]}"
    if ! (cd "$dir" && ctest --output-on-failure -j"$jobs" "${ctest_args[@]}"); then
      result="FAILED (tests)"
    fi
    if ((!build_ok)); then
      [[ $result == passed ]] && result="FAILED (build)" || result="FAILED (build and tests)"
    fi
  fi
  [[ $result == passed ]] || failed=1
  summary+=("stage $name: $result in $((SECONDS - start)) s")
}

cuda_tests=OFF
if command -v nvcc >/dev/null 2>&1; then cuda_tests=ON; fi

if ((quick)); then
  main_labels=(-L unit)
elif ((with_slow)); then
  main_labels=()
else
  main_labels=(-LE slow)
fi
# -g1 (line tables: enough for stack traces) instead of -g everywhere: full debug info of the
# runtime's many template instantiations took a third of the build, and the build is most of CI.
stage main "$build_root/tests-main" "${main_labels[@]}" -- \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCHUNKSTAR_BUILD_CUDA_TESTS=$cuda_tests \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" "-DCMAKE_CUDA_FLAGS_RELWITHDEBINFO=-O2 -DNDEBUG -Xcompiler=-g1"

if ((!quick)); then
  # Halt on the first UBSan report too (by default it prints and carries on, and the test passes).
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
  asan_labels=(-L unit)
  ((with_slow)) && asan_labels=(-L 'unit|slow')
  stage asan "$build_root/tests-asan" "${asan_labels[@]}" -- \
    -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-g1 \
    "-DCMAKE_CXX_FLAGS=-O1 -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer" \
    -DCHUNKSTAR_BUILD_CUDA_TESTS=OFF -DCHUNKSTAR_BUILD_BENCHMARKS=OFF -DCHUNKSTAR_BUILD_EXAMPLES=OFF \
    -DCHUNKSTAR_VERIFY_HEADERS=OFF
  # The GPT example's RTP model under the same sanitizers: the test targets only (a full examples
  # build under ASan would double the stage).
  gpt_asan_tests=(gpt_rtp_model gpt_rtp_chunked gpt_rtp_checkpoint gpt_rtp_backend)
  stage_targets="${gpt_asan_tests[*]/#/test_} test_mpi_rtp_gpt"
  stage asan-gpt "$build_root/tests-asan-gpt" -R "^($(IFS='|'; echo "${gpt_asan_tests[*]}")|mpi_rtp_gpt_np2)\$" -- \
    -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-g1 \
    "-DCMAKE_CXX_FLAGS=-O1 -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer" \
    -DCHUNKSTAR_BUILD_CUDA_TESTS=OFF -DCHUNKSTAR_BUILD_BENCHMARKS=OFF -DCHUNKSTAR_VERIFY_HEADERS=OFF
  stage_targets=
fi

if ((!quick)); then
  # ThreadSanitizer on the threaded code: copy engines (worker threads), spaces (concurrent
  # allocation), in-process rank groups and the runtime (asynchronous moves). Tests that use OpenMP
  # stay out: libgomp is not built with TSan.
  export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$repo/tests/tsan.supp}
  tsan_tests=(copy_engine memory_space communicator chunk_runtime eviction_optimality runtime_ranks scripted_copy_engine zero zero_checkpoint rtp_schedule rtp_mlp
              disk_copy_engine uring_copy_engine disk_runtime zero_disk device_collectives)
  stage_targets="${tsan_tests[*]/#/test_}"
  stage tsan "$build_root/tests-tsan" -R "^($(IFS='|'; echo "${tsan_tests[*]}"))\$" -- \
    -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-g1 "-DCMAKE_CXX_FLAGS=-O1 -fsanitize=thread" \
    -DCHUNKSTAR_BUILD_CUDA_TESTS=OFF -DCHUNKSTAR_BUILD_BENCHMARKS=OFF -DCHUNKSTAR_BUILD_EXAMPLES=OFF \
    -DCHUNKSTAR_VERIFY_HEADERS=OFF -DCHUNKSTAR_ENABLE_MPI=OFF
  stage_targets=
fi

echo
echo "=== summary (nvcc: $cuda_tests)"
printf '%s\n' "${summary[@]}"
exit $failed
