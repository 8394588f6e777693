#!/usr/bin/env bash
# candle-attention vs PyTorch vs candle's own paths, side by side, one table with ratios.
#
#   benches/side_by_side.sh            # every target shape (a few minutes; candle's flash_attn
#                                      # alone takes ~40 s per call at seq 8192)
#   QUICK=1 benches/side_by_side.sh    # skip the candle baselines at seq >= 8192
#   THREADS=2 ITERS=... PYTHON=python3 # threads for both tools (default 2), fixed iterations
#   ROUNDS=5 benches/side_by_side.sh   # ours and PyTorch alternate 5 times per shape, each
#                                      # keeps its fastest median (on a shared VM, neighbours
#                                      # slow whole calls down; the fastest call of each tool
#                                      # is the closest to an idle machine)
#
# Every cell is a separate process running one shape (examples/bench.rs --json,
# benches/compare_pytorch.py --json), so peak RSS is per implementation. Both tools' calling
# thread is one of their THREADS workers (OpenMP's main thread in PyTorch; the bench's
# default `--pool caller` for ours). Timings are only
# comparable on an idle machine: the script prints the 1-minute load average before and after.
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS="${THREADS:-2}"
ROUNDS="${ROUNDS:-1}"
PY="${PYTHON:-python3}"
export RAYON_NUM_THREADS="$THREADS" OMP_NUM_THREADS="$THREADS" MKL_NUM_THREADS="$THREADS"
ITER_ARGS=()
if [[ -n "${ITERS:-}" ]]; then ITER_ARGS=(--iters "$ITERS"); fi

cargo build --release --example bench >&2
BENCH="${CARGO_TARGET_DIR:-target}/release/examples/bench"
OUT="$(mktemp)"
trap 'rm -f "$OUT"' EXIT

load() { cut -d' ' -f1 /proc/loadavg; }
# One discarded call first: the first timed process after a build ran measurably slower
# (up to 1.7x at seq 32) than every later one, both tools alike.
"$BENCH" --batch 1 --seq 32 --hidden 384 --heads 12 --json >/dev/null
"$PY" benches/compare_pytorch.py --seq 32 --hidden 384 --heads 12 --threads "$THREADS" --json >/dev/null || true
echo "load average (1 min) before: $(load); rounds per shape: $ROUNDS" >&2

# label | shape flags
SHAPES=(
  "mha|--batch 1 --seq 32 --hidden 384 --heads 12"
  "mha|--batch 1 --seq 32 --hidden 384 --heads 12 --weights"
  "mha|--batch 1 --seq 128 --hidden 768 --heads 12"
  "mha|--batch 1 --seq 128 --hidden 768 --heads 12 --weights"
  "mha|--batch 1 --seq 512 --hidden 768 --heads 12"
  "mha|--batch 1 --seq 512 --hidden 768 --heads 12 --weights"
  "core|--batch 1 --seq 4096 --hidden 512 --heads 8 --core"
  "core|--batch 1 --seq 4096 --hidden 512 --heads 8 --core --causal"
  "core|--batch 1 --seq 8192 --hidden 512 --heads 8 --core"
  "core|--batch 1 --seq 8192 --hidden 512 --heads 8 --core --causal"
  "mha|--batch 1 --seq 4096 --hidden 512 --heads 8"
  "mem|--batch 1 --seq 16384 --hidden 512 --heads 8"
  "matmul|--seq 2048"
)

for entry in "${SHAPES[@]}"; do
  kind="${entry%%|*}"
  read -r -a flags <<<"${entry#*|}"
  seq=0
  for ((i = 0; i < ${#flags[@]}; i++)); do
    if [[ "${flags[$i]}" == --seq ]]; then seq="${flags[$((i + 1))]}"; fi
  done
  echo "== $kind ${flags[*]}" >&2
  if [[ "$kind" == matmul ]]; then
    for ((round = 0; round < ROUNDS; round++)); do
      "$BENCH" "${flags[@]}" --impl candle-matmul --json "${ITER_ARGS[@]}" | sed 's/^/candle /' >>"$OUT"
      "$PY" benches/compare_pytorch.py "${flags[@]}" --impl matmul --threads "$THREADS" --json "${ITER_ARGS[@]}" | sed 's/^/pytorch /' >>"$OUT"
    done
    continue
  fi
  for ((round = 1; round < ROUNDS; round++)); do
    "$BENCH" "${flags[@]}" --json "${ITER_ARGS[@]}" | sed 's/^/ours /' >>"$OUT"
    "$PY" benches/compare_pytorch.py "${flags[@]}" --threads "$THREADS" --json "${ITER_ARGS[@]}" | sed 's/^/pytorch /' >>"$OUT" || true
  done
  "$BENCH" "${flags[@]}" --json "${ITER_ARGS[@]}" | sed 's/^/ours /' >>"$OUT"
  if [[ "$kind" != mem ]] && ! [[ -n "${QUICK:-}" && "$seq" -ge 8192 ]]; then
    for imp in naive candle-flash; do
      "$BENCH" "${flags[@]}" --impl "$imp" --json "${ITER_ARGS[@]}" 2>/dev/null | sed "s/^/$imp /" >>"$OUT" || true
    done
  fi
  "$PY" benches/compare_pytorch.py "${flags[@]}" --threads "$THREADS" --json "${ITER_ARGS[@]}" | sed 's/^/pytorch /' >>"$OUT" || true
done
echo "load average (1 min) after: $(load)" >&2

"$PY" - "$OUT" <<'EOF'
import json, sys
rows = {}
order = []
for line in open(sys.argv[1]):
    who, _, js = line.partition(" ")
    d = json.loads(js)
    key = (d["batch"], d["seq"], d["hidden"], d["heads"], d.get("kv_heads"), d.get("causal"),
           d.get("weights"), d.get("core"), any(m in d.get("impl", "") for m in ("matmul", "torch.mm")))
    if key not in rows:
        rows[key] = {}
        order.append(key)
    # With ROUNDS > 1 a tool has several calls per shape: keep its fastest.
    old = rows[key].get(who)
    if old is None or d["median_ms"] < old["median_ms"]:
        rows[key][who] = d

def ms(d):
    return f"{d['median_ms']:.3f}" if d else "-"

print(f"{'shape':<44} {'ours ms':>10} {'PyTorch ms':>11} {'x PyTorch':>9} {'naive ms':>10} {'flash ms':>10} "
      f"{'x naive':>8} {'x flash':>8} {'GFLOP/s':>8} {'RSS MiB':>8} {'torch RSS':>9}")
for key in order:
    r = rows[key]
    b, t, d, h, kvh, causal, weights, core, mm = key
    if mm:
        c, p = r.get("candle"), r.get("pytorch")
        print(f"{'matmul ' + str(t) + 'x' + str(t):<44} {'candle':>10} {'':>11} {'':>9} "
              f"{'':>10} {'':>10} {'':>8} {'':>8} {c['gflops'] if c else '-':>8} "
              f"(PyTorch {p['gflops'] if p else '-'} GFLOP/s)")
        continue
    desc = (f"{'sdpa' if core else 'mha'} b{b} t{t} d{d} h{h}" + (f" kv{kvh}" if kvh != h else "")
            + (" causal" if causal else "") + (" +weights" if weights else ""))
    o, p, n, f = r.get("ours"), r.get("pytorch"), r.get("naive"), r.get("candle-flash")
    ratio = lambda other: f"{other['median_ms'] / o['median_ms']:.2f}x" if (o and other) else "-"
    print(f"{desc:<44} {ms(o):>10} {ms(p):>11} {ratio(p):>9} {ms(n):>10} {ms(f):>10} {ratio(n):>8} {ratio(f):>8} "
          f"{o['gflops'] if o else '-':>8} {o['peak_rss_mb'] if o else '-':>8} {p['peak_rss_mb'] if p else '-':>9}")
print("x PyTorch / x naive / x flash: how many times faster ours is (their time / ours).")
EOF
