#!/usr/bin/env bash
# Install checkov (the Kubernetes manifest scanner the chart tests run) into its own virtual
# environment in the user cache. Not into .venv: checkov pins its own versions of packages that vLLM
# and the sidecar also pin, and one resolver run for both would break one of them. Idempotent: a second
# run only checks that the pinned version answers, so a fresh clone reuses the cached copy.
#
#   charts/install-checkov.sh          # installs if missing, prints the checkov executable
#   PYTHON=python3.11 charts/install-checkov.sh
#
# Folder: ${KVSHARD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvshard}/tools/checkov
set -euo pipefail

VERSION="3.3.30"
PYTHON="${PYTHON:-python3}"
CACHE="${KVSHARD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvshard}"
VENV="$CACHE/tools/checkov"
BIN="$VENV/bin/checkov"

if [[ "$("$BIN" --version 2>/dev/null)" == "$VERSION" ]]; then
  echo "$BIN"
  exit 0
fi

mkdir -p "$CACHE/tools"
# One installer at a time; whoever waited re-checks, and a half-built environment (an interrupted
# run) fails the version check and is rebuilt.
exec 9>"$CACHE/tools/checkov.lock"
flock 9
if [[ "$("$BIN" --version 2>/dev/null)" == "$VERSION" ]]; then
  echo "$BIN"
  exit 0
fi
echo "installing checkov==$VERSION into $VENV" >&2
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV" >&2
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "checkov==$VERSION" >&2
"$BIN" --version >&2
echo "$BIN"
