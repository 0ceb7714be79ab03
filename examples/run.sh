#!/usr/bin/env bash
# THE main-job command: bash examples/run.sh [example arguments...]
#
# Installs missing Debian packages (cmake/install_deps.sh), configures a Release build of the
# examples only (no tests, no benchmarks) in build/examples (or $CHUNKSTAR_BUILD_ROOT/examples),
# builds the main example in parallel and runs it, passing it any arguments given here.
# The main example is examples/quickstart: chunk layout, memory spaces and the copy engine on a
# simulated device (no GPU needed).
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
main_target=quickstart
cmake --build "$build" --parallel "$(nproc)" --target "$main_target"

echo "=== examples/quickstart"
"$build/examples/quickstart/$main_target" "$@"
