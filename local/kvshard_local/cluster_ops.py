"""Watching and operating a running local cluster: readiness, what runs, faults on demand.

Why its own module: none of this starts anything. It reads the cluster the way an operator of a
real one would — the CacheShard's status through the API, placement and warm reports from etcd, the
router's ``/readyz``, which processes run — and injects the faults tests and the demo need (a pod
killed, an etcd outage). Starting and stopping the whole cluster is :mod:`kvshard_local.cluster`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvshard import etcd_store
from kvshard import placement_schema as ps
from kvshard.etcd_tls import EtcdTLS
from kvshard.processes import ManagedProcess, http_ok
from kvshard_local.cluster_processes import ClusterStartError
from kvshard_local.kubeapi import CACHESHARDS, KubeApi, condition
from kvshard_local.kubelet import Kubelet, PodContainers
from kvshard_local.run_folder import ProcessInfo, process_start_time
from kvshard_local.testing_servers import EtcdServer, PrometheusServer

log = logging.getLogger("kvshard_local.cluster")  # its lines are the cluster's (`kvshard up` prints the name)


class ClusterOps:
    """The watching half of :class:`~kvshard_local.cluster.LocalCluster` (which sets these attributes)."""

    api: KubeApi
    namespace: str
    name: str
    run_dir: Path
    logs_dir: Path
    kube_url: str
    operator_metrics_url: str
    router_url: str
    etcd_endpoint: str
    etcd_tls: EtcdTLS | None
    _etcd: EtcdServer | None
    _prometheus: PrometheusServer | None
    _kubelet: Kubelet | None
    _processes: dict[str, ManagedProcess]

    def wait_ready(self, timeout: float = 300.0, progress: Callable[[str], None] = print) -> None:
        """Wait until the CacheShard is Ready, the router's ``/readyz`` is 200 and every pod of the
        current generation has warmed all its clusters; ``progress`` gets a line whenever the
        picture changes. Raises :class:`TimeoutError` naming what is still missing."""
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            missing, picture = self._readiness()
            line = "; ".join(missing) + (f" | {picture}" if picture else "")
            if line != last:
                progress(f"waiting: {line}" if missing else f"ready: {picture or 'all parts up'}")
                last = line
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"local cluster not ready after {timeout:.0f} s: {line}")
            self.check_alive()
            time.sleep(1.0)

    def _readiness(self) -> tuple[list[str], str]:
        missing: list[str] = []
        ready = condition(self.cacheshard(), "Ready")
        if ready.get("status") != "True":
            missing.append(f"CacheShard Ready={ready.get('status', '?')} ({ready.get('reason', 'not reconciled')})")
        if not http_ok(self.router_url + "/readyz"):
            missing.append("router /readyz")
        picture = ""
        placement, reports = self.warm_reports()
        if placement is None:
            missing.append("no placement in etcd")
        else:
            parts = []
            for pod in placement.pods:
                want = len(placement.clusters_of(pod))
                report = reports.get(pod)
                current = report is not None and report.generation == placement.generation
                warm = len(report.clusters) if report is not None and current else 0
                if not current or report is None or report.warming:
                    missing.append(f"{pod} warming")
                parts.append(f"{pod} {warm}/{want}")
            picture = f"generation {placement.generation}: " + ", ".join(parts) + " clusters warm"
        return missing, picture

    def check_alive(self) -> None:
        """Raise :class:`ClusterStartError` if a process other than a sidecar exited (the kubelet
        restarts sidecars; nothing restarts the operator, the router or the API)."""
        for name, process in self._processes.items():
            if not process.running:
                raise ClusterStartError(f"{name} exited:\n{process.log_tail()}")

    def cacheshard(self) -> dict[str, Any]:
        """The CacheShard object, status included, as the API holds it ({} before it is applied)."""
        obj = self.api.get(CACHESHARDS.format(ns=self.namespace) + f"/{self.name}")
        return dict(obj or {})

    def warm_reports(self) -> tuple[ps.Placement | None, dict[str, ps.WarmReport]]:
        """The current placement and every pod's warm report, from etcd."""

        async def read() -> tuple[ps.Placement | None, dict[str, ps.WarmReport]]:
            async with self.etcd_store(timeout=2.0, attempts=1) as store:
                return (await store.read_current(self.namespace, self.name),
                        await store.read_warm(self.namespace, self.name))

        return asyncio.run(read())

    def etcd_store(self, **kwargs: Any) -> etcd_store.EtcdStore:
        """An :class:`~kvshard.etcd_store.EtcdStore` on this cluster's etcd, with its client certificate."""
        return etcd_store.EtcdStore([self.etcd_endpoint], tls=self.etcd_tls, **kwargs)

    def pod_ready(self, pod: str) -> bool:
        """The pod's ``Ready`` condition as the API holds it."""
        obj = self.api.get(f"/api/v1/namespaces/{self.namespace}/pods/{pod}")
        return condition(obj, "Ready").get("status") == "True"

    def kill_pod(self, name: str) -> None:
        """SIGKILL the pod's sidecar, and its vLLM with ``engine: vllm`` (a crash of the pod); the kubelet
        marks it not ready and restarts it (a vLLM's restart takes its start time again)."""
        if self._kubelet is None:
            raise RuntimeError("the cluster is not running")
        if name not in self._kubelet.pods:
            raise KeyError(f"no pod {name!r} (pods: {', '.join(self._kubelet.pods)})")
        self._kubelet.kill(name)

    def stop_etcd(self) -> None:
        """Stop etcd (an outage); its data and port stay for :meth:`start_etcd`."""
        if self._etcd is None:
            raise RuntimeError("the cluster is not running")
        self._etcd.stop()
        log.info("etcd stopped")

    def start_etcd(self) -> None:
        """Start etcd again on the same port with the same data, after :meth:`stop_etcd`."""
        if self._etcd is None:
            raise RuntimeError("the cluster is not running")
        self._etcd.start()
        log.info("etcd started again on %s", self.etcd_endpoint)

    def restarts(self, pod: str) -> int:
        return self._kubelet.pods[pod].restarts if self._kubelet is not None else 0

    def processes(self) -> list[ProcessInfo]:
        """Every process of the cluster that runs now, with its URL and log."""
        rows: list[tuple[str, int | None, str, Path, bool]] = []
        if self._etcd is not None:
            rows.append(("etcd", self._etcd.pid, self._etcd.url, self.logs_dir / "etcd.log", False))
        urls = {"kube-api": self.kube_url, "operator": self.operator_metrics_url, "router": self.router_url}
        for name, process in self._processes.items():
            rows.append((name, process.pid, urls.get(name, ""), process.log_path, True))
        if self._kubelet is not None:
            for pod in self._kubelet.pods.values():
                rows.append((pod.name, pod.process.pid, pod.url, pod.process.log_path, True))
                if isinstance(pod.process, PodContainers):  # its vLLM: `kvshard down` must find it too
                    for companion in pod.process.companions:
                        rows.append((f"{pod.name}/vllm", companion.pid, companion.ready_url.rsplit("/", 1)[0],
                                     companion.log_path, True))
        if self._prometheus is not None:
            rows.append(("prometheus", self._prometheus.pid, self._prometheus.url,
                         self.logs_dir / "prometheus.log", False))
        infos = []
        for name, pid, url, log_path, group in rows:
            started = process_start_time(pid) if pid is not None else None
            if pid is not None and started is not None:
                infos.append(ProcessInfo(name, pid, url, str(log_path), group, started))
        return infos
