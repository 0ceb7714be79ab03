#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# train_gpt under bad input, faults and concurrent writers, end to end: every case ends promptly
# with its documented exit code and a message on stderr, and nothing on disk is lost.
#   bash faults.sh <train_gpt> <work dir>
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/trainer_checks.sh"
train=$1
work=$2
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1

base=(--preset tiny --batch 2 --seq 32 --val-every 0 --sample 0)

# run <expected rc> <what stderr must contain> <train_gpt args...>: at most 60 s, never a hang.
run() {
  local want=$1 needle=$2
  shift 2
  timeout 60 "$train" "$@" >out.txt 2>err.txt
  local rc=$?
  if ((rc == 124)); then fail "hung: train_gpt $*"; return; fi
  if ((rc != want)); then fail "rc $rc (want $want): train_gpt $*"; sed 's/^/    /' err.txt | head -5; return; fi
  if [[ -n $needle ]] && ! grep -qF -- "$needle" err.txt; then fail "stderr lacks '$needle': train_gpt $*"; sed 's/^/    /' err.txt | head -5; fi
  if ((want == 2)) && grep -q '^step ' out.txt; then fail "trained before refusing: train_gpt $*"; fi
  echo "ok (rc $rc): train_gpt $*"
}

# Bad options: exit 2 before any work, naming the option.
run 2 "--batch" "${base[@]}" --batch 1000000000000
run 2 "--batch" "${base[@]}" --batch -1
run 2 "--steps" "${base[@]}" --steps 0
run 2 "--steps" "${base[@]}" --steps -3
run 2 "--seq" "${base[@]}" --seq 512
run 2 "--layers" "${base[@]}" --layers 2147483647
run 2 "--val-batches" "${base[@]}" --val-every 5 --val-batches 0
run 2 "--warmup" "${base[@]}" --steps 10 --warmup 20
run 2 "--min-lr" "${base[@]}" --lr 0.001 --min-lr 0.01
run 2 "Could not convert" "${base[@]}" --batch 1e3
run 2 "not expected" "${base[@]}" --no-such-option
run 0 "" --help
grep -q "Exit status" out.txt || fail "--help does not document the exit codes"

# Bad data: refused at once, never read for ever or blocked on.
mkdir -p adir && mkfifo fifo
run 2 "is a directory" "${base[@]}" --data adir
run 2 "is a FIFO" "${base[@]}" --data fifo
run 2 "device" "${base[@]}" --data /dev/zero

# Output paths checked before training.
echo x >regular
run 2 "refusing to replace" "${base[@]}" --steps 2 --save regular
run 2 "" "${base[@]}" --steps 2 --save /proc/ck
run 2 "--trace" "${base[@]}" --steps 2 --trace /nonexistent/t.json
mkdir -p hf && echo '{}' >hf/config.json && echo weights >hf/model.safetensors
run 2 "refusing to replace" "${base[@]}" --steps 2 --save hf
[[ -f hf/config.json && $(cat hf/model.safetensors) == weights ]] || fail "the foreign directory hf/ was changed"

# A save never deletes an unrelated <dir>.tmp.
mkdir -p o8.tmp && echo mine >o8.tmp/notes.txt
run 0 "" "${base[@]}" --steps 2 --save o8
[[ -f o8.tmp/notes.txt ]] || fail "--save o8 deleted o8.tmp/notes.txt"

# A symlinked lock file is never written through: refused before training, its target unchanged.
echo precious >precious.txt && ln -s precious.txt sl.lock
run 2 "symbolic link" "${base[@]}" --steps 2 --save sl
[[ $(cat precious.txt) == precious ]] || fail "--save sl wrote through the symlinked lock sl.lock: $(cat precious.txt)"

# Resume: past the end, changed configuration, changed precision with and without leave.
run 0 "" "${base[@]}" --steps 4 --stop-after 2 --save ck
run 2 "nothing is left to train" "${base[@]}" --steps 4 --stop-after 2 --resume ck
run 2 "--lr" "${base[@]}" --steps 4 --lr 0.01 --resume ck
run 2 "--precision" "${base[@]}" --steps 4 --precision fp16 --resume ck
run 0 "" "${base[@]}" --steps 4 --precision fp16 --resume ck --allow-change precision
run 2 "not a directory" "${base[@]}" --steps 4 --resume regular
run 2 "--allow-change" "${base[@]}" --steps 4 --allow-change lr

# Two trainers saving to one directory at once: both finish, the checkpoint is whole.
a=(timeout 120 "$train" "${base[@]}" --steps 6 --save-every 1 --save cc)
"${a[@]}" >a.txt 2>&1 &
pa=$!
"${a[@]}" >b.txt 2>&1 &
pb=$!
wait $pa; ra=$?
wait $pb; rb=$?
((ra == 0 && rb == 0)) || fail "concurrent writers: rc $ra and $rb"
run 0 "" "${base[@]}" --steps 7 --resume cc --allow-change steps
[[ -z $(ls -d cc.tmp.* 2>/dev/null) ]] || fail "concurrent writers left temporaries: $(ls -d cc.tmp.*)"

# Resumes racing a writer that saves every 8 steps: each either continues the uninterrupted trajectory
# from the step it names (metadata and tensors of one save) or refuses (exit 2), never trains on a
# mix. The writer and the straight run take the same options, so every save lies on that trajectory.
race=("${base[@]}" --steps 100 --warmup 2)
timeout 120 "$train" "${race[@]}" >straight.txt 2>&1 || fail "the straight run failed"
step_lines() { grep -E '^step ' "$1" | sed -E 's/^step +([0-9]+)\/[0-9]+ \| loss ([0-9.]+).*/\1 \2/'; }
timeout 120 "$train" "${race[@]}" --save-every 8 --save rc >writer.txt 2>&1 &
writer=$!
for _ in $(seq 1 100); do [[ -d rc ]] && break; sleep 0.1; done
resumed=0 refused=0 finished=0
while kill -0 $writer 2>/dev/null; do
  timeout 120 "$train" "${race[@]}" --resume rc >r.txt 2>re.txt
  rc=$?
  if ((rc == 0)); then
    resumed=$((resumed + 1))
    from=$(grep -oE '^resumed from rc at step [0-9]+' r.txt | grep -oE '[0-9]+$')
    if ! diff <(step_lines r.txt) <(step_lines straight.txt | awk -v f="$from" '$1 > f') >/dev/null; then
      fail "a resume from step $from left the trajectory (a mixed save?)"
      diff <(step_lines r.txt) <(step_lines straight.txt) | head -4
    fi
  elif ((rc == 2)) && grep -q "another process saved" re.txt; then
    refused=$((refused + 1))
  elif ((rc == 2)) && grep -q "nothing is left to train" re.txt; then
    finished=$((finished + 1))  # the writer had saved its last step
  else
    fail "a resume racing the writer: rc $rc: $(head -2 re.txt)"
  fi
done
wait $writer || fail "the writer failed"
echo "ok: resumes racing a writer: $resumed continued the trajectory, $refused refused (another save in between), $finished found the run finished"
((resumed + refused > 0)) || fail "no resume raced the writer (the check above tested nothing)"

# An address-space limit: a clear out-of-memory error (exit 3) at once, never a hang; with room the
# run trains.
for limit in 100000 600000 800000 900000; do
  (ulimit -v $limit && exec timeout 60 "$train" --preset mini --steps 2 --val-every 0 --sample 0) >out.txt 2>err.txt
  rc=$?
  if ((rc == 124)); then fail "hung under ulimit -v $limit"
  elif ((rc == 3)); then grep -q "ulimit -v" err.txt || fail "ulimit -v $limit: no mention of the limit"; echo "ok (rc 3): ulimit -v $limit"
  elif ((rc == 0)); then echo "ok (rc 0): ulimit -v $limit trains"
  else fail "ulimit -v $limit: rc $rc"; sed 's/^/    /' err.txt | head -5
  fi
done

finish "fault"
