#!/usr/bin/env bash
# The explanation view of the HTML page, screenshotted in headless Chromium (docs/):
#   docs/explain_view.png      a short sentence, --explain grad against another sentence
#   docs/long_input_view.png   a 512-token paragraph (--truncate), --explain norm, and its size
# Needs chromium (Debian: apt-get install -y chromium). Run from the repository root:
#   scripts/screenshot_explanations.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --example attention_dump >/dev/null
bin=target/release/examples/attention_dump
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$bin" --explain grad --against "The tired animal stayed at home." --html "$tmp/short.html" \
  "The animal didn't cross the street because it was too tired." >/dev/null
scripts/screenshot_html.sh "$tmp/short.html" docs/explain_view.png "view=explain&xrow=0"
# 400 words of the benchmark corpus: over 512 tokens, cut to the model's 512 positions.
python3 - "$tmp/long.txt" <<'PY'
import sys
words = []
for line in open("benches/data/corpus.txt", encoding="utf-8"):
    words += line.split()
    if len(words) >= 400:
        break
open(sys.argv[1], "w", encoding="utf-8").write(" ".join(words[:400]) + "\n")
PY
"$bin" --truncate --explain norm --html "$tmp/long.html" --file "$tmp/long.txt" >/dev/null
echo "512-token page: $(du -h "$tmp/long.html" | cut -f1)"
scripts/screenshot_html.sh "$tmp/long.html" docs/long_input_view.png "view=explain&xlayer=2"
