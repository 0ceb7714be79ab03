#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# train_gpt with a disk tier, end to end: model data beyond device + host trains to exactly the
# losses of a run without the disk, on both disk engines; a run saved from the disk tier resumes
# on the same trajectory; a run killed by any signal leaves no file; bad disk options end at once
# with exit 2 naming the option.
#   bash train_disk.sh <train_gpt> <work dir>
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/trainer_checks.sh"
train=$1
work=$2
rm -rf "$work" && mkdir -p "$work/disk" && cd "$work" || exit 1

# tiny: 2.6 MiB of model data; the device holds activations + 20% of it and the host 0.6 MiB, so
# more than half of the model data lives on the disk.
base=(--preset tiny --batch 2 --seq 32 --steps 6 --val-every 3 --val-batches 2 --sample 0 --device sim --device-budget 20%)
disk=(--host-budget 640KiB --disk-dir "$work/disk")

losses() { grep -E '^(step|validation)' "$1" | sed -E 's/\| *[0-9]+ tok\/s.*//'; }

timeout 300 "$train" "${base[@]}" >plain.txt 2>&1 || fail "the run without a disk failed: $(tail -3 plain.txt)"
# Every comparison below needs the full runs to compare (two empty outputs are not "the same losses").
steps_in() { grep -c '^step ' "$1" 2>/dev/null || true; }
[[ $(steps_in plain.txt) == 6 ]] || fail "the run without a disk printed $(steps_in plain.txt) steps, not 6"
for engine in pool uring; do
  timeout 300 "$train" "${base[@]}" "${disk[@]}" --disk-engine "$engine" --disk-verify >"disk_$engine.txt" 2>&1
  rc=$?
  if ((rc == 2)) && [[ $engine == uring ]] && grep -q "io_uring" "disk_$engine.txt"; then
    echo "skip: io_uring is not available here ($(grep -o 'io_uring[^;]*' "disk_$engine.txt" | head -1))"
    continue
  fi
  ((rc == 0)) || { fail "the $engine disk run failed (rc $rc): $(tail -3 "disk_$engine.txt")"; continue; }
  [[ $(steps_in "disk_$engine.txt") == 6 ]] || fail "$engine: $(steps_in "disk_$engine.txt") steps printed, not 6"
  grep -q "the model data exceeds device and host together" "disk_$engine.txt" || fail "$engine: the model data was not beyond device + host"
  grep -qE '^disk: [0-9.]+ [KMG]?i?B written' "disk_$engine.txt" || fail "$engine: no disk summary"
  if diff <(losses plain.txt) <(losses "disk_$engine.txt") >/dev/null; then
    echo "ok: $engine disk tier, the same losses as without it"
  else
    fail "$engine: the losses differ from the run without a disk"
    diff <(losses plain.txt) <(losses "disk_$engine.txt") | head -6
  fi
done
[[ -z $(ls disk) ]] || fail "the disk tier's file was left in $work/disk: $(ls disk)"

# Save at step 3 from the disk tier, resume with it: the same losses as the uninterrupted run.
timeout 300 "$train" "${base[@]}" "${disk[@]}" --stop-after 3 --save ckpt >first.txt 2>&1 || fail "the first half failed: $(tail -3 first.txt)"
timeout 300 "$train" "${base[@]}" "${disk[@]}" --resume ckpt >second.txt 2>&1 || fail "the resumed half failed: $(tail -3 second.txt)"
[[ $(steps_in second.txt) == 3 ]] || fail "the resumed run printed $(steps_in second.txt) steps, not 3"
if diff <(losses plain.txt | grep -E '^step +[4-6]/|validation loss .* at step 6') <(losses second.txt | grep -E '^(step|validation)') >/dev/null; then
  echo "ok: resumed from a checkpoint of the disk tier on the same trajectory"
else
  fail "the resumed run left the trajectory"
  diff <(losses plain.txt | grep -E '^step +[4-6]/|validation loss .* at step 6') <(losses second.txt) | head -6
fi

# A run killed mid-training (SIGKILL, SIGTERM, SIGINT) leaves nothing in the disk directory: the
# file never has a name.
for sig in KILL TERM INT; do
  rm -f killed.txt
  # env --default-signal: a background job of a script starts with SIGINT ignored.
  env --default-signal=INT "$train" "${base[@]}" "${disk[@]}" --steps 100000 --val-every 0 >killed.txt 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do grep -qE '^step +2/' killed.txt 2>/dev/null && break; sleep 0.1; done
  grep -qE '^step +2/' killed.txt || fail "SIG$sig: the run to kill never reached step 2: $(tail -3 killed.txt)"
  [[ -z $(ls disk) ]] || fail "SIG$sig: the disk tier's file has a name while training: $(ls disk)"
  kill -s "$sig" $pid
  for _ in $(seq 1 300); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
  if kill -0 $pid 2>/dev/null; then fail "SIG$sig: the run still runs 30 s later"; kill -9 $pid; fi
  wait $pid 2>/dev/null
  [[ -z $(ls disk) ]] && echo "ok: SIG$sig mid-run left no file in the disk directory" || fail "SIG$sig left $(ls disk) in $work/disk"
done

# Bad disk options: exit 2 before any step, naming what is wrong.
run() {
  local needle=$1
  shift
  timeout 60 "$train" "$@" >out.txt 2>err.txt
  local rc=$?
  if ((rc != 2)); then fail "rc $rc (want 2): train_gpt $*"; sed 's/^/    /' err.txt | head -3; return; fi
  grep -qF -- "$needle" err.txt || { fail "stderr lacks '$needle': train_gpt $*"; sed 's/^/    /' err.txt | head -3; }
  grep -q '^step ' out.txt && fail "trained before refusing: train_gpt $*"
  echo "ok (rc 2): train_gpt $*"
}
run "--disk-dir" "${base[@]}" --disk-budget 1GiB
run "--disk-dir" "${base[@]}" --disk-engine pool
run "does not exist" "${base[@]}" --disk-dir "$work/nowhere"
run "--disk-engine" "${base[@]}" "${disk[@]}" --disk-engine floppy
run "--disk-budget" "${base[@]}" "${disk[@]}" --disk-budget 64KiB
run "--host-budget" "${base[@]}" --host-budget 64KiB --disk-dir "$work/disk"
run "--disk-dir" "${base[@]}" "${disk[@]}" --disk-budget 900TiB  # more than the filesystem holds

finish "disk-tier trainer"
