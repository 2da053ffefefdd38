"""The real kubectl 1.37 against the local API process (``python -m kvshard_local.emulator``): what a
new user types first, with no operator, pods or model behind it, so it stays fast."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kubectl_cli import Kubectl, KubectlUnavailableError, kubectl_binary

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = ROOT / "crds" / "examples" / "cacheshard-minimal.yaml"
READY = {"type": "Ready", "status": "True", "reason": "Published", "message": "placed",
         "lastTransitionTime": "2026-01-01T00:00:00Z"}


@pytest.fixture(scope="module")
def kubectl_bin() -> Path:
    try:
        return kubectl_binary()
    except (KubectlUnavailableError, OSError) as error:
        pytest.skip(f"kubectl unavailable (charts/install-tools.sh could not install it): {error}")


@pytest.fixture
def kubectl(kubectl_bin: Path, tmp_path: Path) -> Iterator[Kubectl]:
    config = tmp_path / "kubeconfig"
    api = subprocess.Popen([sys.executable, "-m", "kvshard_local.emulator", "--port", "0", "--kubeconfig", str(config)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not config.exists():
            assert api.poll() is None and time.monotonic() < deadline, "the local API did not start"
            time.sleep(0.1)
        yield Kubectl(kubectl_bin, config, tmp_path / "kube-cache")
    finally:
        api.terminate()
        api.wait(timeout=10)


def manifest(tmp_path: Path, name: str, **spec: object) -> Path:
    obj = yaml.safe_load(MINIMAL.read_text())
    obj["metadata"]["name"] = name
    obj["spec"].update(spec)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(obj))
    return path


def columns(table: str) -> list[str]:
    return table.splitlines()[0].split()


def test_get_apply_and_tables_like_a_real_cluster(kubectl: Kubectl, tmp_path: Path) -> None:
    empty = kubectl("get", "cs")
    assert "No resources found in default namespace." in empty.stderr and "Warning" not in empty.stderr
    assert kubectl("apply", "-f", str(MINIMAL)).stdout.strip() == "cacheshard.kvshard.io/movielens created"
    assert kubectl("apply", "-f", str(MINIMAL)).stdout.strip() == "cacheshard.kvshard.io/movielens unchanged"
    table = kubectl("get", "cacheshard", "movielens").stdout
    assert columns(table) == ["NAME", "READY", "WARM", "CLUSTERS", "PODS", "GENERATION", "AGE"]
    row = table.splitlines()[1].split()
    assert row[0] == "movielens" and row[-1].endswith("s")  # no status yet: only the name and the age
    assert "WARM CLUSTERS" in kubectl("get", "cs", "-o", "wide").stdout
    listed = json.loads(kubectl("get", "cs", "-o", "json").stdout)
    assert listed["items"][0]["spec"]["itemReplicas"] == 1  # defaulted from the CRD
    for resource in ("pods", "configmaps", "namespaces", "events", "secrets", "all"):
        kubectl("get", resource)
    assert "Number of item clusters" in kubectl("explain", "cs.spec.clusters").stdout


def test_an_invalid_cacheshard_is_refused_naming_the_field(kubectl: Kubectl, tmp_path: Path) -> None:
    refused = kubectl("apply", "-f", str(manifest(tmp_path, "bad", clusters=0)), check=False)
    assert refused.returncode == 1
    assert 'The CacheShard "bad" is invalid: spec.clusters: 0 is less than the minimum of 1' in refused.stderr
    unknown = kubectl("apply", "-f", str(manifest(tmp_path, "typo", clustres=4)), check=False)
    assert unknown.returncode == 1 and "spec.clustres: unknown field" in unknown.stderr
    assert "No resources found" in kubectl("get", "cs").stderr


def test_status_wait_edit_watch_and_a_finalized_delete(kubectl: Kubectl, tmp_path: Path) -> None:
    kubectl("apply", "-f", str(MINIMAL))
    kubectl("patch", "cs", "movielens", "--type=merge", "-p", json.dumps({"status": {"clusters": 99}}))
    assert kubectl("get", "cs", "movielens", "-o", "jsonpath={.status}").stdout == ""  # not through the main resource
    kubectl("patch", "cs", "movielens", "--subresource=status", "--type=merge",
            "-p", json.dumps({"status": {"clusters": 16, "conditions": [READY]}}))
    assert "condition met" in kubectl("wait", "--for=condition=Ready", "cs/movielens", "--timeout=10s").stdout

    watcher = kubectl.popen("get", "cs", "--watch-only")
    time.sleep(1.0)
    edited = kubectl("edit", "cs", "movielens", env={"KUBE_EDITOR": "sed -i s/clusters:\\ 16/clusters:\\ 8/"})
    assert "edited" in edited.stdout
    time.sleep(1.0)
    watcher.terminate()
    changes = [line for line in watcher.communicate(timeout=10)[0].splitlines() if line.startswith("movielens")]
    assert len(changes) == 1 and changes[0].split()[:3] == ["movielens", "True", "16"]
    assert kubectl("get", "cs", "movielens", "-o", "jsonpath={.spec.clusters} {.metadata.generation}").stdout == "8 2"

    kubectl("patch", "cs", "movielens", "--type=merge", "-p", '{"metadata": {"finalizers": ["kvshard.io/test"]}}')
    assert "deleted" in kubectl("delete", "cs", "movielens", "--wait=false").stdout
    assert kubectl("get", "cs", "movielens", "-o", "jsonpath={.metadata.deletionTimestamp}").stdout
    kubectl("patch", "cs", "movielens", "--type=json", "-p", '[{"op": "remove", "path": "/metadata/finalizers"}]')
    kubectl("wait", "--for=delete", "cs/movielens", "--timeout=10s")
    assert "No resources found" in kubectl("get", "cs").stderr
