#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The composition matrix: train_gpt over every product of the choices a user combines, each cell
checked against its reference, or refused before its first step with a message saying why.

  python3 composition.py TRAIN_GPT MPIEXEC WORK [--full] [--table FILE] [--jobs N]

Axes: mode {one process, replicated data parallel, ZeRO, ZeRO memory-saving, RTP} at N = 1 and
N = 2 (one process: N = 1 only) x precision {fp32, bf16, fp16} x placement {resident, patrickstar
(Belady, the default device budget: chunks move), LRU (the same budget), offload (every optimizer
step on the host)} x {no disk, a disk tier below a 1.25 MiB host} x accumulation {1, 2} x clipping
{on (1.0), off}. Three steps of the tiny GPT each; the run saves a checkpoint, whose tensors
(parameters, Adam moments, masters) are the cell's bits. The LRU and offload cells also sleep after
step 2 and wake (--sleep-after 2): nothing may stay on a device meanwhile, and their bits are still
their row's. The patrickstar and offload cells of every mode step their host chunks inside
backward (--overlap-step on), and their bits too are their row's.

What each cell must equal (docs/composition.md states why):
  * bits: the first cell of its group -- the same mode, N, precision, accumulation and clipping at
    another placement or tier -- has the same tensors, bit for bit (what chunkstar promises: nothing
    depends on where a chunk lives); and replicated, ZeRO and ZeRO memory-saving at the same N
    share one reference (rank-order sums: docs/zero.md), so they are bits of one another too, and at
    N = 1 bits of one process.
  * tolerance: where the summation order differs (RTP's ring, N = 2 against one process), every
    printed loss is within TOL[precision] (relative) of one process's in the same precision.
  * refused: exit 2 with an "error:" line and no step printed.
Anything else (a crash, another exit code, a refusal after a step, bits or losses off) fails the
run. Without --full a slice of 54 cells (every mode at both N, each precision, each placement and
tier at least once, groups of two so the bits are compared) runs: the CTest `gpt_composition`.
`--full` (CTest `gpt_composition_full`, label slow) runs all 864 cells; `--table FILE` writes the
markdown table of what each cell did, with the date and commit.
"""
import argparse
import concurrent.futures
import datetime
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time

MODES = [("one", 1), ("replicated", 1), ("zero", 1), ("zero-ms", 1), ("rtp", 1),
         ("replicated", 2), ("zero", 2), ("zero-ms", 2), ("rtp", 2)]
PRECISIONS = ["fp32", "bf16", "fp16"]
POLICIES = ["resident", "patrickstar", "lru", "offload"]
DISKS = [False, True]
ACCUMS = [1, 2]
CLIPS = [True, False]
# Relative tolerance on a printed loss where the summation order differs from one process's:
# 4 x steps x u + 1e-6. Each step's gradient is a sum of at most accum x N = 4 terms whose order
# differs, each add rounding by at most u, the unit roundoff of the gradient's storage (fp32 2^-24;
# the 16-bit runs round every add into their gradient chunks: bf16 2^-8, fp16 2^-11); Adam carries a
# relative change of the gradient into the update at most one to one, and at lr 3e-3 over 3 steps a
# relative change of the update moves the loss by less (so the 3 steps add at most 3 such terms);
# 1e-6 covers printing the loss to six decimals. The worst measured is in the table's header.
STEPS = 3
UNIT = {"fp32": 2.0 ** -24, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
TOL = {p: 4 * STEPS * u + 1e-6 for p, u in UNIT.items()}
BASE = ["--preset", "tiny", "--batch", "4", "--seq", "16", "--steps", str(STEPS), "--warmup", "1", "--val-every", "0",
        "--sample", "0", "--lr", "3e-3"]


def cell_name(c):
    return "{mode} N={n} {prec} {policy} {disk} accum={accum} clip={clip}".format(
        mode=c["mode"], n=c["n"], prec=c["prec"], policy=c["policy"], disk="disk" if c["disk"] else "no-disk",
        accum=c["accum"], clip="on" if c["clip"] else "off")


def all_cells():
    for mode, n in MODES:
        for prec in PRECISIONS:
            for accum in ACCUMS:
                for clip in CLIPS:
                    for policy in POLICIES:
                        for disk in DISKS:
                            yield dict(mode=mode, n=n, prec=prec, policy=policy, disk=disk, accum=accum, clip=clip)


def slice_cells():
    """Every mode at both N with three groups of two cells: each precision, placement and tier
    appears, and each group compares two placements' bits."""
    groups = [("fp32", 1, True, [("resident", False), ("lru", True)]),
              ("bf16", 2, False, [("patrickstar", False), ("offload", True)]),
              ("fp16", 2, True, [("resident", False), ("patrickstar", True)])]
    for mode, n in MODES:
        for prec, accum, clip, members in groups:
            for policy, disk in members:
                yield dict(mode=mode, n=n, prec=prec, policy=policy, disk=disk, accum=accum, clip=clip)


def sleeps(c):
    """The LRU and offload cells put the training state to sleep after step 2 and wake it: their
    bits must still be their row's, and nothing may stay on a device while asleep."""
    return c["policy"] in ("lru", "offload")


ASLEEP = "asleep after step 2: model data on the device 0 B, device memory in use 0 B"


def overlaps(c):
    """Every mode with chunks stepped on the host (patrickstar, offload) steps them inside backward
    (--overlap-step on): their bits must still be their row's, whose reference (resident) does not."""
    return c["policy"] in ("patrickstar", "offload")


def command(c, train, mpiexec, out_dir):
    args = BASE + ["--precision", c["prec"], "--policy", c["policy"], "--accum", str(c["accum"]),
                   "--clip", "1.0" if c["clip"] else "0", "--save", os.path.join(out_dir, "ck")]
    if c["disk"]:
        args += ["--disk-dir", os.path.join(out_dir, "disk"), "--host-budget", "1280KiB"]
    if c["mode"] != "one":
        args += ["--parallel", "zero" if c["mode"].startswith("zero") else c["mode"]]
    if c["mode"] == "zero-ms":
        args += ["--memory-saving"]
    if sleeps(c):
        args += ["--sleep-after", "2", "--sleep-for", "0"]
    if overlaps(c):
        args += ["--overlap-step", "on"]
    if c["n"] == 1:
        return [train] + args
    return [mpiexec, "--allow-run-as-root", "--oversubscribe", "-np", str(c["n"]), train] + args


def tensors(ck):
    """name -> (dtype, shape, bytes) of every tensor in a checkpoint directory's safetensors files."""
    out = {}
    for f in sorted(os.listdir(ck)):
        if not f.endswith(".safetensors"):
            continue
        with open(os.path.join(ck, f), "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
            data = fh.read()
        for name, t in header.items():
            if name == "__metadata__":
                continue
            kind = "optimizer" if f.startswith("optimizer") else "model"
            a, b = t["data_offsets"]
            out[kind + ":" + name] = (t["dtype"], tuple(t["shape"]), data[a:b])
    return out


def digest(ts):
    h = hashlib.sha256()
    for name in sorted(ts):
        dt, shape, data = ts[name]
        h.update(name.encode() + dt.encode() + repr(shape).encode() + data)
    return h.hexdigest()[:16]


LOSS = re.compile(r"^step +(\d+)/\d+ \| loss ([0-9.]+)")


def run_cell(c, train, mpiexec, work, index):
    out_dir = os.path.join(work, "cell%03d" % index)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(os.path.join(out_dir, "disk"))
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    t0 = time.time()
    try:
        p = subprocess.run(command(c, train, mpiexec, out_dir), capture_output=True, text=True, env=env, timeout=300)
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = "timeout", str(e)
    r = dict(cell=c, rc=rc, seconds=time.time() - t0, losses=[], error="", digest="")
    r["losses"] = [float(m.group(2)) for m in map(LOSS.match, text.splitlines()) if m]
    r["slept_empty"] = any(ln.startswith(ASLEEP) for ln in text.splitlines())
    errors = [re.sub(r"^error \(rank \d+\):", "error:", ln) for ln in text.splitlines() if ln.startswith("error")]
    r["error"] = errors[0] if errors else ""
    if rc == 0:
        try:
            r["digest"] = digest(tensors(os.path.join(out_dir, "ck")))
        except (OSError, ValueError) as e:
            r["rc"], r["error"] = "no checkpoint", str(e)
    if rc not in (0, 2):
        r["tail"] = "\n".join(text.splitlines()[-8:])
    shutil.rmtree(out_dir, ignore_errors=True)
    return r


def judge(results):
    """Sets each result's outcome ('bits', 'tol', 'refused', 'FAIL') and why; returns the failures and
    the worst relative loss difference per precision where tolerance applies."""
    groups = {}  # (mode, N, precision, accum, clip) -> its first cell that ran: the row's reference
    for r in results:
        c = r["cell"]
        if r["rc"] == 0:
            groups.setdefault((c["mode"], c["n"], c["prec"], c["accum"], c["clip"]), r)
    worst = {p: 0.0 for p in PRECISIONS}
    failures = []
    for r in results:
        c = r["cell"]
        rest = (c["prec"], c["accum"], c["clip"])
        if r["rc"] == 2 and r["error"] and not r["losses"]:
            r["outcome"], r["why"] = "refused", r["error"]
        elif r["rc"] == 2:
            r["outcome"] = "FAIL"
            r["why"] = "refused after a step: " + r["error"] if r["error"] else "exit 2 without an error line"
        elif r["rc"] != 0:
            r["outcome"], r["why"] = "FAIL", "exit %s: %s" % (r["rc"], r.get("tail", r["error"]))
        else:
            why = []
            if sleeps(c) and not r["slept_empty"]:
                why.append("no '" + ASLEEP + "' line: something stayed on a device while asleep")
            row = groups[(c["mode"], c["n"]) + rest]
            if r["digest"] != row["digest"]:
                why.append("bits differ from " + cell_name(row["cell"]))
            # Where bits are promised across modes: one process (N = 1), replicated and both ZeRO
            # modes share one reference; the first of them that ran is it.
            promise = None
            if c["mode"] != "rtp":
                for m, n in ([("one", 1)] if c["n"] == 1 else []) + [(m, c["n"]) for m in ("replicated", "zero", "zero-ms")]:
                    if (m, n) + rest in groups:
                        promise = groups[(m, n) + rest]
                        break
                if promise is not None and r["digest"] != promise["digest"]:
                    why.append("bits differ from " + cell_name(promise["cell"]))
            # Where they are not (RTP; N = 2 against one process): the losses, within tolerance.
            one = groups.get(("one", 1) + rest)
            tolerance = promise is None or promise["cell"]["mode"] != "one"
            d = None
            if tolerance and one is not None:
                if not r["losses"] or len(r["losses"]) != len(one["losses"]):
                    why.append("%d losses, one process printed %d" % (len(r["losses"]), len(one["losses"])))
                else:
                    d = max(abs(x - y) / abs(y) for x, y in zip(r["losses"], one["losses"]))
                    worst[c["prec"]] = max(worst[c["prec"]], d)
                    if d > TOL[c["prec"]]:
                        why.append("a loss %.2g (relative) from one process's, above %g" % (d, TOL[c["prec"]]))
            if why:
                r["outcome"], r["why"] = "FAIL", "; ".join(why)
            elif promise is not None:
                r["outcome"] = "bits"
                r["why"] = "= " + cell_name(promise["cell"]) + ("" if d is None else "; losses %.1e from one process's" % d)
            else:
                r["outcome"] = "tol"
                r["why"] = "= " + cell_name(row["cell"]) + ("" if d is None else "; losses %.1e from one process's" % d)
        if r["outcome"] == "FAIL":
            failures.append(r)
    return failures, worst


def table(results, worst, full, started, seconds):
    here = os.path.dirname(os.path.abspath(__file__))
    commit = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    if subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                      text=True).stdout.strip():
        commit += " with uncommitted changes"
    counts = {}
    for r in results:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    out = ["# The composition matrix", "",
           "Generated by `examples/gpt/tests/composition.py%s` on %s at commit `%s`: %d cells in %.0f s. "
           "Do not edit by hand." % (" --full" if full else "", started, commit, len(results), seconds), "",
           "Each cell is three steps of `train_gpt --preset tiny --batch 4 --seq 16` with the options of its row and "
           "column, then a checkpoint whose tensors are its bits. **bits**: the same tensors as the first cell of "
           "its row (another placement or tier) and, for replicated and both ZeRO modes, as one another at the same "
           "N (one reference: docs/zero.md), at N = 1 as one process. **tol**: the bits of its row, and every loss "
           "within the precision's tolerance of one process's (relative: fp32 %.1e, bf16 %.1e, fp16 %.1e: 4 x steps x "
           "the unit roundoff of its gradients + 1e-6 for the printing; composition.py says why), where the "
           "summation order differs (RTP's ring; N = 2 against one process). **refused**: exit 2 before the first "
           "step, the message below. The lru and offload cells also sleep after step 2 (`--sleep-after 2`: every chunk "
           "and buffer off the device, then back) and must print 0 bytes on every device while asleep. The "
           "patrickstar and offload cells of every mode step their host chunks inside backward (`--overlap-step "
           "on`). A FAIL "
           "makes the run fail." % (TOL["fp32"], TOL["bf16"], TOL["fp16"]), "",
           "Outcomes: " + ", ".join("%s %d" % (k, v) for k, v in sorted(counts.items())) + ". Worst relative loss "
           "difference from one process where tolerance applies: " +
           ", ".join("%s %.1e" % (p, worst[p]) for p in PRECISIONS) + ".", ""]
    reasons = {}
    for r in results:
        if r["outcome"] == "refused":
            reasons.setdefault(r["why"], []).append(cell_name(r["cell"]))
    if reasons:
        out += ["## Refused cells and why", ""]
        for i, (why, cells) in enumerate(sorted(reasons.items())):
            out.append("%d. %d cells (e.g. `%s`): %s" % (i + 1, len(cells), cells[0], why.replace("|", "\\|")))
        out.append("")
        keys = {why: i + 1 for i, why in enumerate(sorted(reasons))}
    cols = [(p, d) for p in POLICIES for d in DISKS]
    out += ["## Cells", "",
            "| mode | N | precision | accum | clip | " + " | ".join("%s%s" % (p, " +disk" if d else "") for p, d in cols) +
            " |", "|" + "---|" * (5 + len(cols))]
    rows = {}
    for r in results:
        c = r["cell"]
        rows.setdefault((c["mode"], c["n"], c["prec"], c["accum"], c["clip"]), {})[(c["policy"], c["disk"])] = r
    for key, row in rows.items():
        mode, n, prec, accum, clip = key
        cells = []
        for col in cols:
            r = row.get(col)
            if r is None:
                cells.append("")
            elif r["outcome"] == "refused":
                cells.append("refused (%d)" % keys[r["why"]])
            else:
                cells.append(r["outcome"])
        out.append("| %s | %d | %s | %d | %s | %s |" % (mode, n, prec, accum, "on" if clip else "off", " | ".join(cells)))
    failures = [r for r in results if r["outcome"] == "FAIL"]
    if failures:
        out += ["", "## Failures", ""] + ["* `%s`: %s" % (cell_name(r["cell"]), r["why"]) for r in failures]
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("train")
    ap.add_argument("mpiexec")
    ap.add_argument("work")
    ap.add_argument("--full", action="store_true", help="all 864 cells (default: the 54-cell slice)")
    ap.add_argument("--table", help="write the markdown table here (e.g. docs/composition.md)")
    ap.add_argument("--jobs", type=int, default=2, help="cells run at once (N = 2 cells take two cores)")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    cells = list(all_cells() if a.full else slice_cells())
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    t0 = time.time()
    results = [None] * len(cells)
    # One-rank cells two at a time; two-rank cells alone (their ranks take both cores).
    singles = [i for i, c in enumerate(cells) if c["n"] == 1]
    pairs = [i for i, c in enumerate(cells) if c["n"] > 1]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        for i, r in zip(singles, pool.map(lambda i: run_cell(cells[i], a.train, a.mpiexec, a.work, i), singles)):
            results[i] = r
    for i in pairs:
        results[i] = run_cell(cells[i], a.train, a.mpiexec, a.work, i)
    failures, worst = judge(results)
    seconds = time.time() - t0
    for r in results:
        print("%-8s %-62s %5.1f s  %s" % (r["outcome"], cell_name(r["cell"]), r["seconds"], r.get("why", "")))
    counts = {}
    for r in results:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    print("composition: %d cells in %.0f s: %s; worst loss difference where tolerance applies: %s" % (
        len(results), seconds, ", ".join("%s %d" % kv for kv in sorted(counts.items())),
        ", ".join("%s %.1e" % (p, worst[p]) for p in PRECISIONS)))
    if a.table:
        text = table(results, worst, a.full, started, seconds)  # before the file is opened: git sees it as it was
        with open(a.table, "w") as f:
            f.write(text)
        print("wrote " + a.table)
    if failures:
        print("FAIL: %d cells" % len(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
