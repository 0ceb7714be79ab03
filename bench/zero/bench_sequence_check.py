#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""bench_sequence_check: what the MPI collective-sequence check costs the main job's ZeRO run.

The check (mpi_options::check_sequence, on by default) exchanges every rank's description of its
next collective before each one. This runs train_gpt under mpirun with the check on and off in
alternating rounds (on, off, off, on, ...: both see the same machine) and compares the step times:

  step time   per step, from the trainer's own `tok/s` (the step's wall time as rank 0 sees it),
              median over the steps after the first few (the warm-up iteration traces),
  cost        median step time on / off - 1 for each pair of runs next to each other (the
              machine's drift cancels), the median over the pairs; also pooled over all runs,
  latency     with --latency EXE (bench_check_latency): the check's own cost per collective when
              the ranks arrive together, times the checked collectives per step, as a share of the
              step: what the check costs when no skew hides it,
  counted     what the trainer reports as spent inside the check's exchange: an upper bound,
              since it includes waiting for a slower rank, which the data collective absorbs
              when the check is off.

Prints a table, writes --json and draws --plot (gnuplot). docs/zero.md quotes the figures.

  python3 bench/zero/bench_sequence_check.py --train build/examples/examples/gpt/train_gpt
          [--latency bench_check_latency] [--mpiexec M] [--ranks 2] [--rounds 8] [--steps 60] [--quick]
          [--json F] [--plot F.png] [-- trainer args]
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

STEP = re.compile(r"^step +(\d+)/\d+ \|.*\| +(\d+) tok/s")
CHECK = re.compile(r"^collective-sequence check: (\d+) collectives, ([\d.]+) s of ([\d.]+) s")
SUMMARY = re.compile(r"^summary: (\d+) steps in ([\d.]+) s")


def mpirun(exe):
    exe = exe or shutil.which("mpirun") or shutil.which("mpiexec")
    if not exe:
        sys.exit("bench_sequence_check: no mpirun on PATH (apt-get install openmpi-bin)")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    flags = ["--allow-run-as-root", "--oversubscribe"] if "Open MPI" in version or "OpenRTE" in version else []
    return [exe, *flags]


def run(cmd_prefix, train, ranks, steps, check, extra):
    args = [*cmd_prefix, "-np", str(ranks), train, "--parallel", "zero", "--steps", str(steps), "--sample", "0",
            "--val-every", "0", *extra]
    if not check:
        args.append("--no-sequence-check")
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    p = subprocess.run(args, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"bench_sequence_check: {' '.join(args)} failed (exit {p.returncode}):\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    toks, calls, counted, wall = {}, 0, 0.0, None
    for line in p.stdout.splitlines():
        if m := STEP.match(line):
            toks[int(m[1])] = int(m[2])
        elif m := CHECK.match(line):
            calls, counted = int(m[1]), float(m[2])
        elif m := SUMMARY.match(line):
            wall = float(m[2])
    if len(toks) != steps:
        sys.exit(f"bench_sequence_check: expected {steps} step lines, got {len(toks)}:\n{p.stdout[-2000:]}")
    if check and calls == 0:
        sys.exit("bench_sequence_check: the check was on but the trainer reported no checked collectives")
    if not check and calls != 0:
        sys.exit("bench_sequence_check: the check was off but the trainer reported checked collectives")
    return {"toks": toks, "calls": calls, "counted_s": counted, "train_s": wall}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train", required=True, help="the train_gpt executable")
    ap.add_argument("--mpiexec", help="the MPI launcher (default: mpirun on PATH)")
    ap.add_argument("--latency", help="the bench_check_latency executable (the check's own latency per collective)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8, help="runs per mode (even: the order is on, off, off, on, ...)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=5, help="first steps left out (tracing warm-up)")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 12 steps: a smoke test")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("extra", nargs="*", help="after --: more trainer options (default: the main job's)")
    o = ap.parse_args()
    if o.quick:
        o.rounds, o.steps = 2, 12
    if o.steps <= o.skip or o.rounds < 1 or o.ranks < 2:
        sys.exit("bench_sequence_check: needs --steps > --skip, --rounds >= 1, --ranks >= 2")
    prefix = mpirun(o.mpiexec)

    rounds = []  # (mode, median step time relative unit, record)
    order = []
    for r in range(o.rounds):
        order += [True, False] if r % 2 == 0 else [False, True]
    for i, check in enumerate(order):
        rec = run(prefix, o.train, o.ranks, o.steps, check, o.extra)
        # Every step processes the same tokens, so step time is proportional to 1 / tok/s; the
        # trainer's tokens per step make it seconds.
        times = [1.0 / t for s, t in sorted(rec["toks"].items()) if s > o.skip]
        rec["step_median"] = statistics.median(times)
        rec["check"] = check
        rounds.append(rec)
        print(f"  run {i + 1:2d}/{len(order)}: check {'on ' if check else 'off'}  median {1 / rec['step_median']:7.0f} tok/s"
              + (f"  {rec['calls']} checks, {rec['counted_s']:.3f} s counted in them" if check else ""), flush=True)

    on = [r for r in rounds if r["check"]]
    off = [r for r in rounds if not r["check"]]
    pooled_on = statistics.median([1 / t for r in on for s, t in r["toks"].items() if s > o.skip])
    pooled_off = statistics.median([1 / t for r in off for s, t in r["toks"].items() if s > o.skip])
    cost = pooled_on / pooled_off - 1
    pairs = [rounds[2 * k]["step_median"] / rounds[2 * k + 1]["step_median"] if rounds[2 * k]["check"]
             else rounds[2 * k + 1]["step_median"] / rounds[2 * k]["step_median"] for k in range(o.rounds)]
    pairs = [p - 1 for p in pairs]
    calls_per_step = statistics.median([r["calls"] / o.steps for r in on])
    counted_share = statistics.median([r["counted_s"] / r["train_s"] for r in on if r["train_s"]])

    latency = None
    if o.latency:
        args = [*prefix, "-np", str(o.ranks), o.latency, *(["500", "3"] if o.quick else [])]
        p = subprocess.run(args, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"bench_sequence_check: {' '.join(args)} failed (exit {p.returncode}):\n{p.stdout}{p.stderr}")
        latency = json.loads(p.stdout.strip().splitlines()[-1])

    print()
    print(f"bench_sequence_check: train_gpt --parallel zero on {o.ranks} MPI ranks, {o.steps} steps x {o.rounds} rounds per mode "
          f"{' '.join(o.extra)}".rstrip())
    print(f"| {'check':5} | {'median tok/s':>12} | {'step time vs off':>16} |")
    print(f"| {'-' * 5} | {'-' * 12}:| {'-' * 16}:|")
    print(f"| {'off':5} | {1 / pooled_off:12.0f} | {'1.000':>16} |")
    print(f"| {'on':5} | {1 / pooled_on:12.0f} | {pooled_on / pooled_off:16.3f} |")
    print(f"cost of the check: {100 * statistics.median(pairs):+.2f}% of a step (median over the pairs of runs next to each other: "
          f"{', '.join(f'{100 * p:+.1f}%' for p in pairs)}); pooled over all runs {100 * cost:+.2f}%")
    print(f"{calls_per_step:.1f} checked collectives per step; the trainer counted {100 * counted_share:.2f}% of the run inside "
          f"the check's exchange (waits for a slower rank included: an upper bound)")

    latency_share = None
    if latency:
        # tok/s times the step's tokens would give seconds; relative to the step it cancels: share =
        # check seconds per step / step seconds = check_us * checks_per_step * 1e-6 * tok/s / tokens.
        # The trainer's tokens per step are not printed, so take the step time from its summary line.
        step_s = statistics.median([r["train_s"] / o.steps for r in off if r["train_s"]])
        latency_share = latency["check_us"] * 1e-6 * calls_per_step / step_s
        print(f"the check's own latency: {latency['check_us']:.2f} us per collective ({latency['on_us']:.2f} us on, "
              f"{latency['off_us']:.2f} us off, an 8-byte allreduce with the ranks arriving together) x {calls_per_step:.1f} per step "
              f"= {100 * latency_share:.3f}% of a {1e3 * step_s:.1f} ms step")

    result = {"bench": "bench_sequence_check", "ranks": o.ranks, "steps": o.steps, "rounds": o.rounds, "skip": o.skip,
              "extra": o.extra, "tok_s_on": 1 / pooled_on, "tok_s_off": 1 / pooled_off, "cost": statistics.median(pairs), "pooled_cost": cost,
              "pair_costs": pairs,
              "checks_per_step": calls_per_step, "counted_share": counted_share, "latency": latency,
              "latency_share": latency_share,
              "runs": [{"check": r["check"], "tok_s": r["toks"], "calls": r["calls"], "counted_s": r["counted_s"],
                        "train_s": r["train_s"]} for r in rounds]}
    if o.json:
        with open(o.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"json: {o.json}")
    if o.plot:
        if not shutil.which("gnuplot"):
            print("bench_sequence_check: --plot needs gnuplot on PATH (apt-get install gnuplot-nox); no plot written", file=sys.stderr)
        else:
            with tempfile.TemporaryDirectory() as d:
                with open(os.path.join(d, "runs.dat"), "w") as f:
                    for i, r in enumerate(rounds):
                        f.write(f"{i + 1} {1 / r['step_median']:.1f} {1 if r['check'] else 0}\n")
                script = (f"set terminal pngcairo size 1000,600 font ',10' noenhanced\nset output '{o.plot}'\n"
                          f"set title 'train_gpt --parallel zero on {o.ranks} MPI ranks: median tok/s per run, "
                          f"sequence check on vs off (cost {100 * statistics.median(pairs):+.2f}% of a step)'\n"
                          "set xlabel 'run (alternating on/off)'\nset ylabel 'median tok/s'\nset style fill solid 0.6\n"
                          "set boxwidth 0.7\nset yrange [0:*]\nset key outside right top\n"
                          f"plot '{d}/runs.dat' using 1:($3==1?$2:1/0) with boxes lc rgb '#c0392b' title 'check on', "
                          f"'' using 1:($3==0?$2:1/0) with boxes lc rgb '#2e86c1' title 'check off'\n")
                with open(os.path.join(d, "plot.gp"), "w") as f:
                    f.write(script)
                if subprocess.run(["gnuplot", os.path.join(d, "plot.gp")]).returncode == 0:
                    print(f"plot: {o.plot}")
    print("bench_sequence_check: done")


if __name__ == "__main__":
    main()
