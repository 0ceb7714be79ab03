#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# THE test command: bash tests/run.sh [--quick] [--with-slow] [--jobs N]
#
# Installs missing Debian packages (cmake/install_deps.sh), then runs three stages, each in its own
# build directory under build/ (or $CHUNKSTAR_BUILD_ROOT), through ccache when it is installed
# (a second run, or a fresh clone in another folder, compiles nothing that did not change):
#   main   -Og -g1: everything (library tests, the GPT example and its tests, benchmarks,
#          header checks, package tests; CUDA tests compiled by nvcc when it exists, skipped without
#          a GPU); ctest on every label but `slow` (all labels with --with-slow; only `unit` with --quick).
#   asan   ASan+UBSan (-Og) on the library's tests and the GPT example's RTP tests (model, chunk
#          offload, checkpoints, backend, MPI at 2 ranks): only those are built. Skipped by --quick.
#   tsan   ThreadSanitizer (-Og) on the threaded suites (copy engines, spaces, rank groups, runtime,
#          ZeRO, RTP, disk): only those are built. Skipped by --quick.
# Every stage runs even when an earlier one failed; the exit code is non-zero if any failed.
# docs/testing.md: what each stage covers, how long each takes, how to run one area.
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
    -h|--help) sed -n '3,16p' "$0"; exit 0 ;;
    *) echo "tests/run.sh: unknown option '$1' (--quick, --with-slow, --jobs N)" >&2; exit 2 ;;
  esac
  shift
done

chunkstar_install_deps
chunkstar_mpi_env
chunkstar_cuda_path

build_root=${CHUNKSTAR_BUILD_ROOT:-$repo/build}
t0=$SECONDS
summary=()
failed=0

# stage <name> <build dir> <ctest args...> -- <cmake args...>   (stage_target: build only that)
stage() {
  local name=$1 dir=$2
  shift 2
  local ctest_args=()
  while (($#)) && [[ $1 != -- ]]; do ctest_args+=("$1"); shift; done
  shift
  local start=$SECONDS result=passed built tested cases=
  echo "=== stage $name: configure + build in $dir"
  if ! cmake -S "$repo" -B "$dir" -G Ninja "$@"; then
    result="FAILED (configure)"
  else
    # -k 0 and testing what did build: one broken target should not hide every other result.
    local build_ok=1
    local targets=()
    [[ -n ${stage_target:-} ]] && targets=(--target "$stage_target")
    cmake --build "$dir" --parallel "$jobs" "${targets[@]}" -- -k 0 || build_ok=0
    built=$((SECONDS - start))
    echo "=== stage $name: ctest ${ctest_args[*]}"
    if ! (cd "$dir" && ctest --output-on-failure -j"$jobs" "${ctest_args[@]}"); then
      result="FAILED (tests)"
    fi
    tested=$((SECONDS - start - built))
    if ((!build_ok)); then
      [[ $result == passed ]] && result="FAILED (build)" || result="FAILED (build and tests)"
    fi
    cases=$(python3 "$repo/tests/count_cases.py" "$dir" "${ctest_args[@]}" 2>/dev/null || true)
  fi
  [[ $result == passed ]] || failed=1
  summary+=("stage $name: $result in $((SECONDS - start)) s (build ${built:-?} s, tests ${tested:-?} s)${cases:+: $cases}")
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
# -Og -g1: half of -O2's compile time (0.73x -O1's), line tables enough for stack traces; the
# benchmarks, only smoke-run here, at the same flags, not their -O3. Optimised builds are covered
# too: the package tests build consumers at -O2 and -O3 with -Werror and run a step, and the main
# job (examples/run.sh) is Release. CUDA code at -O0: it only compiles here (tests/gpu/run.sh
# builds Release on a GPU).
stage main "$build_root/tests-main" "${main_labels[@]}" -- \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCHUNKSTAR_BUILD_CUDA_TESTS=$cuda_tests -DCHUNKSTAR_BENCH_OPTIMIZE= \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-Og -g1 -DNDEBUG" "-DCMAKE_CUDA_FLAGS_RELWITHDEBINFO=-O0 -DNDEBUG -Xcompiler=-g1"

# The sanitizer stages build only the test programs they run (CHUNKSTAR_TEST_FILTER, target
# chunkstar_tests), at -Og: half the compile time of -O1 under ASan+UBSan, the checks the same.
sanitizer_args=(-DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-g1 -DCHUNKSTAR_ENABLE_CUDA=OFF
                -DCHUNKSTAR_BUILD_BENCHMARKS=OFF -DCHUNKSTAR_VERIFY_HEADERS=OFF)
stage_target=chunkstar_tests
if ((!quick)); then
  # Halt on the first UBSan report too (by default it prints and carries on, and the test passes).
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
  # The library's tests (not its MPI programs, which run in main) and the GPT example's RTP tests.
  asan_filter='^((core|memory|layout|policies|comm|runtime|zero|rtp|disk|checkpoint|optim|package)/.*|gpt/rtp_(model|chunked|checkpoint|backend|gpt))$'
  asan_skip='slow|package|example|cuda'
  ((with_slow)) && asan_skip='package|example|cuda'
  asan_ctest=(-LE "$asan_skip" -E '^mpi_rtp_gpt_np4$')
  stage asan "$build_root/tests-asan" "${asan_ctest[@]}" -- "${sanitizer_args[@]}" \
    "-DCMAKE_CXX_FLAGS=-Og -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer" \
    "-DCHUNKSTAR_TEST_FILTER=$asan_filter"

  # ThreadSanitizer on the threaded code: copy engines (worker threads), spaces (concurrent
  # allocation), in-process rank groups and the runtime (asynchronous moves). Tests that use OpenMP
  # stay out: libgomp is not built with TSan.
  export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:suppressions=$repo/tests/tsan.supp}
  tsan_tests=(copy_engine memory_space communicator chunk_runtime eviction_optimality runtime_ranks scripted_copy_engine zero zero_checkpoint
              rtp_schedule rtp_mlp disk_copy_engine uring_copy_engine disk_runtime zero_disk device_collectives step_worker
              zero_early_step own_model gather_depth early_step step_gathers)
  tsan_names="($(IFS='|'; echo "${tsan_tests[*]}"))"
  stage tsan "$build_root/tests-tsan" -R "^$tsan_names\$" -- "${sanitizer_args[@]}" \
    "-DCMAKE_CXX_FLAGS=-Og -fsanitize=thread" -DCHUNKSTAR_BUILD_EXAMPLES=OFF -DCHUNKSTAR_ENABLE_MPI=OFF \
    "-DCHUNKSTAR_TEST_FILTER=^[a-z]+/$tsan_names\$"
fi
stage_target=

echo
echo "=== summary (nvcc: $cuda_tests) in $((SECONDS - t0)) s"
printf '%s\n' "${summary[@]}"
exit $failed
