#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The public headers' import graph points one way: every `#include <chunkstar/...>` goes to a
folder of a lower layer, or stays in its own folder, and no file includes itself through others.
Forwarding headers (kept at old paths for one release) are skipped. docs/design.md, "Layers",
shows the same table. Usage: check_layers.py [include-dir]; exit 1 naming each bad include."""
import pathlib
import re
import sys

LAYERS = {
    "config_generated.hpp": -1, "config.hpp": 0,
    "core": 1,
    "memory": 2, "comm": 2, "layout": 2, "placement": 2, "eviction": 2, "tracer": 2, "observe": 2,
    "disk": 3, "optim": 3, "mpi": 3, "nccl": 3,
    "store": 4,
    "zero": 5,
    "runtime": 6,
    "rtp": 7, "checkpoint": 7, "cuda": 7,
    "testing": 8,
    "chunkstar.hpp": 9,
}

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent.parent / "include") / "chunkstar"
include = re.compile(r"#include <chunkstar/([^>]+)>")
graph, bad = {}, []
for path in sorted(p for p in root.rglob("*") if p.suffix in {".hpp", ".cuh", ".inc"}):
    text = path.read_text()
    if "Forwarding header" in text:
        continue
    rel = path.relative_to(root).as_posix()
    room = rel.split("/")[0]
    graph[rel] = set()
    for target in include.findall(text):
        there = target.split("/")[0]
        if room not in LAYERS or there not in LAYERS:
            bad.append(f"{rel}: includes {target}: a folder without a layer (add it to LAYERS and docs/design.md)")
        elif there != room and LAYERS[there] >= LAYERS[room]:
            bad.append(f"{rel} (layer {LAYERS[room]}) includes {target} (layer {LAYERS[there]}): includes point down only")
        if target != rel:  # a header that re-includes itself on purpose (an X-macro) is no cycle
            graph[rel].add(target)

state = {}
def visit(node, stack):
    state[node] = 1
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
        if state.get(nxt) == 1:
            bad.append("include cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
        elif nxt in graph and not state.get(nxt):
            visit(nxt, stack)
    stack.pop()
    state[node] = 2
for node in sorted(graph):
    if not state.get(node):
        visit(node, [])

for b in bad:
    print(b)
print(f"check_layers: {len(graph)} headers, {sum(len(v) for v in graph.values())} includes, {len(bad)} problems")
sys.exit(1 if bad else 0)
