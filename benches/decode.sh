#!/usr/bin/env bash
# Decode and prefill speed of examples/generate.rs against transformers' generate, side by
# side, 2 threads each, on a LLaMA-family model directory (default models/smollm2, made by
# scripts/fetch_smollm2.sh).
#
#   benches/decode.sh [MODEL_DIR]          ROUNDS=3 DTYPES="f32 f16 bf16" PYTHON=python3
#
# Decode: 64 new tokens after "The capital of France is", EOS ignored, tokens/s of the
# decode steps (prefill excluded). Prefill: a 512-token prompt. The tools alternate ROUNDS
# times; each keeps its best. The limit: a decode step reads every weight once, so the
# machine's read bandwidth (examples/bench.rs --bandwidth, measured first with the same
# threads) over the weights' bytes bounds tokens/s; ours is shown as a share of that bound.
# Needs: pip install torch transformers (the peer's side).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${1:-models/smollm2}"
THREADS="${THREADS:-2}"
ROUNDS="${ROUNDS:-3}"
PY="${PYTHON:-python3}"
DTYPES="${DTYPES:-f32}"
export RAYON_NUM_THREADS="$THREADS" OMP_NUM_THREADS="$THREADS"
cargo build --release --example generate --example bench >&2
GEN="${CARGO_TARGET_DIR:-target}/release/examples/generate"
BW="$("${CARGO_TARGET_DIR:-target}/release/examples/bench" --bandwidth --json |
  "$PY" -c 'import json, sys; print(json.load(sys.stdin)["read_bandwidth_gb_s"])')"
F32_BYTES="$(stat -c %s "$MODEL/model.safetensors")"
echo "read bandwidth ($THREADS threads): $BW GB/s; f32 weights: $F32_BYTES bytes" >&2
IDS="$(seq -s, 1 512)"
printf '%-6s %-22s %14s %16s %18s\n' dtype tool "decode tok/s" "prefill 512 ms" "bandwidth bound"
for dtype in $DTYPES; do
  best_ours=0; best_pre=999999; best_hf=0; best_hf_pre=999999
  for ((r = 0; r < ROUNDS; r++)); do
    ours="$("$GEN" --model "$MODEL" --prompt "The capital of France is" --max-new-tokens 65 \
      --ignore-eos --format json --dtype "$dtype")"
    pre="$("$GEN" --model "$MODEL" --prompt-ids "$IDS" --max-new-tokens 1 --format json --dtype "$dtype")"
    hf="$("$PY" benches/hf_generate.py "$MODEL" "$dtype" --threads "$THREADS" 2>/dev/null | tail -1)"
    read -r a b c d < <("$PY" -c '
import json, sys
o, p, h = (json.loads(x) for x in sys.argv[1:4])
print(o["decode_tokens_per_s"], p["prefill_ms"], h["decode_tokens_per_s"], h["prefill_512_ms"])' "$ours" "$pre" "$hf")
    best_ours=$("$PY" -c "print(max($best_ours, $a))"); best_pre=$("$PY" -c "print(min($best_pre, $b))")
    best_hf=$("$PY" -c "print(max($best_hf, $c))"); best_hf_pre=$("$PY" -c "print(min($best_hf_pre, $d))")
  done
  bytes=$F32_BYTES
  [[ "$dtype" != f32 ]] && bytes=$((F32_BYTES / 2))
  bound=$("$PY" -c "print(f'{$BW * 1e9 / $bytes:.1f} tok/s, ours {100 * $best_ours / ($BW * 1e9 / $bytes):.0f}%')")
  printf '%-6s %-22s %14.1f %16.0f %18s\n' "$dtype" "candle-attention" "$best_ours" "$best_pre" "$bound"
  printf '%-6s %-22s %14.1f %16.0f\n' "$dtype" "transformers generate" "$best_hf" "$best_hf_pre"
done
