#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# THE main-job command: bash examples/run.sh [example arguments...]
#
# Installs missing Debian packages (cmake/install_deps.sh), configures a Release build of the
# examples only (no tests, no benchmarks) in build/examples (or $CHUNKSTAR_BUILD_ROOT/examples),
# builds the main example in parallel and runs it, passing it any arguments given here.
# The main example is examples/gpt's train_gpt: a byte-level GPT trained on the CPU backend with a
# simulated device smaller than its model data, on the embedded corpus (no GPU, no download).
# `bash examples/run.sh --help` lists its options.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=../cmake/install_deps.sh
source "$repo/cmake/install_deps.sh"

chunkstar_install_deps
chunkstar_mpi_env
chunkstar_cuda_path

build=${CHUNKSTAR_BUILD_ROOT:-$repo/build}/examples
cmake -S "$repo" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCHUNKSTAR_BUILD_TESTS=OFF -DCHUNKSTAR_BUILD_BENCHMARKS=OFF -DCHUNKSTAR_BUILD_EXAMPLES=ON \
  -DCHUNKSTAR_VERIFY_HEADERS=OFF -DCHUNKSTAR_BUILD_CUDA_TESTS=OFF

# Only the main example's target: tests/run.sh builds (and so guards) every example.
cmake --build "$build" --parallel "$(nproc)" --target train_gpt

# No flags or environment variables are needed for full speed: the SIMD kernels choose their ISA at
# run time (chunkstar::active_cpu_isa()), and the GEMMs run on the OpenMP threads with a
# single-threaded OpenBLAS (one thread pool), so OMP_WAIT_POLICY no longer matters.
echo "=== examples/gpt/train_gpt $*"
"$build/examples/gpt/train_gpt" "$@"
