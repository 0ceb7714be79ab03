#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Counts what a ctest selection runs: CTest tests, and doctest cases (each doctest command asked
for its --count with the same filters; a script test counts as one case).
usage: count_cases.py <build dir> [ctest selection args...]   e.g. count_cases.py build/tests-main -LE slow
Prints one line: '<tests> CTest tests, <cases> test cases (<cuda> of them need a GPU)'."""
import json, os, re, subprocess, sys

build, args = sys.argv[1], sys.argv[2:]
info = json.loads(subprocess.run(['ctest', '--show-only=json-v1', *args], cwd=build, capture_output=True, text=True,
                                 check=True).stdout)
tests = cases = cuda = 0
for t in info.get('tests', []):
    cmd = t.get('command') or []
    labels = next((p['value'] for p in t.get('properties', []) if p['name'] == 'LABELS'), [])
    tests += 1
    # the doctest program: the first argument that is an executable named test_* (after mpiexec and its flags)
    k = next((i for i, a in enumerate(cmd) if os.path.basename(a).startswith('test_') and os.access(a, os.X_OK)), None)
    n = 1
    if k is not None:
        env = dict(os.environ)
        for p in t.get('properties', []):
            if p['name'] == 'ENVIRONMENT':
                env.update(v.split('=', 1) for v in p['value'] if '=' in v)
        out = subprocess.run([cmd[k], *cmd[k + 1:], '--count'], cwd=build, env=env, capture_output=True, text=True).stdout
        m = re.search(r'test cases passing the current filters: (\d+)', out)
        if m:
            n = int(m.group(1))
    cases += n
    if 'cuda' in labels:
        cuda += n
print(f'{tests} CTest tests, {cases} test cases ({cuda} of them need a GPU)')
