"""The local cluster end to end: every real process on loopback, through the Python API and the CLI."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from polling import wait_until
from prometheus_client.parser import text_string_to_metric_families

from kvshard.etcd_store import EtcdStore, EtcdTLSError, EtcdUnavailableError
from kvshard.etcd_tls import EtcdTLS
from kvshard.placement_schema import Placement, WarmReport
from kvshard.processes import http_ok
from kvshard_local import LocalCluster
from kvshard_local.cluster import ETCD_TLS_SECRET
from kvshard_local.kubeapi import condition
from kvshard_local.run_folder import process_start_time

pytestmark = [pytest.mark.slow, pytest.mark.model]
JOBS = {"kvshard-sidecar", "kvshard-router", "kvshard-operator"}



def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def post(url: str, body: Any) -> tuple[int, dict[str, str], Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=180) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read().decode(errors="replace")


def up_targets(prometheus_url: str) -> dict[tuple[str, str], float]:
    """(job, pod label or '') → value of ``up`` for every scraped target."""
    query = urllib.parse.urlencode({"query": "up"})
    result = get_json(f"{prometheus_url}/api/v1/query?{query}")["data"]["result"]
    return {(r["metric"]["job"], r["metric"].get("pod", "")): float(r["value"][1]) for r in result}


def alive(pid: int, start_time: int) -> bool:
    return process_start_time(pid) == start_time


def pgrep(pattern: str) -> list[str]:
    done = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True, check=False)
    return [line for line in done.stdout.splitlines() if "pgrep" not in line]


def router_counter(router_url: str, name: str) -> float:
    """Sum of one router counter over all its labels, read from the router's own /metrics."""
    with urllib.request.urlopen(router_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name)


def replay_against_round_robin(router_url: str, placement: Placement, reports: dict[str, WarmReport],
                               requests: int) -> tuple[float, float]:
    """Send ``requests`` requests whose candidates come from one random cluster each (retrieval output is
    cluster-coherent) through the router, and return the cluster hit ratio the router measured
    (``cluster_hits_total / cluster_requests_total``) next to the one round-robin would have had on the
    same requests: request ``j`` on pod ``j mod N``, a hit when that pod reported the cluster warm."""
    rng = random.Random(7)
    pods = sorted(placement.pods)
    hits_before = router_counter(router_url, "kvshard_router_cluster_hits_total")
    asked_before = router_counter(router_url, "kvshard_router_cluster_requests_total")
    round_robin_hits = 0
    for j in range(requests):
        cluster_id = rng.choice(sorted(placement.assignment))
        items = placement.items_of(cluster_id)
        status, _, answer = post(router_url + "/v1/recommend", {
            "user_id": f"replay-{j}", "history": [], "candidates": rng.sample(items, min(4, len(items))),
            "max_tokens": 1})
        assert status == 200, answer
        round_robin_hits += cluster_id in reports[pods[j % len(pods)]].clusters
    hits = router_counter(router_url, "kvshard_router_cluster_hits_total") - hits_before
    asked = router_counter(router_url, "kvshard_router_cluster_requests_total") - asked_before
    assert asked == requests  # one distinct known cluster per request
    return hits / asked, round_robin_hits / requests


def etcd_demands_client_certificates(cluster: LocalCluster) -> None:
    """The cluster's etcd refuses plaintext and a TLS client without a certificate; with the
    cluster's client certificate it answers."""
    assert cluster.etcd_tls is not None and cluster.etcd_tls.cert is not None

    async def ping(tls: EtcdTLS | None) -> None:
        async with EtcdStore([cluster.etcd_endpoint], tls=tls, timeout=3, attempts=1) as store:
            await store.ping()

    with pytest.raises(EtcdUnavailableError, match="if it serves TLS, give its CA"):
        asyncio.run(ping(None))
    with pytest.raises(EtcdTLSError, match="requires a client certificate"):
        asyncio.run(ping(dataclasses.replace(cluster.etcd_tls, cert=None, key=None)))
    asyncio.run(ping(cluster.etcd_tls))


def test_local_cluster_places_scrapes_routes_and_restarts_pods(small_dataset: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    cluster = LocalCluster(pods=2, dir=run, dataset=str(small_dataset), scrape_interval_seconds=1.0,
                           start_timeout_seconds=240)
    with cluster:
        lines: list[str] = []
        started = time.monotonic()
        cluster.wait_ready(timeout=240, progress=lines.append)
        print(f"ready {time.monotonic() - started:.0f} s after start():", *lines, sep="\n  ")
        assert lines[-1].startswith("ready: generation ")

        # etcd takes only TLS clients with a certificate; the operator reached it with the Secret
        # the CacheShard names, router and sidecars with the files their flags name
        etcd_demands_client_certificates(cluster)

        # the operator placed the catalog on both pods
        shard = cluster.cacheshard()
        assert shard["spec"]["etcd"]["tls"] == {"secretRef": {"name": ETCD_TLS_SECRET}}
        assert condition(shard, "Ready")["status"] == "True"
        assert (shard["status"]["pods"], shard["status"]["clusters"], shard["status"]["itemsPlaced"]) == (2, 8, 48)
        # the catalog was embedded by the operator's Indexed Job, whose chunks ran as worker processes
        embedded = shard["status"]["embedding"]
        assert embedded["state"] == "Complete", embedded
        job = cluster.api.get(f"/apis/batch/v1/namespaces/{cluster.namespace}/jobs/{embedded['job']}")
        assert job["status"]["succeeded"] == job["spec"]["completions"] == embedded["chunks"]
        assert len(list(cluster.logs_dir.glob(f"{embedded['job']}-*.log"))) >= embedded["chunks"]
        placement, reports = cluster.warm_reports()
        assert placement is not None and set(placement.pods) == {"engine-0", "engine-1"}
        for pod in placement.pods:
            assert reports[pod].generation == placement.generation and reports[pod].warming == 0
            assert set(reports[pod].clusters) == set(placement.clusters_of(pod))
            assert reports[pod].url == cluster.sidecar_urls[pod]

        # Prometheus scrapes every process: sidecars carry a pod label, the router target none
        targets = wait_until(lambda: (t := up_targets(cluster.prometheus_url))
                             and {j for j, _ in t} == JOBS and all(v == 1.0 for v in t.values()) and t,
                             timeout=30, what="up == 1 for every job")
        assert {pod for job, pod in targets if job == "kvshard-sidecar"} == {"engine-0", "engine-1"}
        assert ("kvshard-router", "") in targets and ("kvshard-operator", "") in targets

        # a request lands on the pod whose warm report holds its candidates' cluster
        for pod in placement.pods:
            cluster_id = reports[pod].clusters[0]
            items = placement.items_of(cluster_id)
            status, headers, answer = post(cluster.router_url + "/v1/recommend", {
                "user_id": f"local-test-{pod}", "history": [], "candidates": items[:5]})
            assert status == 200, answer
            assert cluster_id in reports[headers["X-Kvshard-Pod"]].clusters, (pod, cluster_id, headers)

        # the same requests: the router's cluster hits vs what round-robin would have had
        affinity, round_robin = replay_against_round_robin(cluster.router_url, placement, reports, requests=16)
        print(f"cluster hit ratio on 16 requests: affinity {affinity:.2f}, round-robin {round_robin:.2f}")
        assert affinity >= 0.9 and affinity > round_robin + 0.2, (affinity, round_robin)

        # a crashed sidecar: the kubelet marks its pod not Ready, restarts it, and it warms again
        first = placement.generation
        cluster.kill_pod("engine-1")
        wait_until(lambda: not cluster.pod_ready("engine-1"), timeout=10, what="engine-1 Ready=False")
        wait_until(lambda: cluster.restarts("engine-1") == 1 and cluster.pod_ready("engine-1"), timeout=120,
                   what="engine-1 restarted and Ready again")
        wait_until(lambda: (p := cluster.warm_reports()[0]) is not None and len(p.pods) == 2, timeout=30,
                   what="a placement on both pods again")
        cluster.wait_ready(timeout=120, progress=lines.append)
        after, _ = cluster.warm_reports()
        assert after is not None and set(after.pods) == {"engine-0", "engine-1"}
        assert after.generation >= first + 2, "the operator should have placed without engine-1, then with it"
        processes = cluster.processes()
        assert {p.name for p in processes} == {"etcd", "kube-api", "operator", "engine-0", "engine-1",
                                               "prometheus", "router"}
        for info in processes:
            assert Path(info.log).exists(), info

    assert not [p for p in processes if alive(p.pid, p.start_time)]
    assert pgrep(str(run)) == []
    cluster.stop()  # idempotent


def test_up_and_down_run_and_stop_the_cluster_as_commands(small_dataset: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    command = [sys.executable, "-m", "kvshard.cli", "up", "--pods", "1", "--dir", str(run),
               "--dataset", str(small_dataset), "--no-wait"]
    up_log = (tmp_path / "up.log").open("w")
    up = subprocess.Popen(command, stdout=up_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        state_file = run / "cluster.json"
        state = wait_until(lambda: state_file.exists() and (s := json.loads(state_file.read_text()))["processes"]
                           and s, timeout=180, what="cluster.json with processes")
        assert state["up_pid"] == up.pid
        assert set(state["etcd_tls"]) == {"ca", "cert", "key"}
        assert all(Path(p).exists() for p in state["etcd_tls"].values())
        wait_until(lambda: http_ok(state["urls"]["router"] + "/readyz"), timeout=120, what="router ready")
        assert {p["name"] for p in state["processes"]} >= {"etcd", "kube-api", "operator", "engine-0", "router"}
        table = (tmp_path / "up.log").read_text()
        for row in state["processes"]:
            assert str(row["pid"]) in table and row["log"] in table

        # a second `up` on the same folder is refused while the first runs
        second = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        assert second.returncode == 1
        assert "already runs" in second.stdout and str(up.pid) in second.stdout

        down = subprocess.run([sys.executable, "-m", "kvshard.cli", "down", "--dir", str(run)],
                              capture_output=True, text=True, timeout=120, check=False)
        assert down.returncode == 0, down.stdout + down.stderr
        assert f"stopping kvshard up (pid {up.pid})" in down.stdout and "stopped" in down.stdout
        assert up.wait(timeout=30) == 0
    finally:
        if up.poll() is None:  # the test failed midway: stop the cluster, then the command
            subprocess.run([sys.executable, "-m", "kvshard.cli", "down", "--dir", str(run), "--timeout", "30"],
                           capture_output=True, timeout=120, check=False)
            if up.poll() is None:
                os.killpg(up.pid, signal.SIGKILL)
        up_log.close()
    assert not [p for p in state["processes"] if alive(p["pid"], p["start_time"])]
    assert pgrep(str(run)) == []
    assert not (run / "cluster.json").exists()


def test_down_kills_what_a_killed_up_left_behind(small_dataset: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    up = subprocess.Popen([sys.executable, "-m", "kvshard.cli", "up", "--pods", "1", "--dir", str(run),
                           "--dataset", str(small_dataset), "--no-wait"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    state_file = run / "cluster.json"
    try:
        state = wait_until(lambda: state_file.exists() and (s := json.loads(state_file.read_text()))["processes"]
                           and s, timeout=180, what="cluster.json with processes")
        os.kill(up.pid, signal.SIGKILL)  # no chance to clean up
        up.wait(timeout=10)
        orphans = {p["name"] for p in state["processes"] if alive(p["pid"], p["start_time"])}
        assert orphans >= {"etcd", "kube-api", "operator", "engine-0", "router"}

        down = subprocess.run([sys.executable, "-m", "kvshard.cli", "down", "--dir", str(run)],
                              capture_output=True, text=True, timeout=60, check=False)
        assert down.returncode == 0, down.stdout + down.stderr
        assert f"kvshard up (pid {up.pid}) is not running" in down.stdout
        assert "killed left-over processes" in down.stdout and "engine-0" in down.stdout
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
        subprocess.run([sys.executable, "-m", "kvshard.cli", "down", "--dir", str(run)], capture_output=True,
                       timeout=60, check=False)
    wait_until(lambda: not [p for p in state["processes"] if alive(p["pid"], p["start_time"])], timeout=10,
               what="every process of the run gone")
    assert pgrep(str(run)) == []
