"""The router process in front of two real sidecar processes, with placement in a real etcd (slow)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from router_helpers import metric, publish

from kvshard.datasets import Dataset
from kvshard.placement_schema import Placement, WarmReport
from kvshard.processes import ManagedProcess, http_ok
from kvshard_local.testing_servers import EtcdServer, free_port


def _call(url: str, body: Any = None, raw: bytes | None = None) -> tuple[int, dict[str, str], Any]:
    data = raw if raw is not None else json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, headers, payload = response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        status, headers, payload = error.code, dict(error.headers), error.read()
    try:
        return status, headers, json.loads(payload)
    except ValueError:
        return status, headers, payload.decode(errors="replace")


@pytest.fixture(scope="module")
def processes() -> Iterator[list[ManagedProcess]]:
    started: list[ManagedProcess] = []
    yield started
    for process in started:
        process.stop()


def _sidecar(folder: Path, name: str) -> tuple[ManagedProcess, str]:
    port = free_port()
    command = [sys.executable, "-m", "kvshard.cli", "--log-level", "WARNING", "sidecar", "serve",
               "--port", str(port), "--pod-name", name, "--disk-bytes", "0", "--memory-bytes", str(256 << 20),
               "--max-prompt-tokens", "1024", "--max-queue", "4"]
    url = f"http://127.0.0.1:{port}"
    return ManagedProcess(command, folder / f"{name}.log", f"{url}/readyz", env=dict(os.environ)), url


@pytest.mark.slow
@pytest.mark.model
def test_the_router_process_in_front_of_two_real_sidecars(
    etcd_server: EtcdServer, movielens: Dataset, processes: list[ManagedProcess], tmp_path: Path
) -> None:
    started = time.monotonic()
    shard = "default/movielens"  # every router series carries it as `cacheshard`
    (pod_a, url_a), (pod_b, url_b) = _sidecar(tmp_path, "pod-a"), _sidecar(tmp_path, "pod-b")
    router_port = free_port()
    router_url = f"http://127.0.0.1:{router_port}"
    router = ManagedProcess(
        [sys.executable, "-m", "kvshard.cli", "router", "serve", "--port", str(router_port),
         "--etcd-endpoints", etcd_server.endpoint, *etcd_server.client_flags(), "--cacheshard", shard,
         "--health-interval-seconds", "0.5"],
        tmp_path / "router.log", f"{router_url}/healthz")
    processes.extend([pod_a, pod_b, router])
    for process in (pod_a, pod_b, router):
        process.start(wait=False)  # the two models load in parallel
    for process in (pod_a, pod_b, router):
        process.wait_ready()
    print(f"sidecars and router up after {time.monotonic() - started:.1f} s")  # shown when the test fails

    # Half of the catalog is cluster 0 on pod-a, the other half cluster 1 on pod-b; both report warm.
    ids = list(movielens.items)
    half = {item: 0 if i < len(ids) // 2 else 1 for i, item in enumerate(ids)}
    cluster = {0: [i for i in ids if half[i] == 0], 1: [i for i in ids if half[i] == 1]}
    asyncio.run(publish(etcd_server, shard,
                        Placement(1, {0: ("pod-a",), 1: ("pod-b",)}, half, pods=("pod-a", "pod-b")),
                        {"pod-a": WarmReport(1, (0,), url=url_a), "pod-b": WarmReport(1, (1,), url=url_b)}))
    deadline = time.monotonic() + 15
    while not http_ok(f"{router_url}/readyz") or len(_call(f"{router_url}/readyz")[2]["healthy_pods"]) < 2:
        assert time.monotonic() < deadline, router.log_tail()
        time.sleep(0.1)

    def request(user: str, which: int, offset: int) -> dict[str, Any]:
        return {"user_id": user, "history": movielens.histories[user][:5],
                "candidates": cluster[which][offset:offset + 4], "max_tokens": 1}

    # (1) each request goes to the pod holding its candidates' cluster; the answer's ranking (and the
    # request's top_k) passes through the router untouched
    for n, (user, which) in enumerate([("1", 0), ("2", 1), ("3", 0), ("4", 1), ("5", 0)]):
        sent = {**request(user, which, 4 * n), **({"top_k": 2} if n % 2 else {})}
        status, headers, body = _call(f"{router_url}/v1/recommend", sent)
        assert status == 200, body
        assert headers["X-Kvshard-Pod"] == ("pod-a", "pod-b")[which] and headers["X-Kvshard-Generation"] == "1"
        assert body["candidate"] in sent["candidates"] and body["tokens"]["prompt"] > 0
        assert len(body["ranking"]) == (2 if n % 2 else 4) and body["ranking"][0]["candidate"] == body["candidate"]

    # (2) malformed bodies get 400 naming the field; the sidecar's own 4xx passes through; still serving
    for raw, field in ((b"{not json", "body"), (b'{"candidates": ["1"]}', "user_id"),
                       (b'{"user_id": "1", "candidates": "1"}', "candidates")):
        status, _, body = _call(f"{router_url}/v1/recommend", raw=raw)
        assert (status, body["error"]["field"]) == (400, field)
    status, headers, body = _call(f"{router_url}/v1/recommend", {**request("6", 0, 0), "max_tokens": "two"})
    assert (status, headers["X-Kvshard-Pod"], body["error"]["field"]) == (400, "pod-a", "max_tokens")
    assert _call(f"{router_url}/v1/recommend", request("6", 1, 0))[0] == 200

    # (4) the metrics show the decisions, requests per pod and per-cluster requests and hits
    text = _call(f"{router_url}/metrics")[2]
    assert metric(text, "kvshard_router_decision_seconds_count", cacheshard=shard) == 7
    assert metric(text, "kvshard_router_requests_total", cacheshard=shard, pod="pod-a", code="2xx") == 3
    assert metric(text, "kvshard_router_requests_total", cacheshard=shard, pod="pod-b", code="2xx") == 3
    assert metric(text, "kvshard_router_requests_total", cacheshard=shard, pod="none", code="4xx") == 3
    assert metric(text, "kvshard_router_cluster_requests_total", cacheshard=shard, cluster="0") == 4
    assert metric(text, "kvshard_router_cluster_hits_total", cacheshard=shard, cluster="0") == 3
    assert metric(text, "kvshard_router_cluster_hits_total", cacheshard=shard, cluster="1") == 3

    # (3) pod-a dies: its cluster is served by pod-b (at most the first request retried), and the
    # router reports pod-a unhealthy within a few seconds
    print(f"routing and validation checked after {time.monotonic() - started:.1f} s")
    pod_a.kill()
    for user in ("7", "8"):
        status, headers, body = _call(f"{router_url}/v1/recommend", request(user, 0, 0))
        assert (status, headers["X-Kvshard-Pod"]) == (200, "pod-b"), body
    deadline = time.monotonic() + 5
    while metric(_call(f"{router_url}/metrics")[2], "kvshard_router_pod_healthy", cacheshard=shard, pod="pod-a") != 0:
        assert time.monotonic() < deadline, "pod-a still healthy 5 s after it was killed"
        time.sleep(0.1)
    text = _call(f"{router_url}/metrics")[2]
    assert (metric(text, "kvshard_router_retries_total", cacheshard=shard) or 0) <= 1
    assert metric(text, "kvshard_router_pod_healthy", cacheshard=shard, pod="pod-b") == 1
    assert "pod pod-a is unhealthy" in router.log_tail(20_000)
    print(f"failover checked after {time.monotonic() - started:.1f} s")
