#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# GPU check: bash tests/gpu/run.sh OUT_DIR    (252 s on one H200 with GPU_TRAIN_STEPS=8, 118 s of it the build)
#
# Builds chunkstar (Release, CUDA tests and the GPT example on; CUDA architecture of the local GPU
# from nvidia-smi, else 90) in OUT_DIR/build, then, in one go:
#   1. every CTest test labelled `cuda` (the library's CUDA tests, the GPT's CUDA kernels, the
#      chunked GPT's same bits and numerics on the device, train_gpt --device cuda vs --device sim);
#   2. every GPU benchmark binary bench_*_cuda, with --json OUT_DIR/<binary>.json (HBM copy limit,
#      CUDA Adam, pinned memcpy peak, chunk moves through the copy engine);
#   3. the trainer on CUDA (preset $GPU_TRAIN_PRESET, default gpt2 at batch 8 x seq 256) at 100%, 50%
#      and 10% device budgets in fp32, bf16 and fp16: train_<precision>_<budget>.log; where an mpirun
#      is there, ZeRO and RTP on 2 ranks sharing the GPU (--comm staged) against the one-process fp32
#      losses: train_zero_staged.log, train_rtp_staged.log;
#   4. where python3 has a CUDA-enabled torch, the PyTorch baseline bench/gpu/torch_gpt.py on the same
#      shape (all on the GPU, and with the optimizer on the CPU where DeepSpeed or FSDP is there);
# and writes summary.txt (a table), results.json (every figure: tests/gpu/summarize.py) and the logs
# into OUT_DIR. A missing torch is noted ("torch: unavailable"), not a failure.
# The GPU machine has no network and may lack Debian packages: run `bash tests/gpu/prepare.sh` on the
# development machine first and carry `build/deps` along (doctest and CLI11 headers; without a BLAS
# the GPT's CPU kernels use their built-in GEMM); GPU_CMAKE_ARGS adds configure options (to rehearse
# on a machine with the packages: -DCMAKE_DISABLE_FIND_PACKAGE_BLAS=ON and so on). The exit code is non-zero when the build, a test,
# a run or a benchmark failed, or when no GPU was visible (every cuda test would only skip).
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
# shellcheck disable=SC2086  # GPU_CMAKE_ARGS: several options, split on purpose
if ! cmake -S "$repo" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCHUNKSTAR_BUILD_CUDA_TESTS=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" \
      -DCHUNKSTAR_BUILD_EXAMPLES=ON -DCHUNKSTAR_BUILD_BENCHMARKS=ON -DCHUNKSTAR_VERIFY_HEADERS=OFF ${GPU_CMAKE_ARGS:-} \
      >"$out/configure.log" 2>&1; then
  note "configure: FAILED (see configure.log)"
  exit 1
fi
# Only what the cuda tests, the GPU benchmarks and the trainer need: test_cuda, test_*_cuda,
# bench_*_cuda and train_gpt.
targets=$(cmake --build "$build" --target help 2>/dev/null |
  sed -n 's/^\(test_cuda[A-Za-z0-9_]*\|test_[A-Za-z0-9_]*_cuda\|bench_[A-Za-z0-9_]*_cuda\|train_gpt\):.*/\1/p' | sort -u)
if ! grep -q 'CUDA=1' "$out/configure.log"; then
  note "configure: the CUDA toolkit was not found (see configure.log); put nvcc on PATH"
  exit 1
fi
if [[ -z $targets ]]; then
  note "build: no test_cuda, test_*_cuda or bench_*_cuda targets: nothing to run"
  note "gpu check: PASSED (empty)"
  exit 0
fi
# shellcheck disable=SC2086
if ! cmake --build "$build" --parallel "$(nproc)" --target $targets >"$out/build.log" 2>&1; then
  note "build: FAILED in $((SECONDS - start)) s (see build.log)"
  exit 1
fi
note "build: $(echo "$targets" | wc -w) targets in $((SECONDS - start)) s"

start=$SECONDS
(cd "$build" && ctest -L cuda --output-on-failure --timeout 300 -j1) >"$out/ctest.log" 2>&1
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

# The trainer on the GPU: three budgets (a share of the model data beside the activations) in
# three precisions, the same shape and steps each, so the table compares them side by side.
train_args=(--preset "${GPU_TRAIN_PRESET:-gpt2}" --batch "${GPU_TRAIN_BATCH:-8}" --seq "${GPU_TRAIN_SEQ:-256}"
            --steps "${GPU_TRAIN_STEPS:-12}" --warmup 2 --val-every 0 --sample 0 --device cuda)
train_exe=$build/examples/gpt/train_gpt
if [[ -x $train_exe ]]; then
  for precision in fp32 bf16 fp16; do
    for budget in 100 50 10; do
      name=train_${precision}_$budget
      start=$SECONDS
      if timeout 180 "$train_exe" "${train_args[@]}" --precision "$precision" --device-budget "$budget%" >"$out/$name.log" 2>&1; then
        note "$name: passed in $((SECONDS - start)) s: $(grep -m1 '^summary:' "$out/$name.log")"
      else
        note "$name: FAILED (rc=$?) in $((SECONDS - start)) s (see $name.log)"
        failed=1
      fi
    done
  done
  # The optimizer step inside backward against the step after it (#31), side by side: fp32 at a
  # 10% budget (most chunks stepped on the host), no clipping (every iteration speculates); with
  # it, how far the host runs ahead of the GPU (--scopes-ahead 0 and 2 beside the default 1). The
  # losses must be the same to the last printed digit; summarize.py prints the tokens/s of each.
  for run in on:1 off:1 on:0 on:2; do
    overlap=${run%:*} ahead=${run#*:}
    name=overlap_$overlap
    [[ $ahead == 1 ]] || name=${name}_ahead$ahead
    start=$SECONDS
    if timeout 180 "$train_exe" "${train_args[@]}" --precision fp32 --device-budget 10% --clip 0 \
          --overlap-step "$overlap" --scopes-ahead "$ahead" >"$out/$name.log" 2>&1; then
      note "$name: passed in $((SECONDS - start)) s: $(grep -m1 '^chunks:' "$out/$name.log" | sed 's/.*optimizer/optimizer/')"
    else
      note "$name: FAILED (rc=$?) in $((SECONDS - start)) s (see $name.log)"
      failed=1
    fi
  done
  for name in overlap_on overlap_on_ahead0 overlap_on_ahead2; do
    [[ -s $out/$name.log && -s $out/overlap_off.log ]] || continue
    if cmp -s <(grep -E '^step ' "$out/$name.log" | sed -E 's/ [|] +[0-9]+ tok[/]s.*//') \
              <(grep -E '^step ' "$out/overlap_off.log" | sed -E 's/ [|] +[0-9]+ tok[/]s.*//'); then
      note "$name against overlap_off: the same losses"
    else
      note "$name against overlap_off: losses DIFFER (see $name.log, overlap_off.log)"
      failed=1
    fi
  done
  # ZeRO and RTP on the GPU: 2 MPI ranks sharing it (MPI through pinned host buffers), where this
  # machine has an MPI; the losses must follow the one-process fp32 run at 100% within fp32 tolerance.
  for mode in zero rtp; do
    name=train_${mode}_staged
    # Not `--help | grep -q`: under pipefail, grep's early exit fails the pipeline (SIGPIPE) at random.
    if command -v mpirun >/dev/null 2>&1 && grep -q -- '--comm' <("$train_exe" --help 2>&1); then
      start=$SECONDS
      if timeout 300 mpirun --allow-run-as-root --oversubscribe -np 2 "$train_exe" "${train_args[@]}" --precision fp32 \
            --parallel "$mode" --comm staged >"$out/$name.log" 2>&1; then
        note "$name: ran in $((SECONDS - start)) s: $(grep -m1 '^summary:' "$out/$name.log")"
        if python3 - "$out/train_fp32_100.log" "$out/$name.log" "$name" >>"$summary" <<'PY'; then :; else failed=1; fi
import re, sys
losses = [[float(x) for x in re.findall(r'^step +\d+/\d+ \| loss ([0-9.]+)', open(f).read(), re.M)] for f in sys.argv[1:3]]
worst = max((abs(a - b) / abs(a) for a, b in zip(*losses)), default=float('inf'))
ok = len(losses[0]) == len(losses[1]) > 0 and worst < 1e-3
print(f"{sys.argv[3]} vs one GPU: {len(losses[1])} losses, largest relative difference {worst:.2e}: {'ok' if ok else 'FAILED'}")
sys.exit(0 if ok else 1)
PY
      else
        note "$name: FAILED (rc=$?) in $((SECONDS - start)) s (see $name.log)"
        failed=1
      fi
    else
      note "$name: not run (no mpirun here, or train_gpt built without MPI)"
    fi
  done
else
  note "train_gpt: not built (see configure.log: BLAS or CLI11 missing?)"
  failed=1
fi

# The PyTorch baseline: the same GPT shape, all on the GPU and with the optimizer on the CPU.
if python3 -c 'import torch; assert torch.cuda.is_available()' >/dev/null 2>&1; then
  for precision in fp32 bf16; do
    name=torch_gpt_$precision
    start=$SECONDS
    if timeout 300 python3 "$repo/bench/gpu/torch_gpt.py" --preset "${GPU_TRAIN_PRESET:-gpt2}" --batch "${GPU_TRAIN_BATCH:-8}" \
          --seq "${GPU_TRAIN_SEQ:-256}" --steps "${GPU_TRAIN_STEPS:-12}" --precision "$precision" \
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

if python3 "$repo/tests/gpu/summarize.py" "$out" >"$out/table.txt" 2>"$out/summarize.log"; then cat "$out/table.txt" >>"$summary"
else note "summarize: FAILED (see summarize.log)"; failed=1; fi
note "gpu check: $([[ $failed == 0 ]] && echo PASSED || echo FAILED)"
exit $failed
