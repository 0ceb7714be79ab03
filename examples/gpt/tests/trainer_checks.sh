# SPDX-License-Identifier: Apache-2.0
# What the trainer's end-to-end scripts (zero.sh, rtp.sh, faults.sh, train_disk.sh) share; sourced.
#   begin_mpi_checks TRAIN MPIEXEC WORK   set train, mpiexec and mpi (mpiexec -np ...), one thread
#                          per rank (several ranks share few cores), and work in a fresh WORK
#   fail MESSAGE           count a failed check and say why
#   sleeps NAME REF CMD... CMD --sleep-after 4 has REF's losses and nothing on a device while asleep
#   losses FILE            a run's "step loss" and "vSTEP loss" lines, for diffs
#   kill_a_rank N ARGS...  start N MPI ranks of train_gpt ARGS (under $mpiexec), SIGKILL one after
#                          step 3, and check that the job ends by itself, non-zero, within 30 s
#   mpmd MODE WORDS...     two ranks of train_gpt $args --parallel MODE, the second given WORDS too
#   ranks_disagree MODE WORDS...  mpmd, and check it ends with exit 2 naming the option, before any step
#   finish NAME            exit 1 if any check failed, else say all NAME checks passed
failures=0
begin_mpi_checks() {
  train=$1
  mpiexec=$2
  work=$3
  rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1
  export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE OPENBLAS_NUM_THREADS=1
  mpi=("$mpiexec" --allow-run-as-root --oversubscribe -np)
}
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
# sleeps NAME REF CMD...: CMD --sleep-after 4 gives REF's losses, and while asleep no rank held
# model data or any device memory.
sleeps() {
  local name=$1 ref=$2
  shift 2
  "$@" --sleep-after 4 --sleep-for 0.2 >"sleep_$name.txt" 2>&1 || { fail "$name with --sleep-after 4: rc $?"; return; }
  local empty='^asleep after step 4: model data on the device 0 B, device memory in use 0 B'
  if diff <(losses "$ref") <(losses "sleep_$name.txt") >/dev/null && grep -q "$empty" "sleep_$name.txt"; then
    echo "ok: $name: asleep after step 4 with nothing on any rank's device, then the same losses"
  else
    fail "$name with --sleep-after 4: $(grep -m1 '^asleep' "sleep_$name.txt"); $(diff <(losses "$ref") <(losses "sleep_$name.txt") | head -4)"
  fi
}
losses() { grep -E '^(step|validation)' "$1" | sed -E 's/^step +([0-9]+)\/[0-9]+ \| loss ([0-9.]+).*/\1 \2/; s/^validation loss ([0-9.]+) at step ([0-9]+)/v\2 \1/'; }

kill_a_rank() {
  local n=$1
  shift
  local pattern="train_gpt $*"
  "${mpi[@]}" "$n" "$train" "$@" >kill.txt 2>&1 &
  local job=$!
  for _ in $(seq 1 300); do grep -qE '^step +3/' kill.txt 2>/dev/null && break; sleep 0.1; done
  local victim start=$SECONDS
  victim=$(pgrep -f -n -- "$pattern")
  if [[ -n $victim ]]; then kill -9 "$victim"; else fail "no rank to kill"; fi
  for _ in $(seq 1 300); do kill -0 $job 2>/dev/null || break; sleep 0.1; done
  if kill -0 $job 2>/dev/null; then
    fail "the job still runs 30 s after a rank was killed"
    pkill -9 -f -- "$pattern"
    kill -9 $job 2>/dev/null
  fi
  wait $job
  local rc=$?
  ((rc != 0)) || fail "the job exited 0 after a rank was killed"
  echo "ok: a killed rank ended the job in $((SECONDS - start)) s with rc $rc"
}

mpmd() {
  local mode=$1
  shift
  timeout 120 "$mpiexec" --allow-run-as-root --oversubscribe -np 1 "$train" "${args[@]}" --parallel "$mode" : \
    -np 1 "$train" "${args[@]}" --parallel "$mode" "$@" >mpmd.txt 2>&1
}

ranks_disagree() {
  local mode=$1
  shift
  mpmd "$mode" "$@"
  local rc=$?
  if ((rc == 2)) && grep -q "the ranks are not configured alike: rank 0 has $1" mpmd.txt && ! grep -q '^step ' mpmd.txt; then
    echo "ok: $* on one of 2 $mode ranks: $(grep -m1 -o 'rank 0 has .* but rank 1 has [^;]*' mpmd.txt)"
  else
    fail "$* on one of 2 $mode ranks: rc $rc, $(grep -m1 error mpmd.txt)"
  fi
}

finish() {
  ((failures)) && { echo "$failures check(s) failed"; exit 1; }
  echo "all $1 checks passed"
}
