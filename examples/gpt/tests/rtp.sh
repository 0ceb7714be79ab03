#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# train_gpt --parallel rtp on MPI ranks, end to end:
#  1. 2 and 4 ranks train the same model on the same data as one process: losses within fp32
#     rounding (the ring adds the shards' partial sums in its own order, so bits may differ); and
#     each rank's shards in its chunk runtime give the same losses, bit for bit as printed, whether
#     they stay on the device (--policy resident) or live on the host (--policy offload), and
#     whether the shards rotate over MPI directly or through host staging buffers (--comm staged),
#     and with a disk tier per rank below a host too small for its shards (--disk-dir), and when
#     the ranks sleep after step 4 (--sleep-after: nothing on a device while asleep); in bf16 and
#     fp16 (16-bit shards rotate) the losses of one process in the same precision, within tolerance;
#  2. checkpoints cross modes: saved under RTP at 4 ranks, resumed under RTP at 2, in one process
#     and under ZeRO at 2; saved in one process and under ZeRO, resumed under RTP — every resume on
#     the uninterrupted trajectory;
#  3. bad input (a world size the heads do not split over, an option RTP does not take, one rank's
#     option changed) is exit 2 with a message naming it; a rank killed (SIGKILL) mid-run ends the
#     job, non-zero, within 30 s.
#   bash rtp.sh <train_gpt> <mpiexec> <work dir>
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/trainer_checks.sh"
begin_mpi_checks "$@"
args=(--preset tiny --batch 8 --seq 32 --steps 8 --warmup 2 --val-every 4 --sample 16)
# Same steps, each loss within 1e-4 relative (fp32 rounding, amplified a little by Adam over 8 steps),
# or the relative tolerance given third.
close() {
  awk -v tol="${3:-1e-4}" 'NR == FNR { a[$1] = $2; next } { if (!($1 in a)) { print "missing " $1; bad = 1; next }
       d = a[$1] - $2; if (d < 0) d = -d; if (d > tol * $2) { print $1 ": " a[$1] " vs " $2; bad = 1 } n++ }
       END { exit bad || n == 0 }' <(losses "$1") <(losses "$2")
}
after4() { losses "$1" | grep -E '^(5|6|7|8|v8) '; }

timeout 300 "$train" "${args[@]}" >one.txt 2>&1 || fail "one process: rc $?"
for n in 2 4; do
  timeout 300 "${mpi[@]}" $n "$train" "${args[@]}" --parallel rtp >rtp$n.txt 2>&1 || fail "$n RTP ranks: rc $?"
  if out=$(close rtp$n.txt one.txt); then echo "ok: $n RTP ranks train as one process: $(losses rtp$n.txt | tr '\n' ' ')"
  else fail "$n RTP ranks differ from one process: $out"; fi
  grep -q "per rank (largest): model data" rtp$n.txt || fail "no per-rank memory in the $n-rank summary"
  grep -q "^sample:" rtp$n.txt || fail "no sample from $n ranks"
done
grep -q "1/4 of the whole" rtp4.txt || fail "the 4-rank summary does not say each rank holds 1/4"
grep -q "chunks will move" rtp4.txt || fail "the default device budget does not make the shards move"
for policy in resident offload; do
  timeout 300 "${mpi[@]}" 2 "$train" "${args[@]}" --parallel rtp --policy $policy >rtp2_$policy.txt 2>&1 || fail "2 RTP ranks, --policy $policy: rc $?"
  if diff <(losses rtp2.txt) <(losses rtp2_$policy.txt) >/dev/null; then echo "ok: --policy $policy gives the same losses under RTP"
  else fail "--policy $policy changed the RTP losses: $(diff <(losses rtp2.txt) <(losses rtp2_$policy.txt) | head -4)"; fi
done
grep -q "optimizer steps on device 0, on host" rtp2_offload.txt || fail "--policy offload did not step on the host"
# --comm staged: the rotations through host staging buffers (what ranks sharing a GPU use), on the
# simulated device through memcpy: the same bytes arrive, so the same losses, bit for bit as printed.
timeout 300 "${mpi[@]}" 2 "$train" "${args[@]}" --parallel rtp --comm staged >rtp2_staged.txt 2>&1 || fail "2 RTP ranks, --comm staged: rc $?"
if diff <(losses rtp2.txt) <(losses rtp2_staged.txt) >/dev/null; then echo "ok: --comm staged gives the same losses under RTP"
else fail "--comm staged changed the RTP losses: $(diff <(losses rtp2.txt) <(losses rtp2_staged.txt) | head -4)"; fi
grep -q "host staging buffers" rtp2_staged.txt || fail "the RTP run does not say it stages through host buffers"
sleeps "2 RTP ranks" rtp2.txt timeout 300 "${mpi[@]}" 2 "$train" "${args[@]}" --parallel rtp
# Mixed precision: 16-bit shards rotate (half the ring's bytes), fp32 masters and moments stay with
# their owner; each loss within 4 x steps x u + 1e-6 of one process's in the same precision (u: bf16
# 2^-8, fp16 2^-11; the reasoning is composition.py's), and the ring sends half of fp32's bytes.
for prec in bf16:0.125 fp16:0.0157; do
  p=${prec%%:*} tol=${prec##*:}
  timeout 300 "$train" "${args[@]}" --precision "$p" >one_$p.txt 2>&1 || fail "one process in $p: rc $?"
  timeout 300 "${mpi[@]}" 2 "$train" "${args[@]}" --parallel rtp --precision "$p" >rtp2_$p.txt 2>&1 || fail "2 RTP ranks in $p: rc $?"
  if out=$(close rtp2_$p.txt one_$p.txt "$tol") && grep -q "; $p shards rotate" rtp2_$p.txt; then
    echo "ok: 2 RTP ranks in $p train as one process in $p (within $tol): $(losses rtp2_$p.txt | tr '\n' ' ')"
  else fail "2 RTP ranks in $p differ from one process: $out $(grep -m1 -E '^(error|parallel)' rtp2_$p.txt)"; fi
done
sent() { grep -m1 -oE '^step +2/[0-9]+ .*\| sent [0-9.]+ [KMG]?i?B' "$1" | grep -oE 'sent .*'; }
echo "ring bytes per step: fp32 $(sent rtp2.txt), bf16 $(sent rtp2_bf16.txt)"
# A disk tier per rank (--disk-dir): each rank's shard store spills below a host too small for its
# share (model data 1.9 MiB a rank, host 800 KiB), with the losses of the run without it.
mkdir -p disk
timeout 300 "${mpi[@]}" 2 "$train" "${args[@]}" --parallel rtp --device-budget 20% >rtp2_small.txt 2>&1 || fail "2 RTP ranks, 20% device: rc $?"
timeout 300 "${mpi[@]}" 2 "$train" "${args[@]}" --parallel rtp --device-budget 20% --host-budget 800KiB --disk-dir disk \
  >rtp2_disk.txt 2>&1 || fail "2 RTP ranks with a disk tier: rc $?"
if diff <(losses rtp2_small.txt) <(losses rtp2_disk.txt) >/dev/null && grep -q "^disk: .* written" rtp2_disk.txt; then
  echo "ok: a disk tier per RTP rank gives the same losses: $(grep -m1 '^disk:' rtp2_disk.txt | cut -d';' -f1)"
else fail "the disk tier changed the RTP losses: $(diff <(losses rtp2_small.txt) <(losses rtp2_disk.txt) | head -4)"; fi
timeout 60 "${mpi[@]}" 2 "$train" "${args[@]}" --parallel rtp --comm nccl --device sim >rtp2_nccl.txt 2>&1
rc=$?
[[ $rc -eq 2 ]] && grep -q "NCCL needs --device cuda" rtp2_nccl.txt || fail "--comm nccl on the simulated device: rc $rc, $(tail -2 rtp2_nccl.txt)"

# Checkpoints across modes. An uninterrupted run's steps 5-8 are the reference for every resume.
cmp_resume() {  # <what> <file>
  local d
  d=$(awk 'NR == FNR { a[$1] = $2; next } ($1 in a) { x = a[$1] - $2; if (x < 0) x = -x; if (x > 1e-4 * $2) print $1 ": " a[$1] " vs " $2 }' \
      <(after4 one.txt) <(after4 "$2"))
  [[ -z $d && -n $(after4 "$2") ]] && echo "ok: $1 on the uninterrupted trajectory" || fail "$1 left the trajectory: $d"
}
timeout 300 "${mpi[@]}" 4 "$train" "${args[@]}" --parallel rtp --stop-after 4 --save ck_rtp >save_rtp.txt 2>&1 || fail "RTP save: rc $?"
[[ -f ck_rtp/model.safetensors.index.json && -f ck_rtp/optimizer-00004-of-00004.safetensors ]] || fail "no sharded RTP checkpoint: $(ls ck_rtp)"
timeout 300 "${mpi[@]}" 2 "$train" "${args[@]}" --parallel rtp --resume ck_rtp >r_rtp2.txt 2>&1 || fail "RTP 4 -> RTP 2 resume: rc $?"
cmp_resume "RTP at 4 ranks -> RTP at 2" r_rtp2.txt
timeout 300 "$train" "${args[@]}" --resume ck_rtp >r_one.txt 2>&1 || fail "RTP -> one process resume: rc $?"
cmp_resume "RTP at 4 ranks -> one process" r_one.txt
timeout 300 "${mpi[@]}" 2 "$train" "${args[@]}" --parallel zero --resume ck_rtp >r_zero.txt 2>&1 || fail "RTP -> ZeRO resume: rc $?"
cmp_resume "RTP at 4 ranks -> ZeRO at 2" r_zero.txt
# fp16 under RTP: saved at step 4 with its loss scale, resumed at the same N, the uninterrupted fp16 run's losses.
timeout 300 "${mpi[@]}" 2 "$train" "${args[@]}" --parallel rtp --precision fp16 --stop-after 4 --save ck_rtp16 >save_rtp16.txt 2>&1 || fail "RTP fp16 save: rc $?"
timeout 300 "${mpi[@]}" 2 "$train" "${args[@]}" --parallel rtp --precision fp16 --resume ck_rtp16 >r_rtp16.txt 2>&1 || fail "RTP fp16 resume: rc $?"
if diff <(after4 rtp2_fp16.txt) <(after4 r_rtp16.txt) >/dev/null && [[ -n $(after4 r_rtp16.txt) ]]; then echo "ok: RTP in fp16 resumes on its trajectory"
else fail "RTP in fp16 left its trajectory on resume: $(diff <(after4 rtp2_fp16.txt) <(after4 r_rtp16.txt) | head -4)"; fi
timeout 300 "$train" "${args[@]}" --stop-after 4 --save ck_one >save_one.txt 2>&1 || fail "one-process save: rc $?"
timeout 300 "${mpi[@]}" 4 "$train" "${args[@]}" --parallel rtp --resume ck_one >r_from_one.txt 2>&1 || fail "one process -> RTP resume: rc $?"
cmp_resume "one process -> RTP at 4 ranks" r_from_one.txt
timeout 300 "${mpi[@]}" 2 "$train" "${args[@]}" --parallel zero --stop-after 4 --save ck_zero >save_zero.txt 2>&1 || fail "ZeRO save: rc $?"
timeout 300 "${mpi[@]}" 2 "$train" "${args[@]}" --parallel rtp --resume ck_zero >r_from_zero.txt 2>&1 || fail "ZeRO -> RTP resume: rc $?"
cmp_resume "ZeRO at 2 ranks -> RTP at 2" r_from_zero.txt

# Bad input: exit 2, the message names what is wrong.
timeout 120 "${mpi[@]}" 3 "$train" "${args[@]}" --batch 6 --parallel rtp >bad3.txt 2>&1
rc=$?
((rc == 2)) && grep -q "dimension 'heads' of size 4 does not split evenly over 3 ranks" bad3.txt && grep -q "1, 2, 4" bad3.txt \
  && echo "ok: 3 ranks for 4 heads: exit 2, the heads and the valid world sizes named" || fail "3 ranks for 4 heads: rc $rc: $(head -3 bad3.txt)"
timeout 120 "${mpi[@]}" 2 "$train" "${args[@]}" --parallel rtp --memory-saving >badp.txt 2>&1
rc=$?
((rc == 2)) && grep -q -- "--memory-saving does not apply to --parallel rtp" badp.txt && echo "ok: --memory-saving under RTP: exit 2, named" \
  || fail "--memory-saving under RTP: rc $rc: $(head -3 badp.txt)"

# Ranks given different options (one rank's changed, MPMD): exit 2 on every rank naming the option.
for change in "--steps 9" "--seed 7" "--sample 5"; do
  read -r -a words <<<"$change"
  ranks_disagree rtp "${words[@]}"
done

# A rank dies: the job must end by itself.
kill_a_rank 4 --preset tiny --batch 8 --seq 32 --steps 100000 --warmup 2 --val-every 0 --sample 0 --parallel rtp

finish "RTP trainer"
