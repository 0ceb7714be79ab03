#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# train_gpt --parallel zero on MPI ranks, end to end:
#  1. 3 ranks train the same model on the same data as one process (losses equal as printed), also
#     with every collective staged through host buffers (--comm staged), and 3 replicated data-
#     parallel ranks (--parallel replicated) as 3 ZeRO ranks; one process and 3 ranks
#     that sleep after step 4 (--sleep-after: nothing on a device) train as if they had not;
#  2. a checkpoint saved at 3 ranks resumes at 2 ranks and in one process, continuing the trajectory;
#     3 ranks with a disk tier each (hosts too small for a rank's share) train as one process too;
#     a device only ZeRO's memory-saving mode fits chooses it; one too small for both is exit 2;
#  3. ranks given different options (MPMD, one rank's option changed) end with exit 2 naming the
#     option and both values, before any step; mpirun without --parallel is refused;
#  4. a rank killed (SIGKILL) mid-run ends the whole job, non-zero, within 30 s — never a hang.
#   bash zero.sh <train_gpt> <mpiexec> <work dir>
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/trainer_checks.sh"
begin_mpi_checks "$@"
args=(--preset tiny --batch 6 --seq 32 --steps 8 --warmup 2 --val-every 4 --sample 0)

timeout 300 "$train" "${args[@]}" >one.txt 2>&1 || fail "one process: rc $?"
timeout 300 "${mpi[@]}" 3 "$train" "${args[@]}" --parallel zero >three.txt 2>&1 || fail "3 ranks: rc $?"
if diff <(losses one.txt) <(losses three.txt) >/dev/null; then echo "ok: 3 ZeRO ranks train as one process: $(losses three.txt | tr '\n' ' ')"
else fail "3 ranks differ from one process:"; diff <(losses one.txt) <(losses three.txt) | head; fi
grep -q "per rank (largest): model data" three.txt || fail "no per-rank memory in the summary"

# The path ranks sharing a GPU take (every collective staged through host buffers), on the CPU.
timeout 300 "${mpi[@]}" 3 "$train" "${args[@]}" --parallel zero --comm staged >staged.txt 2>&1 || fail "3 ranks, --comm staged: rc $?"
if diff <(losses one.txt) <(losses staged.txt) >/dev/null; then echo "ok: 3 ZeRO ranks through host staging buffers train as one process"
else fail "3 ranks with --comm staged differ from one process:"; diff <(losses one.txt) <(losses staged.txt) | head; fi
grep -q "MPI through host staging buffers" staged.txt || fail "the staged run does not say how its ranks talk"
# Plain data parallelism (--parallel replicated): every rank holds the whole model and the gradients
# are all-reduced in rank order, which is ZeRO's reference: ZeRO's losses. Its checkpoint (rank 0's)
# resumes under ZeRO on the same trajectory.
timeout 300 "${mpi[@]}" 3 "$train" "${args[@]}" --parallel replicated --save ck_rep >replicated.txt 2>&1 || fail "3 replicated ranks: rc $?"
if diff <(losses three.txt) <(losses replicated.txt) >/dev/null && grep -q "^parallel: replicated data parallelism over 3" replicated.txt; then
  echo "ok: 3 replicated data-parallel ranks train as 3 ZeRO ranks"
else fail "3 replicated ranks differ from ZeRO:"; diff <(losses three.txt) <(losses replicated.txt) | head; fi
[[ -f ck_rep/model.safetensors ]] || fail "no checkpoint from the replicated ranks: $(ls ck_rep 2>&1)"
# Sleep after step 4 (every chunk off the device, then back): the losses of the run that never slept.
sleeps "one process" one.txt timeout 300 "$train" "${args[@]}"
sleeps "3 ZeRO ranks" three.txt timeout 300 "${mpi[@]}" 3 "$train" "${args[@]}" --parallel zero
timeout 60 "${mpi[@]}" 2 "$train" "${args[@]}" --parallel zero --device sim --comm nccl >nccl.txt 2>&1
rc=$?
((rc == 2)) && grep -q "NCCL needs --device cuda" nccl.txt || fail "--comm nccl on the simulated device: rc $rc, $(grep -m1 error nccl.txt)"

# ZeRO's mode from the budget: the group mode unless only the memory-saving mode fits (then it, said
# so, with the losses of one process); below both, exit 2 naming the shortfall before any step.
timeout 300 "${mpi[@]}" 3 "$train" "${args[@]}" --parallel zero --device-budget 5900KiB >auto_ms.txt 2>&1 || fail "3 ranks at 5900KiB: rc $?"
grep -q "^ZeRO: the memory-saving mode" auto_ms.txt || fail "a budget only the memory-saving mode fits did not choose it: $(grep -m1 -E '^(ZeRO|error)' auto_ms.txt)"
if diff <(losses one.txt) <(losses auto_ms.txt) >/dev/null; then echo "ok: the memory-saving mode chosen for a tight device trains as one process"
else fail "the chosen memory-saving mode differs from one process:"; diff <(losses one.txt) <(losses auto_ms.txt) | head; fi
timeout 60 "${mpi[@]}" 3 "$train" "${args[@]}" --parallel zero --device-budget 4MiB >too_small.txt 2>&1
rc=$?
((rc == 2)) && grep -q "short of the least this run can use" too_small.txt || fail "a device below both modes: rc $rc, $(grep -m1 error too_small.txt)"

mkdir -p disk
timeout 300 "${mpi[@]}" 3 "$train" "${args[@]}" --parallel zero --device-budget 20% --host-budget 540KiB --disk-dir "$work/disk" >disk.txt 2>&1 ||
  fail "3 ranks with a disk tier: rc $? $(grep -m1 error disk.txt)"
if diff <(losses one.txt) <(losses disk.txt) >/dev/null; then echo "ok: 3 ZeRO ranks, each with a disk tier, train as one process"
else fail "3 ranks with a disk tier differ from one process:"; diff <(losses one.txt) <(losses disk.txt) | head; fi
grep -qE '^disk: [0-9.]+ [KMG]?i?B written' disk.txt || fail "no disk traffic with a host of 540 KiB per rank"
[[ -z $(ls disk) ]] || fail "a disk tier's file was left in $work/disk: $(ls disk)"

timeout 300 "${mpi[@]}" 3 "$train" "${args[@]}" --parallel zero --stop-after 4 --save ck >save.txt 2>&1 || fail "3-rank save: rc $?"
[[ -f ck/model.safetensors.index.json && -f ck/optimizer-00003-of-00003.safetensors ]] || fail "no sharded checkpoint: $(ls ck)"
timeout 300 "${mpi[@]}" 2 "$train" "${args[@]}" --parallel zero --resume ck >resume2.txt 2>&1 || fail "2-rank resume: rc $?"
timeout 300 "$train" "${args[@]}" --resume ck >resume1.txt 2>&1 || fail "one-process resume: rc $?"
tail8() { losses "$1" | grep -E '^(5|6|7|8|v8) '; }
[[ "$(tail8 resume2.txt)" == "$(tail8 one.txt)" ]] || fail "3 -> 2 ranks resume left the trajectory: $(tail8 resume2.txt | tr '\n' ' ')"
[[ "$(tail8 resume1.txt)" == "$(tail8 one.txt)" ]] || fail "3 ranks -> one process resume left the trajectory"
echo "ok: saved at 3 ranks, resumed at 2 and at 1 on the same trajectory"

# Ranks given different options (one rank's changed, MPMD): exit 2 on every rank naming the option
# and both values, before any step -- never a silent divergence, a crash inside MPI or a hang.
for change in "--seed 7" "--lr 0.01" "--steps 9" "--accum 2" "--val-every 3" "--save ck2" "--stop-after 2" "--memory-saving" "--sample 5" "--clip 0"; do
  read -r -a words <<<"$change"
  ranks_disagree zero "${words[@]}"
done
[[ -e ck2 ]] && fail "a refused run left a checkpoint"
# The sequence check turned off on one rank only: refused by the communicator, before any collective.
mpmd zero --no-sequence-check
rc=$?
((rc == 2)) && grep -q "ranks disagree on mpi_options::check_sequence" mpmd.txt && ! grep -q '^step ' mpmd.txt &&
  echo "ok: --no-sequence-check on one rank refused" || fail "--no-sequence-check on one of 2 ranks: rc $rc, $(grep -m1 error mpmd.txt)"
# Under a launcher without --parallel: refused, not N independent copies writing the same files.
timeout 60 "${mpi[@]}" 2 "$train" "${args[@]}" >none.txt 2>&1
rc=$?
((rc == 2)) && grep -q "none on 2 MPI ranks" none.txt && ! grep -q '^step ' none.txt && echo "ok: mpirun without --parallel refused" ||
  fail "mpirun -np 2 without --parallel: rc $rc, $(grep -m1 error none.txt)"

# A rank dies: the job must end by itself.
kill_a_rank 3 --preset tiny --batch 6 --seq 32 --steps 100000 --warmup 2 --val-every 0 --sample 0 --parallel zero

finish "ZeRO trainer"
