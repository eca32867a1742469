#!/bin/sh
# Build the documentation site and take screenshots of a few pages in headless Chromium, to look
# at what a reader sees (a table too wide, a code block cut off) before it ships.
#   scripts/screenshot_docs.sh [OUT_DIR] [PAGE...]     pages as site paths, e.g. providers/kubernetes
# Needs chromium (Debian: apt-get install chromium). Writes OUT_DIR/<page>.png (default /tmp/docs-shots).
set -eu
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/docs-shots}
[ $# -gt 0 ] && shift
PAGES=${*:-"index providers/kubernetes reference"}
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict -q -d "$SITE"
mkdir -p "$OUT"
for page in $PAGES; do
	file="$SITE/$page/index.html"
	[ "$page" = index ] && file="$SITE/index.html"
	png="$OUT/$(echo "$page" | tr / -).png"
	chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,1600 \
		--screenshot="$png" "file://$file" >/dev/null 2>&1
	echo "$png"
done
