#!/usr/bin/env bash
# One training step (forward + backward to the input and every parameter, no optimizer
# update) of candle-attention against PyTorch, side by side, one table with ratios.
#
#   benches/train_step.sh                 # the three shapes of issue 21, 3 rounds each
#   ROUNDS=5 THREADS=2 PYTHON=.venv/bin/python benches/train_step.sh
#   MALLOC=tuned benches/train_step.sh    # both processes with glibc's heap kept (see below)
#
# Ours: examples/bench.rs --train (a fresh layer on a VarMap in nn.MultiheadAttention's
# layout, x a variable); PyTorch: benches/compare_pytorch.py --train (nn.MultiheadAttention
# in train mode, need_weights=False). Each cell is its own process (peak RSS per tool; the
# PyTorch figure includes the torch runtime, ~300 MiB). The tools alternate ROUNDS times per
# shape and each keeps its fastest median (neighbours on a shared VM slow whole runs down).
# MALLOC=tuned sets GLIBC_TUNABLES for both tools so that glibc keeps freed memory instead of
# handing it back to the system (mmap and trim thresholds at 2-4 GB): candle allocates every
# tensor afresh, and re-faulting that memory costs a small VM as much as the arithmetic.
# Needs: pip install torch (PyTorch's side).
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS="${THREADS:-2}"
ROUNDS="${ROUNDS:-3}"
PY="${PYTHON:-python3}"
export RAYON_NUM_THREADS="$THREADS" OMP_NUM_THREADS="$THREADS" MKL_NUM_THREADS="$THREADS"
if [[ "${MALLOC:-default}" == tuned ]]; then
  export GLIBC_TUNABLES=glibc.malloc.mmap_threshold=2000000000:glibc.malloc.trim_threshold=4000000000
fi

cargo build --release --example bench >&2
BENCH="${CARGO_TARGET_DIR:-target}/release/examples/bench"
OUT="$(mktemp)"
trap 'rm -f "$OUT"' EXIT
echo "load average (1 min) before: $(cut -d' ' -f1 /proc/loadavg); rounds: $ROUNDS; malloc: ${MALLOC:-default}" >&2

SHAPES=(
  "--batch 8 --seq 128 --hidden 768 --heads 12"
  "--batch 1 --seq 512 --hidden 768 --heads 12"
  "--batch 1 --seq 4096 --hidden 512 --heads 8"
  "--batch 1 --seq 4096 --hidden 512 --heads 8 --core"
)
for shape in "${SHAPES[@]}"; do
  read -r -a flags <<<"$shape"
  for ((r = 0; r < ROUNDS; r++)); do
    echo "ours $("$BENCH" "${flags[@]}" --train --json)" >>"$OUT"
    echo "torch $("$PY" benches/compare_pytorch.py "${flags[@]}" --train --threads "$THREADS" --json)" >>"$OUT"
  done
done

"$PY" - "$OUT" <<'EOF'
import json, sys
best = {}
for line in open(sys.argv[1]):
    tool, _, js = line.partition(" ")
    r = json.loads(js)
    key = (r["batch"], r["seq"], r["hidden"], r["heads"], r["core"])
    cur = best.setdefault(key, {}).get(tool)
    if cur is None or r["median_ms"] < cur["median_ms"]:
        best[key][tool] = r
print(f"{'shape (batch, seq, hidden, heads)':<38} {'ours ms':>9} {'torch ms':>9} {'speed-up':>9} "
      f"{'ours MiB':>9} {'torch MiB':>10}")
for key, tools in best.items():
    o, t = tools["ours"], tools["torch"]
    what = f"{key[:4]}" + (" attention only" if key[4] else " MHA")
    print(f"{what:<38} {o['median_ms']:>9.1f} {t['median_ms']:>9.1f} {t['median_ms'] / o['median_ms']:>8.2f}x "
          f"{o['peak_rss_mb']:>9.0f} {t['peak_rss_mb']:>10.0f}")
torch = next(iter(best.values()))["torch"].get("torch", "?")
threads = next(iter(best.values()))["ours"]["threads"]
print(f"speed-up = PyTorch's time / ours (> 1: ours faster); torch {torch}, {threads} threads")
EOF
echo "load average (1 min) after: $(cut -d' ' -f1 /proc/loadavg)" >&2
