#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Collects one GPU check's figures (tests/gpu/run.sh OUT_DIR) into OUT_DIR/results.json and prints
the table run.sh appends to summary.txt: train_gpt on CUDA per precision and budget (tokens/s,
memory, bytes moved, optimizer steps per tier) beside the PyTorch baseline of the same shape, and
the GPU benchmark's measurements against their limits. Standard library only."""
import glob
import json
import os
import re
import statistics
import sys

STEP = re.compile(r"^step +(\d+)/\d+ \| loss ([0-9.]+) \| +([0-9.]+) tok/s .*\| moved ([0-9.]+ [KMGT]?i?B) \| stall ([0-9.]+) ms")
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def size(text):
    number, unit = text.split()
    return float(number) * UNITS[unit]


def trainer_runs(out):
    runs = []
    for path in sorted(glob.glob(os.path.join(out, "train_*_*.log"))):
        m = re.match(r"train_(fp32|bf16|fp16)_(\d+)\.log$", os.path.basename(path))
        if not m:
            continue
        text = open(path, errors="replace").read().splitlines()
        steps = [STEP.match(line) for line in text]
        steps = [s for s in steps if s]
        r = {"precision": m.group(1), "budget_percent": int(m.group(2)), "log": os.path.basename(path), "steps": len(steps)}
        if steps:
            timed = steps[2:] or steps  # the first steps warm up (trace, allocation)
            r.update(
                tokens_per_s=statistics.median(float(s.group(3)) for s in timed),
                first_loss=float(steps[0].group(2)),
                last_loss=float(steps[-1].group(2)),
                moved_bytes_per_step=statistics.median(size(s.group(4)) for s in timed),
                stall_ms_per_step=statistics.median(float(s.group(5)) for s in timed),
                losses=[float(s.group(2)) for s in steps],
            )
        for line in text:
            if line.startswith("device: "):
                r["device"] = line[len("device: "):]
            elif line.startswith("memory: "):
                b = re.search(r"device budget ([0-9.]+ [KMGT]?i?B)", line)
                d = re.search(r"model data ([0-9.]+ [KMGT]?i?B)", line)
                if b:
                    r["device_budget_bytes"] = size(b.group(1))
                if d:
                    r["model_bytes"] = size(d.group(1))
            elif line.startswith("peaks over the run: "):
                p = re.search(r"device ([0-9.]+ [KMGT]?i?B) of", line)
                if p:
                    r["peak_device_bytes"] = size(p.group(1))
            elif line.startswith("chunks: "):
                s = re.search(r"optimizer steps on device (\d+), on host (\d+)", line)
                if s:
                    r["device_steps"], r["host_steps"] = int(s.group(1)), int(s.group(2))
        runs.append(r)
    order = {"fp32": 0, "bf16": 1, "fp16": 2}
    return sorted(runs, key=lambda r: (order[r["precision"]], -r["budget_percent"]))


def overlap_runs(out):
    """train_gpt with the optimizer step inside backward (overlap_on.log; with --scopes-ahead 0 and 2,
    overlap_on_ahead0.log and overlap_on_ahead2.log) and after it (overlap_off.log)."""
    runs = {}
    for mode in ("on", "off", "on_ahead0", "on_ahead2"):
        path = os.path.join(out, "overlap_%s.log" % mode)
        if not os.path.exists(path):
            continue
        text = open(path, errors="replace").read().splitlines()
        steps = [s for s in (STEP.match(line) for line in text) if s]
        r = {"log": os.path.basename(path), "steps": len(steps)}
        if steps:
            timed = steps[2:] or steps
            r.update(tokens_per_s=statistics.median(float(s.group(3)) for s in timed),
                     losses=[float(s.group(2)) for s in steps])
        for line in text:
            m = re.search(r"on host (\d+) \((\d+) inside backward\)", line)
            if line.startswith("chunks: ") and m:
                r["host_steps"], r["inside_backward"] = int(m.group(1)), int(m.group(2))
        runs[mode] = r
    return runs


def torch_runs(out):
    runs = []
    for path in sorted(glob.glob(os.path.join(out, "torch_gpt_*.json"))):
        doc = json.load(open(path))
        for mode in doc.get("modes", []):
            runs.append({"precision": doc["config"]["precision"], **{k: v for k, v in mode.items() if k not in ("losses", "step_s")}})
    return runs


def bench_records(out):
    records = []
    for path in sorted(glob.glob(os.path.join(out, "bench_*_cuda.json"))):
        doc = json.load(open(path))
        records.extend(r for r in doc if isinstance(r, dict) and "name" in r and "gbs" in r)
    return records


def main():
    out = sys.argv[1]
    results = {"trainer": trainer_runs(out), "torch": torch_runs(out), "bench": bench_records(out),
               "overlap": overlap_runs(out)}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)

    mib = lambda b: f"{b / 2**20:.0f}" if isinstance(b, (int, float)) else "-"
    print("\ntrain_gpt --device cuda (median tokens/s after 2 warm-up steps) beside PyTorch on the same shape")
    print(f"{'run':<22} {'tokens/s':>10} {'vs torch':>9} {'budget MiB':>11} {'peak MiB':>9} {'moved MiB/step':>15} {'stall ms':>9} {'steps dev/host':>15} {'loss':>16}")
    torch_by = {(t["precision"], t.get("mode")): t for t in results["torch"] if t.get("status") == "ok"}
    for r in results["trainer"]:
        if "tokens_per_s" not in r:
            print(f"{'chunkstar ' + r['precision'] + ' ' + str(r['budget_percent']) + '%':<22} (no steps: see {r['log']})")
            continue
        base = torch_by.get((r["precision"], "device"))
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        print(f"{'chunkstar ' + r['precision'] + ' ' + str(r['budget_percent']) + '%':<22} {r['tokens_per_s']:>10.0f} {ratio:>9} "
              f"{mib(r.get('device_budget_bytes')):>11} {mib(r.get('peak_device_bytes')):>9} {mib(r['moved_bytes_per_step']):>15} "
              f"{r['stall_ms_per_step']:>9.1f} {str(r.get('device_steps', '-')) + '/' + str(r.get('host_steps', '-')):>15} "
              f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}")
    for t in results["torch"]:
        if t.get("status") == "ok":
            print(f"{'torch ' + t['precision'] + ' ' + t['mode']:<22} {t['tokens_per_s']:>10.0f} {'1.00x' if t['mode'] == 'device' else '-':>9} "
                  f"{'-':>11} {mib(t.get('peak_gpu_bytes')):>9} {'-':>15} {'-':>9} {'-':>15} {t['first_loss']:.3f} -> {t['last_loss']:.3f}")
        else:
            print(f"{'torch ' + t['precision'] + ' ' + t.get('mode', '?'):<22} {t.get('status')}: {t.get('reason', '')}")
    ov = results["overlap"]
    if "tokens_per_s" in ov.get("on", {}) and "tokens_per_s" in ov.get("off", {}):
        on, off = ov["on"], ov["off"]
        print("\nThe optimizer step inside backward (fp32, 10%% budget, --clip 0): on %.0f tokens/s (%s of %s host "
              "chunk steps inside backward), off %.0f: on/off %.2f; losses %s"
              % (on["tokens_per_s"], on.get("inside_backward", "?"), on.get("host_steps", "?"), off["tokens_per_s"],
                 on["tokens_per_s"] / off["tokens_per_s"], "the same" if on["losses"] == off["losses"] else "DIFFER"))
        for ahead in ("0", "2"):
            r = ov.get("on_ahead" + ahead, {})
            if "tokens_per_s" in r:
                print("  --scopes-ahead %s (default 1): %.0f tokens/s, %.2f of the default's; losses %s"
                      % (ahead, r["tokens_per_s"], r["tokens_per_s"] / on["tokens_per_s"],
                         "the same" if r["losses"] == off["losses"] else "DIFFER"))
    if results["bench"]:
        print("\nGPU benchmark (bench_gpu_cuda): achieved against the limit measured in the same run")
        print(f"{'name':<18} {'GB/s':>9} {'limit GB/s':>11} {'ratio':>7}  limit")
        for b in results["bench"]:
            lim = b.get("limit_gbs")
            ratio = b.get("ratio")
            print(f"{b['name']:<18} {b['gbs']:>9.1f} {lim if lim is None else round(lim, 1)!s:>11} "
                  f"{'-' if ratio is None else f'{ratio:.3f}':>7}  {b.get('limit_name', '')}")


if __name__ == "__main__":
    main()
