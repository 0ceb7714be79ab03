# SPDX-License-Identifier: Apache-2.0
# shellcheck shell=bash
# Sourced by tests/run.sh and examples/run.sh: installs the Debian packages chunkstar's build,
# tests and examples need, but only those missing (dpkg -s first), so a prepared machine never
# touches the network. The CUDA toolkit is not a Debian package here: it is used when found.

CHUNKSTAR_DEBIAN_PACKAGES=(
  cmake ninja-build g++ clang git pkg-config ccache python3
  doctest-dev nlohmann-json3-dev libcli11-dev
  libopenmpi-dev openmpi-bin libopenblas-dev gnuplot-nox liburing-dev
)

# chunkstar_install_deps [package...]: defaults to CHUNKSTAR_DEBIAN_PACKAGES.
chunkstar_install_deps() {
  local pkgs=("$@")
  ((${#pkgs[@]})) || pkgs=("${CHUNKSTAR_DEBIAN_PACKAGES[@]}")
  local missing=()
  local p
  for p in "${pkgs[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  if ((${#missing[@]} == 0)); then
    echo "deps: all ${#pkgs[@]} Debian packages present"
    return 0
  fi
  echo "deps: installing ${missing[*]}"
  local sudo=()
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null 2>&1 || {
      echo "deps: missing packages (${missing[*]}) and not root; install them or run as root" >&2
      return 1
    }
    sudo=(sudo)
  fi
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
}

# mpirun refuses to start as root unless told; containers and CI often run as root.
chunkstar_mpi_env() {
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  # Oversubscription: CI machines have fewer cores than some tests have ranks.
  export OMPI_MCA_rmaps_base_oversubscribe=1
}

# The CUDA toolkit usually lives outside PATH; expose nvcc when it is installed in the usual place.
chunkstar_cuda_path() {
  if ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  fi
}
