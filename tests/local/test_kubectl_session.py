"""The kubectl session a user types against ``kvshard up`` (README, "Local cluster"), with the real
kubectl 1.37 and every real process behind the API: the operator places, the sidecar warms."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
import yaml
from kubectl_cli import Kubectl, KubectlUnavailableError, kubectl_binary
from polling import wait_until

from kvshard_local import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.model]


def etcd_keys(cluster: LocalCluster, name: str) -> list[str]:
    async def read() -> list[str]:
        async with cluster.etcd_store(timeout=2, attempts=1) as store:
            return await store.keys("default", name)

    return asyncio.run(read())


def test_kubectl_session_against_the_local_cluster(small_dataset: Path, tmp_path: Path) -> None:
    try:
        binary = kubectl_binary()
    except (KubectlUnavailableError, OSError) as error:
        pytest.skip(f"kubectl unavailable (charts/install-tools.sh could not install it): {error}")
    with LocalCluster(pods=1, dir=tmp_path / "run", dataset=str(small_dataset), scrape_interval_seconds=1.0,
                      start_timeout_seconds=240) as cluster:
        cluster.wait_ready(timeout=240, progress=lambda line: None)
        kubectl = Kubectl(binary, cluster.kubeconfig, tmp_path / "kube-cache")

        # the table from the CRD's printer columns; the shard is placed, published and warm
        kubectl("wait", "--for=condition=Warm", "cacheshard/local", "--timeout=120s")
        table = kubectl("get", "cs").stdout.splitlines()
        assert table[0].split() == ["NAME", "READY", "WARM", "CLUSTERS", "PODS", "GENERATION", "AGE"]
        assert table[1].split()[:6] == ["local", "True", "True", "4", "1", "1"]
        wide = kubectl("get", "cs", "local", "-o", "wide").stdout
        assert "WARM CLUSTERS" in wide and "WARM PODS" in wide
        described = kubectl("describe", "cs", "local").stdout
        assert re.search(r"Warm Clusters:\s+4\n", described) and re.search(r"Type:\s+Warm\n", described)
        pods = kubectl("get", "pods").stdout.splitlines()
        assert pods[1].split()[:3] == ["engine-0", "1/1", "Running"]

        # the user's run CacheShard, changed and applied again: a new generation, cold, then warm
        applied = yaml.safe_load((cluster.run_dir / "cacheshard.yaml").read_text())
        applied["spec"]["clusters"] = 2
        (tmp_path / "local.yaml").write_text(yaml.safe_dump(applied))
        out = kubectl("apply", "-f", str(tmp_path / "local.yaml"))
        assert out.stdout.strip() == "cacheshard.kvshard.io/local configured" and "Warning" not in out.stderr
        wait_until(lambda: cluster.cacheshard()["status"].get("placementGeneration") == 2, timeout=60,
                   what="generation 2")
        kubectl("wait", "--for=condition=Warm", "cacheshard/local", "--timeout=120s")
        shard = json.loads(kubectl("get", "cs", "local", "-o", "json").stdout)
        assert (shard["metadata"]["generation"], shard["status"]["warmClusters"]) == (2, 2)

        # an invalid CacheShard never reaches the operator: refused at the API, the field named
        bad = dict(applied, metadata={"name": "typo"}, spec=dict(applied["spec"], clusters=0))
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
        refused = kubectl("apply", "-f", str(tmp_path / "bad.yaml"), check=False)
        assert refused.returncode == 1
        assert 'The CacheShard "typo" is invalid: spec.clusters: 0 is less than the minimum of 1' in refused.stderr

        # delete: the operator's finalizer removes the shard's etcd keys before the object goes
        assert etcd_keys(cluster, "local")
        kubectl("delete", "cs", "local", "--timeout=60s")
        assert "No resources found" in kubectl("get", "cs").stderr
        assert etcd_keys(cluster, "local") == []
