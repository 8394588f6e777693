#!/usr/bin/env bash
# Builds the GPU run's binaries here, for a GPU machine that has no cargo and no network:
#
#   scripts/gpu_pack.sh [DIR]        # default .gpu (ignored by git); then, on the GPU machine,
#   tar -C DIR -xJf DIR/bin.tar.xz && BIN_DIR=DIR/bin scripts/gpu_check.sh
#   BINS="devices generate" scripts/gpu_pack.sh .gpu-small    # some of them only
#   BINS="lib devices" scripts/gpu_pack.sh .gpu    # `lib`: the library's unit tests (candle_attention)
#
# `--features cuda` with nvcc from PyPI's CUDA 13.0 wheels (as scripts/check_backends.sh),
# CUDA_COMPUTE_CAP 90 (H100 / H200) unless set. Packs BINS (default: the tests of
# tests/devices.rs and the examples attention_dump, bench and generate), stripped, into
# DIR/bin.tar.xz, with the source directory they were built in (`manifest_dir`: the tests
# find their fixtures there; gpu_check.sh links it to the checkout). The binaries share most
# of their bytes (candle's kernels), which one xz stream with a large window stores once:
# 4 of them ~11 MiB (the 512 MiB window needs ~5.5 GiB of memory to compress). Nothing here
# needs a GPU or CUDA's libraries (see the link stubs below).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.gpu}"
cache="${CANDLE_ATTENTION_CACHE:-$HOME/.cache/candle-attention}"
# shellcheck source=scripts/cuda_wheels.sh
. scripts/cuda_wheels.sh
cuda_from_pypi "$cache"
cu="$CUDA_ROOT"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$cache/target-cuda}"

# candle links cudarc's libraries at build time (its `dynamic-linking`); PyPI's nvcc wheels
# hold none but cudart. Stubs with the real libraries' names (sonames) and every function
# cudarc declares stand in for the link; the GPU machine loads the real ones by those names.
src=$(cargo metadata --format-version 1 --features cuda | python3 -c '
import json, sys
print(next(p["manifest_path"] for p in json.load(sys.stdin)["packages"] if p["name"] == "cudarc").rsplit("/", 1)[0])')
stubs="$cache/cuda-link-stubs/$(basename "$src")" # one set per cudarc version
if [ ! -e "$stubs/.done" ]; then
  mkdir -p "$stubs"
  for spec in driver:cuda:1 cublas:cublas:13 cublaslt:cublasLt:13 curand:curand:10 \
    nvrtc:nvrtc:13; do
    IFS=: read -r module lib major <<<"$spec"
    grep -ho 'pub unsafe fn [A-Za-z0-9_]*' "$src/src/$module/sys/mod.rs" | sort -u |
      awk '{ print "void " $4 "(void) {}" }' >"$stubs/$lib.c"
    cc -shared -fPIC -Wl,-soname,"lib$lib.so.$major" -o "$stubs/lib$lib.so" "$stubs/$lib.c"
  done
  # candle-kernels' own CUDA code needs cudart's internals: the real library from the wheel.
  ln -sf "$cu/lib/libcudart.so.13" "$stubs/libcudart.so"
  touch "$stubs/.done"
fi
export LIBRARY_PATH="$stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"

build=(--release --features cuda)
tests=() examples=()
for b in ${BINS:-devices attention_dump bench generate}; do
  if [ "$b" = lib ]; then
    tests+=(--lib)
  elif [ -f "tests/$b.rs" ]; then
    tests+=(--test "$b")
  else
    examples+=(--example "$b")
  fi
done
# The executables' paths, from cargo's own report (tests as `cargo test` builds them,
# examples as `cargo build` does); a failed build stops the script here.
report="$(mktemp)"
trap 'rm -f "$report"' EXIT
if [ ${#tests[@]} -gt 0 ]; then
  cargo test "${build[@]}" "${tests[@]}" --no-run --message-format=json >>"$report"
fi
if [ ${#examples[@]} -gt 0 ]; then
  cargo build "${build[@]}" "${examples[@]}" --message-format=json >>"$report"
fi
exes=$(python3 -c '
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])' "$report")

rm -rf "$out/bin" && mkdir -p "$out/bin"
while read -r name exe; do cp "$exe" "$out/bin/$name"; done <<<"$exes"
strip "$out"/bin/*
pwd >"$out/bin/manifest_dir"
tar -C "$out" -cf - bin | xz -T1 --lzma2=preset=6,dict=512MiB >"$out/bin.tar.xz"
rm -rf "$out/bin"
ls -l "$out/bin.tar.xz"
