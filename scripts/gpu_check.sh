#!/usr/bin/env bash
# One command for a GPU run, on a machine with an NVIDIA GPU and its driver:
#
#   scripts/gpu_check.sh            # build, tests on the GPU, the attention benchmark table
#   SKIP_BENCH=1 scripts/gpu_check.sh
#   SKIP_FLASH=1 scripts/gpu_check.sh   # do not try `--features flash-attn`
#   PYTHON=python3 ITERS=50 scripts/gpu_check.sh
#   BIN_DIR=.gpu/bin scripts/gpu_check.sh   # binaries from scripts/gpu_pack.sh: no cargo here
#   TEST_ARGS="--skip encoder" scripts/gpu_check.sh    # passed to the test binaries
#
# With BIN_DIR (a GPU machine without cargo or network: build and pack elsewhere with
# scripts/gpu_pack.sh, unpack here), steps 1 and 2 are skipped and the binaries in BIN_DIR
# run instead of cargo's, each step whose binary is there; the directory they were built in
# is linked to this checkout, where the tests look for their fixtures.
#
# 1. The CUDA toolkit: `nvcc` on PATH (or under $CUDA_HOME / /usr/local/cuda), else PyPI's
#    CUDA 13.0 wheels as scripts/check_backends.sh installs them (needs PyPI);
#    CUDA_COMPUTE_CAP from nvidia-smi unless set.
# 2. `cargo build --features cuda`, then `--features flash-attn` when it builds (its build
#    script compiles the kernels with nvcc and clones CUTLASS from GitHub; without network
#    it fails and the run goes on with `cuda` alone, saying so).
# 3. tests/devices.rs (golden against the PyTorch fixtures, invariants and gradients on
#    `cuda`, f32 / f16 / bf16; the shipped encoder, the explanations and the tiny GGUF
#    decoders against their fixtures there) and the golden tests (tests/golden.rs,
#    tests/encoder_golden.rs, CPU ones built with the GPU feature); then the main job on
#    `--device cuda`.
# 4. The GGUF path on the GPU: a tiny Q4_1 decoder (tests/fixtures/gguf) through `generate`
#    on the CPU and on `cuda`, exact and with --int8-activations (candle's quantized
#    kernels): the ids of each, which the exact ones must share with the CPU's.
# 5. The attention alone (`bench --core`) against PyTorch's
#    `torch.nn.functional.scaled_dot_product_attention` on the same GPU, f16, batch 1,
#    16 heads of 64, seq 1024 and 4096, plain and causal: one table, ratios torch/ours.
#    PyTorch with CUDA must be importable by $PYTHON (default python3); without it the
#    table has our column only.
#
# Exit status: non-zero when a build or a test fails (the benchmark never fails the run).
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
cache="${CANDLE_ATTENTION_CACHE:-$HOME/.cache/candle-attention}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$cache/target-gpu}"

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU here (nvidia-smi finds none); nothing to run" >&2
  exit 2
fi
echo "== GPU"
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader

# The binaries load CUDA's libraries by name: where the loader does not know one (PyPI's
# wheels beside PyTorch, a driver or toolkit outside ldconfig's paths), point it there.
# (Not a toolkit's `compat/` libcuda: the driver's own must win.)
known="$(ldconfig -p 2>/dev/null || true)"
for lib in libcuda.so.1 libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 \
  libnvrtc.so.13; do
  if ! grep -qF "$lib" <<<"$known"; then
    at=$( (find /usr/local /opt /usr/lib -name "$lib" -not -path '*/compat/*' 2>/dev/null || true) |
      head -n 1)
    if [ -n "$at" ]; then LD_LIBRARY_PATH="$(dirname "$at")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
  fi
done
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

status=0
if [ -n "${BIN_DIR:-}" ]; then
  BIN_DIR="$(cd "$BIN_DIR" && pwd)"
  built_in="$(cat "$BIN_DIR/manifest_dir")"
  if [ "$built_in" != "$PWD" ] && [ ! -e "$built_in" ]; then
    mkdir -p "$(dirname "$built_in")" && ln -s "$PWD" "$built_in"
  fi
  feature="cuda (prebuilt in $BIN_DIR)"
  if [ -x "$BIN_DIR/devices" ]; then
    echo "== tests on the GPU (prebuilt: tests/devices.rs)"
    # shellcheck disable=SC2086
    "$BIN_DIR/devices" --nocapture ${TEST_ARGS:-} 2>&1 || status=1
  fi
  run_example() {
    if [ -x "$BIN_DIR/$1" ]; then "$BIN_DIR/$1" "${@:2}"; else echo "($1 not in $BIN_DIR)" >&2; fi
  }
  BENCH="$BIN_DIR/bench"
else

# --- the CUDA toolkit -------------------------------------------------------------------
if ! command -v nvcc >/dev/null; then
  for d in "${CUDA_HOME:-}" /usr/local/cuda; do
    if [ -n "$d" ] && [ -x "$d/bin/nvcc" ]; then
      export PATH="$d/bin:$PATH"
      break
    fi
  done
fi
if ! command -v nvcc >/dev/null; then
  # shellcheck source=scripts/cuda_wheels.sh
  . scripts/cuda_wheels.sh
  cuda_from_pypi "$cache" "$PY"
fi
nvcc --version | tail -2
if [ -z "${CUDA_COMPUTE_CAP:-}" ]; then
  CUDA_COMPUTE_CAP="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d '.')"
fi
export CUDA_COMPUTE_CAP
echo "CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP"

# --- builds ------------------------------------------------------------------------------
feature=cuda
echo "== cargo build --release --features cuda --examples --tests"
cargo build --release --features cuda --examples --tests
if [ "${SKIP_FLASH:-0}" != 1 ]; then
  echo "== cargo build --release --features flash-attn --examples --tests"
  if cargo build --release --features flash-attn --examples --tests; then
    feature=flash-attn
  else
    echo "!!! flash-attn did not build (see above); going on with --features cuda"
  fi
fi
echo "== feature used below: $feature"

# --- tests on the GPU ----------------------------------------------------------------------
echo "== cargo test --release --features $feature --test devices --test golden --test encoder_golden"
# shellcheck disable=SC2086
cargo test --release --features "$feature" --test devices --test golden --test encoder_golden \
  -- --nocapture ${TEST_ARGS:-} || status=1
run_example() { cargo run --release --quiet --features "$feature" --example "$1" -- "${@:2}"; }
BENCH="$CARGO_TARGET_DIR/release/examples/bench"
fi
has() { [ -z "${BIN_DIR:-}" ] || [ -x "$BIN_DIR/$1" ]; }
if has attention_dump; then
  echo "== the main job on the GPU"
  run_example attention_dump --device cuda \
    "The animal didn't cross the street because it was too tired." || status=1
fi

if has generate; then
  echo "== a GGUF decoder on the GPU (tests/fixtures/gguf/llama_gqa.q4_1.gguf)"
  gguf=(--model tests/fixtures/gguf/llama_gqa.q4_1.gguf --prompt-ids 1,5,9,14,3
    --max-new-tokens 16 --ignore-eos --format json)
  ids() { "$PY" -c "import json, sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])['generated_ids'])"; }
  cpu_ids="$(run_example generate "${gguf[@]}" | ids)" || status=1
  cuda_ids="$(run_example generate "${gguf[@]}" --device cuda | ids)" || status=1
  int8_ids="$(run_example generate "${gguf[@]}" --device cuda --int8-activations | ids)" || status=1
  echo "cpu exact:  $cpu_ids"
  echo "cuda exact: $cuda_ids"
  echo "cuda int8:  $int8_ids"
  if [ -z "$cpu_ids" ] || [ "$cpu_ids" != "$cuda_ids" ]; then
    echo "!!! the exact ids on cuda differ from the CPU's"
    status=1
  fi
fi

# --- the attention against PyTorch's SDPA ----------------------------------------------------
if [ "${SKIP_BENCH:-0}" != 1 ] && has bench; then
  ITER_ARGS=()
  if [ -n "${ITERS:-}" ]; then ITER_ARGS=(--iters "$ITERS"); fi
  have_torch=0
  if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    have_torch=1
  else
    echo "(PyTorch with CUDA is not importable by $PY: our column only)" >&2
  fi
  field() { "$PY" -c "import json, sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])['$1'])"; }
  echo
  echo "attention alone, f16, batch 1, 16 heads x 64, $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1), build --features $feature"
  echo "| seq | mask | ours ms | ours TFLOP/s | torch SDPA ms | torch / ours |"
  echo "|---|---|---|---|---|---|"
  for seq in 1024 4096; do
    for causal in "" --causal; do
      args=(--batch 1 --seq "$seq" --hidden 1024 --heads 16 --core --dtype f16 --device cuda --json)
      if [ -n "$causal" ]; then args+=("$causal"); fi
      args+=("${ITER_ARGS[@]}")
      ours="$("$BENCH" "${args[@]}" 2>/dev/null || true)"
      ours_ms="$(echo "$ours" | field median_ms 2>/dev/null || echo error)"
      ours_tf="$(echo "$ours" | field gflops 2>/dev/null | awk '{printf "%.1f", $1 / 1000}' || echo -)"
      torch_ms=-
      ratio=-
      if [ "$have_torch" = 1 ]; then
        theirs="$("$PY" benches/compare_pytorch.py "${args[@]}" 2>/dev/null || true)"
        torch_ms="$(echo "$theirs" | field median_ms 2>/dev/null || echo error)"
        ratio="$(awk -v a="$torch_ms" -v b="$ours_ms" 'BEGIN { if (a + 0 > 0 && b + 0 > 0) printf "%.2f", a / b; else print "-" }')"
      fi
      label=none
      if [ -n "$causal" ]; then label=causal; fi
      echo "| $seq | $label | $ours_ms | $ours_tf | $torch_ms | $ratio |"
    done
  done
fi
exit $status
