#!/usr/bin/env bash
# Copy the CRDs from the repository's crds/ (the one source) into the chart's crds/.
# `--check` only compares and exits 1 when the chart's copy differs (tests/chart runs the same check).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
src="$root/crds"
dst="$root/charts/kvshard/crds"
if [[ "${1:-}" == "--check" ]]; then
  if diff -r --exclude=examples "$src" "$dst" >/dev/null; then
    echo "chart CRDs are in sync with crds/"
    exit 0
  fi
  echo "charts/kvshard/crds differs from crds/: run charts/sync-crds.sh" >&2
  exit 1
fi
mkdir -p "$dst"
find "$dst" -maxdepth 1 -name '*.yaml' -delete
cp "$src"/*.yaml "$dst"/
echo "copied $(ls "$src"/*.yaml | wc -l) CRD file(s) to charts/kvshard/crds/"
