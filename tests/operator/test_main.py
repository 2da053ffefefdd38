"""`kvshard operator run` starts kopf with our settings: liveness endpoint, finalizer, no peering."""

from __future__ import annotations

import argparse
import threading
import urllib.request
from pathlib import Path

import pytest
from emulated import EmulatedCluster, condition, etcd_spec
from polling import wait_until

from kvshard_local.testing_servers import EtcdServer, free_port
from kvshard_operator import main as operator_main

pytestmark = pytest.mark.slow


def test_operator_run_serves_liveness_and_places_shards(cluster: EmulatedCluster, etcd: EtcdServer,
                                                          catalog_file: Path) -> None:
    parser = argparse.ArgumentParser()
    operator_main.add_arguments(parser)
    port = free_port()
    args = parser.parse_args(["--metrics-port", "0", "--namespace", "default",
                              "--liveness-endpoint", f"http://127.0.0.1:{port}/healthz"])
    stop = threading.Event()
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(operator_main.main(args, stop_flag=stop)), daemon=True)
    cluster.create_pod("engine-0", {"app": "engine"})
    cluster.trust_etcd(etcd)
    thread.start()
    try:
        def alive() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as resp:
                    return resp.status == 200
            except OSError:
                return False

        wait_until(alive, what="liveness endpoint")
        cluster.create_shard({
            "apiVersion": "kvshard.io/v1alpha1", "kind": "CacheShard", "metadata": {"name": "via-main"},
            "spec": {"model": {"name": "m"}, "catalog": {"file": {"path": str(catalog_file)}}, "clusters": 4,
                     "podSelector": {"matchLabels": {"app": "engine"}}, "capacityPerPod": "1Gi",
                     "etcd": etcd_spec(etcd)},
        })
        obj = wait_until(lambda: condition(cluster.shard("via-main"), "Ready").get("status") == "True"
                         and cluster.shard("via-main"), what="Ready via operator run")
        annotations = obj["metadata"].get("annotations", {})
        assert any(k.startswith("kvshard.io/") for k in annotations), "progress is kept in our annotations"
        assert "kopf" not in obj["status"], "no kopf progress in status"
    finally:
        stop.set()
        thread.join(timeout=30)
    assert result == [0]
