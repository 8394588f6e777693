#!/usr/bin/env bash
# Headless screenshot of an HTML file (e.g. the filled attention_view.html).
#   scripts/screenshot_html.sh <file.html> <out.png> [hash]
# hash: URL fragment without or with '#', e.g. 'view=model' or 'view=head&layer=2&heads=0,3&focus=4'.
# Env: WINDOW_SIZE (default 1400,1000), CHROMIUM (binary), DUMP_DOM=<path> (also save the rendered DOM).
# Prints the browser console messages / JS errors it sees; exits 3 if the page reported an error.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 <file.html> <out.png> [hash]" >&2
  exit 2
fi
in=$1; out=$2; hash=${3:-}
hash=${hash#\#}
CHROMIUM=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)}
if [ -z "$CHROMIUM" ]; then
  echo "chromium not found (Debian: apt-get install -y chromium)" >&2
  exit 2
fi
url="file://$(realpath "$in")"
[ -n "$hash" ] && url="$url#$hash"
outabs=$(realpath -m "$out")
profile=$(mktemp -d)
log=$(mktemp)
trap 'rm -rf "$profile" "$log"' EXIT
flags=(--headless --no-sandbox --disable-gpu --disable-quic --no-first-run
  --disable-background-networking --disable-component-update --disable-sync
  --hide-scrollbars --user-data-dir="$profile" --window-size="${WINDOW_SIZE:-1400,1000}"
  --enable-logging=stderr --v=0 --virtual-time-budget=3000)
"$CHROMIUM" "${flags[@]}" --screenshot="$outabs" "$url" 2>"$log" >/dev/null || true
status=0
if grep -E 'CONSOLE|Uncaught|JavaScript error' "$log"; then
  grep -qE 'Uncaught|JavaScript error' "$log" && status=3
fi
if [ -n "${DUMP_DOM:-}" ]; then
  rm -rf "$profile"; mkdir -p "$profile"
  "$CHROMIUM" "${flags[@]}" --dump-dom "$url" 2>/dev/null >"$DUMP_DOM" || true
  if grep -q 'data-render="error"' "$DUMP_DOM"; then
    echo "page reported an error (see #errbox in $DUMP_DOM)" >&2
    status=3
  fi
fi
if [ ! -s "$outabs" ]; then
  echo "no screenshot written; chromium log:" >&2
  tail -20 "$log" >&2
  exit 1
fi
echo "wrote $outabs ($url)"
exit $status
