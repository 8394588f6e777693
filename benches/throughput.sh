#!/usr/bin/env bash
# Fused-path throughput against the machine's matrix multiply, alternating in one run.
#
#   benches/throughput.sh              # 5 rounds
#   ROUNDS=12 THREADS=2 benches/throughput.sh
#
# Each round runs candle's 2048 x 2048 f32 matmul (the reference: the machine's best
# matrix multiply through candle) and then every fused shape at seq >= 512, one process
# per call (examples/bench.rs --json). Each keeps its best GFLOP/s over the rounds: on a
# shared machine neighbours slow whole calls down, and alternating gives every shape the
# same chances of a quiet moment. The table gives each shape's best and its share of the
# matmul's best.
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS="${THREADS:-2}"
ROUNDS="${ROUNDS:-5}"
export RAYON_NUM_THREADS="$THREADS"

cargo build --release --example bench >&2
BENCH="${CARGO_TARGET_DIR:-target}/release/examples/bench"
OUT="$(mktemp)"
trap 'rm -f "$OUT"' EXIT

SHAPES=(
  "matmul|--seq 2048 --impl candle-matmul --iters 3"
  "mha|--batch 1 --seq 512 --hidden 768 --heads 12 --iters 10"
  "mha|--batch 1 --seq 512 --hidden 768 --heads 12 --weights --iters 10"
  "sdpa|--batch 1 --seq 4096 --hidden 512 --heads 8 --core --iters 2"
  "sdpa|--batch 1 --seq 8192 --hidden 512 --heads 8 --core --iters 1"
  "mha|--batch 1 --seq 4096 --hidden 512 --heads 8 --iters 2"
  "mha|--batch 1 --seq 16384 --hidden 512 --heads 8 --iters 1"
)

echo "load average (1 min) before: $(cut -d' ' -f1 /proc/loadavg); rounds: $ROUNDS" >&2
for ((round = 1; round <= ROUNDS; round++)); do
  echo "round $round/$ROUNDS" >&2
  for entry in "${SHAPES[@]}"; do
    read -r -a flags <<<"${entry#*|}"
    echo "${entry%%|*} $("$BENCH" "${flags[@]}" --json)" >>"$OUT"
  done
done
echo "load average (1 min) after: $(cut -d' ' -f1 /proc/loadavg)" >&2

python3 - "$OUT" <<'EOF'
import json, sys
best, order = {}, []
for line in open(sys.argv[1]):
    kind, _, js = line.partition(" ")
    d = json.loads(js)
    key = kind if kind == "matmul" else (
        f"{kind} b{d['batch']} t{d['seq']} d{d['hidden']} h{d['heads']}"
        + (" +weights" if d.get("weights") else ""))
    if key not in best:
        order.append(key)
        best[key] = []
    best[key].append(d["gflops"])
mm = max(best["matmul"])
print(f"{'shape':<32} {'best GFLOP/s':>12} {'of matmul':>10}  every round")
for key in order:
    g = best[key]
    label = "candle matmul 2048x2048" if key == "matmul" else key
    print(f"{label:<32} {max(g):>12.1f} {max(g) / mm:>9.0%}  {' '.join(f'{x:.0f}' for x in g)}")
EOF
