#!/usr/bin/env bash
# How far `--int8-activations` (8-bit activations, llama.cpp's precision) keeps to the exact
# greedy ids: for each GGUF file and prompt, 24 greedy tokens (EOS ignored) exact and 8-bit,
# and the number of leading ids the 8-bit run shares with the exact one. The short prompts
# run on the 8-bit row kernels alone; the longer ones (over 24 tokens) go through the 8-bit
# prompt product (AVX-512 VNNI). Beside ours, llama.cpp's own greedy ids on the same prompt ids,
# counted the same way, where llama-cpp-python is installed (PYTHON=...).
#
#   benches/int8_agreement.sh [FILE.gguf ...]     (default: models/SmolLM2-135M-Instruct.*.gguf)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export RAYON_NUM_THREADS="${THREADS:-2}"
files=("$@")
if [ ${#files[@]} -eq 0 ]; then
  shopt -s nullglob
  files=(models/SmolLM2-135M-Instruct.*.gguf)
fi
[ ${#files[@]} -gt 0 ] || { echo "no .gguf files (scripts/fetch_smollm2_gguf.sh fetches one)" >&2; exit 2; }
cargo build --release --example generate >&2
BIN="${CARGO_TARGET_DIR:-target}/release/examples/generate"
have_llama=0
"$PY" -c 'import llama_cpp, numpy' 2>/dev/null && have_llama=1
short=("The capital of France is" "Once upon a time" "def fibonacci(n):" "The meaning of life is" "Water boils at")
long=("The history of the Roman Empire is long and complicated, and historians still argue about why it fell. Some blame the economy, others the army, and others the sheer size of the empire."
  "Write a short poem about the ocean at night, with the moon shining on the waves and a lonely lighthouse keeper watching the ships pass by in the dark."
  "def quicksort(arr):
    if len(arr) <= 1:
        return arr
    pivot = arr[len(arr) // 2]
    left = [x for x in arr if x < pivot]"
  "Photosynthesis is the process by which green plants and some other organisms use sunlight to make their food. In this process, carbon dioxide and water are turned into"
  "In a small village at the foot of the mountains, there lived an old man who had a very unusual hobby. Every morning, before the sun came up, he would")
field() { python3 -c "import json, sys; print(json.load(sys.stdin)['$1'])"; }
leading() { python3 -c "a, b = $1, $2; print(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)))"; }
printf '| file | prompts | ours --int8-activations | llama.cpp |\n|---|---|---|---|\n'
for f in "${files[@]}"; do
  for set in short long; do
    declare -n prompts="$set"
    ours=""; peer=" -"; lengths=""
    for p in "${prompts[@]}"; do
      exact="$("$BIN" --model "$f" --prompt "$p" --max-new-tokens 24 --ignore-eos --format json)"
      ids="$(echo "$exact" | field generated_ids)"
      lengths="$lengths $(echo "$exact" | field prompt_ids | python3 -c 'import ast, sys; print(len(ast.literal_eval(sys.stdin.read())))')"
      int8="$("$BIN" --model "$f" --prompt "$p" --max-new-tokens 24 --ignore-eos --format json --int8-activations | field generated_ids)"
      ours="$ours $(leading "$ids" "$int8")"
      if [ "$have_llama" = 1 ]; then
        [ "$peer" = " -" ] && peer=""
        theirs="$("$PY" benches/llamacpp_greedy.py "$f" "$(echo "$exact" | field prompt_ids)" 24 "$RAYON_NUM_THREADS" 2>/dev/null)"
        peer="$peer $(leading "$ids" "$theirs")"
      fi
    done
    span="$(echo $lengths | tr ' ' '\n' | sort -n | sed -n '1p;$p' | paste -sd-)"
    printf '| %s | %s (%s tokens) | %s | %s |\n' "$(basename "$f")" "$set" "$span" "${ours# }" "${peer# }"
  done
done
