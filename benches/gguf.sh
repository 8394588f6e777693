#!/usr/bin/env bash
# GGUF models: ours (examples/generate.rs) against llama.cpp (llama-cpp-python, built from
# source with native flags) and candle-transformers' `quantized_llama` / `quantized_gemma3`
# (benches/candle_quantized, built here with -C target-cpu=native; CANDLE=0 skips it) on the
# same files, side by side,
# THREADS threads each, with each file's bandwidth bound.
#
#   benches/gguf.sh [FILE.gguf ...]     (default: models/SmolLM2-135M-Instruct.*.gguf)
#   THREADS=2 ROUNDS=3 PYTHON=python3 INT8=1 (INT8=0: no row for --int8-activations)
#
# Decode: 64 greedy tokens after "The capital of France is", EOS ignored, tokens/s of the
# decode steps. Prefill: a 512-token prompt, tokens/s. Each tool keeps its best of ROUNDS.
# Peak RSS: each process's. The bound: a decode step reads every weight once (the tied
# output head reads the whole embedding), so read bandwidth (examples/bench.rs
# --bandwidth) / the file's bytes bounds tokens/s. The bandwidth is measured again before
# each file's rows (the median of 3 measurements: on a shared VM it moves between minutes)
# and shown in the bound's cell.
# Needs (the peer's side): CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" pip install
# llama-cpp-python==0.3.36; without it, our rows only.
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS="${THREADS:-2}"
ROUNDS="${ROUNDS:-3}"
PY="${PYTHON:-python3}"
export RAYON_NUM_THREADS="$THREADS" OMP_NUM_THREADS="$THREADS"
files=("$@")
if [ ${#files[@]} -eq 0 ]; then
  shopt -s nullglob
  files=(models/SmolLM2-135M-Instruct.*.gguf)
fi
[ ${#files[@]} -gt 0 ] || { echo "no .gguf files (scripts/fetch_smollm2_gguf.sh fetches one)" >&2; exit 2; }
cargo build --release --example generate --example bench >&2
BIN="${CARGO_TARGET_DIR:-target}/release/examples"
# The median of 3 read-bandwidth measurements, GB/s.
bandwidth() {
  for _ in 1 2 3; do
    "$BIN/bench" --bandwidth --json | "$PY" -c 'import json, sys; print(json.load(sys.stdin)["read_bandwidth_gb_s"])'
  done | sort -n | sed -n 2p
}
BW="$(bandwidth)"
echo "read bandwidth ($THREADS threads): $BW GB/s; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)" >&2
have_candle=0
if [ "${CANDLE:-1}" = 1 ]; then
  CANDLE_TARGET="${CANDLE_TARGET:-$HOME/.cache/candle-attention/target-candle-bench}"
  if CARGO_TARGET_DIR="$CANDLE_TARGET" RUSTFLAGS="-C target-cpu=native" \
    cargo build --release --manifest-path benches/candle_quantized/Cargo.toml >&2; then
    have_candle=1
    CANDLE_BIN="$CANDLE_TARGET/release/candle-quantized-bench"
  fi
fi
have_llama=0
"$PY" -c 'import llama_cpp' 2>/dev/null && have_llama=1
IDS="$("$PY" -c 'print(",".join(str(i) for i in ([504, 3575, 282, 4649, 314] * 120)[:512]))')"
field() { "$PY" -c "import json, sys; print(json.loads(sys.stdin.read().strip().splitlines()[0])['$1'])"; }
printf '| file | tool | decode tok/s | prefill-512 tok/s | peak RSS MB | decode / bound |\n|---|---|---|---|---|---|\n'
for f in "${files[@]}"; do
  bytes="$(stat -c %s "$f")"
  BW="$(bandwidth)"
  bound="$(awk -v bw="$BW" -v b="$bytes" 'BEGIN { printf "%.0f", bw * 1e9 / b }') ($BW GB/s)"
  best_dec=0; best_pre=0; rss=0
  for _ in $(seq "$ROUNDS"); do
    dec="$("$BIN/generate" --model "$f" --prompt "The capital of France is" --max-new-tokens 64 --ignore-eos --format json | field decode_tokens_per_s)"
    out="$( { /usr/bin/time -f '%M' "$BIN/generate" --model "$f" --prompt-ids "$IDS" --max-new-tokens 2 --format json; } 2>&1)"
    pre="$(echo "$out" | field prefill_ms | awk '{ printf "%.1f", 512 / ($1 / 1000) }')"
    kb="$(echo "$out" | tail -n 1)"
    best_dec="$(awk -v a="$best_dec" -v b="$dec" 'BEGIN { print (b > a) ? b : a }')"
    best_pre="$(awk -v a="$best_pre" -v b="$pre" 'BEGIN { print (b > a) ? b : a }')"
    rss="$(awk -v a="$rss" -v b="$kb" 'BEGIN { print (b > a) ? b : a }')"
  done
  printf '| %s | ours | %.1f | %.0f | %.0f | %.0f%% of %s |\n' "$(basename "$f")" "$best_dec" "$best_pre" "$(awk -v k="$rss" 'BEGIN { print k / 1024 }')" "$(awk -v d="$best_dec" -v b="$bound" 'BEGIN { print 100 * d / b }')" "$bound"
  if [ "${INT8:-1}" = 1 ]; then
    # The opt-in 8-bit activations (llama.cpp's precision), decode and prefill.
    i8=0; i8_pre=0
    for _ in $(seq "$ROUNDS"); do
      d="$("$BIN/generate" --model "$f" --prompt "The capital of France is" --max-new-tokens 64 --ignore-eos --format json --int8-activations | field decode_tokens_per_s)"
      i8="$(awk -v a="$i8" -v b="$d" 'BEGIN { print (b > a) ? b : a }')"
      p="$("$BIN/generate" --model "$f" --prompt-ids "$IDS" --max-new-tokens 2 --format json --int8-activations | field prefill_ms | awk '{ printf "%.1f", 512 / ($1 / 1000) }')"
      i8_pre="$(awk -v a="$i8_pre" -v b="$p" 'BEGIN { print (b > a) ? b : a }')"
    done
    printf '| %s | ours --int8-activations | %.1f | %.0f | - | %.0f%% of %s |\n' "$(basename "$f")" "$i8" "$i8_pre" "$(awk -v d="$i8" -v b="$bound" 'BEGIN { print 100 * d / b }')" "$bound"
  fi
  if [ "$have_candle" = 1 ]; then
    c_dec=0; c_pre=0; c_rss=0
    for _ in $(seq "$ROUNDS"); do
      d="$("$CANDLE_BIN" "$f" 504,3575,282,4649,314 64 | field decode_tokens_per_s)"
      out="$( { /usr/bin/time -f '%M' "$CANDLE_BIN" "$f" "$IDS" 2; } 2>&1)"
      p="$(echo "$out" | field prefill_tokens_per_s)"
      kb="$(echo "$out" | tail -n 1)"
      c_dec="$(awk -v a="$c_dec" -v b="$d" 'BEGIN { print (b > a) ? b : a }')"
      c_pre="$(awk -v a="$c_pre" -v b="$p" 'BEGIN { print (b > a) ? b : a }')"
      c_rss="$(awk -v a="$c_rss" -v b="$kb" 'BEGIN { print (b > a) ? b : a }')"
    done
    c_tool="$("$CANDLE_BIN" "$f" 504,3575,282,4649,314 2 | field tool)"
    printf '| %s | %s | %.1f | %.0f | %.0f | %.0f%% of %s |\n' "$(basename "$f")" "$c_tool" "$c_dec" "$c_pre" \
      "$(awk -v k="$c_rss" 'BEGIN { print k / 1024 }')" "$(awk -v d="$c_dec" -v b="$bound" 'BEGIN { print 100 * d / b }')" "$bound"
  fi
  if [ "$have_llama" = 1 ]; then
    j="$("$PY" benches/llamacpp_gguf.py "$f" "$THREADS" "$ROUNDS" 2>/dev/null)"
    printf '| %s | %s | %.1f | %.0f | %.0f | %.0f%% of %s |\n' "$(basename "$f")" "$(echo "$j" | field tool)" \
      "$(echo "$j" | field decode_tokens_per_s)" "$(echo "$j" | field prefill_tokens_per_s)" "$(echo "$j" | field peak_rss_mb)" \
      "$(awk -v d="$(echo "$j" | field decode_tokens_per_s)" -v b="$bound" 'BEGIN { print 100 * d / b }')" "$bound"
  fi
done
