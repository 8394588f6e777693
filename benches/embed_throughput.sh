#!/usr/bin/env bash
# Issue 23: embed a corpus with all-MiniLM-L6-v2, examples/embed.rs against
# sentence-transformers (torch) and ONNX Runtime, side by side, one table with ratios.
#
#   benches/embed_throughput.sh                     # 3 rounds, 2 threads, benches/data/corpus.txt
#   ROUNDS=5 THREADS=2 PYTHON=.venv/bin/python benches/embed_throughput.sh
#   CORPUS=my.txt PEERS="ort" benches/embed_throughput.sh
#   PEERS_ONLY=1 ROUNDS=1 benches/embed_throughput.sh   # the peers alone (no cargo, no ours)
#   SKIP_BUILD=1 CARGO_TARGET_DIR=... benches/embed_throughput.sh   # an already-built binary
#
# Each cell is its own process, timed from outside with GNU time (`%e %M`): whole-process
# wall time (interpreter start-up, imports, model load, tokenization, encode, output) and
# peak RSS. sentences/s = the corpus's sentences / that wall time. The peers' own JSON
# (benches/embed_peers.py) adds their in-process rate (tokenization + encode, no load), ours
# comes from `embed --stats` (the time inside Embedder::embed).
#
# The limits, after the rounds: the FMA peak (`bench --fma-peak`), the encoder's FLOP rate
# over the whole process and over its in-process time, and the vendor BLAS's rate
# (torch.matmul, MKL on x86-64 wheels) on the encoder's four products at a batch's mean rows.
# The tools alternate ROUNDS times (the order rotates each round); each keeps its fastest
# round (neighbours on a shared VM slow whole runs down), the median is shown beside it.
#
# Ours: ${CARGO_TARGET_DIR:-target}/release/examples/embed --file CORPUS --format json
#   --batch-size 32 --stats > /dev/null, RAYON_NUM_THREADS=THREADS.
# st:   SentenceTransformer(weights/).encode(batch_size=32, normalize_embeddings=True), f32.
# ort:  ONNX Runtime 1 session on the exported BertModel (BERT-fused graph, cached under
#       ~/.cache/candle-attention/onnx/), tokenizers + numpy pooling, intra-op THREADS.
#
# Agreement (CHECK=1, the default; CHECK=0 skips it): before the timed rounds, one untimed
# run of each tool saves its embeddings and every one is compared with sentence-transformers'
# row by row; the run stops unless every cosine is >= 0.99999. It doubles as the warm-up
# (page cache, ONNX export). By hand:
#   .venv/bin/python benches/embed_peers.py --impl st  --check /tmp/st.npy
#   .venv/bin/python benches/embed_peers.py --impl ort --check /tmp/ort.npy
#   target/release/examples/embed --file benches/data/corpus.txt --format json > /tmp/ours.jsonl
#   .venv/bin/python benches/embed_peers.py --compare /tmp/st.npy /tmp/ort.npy    # and /tmp/ours.jsonl
#
# Needs: pip install sentence-transformers onnxruntime onnx onnxscript (torch, transformers,
# tokenizers, numpy come with them); GNU time (apt-get install time), else a Python timer.
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS="${THREADS:-2}"
ROUNDS="${ROUNDS:-3}"
BATCH="${BATCH:-32}"
CORPUS="${CORPUS:-benches/data/corpus.txt}"
PEERS="${PEERS:-st ort}"
CHECK="${CHECK:-1}"
if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"; elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
export RAYON_NUM_THREADS="$THREADS" OMP_NUM_THREADS="$THREADS" MKL_NUM_THREADS="$THREADS" \
  OPENBLAS_NUM_THREADS="$THREADS" RAYON_RS_NUM_CPUS="$THREADS" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

TOOLS=()
if [[ -z "${PEERS_ONLY:-}" ]]; then
  [[ -n "${SKIP_BUILD:-}" ]] || cargo build --release --example embed --example bench >&2
  EMBED="${CARGO_TARGET_DIR:-target}/release/examples/embed"
  [[ -x "$EMBED" ]] || { echo "no $EMBED (build it, or set CARGO_TARGET_DIR)" >&2; exit 1; }
  TOOLS+=(ours)
fi
read -r -a peers <<<"$PEERS"
TOOLS+=("${peers[@]}")
N="$(grep -c '[^[:space:]]' "$CORPUS")"  # examples/embed.rs and the peers skip blank lines

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
RESULTS="$TMP/results"

# measure TOOL STDOUT_FILE: runs TOOL once, appends "TOOL wall_s maxrss_kb peer-json|-".
measure() {
  local tool="$1" out="$2" cmd
  case "$tool" in
    ours) cmd=("$EMBED" --file "$CORPUS" --format json --batch-size "$BATCH" --stats) ;;
    *) cmd=("$PY" benches/embed_peers.py --impl "$tool" --file "$CORPUS" --threads "$THREADS"
            --batch-size "$BATCH" "${@:3}") ;;
  esac
  if [[ -x /usr/bin/time ]]; then
    /usr/bin/time -f "%e %M" -o "$TMP/time" "${cmd[@]}" >"$out" 2>"$TMP/stderr" ||
      { cat "$TMP/stderr" >&2; return 1; }
  else
    "$PY" -c 'import resource, subprocess, sys, time
t = time.perf_counter(); rc = subprocess.call(sys.argv[2:]); t = time.perf_counter() - t
open(sys.argv[1], "w").write(f"{t:.3f} {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}\n")
sys.exit(rc)' "$TMP/time" "${cmd[@]}" >"$out" 2>"$TMP/stderr" ||
      { cat "$TMP/stderr" >&2; return 1; }
  fi
  local js
  # The peers print their JSON last on stdout, ours (--stats) last on stderr.
  if [[ "$tool" == ours ]]; then js="$(tail -n 1 "$TMP/stderr")"; else js="$(tail -n 1 "$out")"; fi
  echo "$tool $(tail -n 1 "$TMP/time") $js" >>"$RESULTS"
  local wall rss
  read -r wall rss <"$TMP/time"
  echo "  $tool: ${wall} s, $((rss / 1024)) MiB (load $(cut -d' ' -f1 /proc/loadavg))" >&2
}

echo "corpus: $CORPUS ($N sentences); tools: ${TOOLS[*]}; threads: $THREADS; rounds: $ROUNDS" >&2
[[ " ${TOOLS[*]} " == *" ort "* ]] && "$PY" benches/embed_peers.py --impl ort --prepare >/dev/null
if [[ "$CHECK" == 1 ]]; then
  echo "agreement check (untimed, also the warm-up) ..." >&2
  RESULTS="$TMP/check-results"
  for tool in "${TOOLS[@]}"; do
    case "$tool" in
      ours) measure ours "$TMP/ours.jsonl" ;;
      *) measure "$tool" /dev/null --check "$TMP/$tool.npy" ;;
    esac
  done
  base=st; [[ -f "$TMP/st.npy" ]] || base="${TOOLS[0]}"
  basefile="$TMP/$base.npy"; [[ "$base" == ours ]] && basefile="$TMP/ours.jsonl"
  for tool in "${TOOLS[@]}"; do
    [[ "$tool" == "$base" ]] && continue
    other="$TMP/$tool.npy"; [[ "$tool" == ours ]] && other="$TMP/ours.jsonl"
    "$PY" benches/embed_peers.py --compare "$basefile" "$other" |
      "$PY" -c 'import json, sys; r = json.loads(sys.stdin.read())
print("  %s vs %s: min cosine %.8f, max |diff| %.2e over %d rows" % (sys.argv[1], sys.argv[2],
      r["min_cosine"], r["max_abs_diff"], r["rows"]), file=sys.stderr)
sys.exit(0 if r["ok_0.99999"] else 1)' "$tool" "$base" ||
      { echo "embeddings disagree: $tool vs $base (min cosine < 0.99999)" >&2; exit 1; }
  done
  RESULTS="$TMP/results"
else
  cat weights/model.safetensors ~/.cache/candle-attention/onnx/*.onnx >/dev/null 2>&1 || true
fi

echo "load average (1 min) before: $(cut -d' ' -f1 /proc/loadavg)" >&2
for ((r = 0; r < ROUNDS; r++)); do
  echo "round $((r + 1))/$ROUNDS" >&2
  for ((i = 0; i < ${#TOOLS[@]}; i++)); do
    tool="${TOOLS[$(((i + r) % ${#TOOLS[@]}))]}"
    measure "$tool" "$TMP/stdout"
  done
done
echo "load average (1 min) after: $(cut -d' ' -f1 /proc/loadavg)" >&2
# The machine's limit: independent vector FMAs on THREADS threads (examples/bench.rs).
PEAK="{}"
BENCH="${CARGO_TARGET_DIR:-target}/release/examples/bench"
[[ -x "$BENCH" ]] && PEAK="$("$BENCH" --fma-peak --json)"

"$PY" - "$RESULTS" "$N" "$THREADS" "$BATCH" "$CORPUS" "$PEAK" <<'EOF'
import json, statistics, sys
path, n, threads, batch = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
corpus, peak = sys.argv[5], json.loads(sys.argv[6])
runs = {}
for line in open(path):
    tool, wall, rss_kb, js = line.rstrip("\n").split(" ", 3)
    runs.setdefault(tool, []).append((float(wall), int(rss_kb) / 1024, None if js == "-" else json.loads(js)))
names = {"ours": "candle-attention (examples/embed)", "st": "sentence-transformers (torch)",
         "ort": "ONNX Runtime"}
best = {t: min(r, key=lambda x: x[0]) for t, r in runs.items()}
print(f"| implementation | sentences/s (whole process) | wall s best / median | in-process encode sentences/s "
      f"| load + import s | peak RSS MB | ours is Nx (> 1: faster) | peer RSS / ours |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for tool, rs in runs.items():
    wall, rss, js = best[tool]
    med = statistics.median(w for w, _, _ in rs)
    rss_med = statistics.median(m for _, m, _ in rs)
    enc = f"{max(j['sentences_per_s'] for _, _, j in rs):.0f}" if js else "—"
    load = f"{js['load_s'] + js.get('import_s', 0):.2f}" if js else "—"
    if tool != "ours" and "ours" in best:
        ratio, mem = f"{wall / best['ours'][0]:.2f}x", f"{rss_med / statistics.median(m for _, m, _ in runs['ours']):.2f}x"
    else:
        ratio = mem = "—"
    print(f"| {names.get(tool, tool)} | {n / wall:.0f} | {wall:.2f} / {med:.2f} | {enc} | {load} "
          f"| {rss_med:.0f} | {ratio} | {mem} |")
vers = {}
for tool, rs in runs.items():
    if rs[0][2] and "versions" in rs[0][2]:
        vers.update(rs[0][2]["versions"])
print(f"\n{n} sentences, batch {batch}, {threads} threads, {len(next(iter(runs.values())))} round(s); "
      f"sentences/s and 'ours is Nx' from each tool's fastest whole-process wall time (ratio = peer's "
      f"time / ours, > 1: ours faster); peak RSS is the median of the rounds' ru_maxrss (MiB).")
print("versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()))
lens = None  # token counts per sentence, when tokenizers is there
# The encoder's FLOPs on the real tokens (no padding): per layer 2T(4d^2 + 2 d inter) for the
# projections and the feed-forward, 4 T^2 d for the attention.
try:
    from tokenizers import Tokenizer
    cfg = json.load(open("weights/config.json"))
    d, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    tok = Tokenizer.from_file("weights/tokenizer.json")
    tok.no_truncation(); tok.no_padding()
    lines = [l.rstrip("\r\n") for l in open(corpus, encoding="utf-8") if l.strip()]
    lens = [len(e.ids) for e in tok.encode_batch(lines)]
    flops = sum(layers * (2 * t * (4 * d * d + 2 * d * inter) + 4 * t * t * d) for t in lens)
    line = f"encoder FLOPs on the real tokens: {flops / 1e9:.0f} GFLOP ({sum(lens)} tokens)"
    fma = peak.get("fma_peak_gflops")
    pct = lambda r: f" = {100 * r / fma:.0f}% of the FMA peak" if fma else ""
    if "ours" in best:
        rate = flops / best["ours"][0] / 1e9
        line += f"; ours {rate:.0f} GFLOP/s over the whole process{pct(rate)}"
        inproc = [j["embed_s"] for _, _, j in runs["ours"] if j and "embed_s" in j]
        if inproc:
            rate = flops / min(inproc) / 1e9
            line += f", {rate:.0f} GFLOP/s over its embedding time (tokenize, encode, pool){pct(rate)}"
    if fma:
        line += f"; FMA peak {fma:.0f} GFLOP/s ({peak['isa']}, {peak['threads']} threads, measured after the rounds)"
    print(line)
except ImportError:
    pass
# The practical limit of the products: the vendor BLAS (torch.matmul: MKL on x86-64 wheels)
# at the encoder's four product shapes, a batch's mean rows, THREADS threads, weighted by
# their FLOPs per layer (QKV 3, output 1, feed-forward 4 + 4).
try:
    import time, torch
except ImportError:
    torch = None
if torch is not None and lens is not None:
    torch.set_num_threads(int(threads))
    rows = round(sum(lens) / max(1, -(-len(lens) // int(batch))))
    shapes = [(rows, d, 3 * d), (rows, d, d), (rows, d, inter), (rows, inter, d)]
    total_flops = total_s = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        c = torch.empty(m, n)
        reps = max(1, int(2e9 / (2 * m * k * n)))
        for _ in range(reps):
            torch.matmul(a, b, out=c)
        times = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(reps):
                torch.matmul(a, b, out=c)
            times.append((time.perf_counter() - t) / reps)
        total_flops += 2 * m * k * n
        total_s += min(times)
    rate = total_flops / total_s / 1e9
    print(f"vendor BLAS (torch {torch.__version__} matmul, {threads} threads) on the encoder's products "
          f"({rows} rows: {', '.join(f'{k}x{n}' for _, k, n in shapes)}): {rate:.0f} GFLOP/s{pct(rate)}")
EOF
