"""Real metric traffic for the rebalancer's tests: a router and sidecars as prometheus_client HTTP
exporters (each with its own registry, as in the real processes) whose counters grow at set rates,
and a real Prometheus scraping them every second.

The exporters speak the metric contract the router and sidecars implement:
``kvshard_router_cluster_requests_total{cluster}``, ``kvshard_router_requests_total{pod,code}`` and
``kvshard_sidecar_{hit,query}_tokens_total`` — the sidecar ones without a ``pod`` label, which the
scrape config adds per target, as Kubernetes service discovery does — every series also carrying
``cacheshard="<namespace>/<name>"``. A real router or sidecar follows one CacheShard; a
:class:`Traffic` may stand for several with the same rates (one series per shard), so tests of
several shards over one Prometheus need only one set of exporters.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server

from kvshard_local.testing_servers import PrometheusNotInstalledError, PrometheusServer, free_port

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TICK_SECONDS = 0.1


class _Exporter:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.port = free_port()
        self.server, self.thread = start_http_server(self.port, addr="127.0.0.1", registry=registry)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


class Traffic:
    """One router exporter and one sidecar exporter per pod, for the CacheShards ``shards``
    (``<namespace>/<name>``); a background thread adds ``rate × elapsed`` to every counter ten times
    a second, so Prometheus sees steady rates."""

    def __init__(self, pods: tuple[str, ...], shards: Sequence[str]) -> None:
        self.pods = pods
        self.shards = tuple(shards)
        router = CollectorRegistry()
        self._cluster_requests = Counter("kvshard_router_cluster_requests", "Requests by candidate cluster",
                                         ["cacheshard", "cluster"], registry=router)
        self._pod_requests = Counter("kvshard_router_requests", "Requests by pod and status",
                                     ["cacheshard", "pod", "code"], registry=router)
        self.router = _Exporter(router)
        self._hits: dict[str, Counter] = {}
        self._queries: dict[str, Counter] = {}
        self.sidecars: dict[str, _Exporter] = {}
        for pod in pods:
            registry = CollectorRegistry()
            self._queries[pod] = Counter("kvshard_sidecar_query_tokens", "Prompt tokens",
                                         ["cacheshard", "model_name", "kind"], registry=registry)
            self._hits[pod] = Counter("kvshard_sidecar_hit_tokens", "Cached prompt tokens",
                                      ["cacheshard", "model_name", "kind", "tier"], registry=registry)
            self.sidecars[pod] = _Exporter(registry)
        self._lock = threading.Lock()
        self._clusters: dict[int, float] = {}
        self._load: dict[str, float] = {}
        self._tokens: dict[str, tuple[float, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def set(self, *, clusters: Mapping[int, float] | None = None, load: Mapping[str, float] | None = None,
            tokens: Mapping[str, tuple[float, float]] | None = None) -> None:
        """Requests/s per cluster, requests/s per pod, and (hit, query) item tokens/s per pod."""
        with self._lock:  # a series exists before it grows, so rate() sees all of it
            if clusters is not None:
                self._clusters = dict(clusters)
            if load is not None:
                self._load = dict(load)
            if tokens is not None:
                self._tokens = dict(tokens)
            self._grow(0.0)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(TICK_SECONDS):
            now = time.monotonic()
            dt, last = now - last, now
            with self._lock:
                self._grow(dt)

    def _grow(self, dt: float) -> None:
        for shard in self.shards:
            for c, rate in self._clusters.items():
                self._cluster_requests.labels(shard, str(c)).inc(rate * dt)
            for p, rate in self._load.items():
                self._pod_requests.labels(shard, p, "200").inc(rate * dt)
            for p, (hit, query) in self._tokens.items():
                self._hits[p].labels(shard, MODEL, "item", "memory").inc(hit * dt)
                self._queries[p].labels(shard, MODEL, "item").inc(query * dt)
                # other kinds and tiers must not leak into the item hit ratio
                self._hits[p].labels(shard, MODEL, "history", "memory").inc(query * dt)
                self._queries[p].labels(shard, MODEL, "history").inc(query * dt)

    def scrape_config(self) -> str:
        """Prometheus YAML: scrape the router, and each sidecar with its ``pod`` target label."""
        return scrape_config(self)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.router.close()
        for exporter in self.sidecars.values():
            exporter.close()


def scrape_config(*traffic: Traffic) -> str:
    """Prometheus YAML: one Prometheus scraping the routers and sidecars of every ``traffic`` (the
    sidecars with their ``pod`` target label, which repeats when two shards have same-named pods)."""
    jobs = []
    for i, t in enumerate(traffic):
        sidecars = "\n".join(f"      - targets: ['{e.target}']\n        labels: {{pod: '{p}'}}"
                             for p, e in t.sidecars.items())
        jobs.append(f"  - job_name: router-{i}\n    static_configs:\n      - targets: ['{t.router.target}']\n"
                    f"  - job_name: sidecar-{i}\n    static_configs:\n{sidecars}\n")
    return ("global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n  evaluation_interval: 1s\n"
            "scrape_configs:\n" + "".join(jobs))


@contextlib.contextmanager
def running_prometheus(config: str, directory: Path) -> Iterator[PrometheusServer]:
    """A real Prometheus with ``config``; skips locally without the binary, fails under ``CI=true``."""
    path = directory / "prometheus.yml"
    path.write_text(config)
    try:
        server = PrometheusServer(path, data_dir=directory / "data")
    except PrometheusNotInstalledError as exc:
        if os.environ.get("CI"):
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    with server:
        yield server


def wait_scraped(url: str, seconds: float, targets: int) -> None:
    """Block until Prometheus holds ``seconds`` worth of scrapes of all ``targets`` (so a rate over
    that window is a full-window rate, not the first two samples)."""
    from polling import wait_until

    from kvshard_operator.prometheus import PrometheusClient

    async def counts() -> list[float]:
        async with PrometheusClient(url) as client:
            return [v for _, v in await client.query(f"count_over_time(up[{seconds + 1:.0f}s])")]

    wait_until(lambda: (found := asyncio.run(counts())) and len(found) == targets and min(found) >= seconds + 1,
               timeout=30, what=f"{seconds:.0f} s of scrapes of {targets} targets")
