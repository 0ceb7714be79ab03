#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Run on the development machine before a GPU check: copies the headers the GPU machine's image
# lacks (doctest, CLI11) into build/deps, which the device run carries (`carry: ["build/deps"]`).
# The GPT's CPU kernels need no BLAS there (their built-in GEMM); nothing else is needed.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
deps=$repo/build/deps
mkdir -p "$deps/doctest"
cp /usr/include/doctest/doctest.h "$deps/doctest/doctest.h"
rm -rf "$deps/CLI" && cp -r /usr/include/CLI "$deps/CLI"
du -sh "$deps"
