#!/usr/bin/env bash
# Time N whole-process runs of benches/python_attention_dump.py (2 threads) and
# print the median wall time.  Usage: benches/time_python_dump.sh ["sentence"] [N]
set -euo pipefail
cd "$(dirname "$0")/.."
DEFAULT_TEXT="The animal didn't cross the street because it was too tired."
TEXT="${1:-$DEFAULT_TEXT}"
N="${2:-5}"
PY="${PYTHON:-python3}"
export OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false
# sanity: one run must produce valid JSON
"$PY" benches/python_attention_dump.py "$TEXT" | "$PY" -c \
  'import json,sys; d=json.load(sys.stdin); print("shape", d["shape"], "tokens", len(d["tokens"]))'
if command -v hyperfine >/dev/null 2>&1; then
  tmp="$(mktemp)"
  hyperfine --warmup 1 --runs "$N" --export-json "$tmp" \
    "$PY benches/python_attention_dump.py $(printf '%q' "$TEXT") > /dev/null"
  "$PY" -c 'import json,sys; r=json.load(open(sys.argv[1]))["results"][0]; print("median wall time: %.3f s (N=%d, mean %.3f s, min %.3f s, max %.3f s)" % (r["median"], len(r["times"]), r["mean"], r["min"], r["max"]))' "$tmp"
  rm -f "$tmp"
else
  times=()
  for _ in $(seq "$N"); do
    s=$(date +%s.%N)
    "$PY" benches/python_attention_dump.py "$TEXT" > /dev/null
    e=$(date +%s.%N)
    times+=("$(echo "$e - $s" | bc)")
  done
  printf '%s\n' "${times[@]}" | sort -g | "$PY" -c \
    'import sys,statistics; t=[float(x) for x in sys.stdin]; print(f"median wall time: {statistics.median(t):.3f} s (N={len(t)})")'
fi
