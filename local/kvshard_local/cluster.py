"""Everything a kvshard cluster runs, on loopback on one machine: ``LocalCluster``.

The parts are the real ones, started as processes through the ``kvshard`` CLI exactly as the
chart starts them in pods — etcd, a Kubernetes API (:mod:`kvshard_local.emulator`, which ``kubectl`` talks to),
the operator, N sidecars with the embedded engine (or, ``engine: vllm``, each with its own vLLM server:
:meth:`LocalCluster._vllm`), Prometheus and the router — so what works here works for the same reasons
in a cluster. Only the kubelet is ours (:mod:`kvshard_local.kubelet`:
sidecar processes as ready/not-ready pods, crashed ones restarted), and the Job controller
(:mod:`kvshard_local.job_controller`: the operator's embedding Jobs, one process per chunk).

    with LocalCluster(LocalClusterSettings(pods=2)) as cluster:
        cluster.wait_ready(timeout=300)
        urllib.request.urlopen(cluster.router_url + "/v1/placement")

Every port is a free one, every process is its own process group logging to ``<run>/logs``, and
``stop()`` stops them all (twice is harmless). The CacheShard is applied once every sidecar is
ready, so the first placement generation already spans every pod instead of growing pod by pod.

etcd serves TLS and demands client certificates, as in a cluster: its CA and one client certificate
are made at start (``<run>/etcd/tls``); the router and the sidecars get the files as flags, the
operator reads them from the Secret :data:`ETCD_TLS_SECRET` that ``spec.etcd.tls`` names — the
chart wires them the same way.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import dataclasses
import importlib.util
import logging
import os
import secrets
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from kvshard import etcd_store
from kvshard import placement_schema as ps
from kvshard import settings as settings_lib
from kvshard.etcd_tls import EtcdTLS
from kvshard.models import model_blend, model_prompt, model_scorer, prompt_for_model, resolve_model
from kvshard.processes import ManagedProcess, ProcessStartError, http_ok
from kvshard_local import job_controller, manifests
from kvshard_local.certificates import EtcdCertificates
from kvshard_local.kubeapi import CACHESHARDS, KubeApi, condition
from kvshard_local.kubelet import Kubelet, PodContainers, PodProcess
from kvshard_local.run_folder import (
    ProcessInfo,
    RunFolderLock,
    forget_previous_run,
    process_start_time,
)
from kvshard_local.scaling import LocalAutoscaler, ScaleChange, local_rules, scale_pods
from kvshard_local.settings import LocalClusterSettings
from kvshard_local.testing_servers import EtcdServer, PrometheusServer, free_port, free_ports

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
ETCD_TLS_SECRET = "kvshard-etcd-client"
"""The Secret (``ca.crt``, ``tls.crt``, ``tls.key``) the local CacheShard's ``spec.etcd.tls`` names."""
SECRETS = "/api/v1/namespaces/{ns}/secrets"
VLLM_KV_CACHE_GIB = "1"
"""``VLLM_CPU_KVCACHE_SPACE`` of each pod's vLLM: a recommendation's K candidates at a few hundred tokens
each fit many times over, and N pods' vLLMs must fit one small machine."""
class ClusterStartError(RuntimeError):
    """A part of the cluster did not come up; the message names it and carries its log's tail."""


def _cli(*words: str) -> list[str]:
    return [sys.executable, "-m", "kvshard.cli", *words]


def _answers(url: str) -> bool:
    """True once something answers HTTP at ``url`` (any status: the server listens)."""
    try:
        with urllib.request.urlopen(url, timeout=1.0):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


class LocalCluster:
    """etcd, a Kubernetes API, the operator, N sidecars, Prometheus and the router on loopback."""

    def __init__(self, settings: LocalClusterSettings | None = None, **overrides: Any) -> None:
        base = settings or LocalClusterSettings()
        self.settings = dataclasses.replace(base, **overrides) if overrides else base
        self.run_dir = self.settings.run_dir
        self.logs_dir = self.run_dir / "logs"
        self.namespace = self.settings.namespace
        self._generated = self.settings.cacheshard is None
        self._manifest = manifests.load_cacheshard(self.settings.cacheshard)
        self._prompt = manifests.load_prompt(self.settings.prompt) if self.settings.prompt else None
        self._blend: dict[str, object] = {}
        self.model_path = resolve_model(self.settings.model)
        if self.settings.engine == "vllm":
            self._check_vllm()
        if self._generated:  # the CacheShard it writes asks the model as it was trained (e.g. labelPosition)
            model = self.model_path
            self._prompt = prompt_for_model(self._prompt, model_prompt(model))[0] or None
            self._blend = model_blend(model)  # and blends it as it calls for (a late scorer: none)
        self.name = str(self._manifest["metadata"]["name"])
        self.pod_names = [f"engine-{i}" for i in range(self.settings.pods)]
        # every port of the cluster in one call, etcd's and Prometheus' too: ports chosen in separate calls
        # may come back equal (seen: the Kubernetes API failing with "Address already in use")
        vllms = [f"{pod}-vllm" for pod in self.pod_names] if self.settings.engine == "vllm" else []
        roles = ("kube", "operator_metrics", "operator_health", "router", "etcd_client", "etcd_peer", "prometheus",
                 *self.pod_names, *vllms)
        self._ports = dict(zip(roles, free_ports(len(roles)), strict=True))
        self.kube_url = f"http://{HOST}:{self._ports['kube']}"
        self.operator_metrics_url = f"http://{HOST}:{self._ports['operator_metrics']}/metrics"
        self.operator_health_url = f"http://{HOST}:{self._ports['operator_health']}/healthz"
        self.router_url = f"http://{HOST}:{self._ports['router']}"
        self.sidecar_urls = {pod: f"http://{HOST}:{self._ports[pod]}" for pod in self.pod_names}
        self.prometheus_url = ""
        self.etcd_endpoint = ""
        self.etcd_tls: EtcdTLS | None = None
        """What a client needs to reach this cluster's etcd (CA, client certificate and key)."""
        self.etcd_certificates: EtcdCertificates | None = None
        self.etcd_client_flags: list[str] = []
        """``--etcd-ca-file …`` flags for a ``kvshard router``/``sidecar`` against this cluster's etcd."""
        self.api = KubeApi(self.kube_url)
        self._etcd: EtcdServer | None = None
        self._prometheus: PrometheusServer | None = None
        self._processes: dict[str, ManagedProcess] = {}
        self._kubelet: Kubelet | None = None
        self.jobs: job_controller.JobController | None = None
        """Runs the operator's embedding Jobs as processes (``settings.embedding_jobs``)."""
        self.autoscaler: LocalAutoscaler | None = None
        """The autoscaler loop when ``settings.autoscale`` (started once the cluster is ready)."""
        self._run_lock = RunFolderLock(self.run_dir)
        self._started = False

    # ------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Bring every part up, in dependency order; on any failure stop what was started."""
        self.acquire()
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        self._started = True
        forget_previous_run(self.run_dir, self.logs_dir)

        log.info("starting etcd (TLS, client certificates)")
        self._etcd = EtcdServer(data_dir=self.run_dir / "etcd",
                                ports=(self._ports["etcd_client"], self._ports["etcd_peer"]))
        self._etcd.start()
        self.etcd_endpoint = self._etcd.endpoint
        self.etcd_tls = self._etcd.client_tls
        self.etcd_certificates = self._etcd.certificates
        self.etcd_client_flags = self._etcd.client_flags()
        self._link_log("etcd", self.run_dir / "etcd.log")

        log.info("starting the local Kubernetes API on %s", self.kube_url)
        self._spawn("kube-api", [sys.executable, "-m", "kvshard_local.emulator", "--port", str(self._ports["kube"]),
                                 "--kubeconfig", str(self.kubeconfig), "--namespace", self.namespace],
                    ready_url=self.kube_url + "/version", timeout=60)
        self.api.create(SECRETS.format(ns=self.namespace), {
            "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
            "metadata": {"name": ETCD_TLS_SECRET, "namespace": self.namespace},
            "data": {k: base64.b64encode(v).decode() for k, v in self._etcd.tls_secret_data().items()}})

        if self.settings.embedding_jobs:
            self.jobs = job_controller.JobController(self.api, self.namespace, self.logs_dir)
            self.jobs.start()
        log.info("starting the operator")
        operator = self._spawn("operator", _cli("operator", "run", "--metrics-port",
                                                str(self._ports["operator_metrics"]),
                                                "--liveness-endpoint", self.operator_health_url),
                               ready_url=self.operator_health_url, env=self._operator_env(), wait=False)

        log.info("starting %d sidecars%s", self.settings.pods,
                 ", each with its own vLLM" if self.settings.engine == "vllm" else "")
        token_file = self.peer_token_file
        token_file.write_text(secrets.token_hex(16))
        token_file.chmod(0o600)
        pods = [PodProcess(pod, self._sidecar(pod, token_file), url) for pod, url in self.sidecar_urls.items()]
        self._kubelet = Kubelet(self.api, self.namespace, pods)
        for pod in pods:
            pod.process.start(wait=False)
        self._kubelet.start()

        log.info("starting Prometheus")
        config = self.write_prometheus_config()
        self._prometheus = PrometheusServer(config, data_dir=self.run_dir / "prometheus",
                                            port=self._ports["prometheus"])
        self._prometheus.start()
        self.prometheus_url = self._prometheus.url
        self._link_log("prometheus", self._prometheus.log_path)

        log.info("starting the router on %s", self.router_url)
        router = self._spawn("router", _cli("router", "serve", "--host", HOST, "--port", str(self._ports["router"]),
                                            "--etcd-endpoints", self.etcd_endpoint, *self.etcd_client_flags,
                                            "--cacheshard", f"{self.namespace}/{self.name}",
                                            "--policy", self.settings.router_policy),
                             ready_url=self.router_url + "/readyz", wait=False)
        self._wait(lambda: _answers(self.router_url + "/readyz"), 60, "the router to listen", router)

        self._wait(lambda: http_ok(self.operator_health_url), 120, "the operator's liveness probe", operator)
        log.info("waiting for %d sidecars to load the model", self.settings.pods)
        self._wait(self._kubelet.all_ready, self.settings.start_timeout_seconds, "every sidecar pod to be Ready")

        manifest = manifests.local_cacheshard(
            self._manifest, namespace=self.namespace, etcd_endpoint=self.etcd_endpoint,
            etcd_tls_secret=ETCD_TLS_SECRET, prometheus_url=self.prometheus_url, generated=self._generated,
            dataset=self.settings.dataset, clusters=self.settings.clusters_per_pod * self.settings.pods,
            rebalance_interval_seconds=self.settings.rebalance_interval_seconds, prompt=self._prompt,
            catalog_refresh_seconds=self.settings.catalog_refresh_seconds, blend=self._blend)
        (self.run_dir / "cacheshard.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
        self.api.create(CACHESHARDS.format(ns=self.namespace), manifests.as_applied(manifest))
        log.info("applied CacheShard %s/%s (%s clusters)", self.namespace, self.name, manifest["spec"].get("clusters"))
        if self.settings.autoscale:
            self.autoscaler = LocalAutoscaler(self, local_rules(self.settings))
            self.autoscaler.start()

    def stop(self) -> None:
        """Stop everything this cluster started (process groups, no orphans); idempotent."""
        if self.autoscaler is not None:
            self.autoscaler.stop()  # first, or it would scale what we stop
        if self.jobs is not None:
            self.jobs.stop()
            self.jobs = None
        processes = list(self._processes.items())
        self._processes = {}
        if self._kubelet is not None:
            self._kubelet.stop()  # first, or it would restart the sidecars we stop
            processes += [(pod.name, pod.process) for pod in self._kubelet.pods.values()]  # a pod's vLLM too
            self._kubelet = None
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(processes))) as pool:
            for future in [pool.submit(p.stop, 10.0) for name, p in processes if name != "kube-api"]:
                future.result()
        if self._prometheus is not None:
            self._prometheus.stop()
            self._prometheus = None
        for name, process in processes:
            if name == "kube-api":  # last but etcd: the operator talks to it while stopping
                process.stop()
        if self._etcd is not None:
            self._etcd.stop()
            self._etcd = None
        if self._started:
            log.info("local cluster in %s stopped", self.run_dir)
            self._started = False
        self._run_lock.release()

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # ------------------------------------------------------------------------------- readiness

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

    # ------------------------------------------------------------------------------- observing

    @property
    def kubeconfig(self) -> Path:
        return self.run_dir / "kubeconfig"

    @property
    def peer_token_file(self) -> Path:
        """The token sidecars demand of each other on ``GET /v1/blocks/{key}``."""
        return self.run_dir / "peer-token"

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

    def pod_disk_dir(self, pod: str) -> Path:
        """The pod's disk tier folder (``<run>/blocks/<pod>``); it outlives the pod's restarts."""
        return self.run_dir / "blocks" / pod

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

    def start_operator(self, name: str) -> ManagedProcess:
        """One more operator process as the cluster's own is run (same API, same settings) on free
        ports, e.g. to race two replicas; :meth:`stop_operator` stops it, :meth:`stop` too."""
        if name in self._processes:
            raise ValueError(f"a process named {name!r} already runs")
        health_port, metrics_port = free_ports(2)
        health_url = f"http://{HOST}:{health_port}/healthz"
        command = _cli("operator", "run", "--metrics-port", str(metrics_port), "--liveness-endpoint", health_url)
        return self._spawn(name, command, ready_url=health_url, env=self._operator_env(), timeout=120)

    def stop_operator(self, name: str) -> None:
        """Stop an operator started by :meth:`start_operator`."""
        self._processes.pop(name).stop()

    def scale(self, pods: int, *, drain_timeout: float = 60.0) -> ScaleChange:
        """Run ``pods`` sidecar pods, adding or removing the highest ordinals as a StatefulSet does:
        a new pod starts, the operator places it, it warms and the router routes to it once warm; a
        leaving pod drains first (``GET /v1/drain``, as the chart's preStop hook), then stops and
        its Pod object is deleted. Returns once the pods run (not once the new ones are warm)."""
        return scale_pods(self, pods, drain_timeout=drain_timeout)

    def write_prometheus_config(self) -> Path:
        """``<run>/prometheus.yml`` for the pods that run now (Prometheus re-reads it on reload)."""
        config = self.run_dir / "prometheus.yml"
        config.write_text(yaml.safe_dump(manifests.prometheus_config(
            scrape_interval_seconds=self.settings.scrape_interval_seconds,
            sidecars={pod: url.split("//", 1)[1] for pod, url in self.sidecar_urls.items()},
            router=self.router_url.split("//", 1)[1],
            operator=f"{HOST}:{self._ports['operator_metrics']}", namespace=self.namespace)))
        if self._prometheus is not None and self._prometheus.pid is not None:
            self._prometheus.reload()
        return config

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

    # ------------------------------------------------------------------------------- helpers

    def acquire(self) -> None:
        """Hold the run folder (:class:`~kvshard_local.run_folder.RunFolderLock`) or raise
        :class:`ClusterAlreadyRunningError` naming the ``kvshard up`` that holds it."""
        self._run_lock.acquire()

    def _link_log(self, name: str, target: Path) -> None:
        link = self.logs_dir / f"{name}.log"
        if not link.exists():
            link.symlink_to(target)

    def _spawn(self, name: str, command: list[str], *, ready_url: str, env: dict[str, str] | None = None,
               timeout: float = 60.0, wait: bool = True) -> ManagedProcess:
        process = ManagedProcess(command, self.logs_dir / f"{name}.log", ready_url,
                                 env={**os.environ, **(env or {})}, start_timeout=timeout)
        self._processes[name] = process
        try:
            process.start(wait=wait)
        except ProcessStartError as exc:
            raise ClusterStartError(f"{name} did not start: {exc}") from None
        return process

    def _operator_env(self) -> dict[str, str]:
        return {
            "KUBECONFIG": str(self.kubeconfig),
            # clusters follow co-occurrence in user histories (built-in catalogs carry them)
            "KVSHARD_OPERATOR_COOCCURRENCE_PERCENT": "50",
            "KVSHARD_OPERATOR_POD_SYNC_SECONDS": "1",
            # a replaced catalog file is seen within a second of its spec.catalog.refreshSeconds
            "KVSHARD_OPERATOR_CATALOG_CHECK_SECONDS": "1",
            "KVSHARD_OPERATOR_REBALANCE_CHECK_SECONDS": str(min(5, self.settings.rebalance_interval_seconds)),
            "KVSHARD_OPERATOR_RETRY_BACKOFF_MAX": "10",
            **(job_controller.operator_env(self.run_dir / "embeddings") if self.settings.embedding_jobs else {}),
        }

    def _check_vllm(self) -> None:
        """Refuse ``engine: vllm`` where it cannot work, before anything starts."""
        if model_scorer(self.model_path) == "answer":
            raise settings_lib.SettingsError(
                f"engine vllm serves scorer models only (--model late or scorer); {self.settings.model!r} "
                f"({self.model_path.name}) answers at the answer position, whose blended cache the sidecar's own "
                "engine must compute — the local cluster does not run that path with vLLM (use --engine embedded)")
        if importlib.util.find_spec("vllm") is None:
            raise settings_lib.SettingsError("engine vllm needs vLLM in this Python (the vllm extra: "
                                             "pip install 'kvshard[vllm]')")

    def _vllm(self, pod: str) -> ManagedProcess:
        """The pod's vLLM container: the cluster's model on a free port, kvshard's connector loading from and
        saving to the pod's disk tier (``block_dir``), its log in ``<run>/logs/<pod>-vllm.log``."""
        port = self._ports.get(f"{pod}-vllm") or free_port()  # a pod added by scaling gets a fresh port
        command = _cli("sidecar", "vllm", "--model", str(self.model_path), "--port", str(port),
                       "--exchange-dir", str(self.exchange_dir(pod)), "--block-dir", str(self.pod_disk_dir(pod)))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": VLLM_KV_CACHE_GIB, "TOKENIZERS_PARALLELISM": "false"}
        return ManagedProcess(command,
                              self.logs_dir / f"{pod}-vllm.log", f"http://{HOST}:{port}/health", env=env,
                              start_timeout=self.settings.start_timeout_seconds)

    def exchange_dir(self, pod: str) -> Path:
        """The KV exchange folder the pod's sidecar and vLLM share (``<run>/exchange/<pod>``; the connector
        writes its stats there)."""
        return self.run_dir / "exchange" / pod

    def _sidecar(self, pod: str, token_file: Path) -> ManagedProcess:
        """The pod's sidecar process; with ``engine: vllm`` a :class:`PodContainers` that also runs the
        pod's vLLM (started first, stopped and restarted with the sidecar, both probed for readiness)."""
        url = self.sidecar_urls[pod]
        threads = str(self.settings.threads)
        command = _cli("sidecar", "serve", "--host", HOST, "--port", url.rsplit(":", 1)[1], "--pod-name", pod,
                       "--model", self.settings.model,
                       "--memory-bytes", str(self.settings.memory_bytes),
                       "--disk-dir", str(self.pod_disk_dir(pod)), "--peer-token-file", str(token_file))
        # the sidecar follows placement: it warms its clusters, reports them, and finds peers in etcd;
        # its catalog and prompt are the CacheShard's (the version the placement names), no --dataset
        command += ["--etcd-endpoints", self.etcd_endpoint, *self.etcd_client_flags,
                    "--cacheshard", f"{self.namespace}/{self.name}", "--advertise-url", url]
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
               "KVSHARD_SIDECAR_THREADS": threads, "TOKENIZERS_PARALLELISM": "false",
               "KVSHARD_SIDECAR_TTFT_TARGET_SECONDS": str(self.settings.ttft_target_seconds),
               "KVSHARD_SIDECAR_PRESSURE_WINDOW_SECONDS": str(self.settings.pressure_window_seconds)}
        if self.settings.engine == "vllm":
            vllm = self._vllm(pod)
            command += ["--engine", "vllm", "--vllm-url", vllm.ready_url.rsplit("/", 1)[0],
                        "--vllm-model", self.model_path.name, "--exchange-dir", str(self.exchange_dir(pod))]
            return PodContainers(command, self.logs_dir / f"{pod}.log", url + "/readyz", companions=[vllm], env=env,
                                 start_timeout=self.settings.start_timeout_seconds)
        return ManagedProcess(command, self.logs_dir / f"{pod}.log", url + "/readyz", env=env,
                              start_timeout=self.settings.start_timeout_seconds)

    def _wait(self, fact: Callable[[], bool], timeout: float, what: str,
              process: ManagedProcess | None = None) -> None:
        deadline = time.monotonic() + timeout
        while not fact():
            if process is not None and not process.running:
                raise ClusterStartError(f"{what}: the process exited:\n{process.log_tail()}")
            crashing = [p for p in (self._kubelet.pods.values() if self._kubelet else ()) if p.restarts >= 3]
            if crashing:
                pod = crashing[0]
                raise ClusterStartError(f"{what}: pod {pod.name} keeps crashing ({pod.restarts} restarts):\n"
                                        f"{pod.process.log_tail()}")
            if time.monotonic() >= deadline:
                detail = self._not_ready_detail()
                raise ClusterStartError(f"timed out after {timeout:.0f} s waiting for {what}{detail}")
            time.sleep(0.5)

    def _not_ready_detail(self) -> str:
        if self._kubelet is None:
            return ""
        lines = [f"\n--- {p.name} (restarts {p.restarts}) ---\n{p.process.log_tail(1500)}"
                 for p in self._kubelet.pods.values() if not p.ready]
        return "".join(lines)
