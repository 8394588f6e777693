#!/usr/bin/env bash
# Compile checks for the GPU backends on a machine without a GPU.
#
#   scripts/check_backends.sh [cuda] [flash-attn] [metal]      (default: all three)
#
# CUDA: `cargo check --features cuda --all-targets` with nvcc from PyPI's CUDA 13.0 wheels
#       (pinned: unpinned wheels drift to versions cudarc does not know). candle-kernels'
#       build script runs nvcc, so the first check takes 9-27 minutes on 2 cores; the
#       target directory is kept between runs.
# flash-attn: `cargo check --features flash-attn --all-targets` against candle-flash-attn's
#       real Rust API, with its build script stubbed out: that script compiles the kernels
#       with nvcc and clones CUTLASS from GitHub, which this machine cannot reach. So this
#       checks our code against the crate's API, not the CUDA kernels themselves.
# Metal: `cargo check --no-default-features --features metal --target aarch64-apple-darwin
#       --all-targets` (without `hub`, whose TLS crate compiles C for which Linux has no
#       Apple toolchain)
#       (needs `rustup target add aarch64-apple-darwin`; if the target cannot be
#       installed, this script says so loudly and exits non-zero unless
#       ALLOW_MISSING_METAL_TARGET=1). Never --all-features on Linux (objc2 refuses
#       non-Apple targets).
set -euo pipefail
cd "$(dirname "$0")/.."

cache="${CANDLE_ATTENTION_CACHE:-$HOME/.cache/candle-attention}"
what=("$@")
[ ${#what[@]} -eq 0 ] && what=(cuda flash-attn metal)
status=0

# shellcheck source=scripts/cuda_wheels.sh
. scripts/cuda_wheels.sh
cuda_env() {
  cuda_from_pypi "$cache"
  export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
  nvcc --version | tail -2
}

check_cuda() {
  cuda_env
  echo "== cargo check --features cuda --all-targets (CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP)"
  CARGO_TARGET_DIR="$cache/target-cuda" cargo check --release --features cuda --all-targets
}

check_flash_attn() {
  cuda_env
  local version=0.11.1
  local home="${CARGO_HOME:-$HOME/.cargo}"
  local crate
  crate=$(ls "$home"/registry/cache/*/candle-flash-attn-$version.crate 2>/dev/null | head -n 1 || true)
  if [ -z "$crate" ]; then
    cargo fetch --quiet # the lock file pins the optional dependency too
    crate=$(ls "$home"/registry/cache/*/candle-flash-attn-$version.crate | head -n 1)
  fi
  local stub="$cache/candle-flash-attn-$version-nobuild"
  rm -rf "$stub" && mkdir -p "$stub"
  tar -xzf "$crate" -C "$stub" --strip-components=1
  # No build script (it would run nvcc and clone CUTLASS), no build dependencies.
  echo 'fn main() {}' >"$stub/build.rs"
  python3 - "$stub/Cargo.toml" <<'PY'
import re, sys
p = sys.argv[1]
s = open(p).read()
s = re.sub(r"\n\[build-dependencies[^\]]*\][^\[]*", "\n", s)
open(p, "w").write(s)
PY
  echo "== cargo check --features flash-attn --all-targets (candle-flash-attn's build script stubbed)"
  cp Cargo.lock "$cache/Cargo.lock.before-flash-check"
  local rc=0
  CARGO_TARGET_DIR="$cache/target-cuda" cargo check --release --features flash-attn --all-targets \
    --config "patch.crates-io.candle-flash-attn.path=\"$stub\"" || rc=$?
  cp "$cache/Cargo.lock.before-flash-check" Cargo.lock
  return $rc
}

check_metal() {
  local target=aarch64-apple-darwin
  if ! rustup target list --installed 2>/dev/null | grep -qx "$target"; then
    echo "== rustup target add $target"
    if ! rustup target add "$target"; then
      echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
      echo "!!! METAL NOT CHECKED: the Rust target $target cannot be installed here"
      echo "!!! (rustup needs the Rust distribution server). The metal feature was NOT"
      echo "!!! compile-checked on this machine."
      echo "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
      [ "${ALLOW_MISSING_METAL_TARGET:-0}" = 1 ] && return 0
      return 1
    fi
  fi
  # Without the default `hub` feature: its TLS stack (ring) compiles C code, which needs an
  # Apple C toolchain that Linux lacks; `hub` is platform-independent Rust and is checked
  # by every Linux build.
  echo "== cargo check --no-default-features --features metal --target $target --all-targets"
  CARGO_TARGET_DIR="$cache/target-metal" cargo check --release --no-default-features --features metal \
    --target "$target" --all-targets
}

for w in "${what[@]}"; do
  case "$w" in
    cuda) check_cuda || status=1 ;;
    flash-attn) check_flash_attn || status=1 ;;
    metal) check_metal || status=1 ;;
    *) echo "unknown backend $w (cuda|flash-attn|metal)" >&2; exit 2 ;;
  esac
done
exit $status
