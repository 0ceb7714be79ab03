#!/usr/bin/env bash
# GPU check: bash tests/gpu/run.sh OUT_DIR
#
# Builds chunkstar (Release, CUDA tests on; CUDA architecture of the local GPU from nvidia-smi,
# else 90) in OUT_DIR/build, runs every CTest test labelled `cuda`, then any GPU benchmark
# binaries named bench_*_cuda (each with --json OUT_DIR/<binary>.json), then, where python3 has a
# CUDA-enabled torch, the PyTorch baseline bench/gpu/torch_gpt.py (mini preset, fp32 and bf16),
# and writes into OUT_DIR:
#   nvidia-smi.txt, configure.log, build.log, ctest.log, bench_<name>.log, bench_<name>.json,
#   torch_gpt_<precision>.log, torch_gpt_<precision>.json, summary.txt
# A missing torch is noted in summary.txt ("torch: unavailable"), not a failure.
# The GPU machine may lack Debian's doctest-dev and has no network: copy /usr/include/doctest/doctest.h
# to build/deps/doctest/doctest.h here and carry `build/deps` along (tests/CMakeLists.txt looks there).
# Self-contained (no package installation, no network); the exit code is non-zero when the build,
# a test or a benchmark failed, or when no GPU was visible (every cuda test would only skip).
set -uo pipefail

if (($# != 1)); then
  echo "usage: bash tests/gpu/run.sh OUT_DIR" >&2
  exit 2
fi
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=$(mkdir -p "$1" && cd "$1" && pwd)
build=$out/build
summary=$out/summary.txt
: >"$summary"
failed=0
note() { echo "$*" | tee -a "$summary"; }

if ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

arch=90
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >"$out/nvidia-smi.txt" 2>&1; then
  cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' .')
  [[ $cc =~ ^[0-9]+$ ]] && arch=$cc
  note "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -n1) (sm_$arch)"
else
  note "gpu: nvidia-smi unavailable; building for sm_$arch"
fi

start=$SECONDS
if ! cmake -S "$repo" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCHUNKSTAR_BUILD_CUDA_TESTS=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" \
      -DCHUNKSTAR_BUILD_EXAMPLES=OFF -DCHUNKSTAR_VERIFY_HEADERS=OFF >"$out/configure.log" 2>&1; then
  note "configure: FAILED (see configure.log)"
  exit 1
fi
# Only what the cuda tests and GPU benchmarks need: test_cuda_* and bench_*_cuda targets.
targets=$(cmake --build "$build" --target help 2>/dev/null | sed -n 's/^\(test_cuda_[A-Za-z0-9_]*\|bench_[A-Za-z0-9_]*_cuda\):.*/\1/p' | sort -u)
if ! grep -q 'CUDA=1' "$out/configure.log"; then
  note "configure: the CUDA toolkit was not found (see configure.log); put nvcc on PATH"
  exit 1
fi
if [[ -z $targets ]]; then
  note "build: no test_cuda_* or bench_*_cuda targets: nothing to run"
  note "gpu check: PASSED (empty)"
  exit 0
fi
# shellcheck disable=SC2086
if ! cmake --build "$build" --parallel "$(nproc)" --target $targets >"$out/build.log" 2>&1; then
  note "build: FAILED in $((SECONDS - start)) s (see build.log)"
  exit 1
fi
note "build: $(echo $targets | wc -w) targets in $((SECONDS - start)) s"

start=$SECONDS
(cd "$build" && ctest -L cuda --output-on-failure --timeout 120 -j1) >"$out/ctest.log" 2>&1
rc=$?
grep -E '^ *[0-9]+/[0-9]+ Test|tests passed|tests failed' "$out/ctest.log" >>"$summary"
if ((rc != 0)); then failed=1; fi
total=$(grep -cE 'Test +#[0-9]+: ' "$out/ctest.log" || true)
skipped=$(grep -cE 'Test +#[0-9]+: .*\*\*\*Skipped' "$out/ctest.log" || true)
ran=$((total - skipped))
note "ctest -L cuda: rc=$rc, $ran run, $skipped skipped, in $((SECONDS - start)) s"
if ((skipped > 0)) && ((ran == 0)); then
  note "ctest -L cuda: every test skipped: no usable GPU"
  failed=1
fi

for exe in $(find "$build/bench" -type f -name 'bench_*_cuda' -perm -u+x 2>/dev/null | sort); do
  name=$(basename "$exe")
  start=$SECONDS
  if timeout 120 "$exe" --json "$out/$name.json" >"$out/$name.log" 2>&1; then
    note "$name: passed in $((SECONDS - start)) s"
  else
    note "$name: FAILED (rc=$?) in $((SECONDS - start)) s (see $name.log)"
    failed=1
  fi
done

# The PyTorch baseline: the same GPT shapes, all on the GPU and with the optimizer on the CPU.
if python3 -c 'import torch; assert torch.cuda.is_available()' >/dev/null 2>&1; then
  for precision in fp32 bf16; do
    name=torch_gpt_$precision
    start=$SECONDS
    if timeout 300 python3 "$repo/bench/gpu/torch_gpt.py" --preset mini --steps 20 --precision "$precision" \
          --json "$out/$name.json" >"$out/$name.log" 2>&1; then
      note "$name: passed in $((SECONDS - start)) s"
      grep -E '^  (device|cpu_optimizer) ' "$out/$name.log" >>"$summary"
    else
      note "$name: FAILED (rc=$?) in $((SECONDS - start)) s (see $name.log)"
      failed=1
    fi
  done
else
  note "torch: unavailable (python3 cannot import torch with CUDA); torch_gpt not run"
fi

note "gpu check: $([[ $failed == 0 ]] && echo PASSED || echo FAILED)"
exit $failed
