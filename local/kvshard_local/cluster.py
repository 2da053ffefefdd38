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

This module is the cluster's lifecycle: what starts in which order, what is waited for, and stopping
it all. How each part's process is made is :mod:`kvshard_local.cluster_processes`; watching and
operating a running cluster (readiness, faults) is :mod:`kvshard_local.cluster_ops`.
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import logging
import secrets
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from types import TracebackType
from typing import Any

import yaml

from kvshard.etcd_tls import EtcdTLS
from kvshard.models import model_blend, model_prompt, prompt_for_model, resolve_model
from kvshard.processes import ManagedProcess, http_ok
from kvshard_local import job_controller, manifests
from kvshard_local.certificates import EtcdCertificates
from kvshard_local.cluster_ops import ClusterOps
from kvshard_local.cluster_processes import HOST, ClusterProcesses, ClusterStartError, cli_command
from kvshard_local.kubeapi import CACHESHARDS, KubeApi
from kvshard_local.kubelet import Kubelet, PodProcess
from kvshard_local.run_folder import RunFolderLock, forget_previous_run
from kvshard_local.scaling import LocalAutoscaler, ScaleChange, local_rules, scale_pods
from kvshard_local.settings import LocalClusterSettings
from kvshard_local.testing_servers import EtcdServer, PrometheusServer, free_ports

__all__ = ["ETCD_TLS_SECRET", "ClusterStartError", "LocalCluster"]

log = logging.getLogger(__name__)

ETCD_TLS_SECRET = "kvshard-etcd-client"
"""The Secret (``ca.crt``, ``tls.crt``, ``tls.key``) the local CacheShard's ``spec.etcd.tls`` names."""
SECRETS = "/api/v1/namespaces/{ns}/secrets"


def _answers(url: str) -> bool:
    """True once something answers HTTP at ``url`` (any status: the server listens)."""
    try:
        with urllib.request.urlopen(url, timeout=1.0):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError, ValueError):
        return False



class LocalCluster(ClusterProcesses, ClusterOps):
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
        operator = self._spawn("operator", cli_command("operator", "run", "--metrics-port",
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
        router = self._spawn("router", cli_command("router", "serve", "--host", HOST,
                                                   "--port", str(self._ports["router"]),
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

    def scale(self, pods: int, *, drain_timeout: float = 60.0) -> ScaleChange:
        """Run ``pods`` sidecar pods, adding or removing the highest ordinals as a StatefulSet does:
        a new pod starts, the operator places it, it warms and the router routes to it once warm; a
        leaving pod drains first (``GET /v1/drain``, as the chart's preStop hook), then stops and
        its Pod object is deleted. Returns once the pods run (not once the new ones are warm)."""
        return scale_pods(self, pods, drain_timeout=drain_timeout)

    # ------------------------------------------------------------------------------- helpers

    def acquire(self) -> None:
        """Hold the run folder (:class:`~kvshard_local.run_folder.RunFolderLock`) or raise
        :class:`ClusterAlreadyRunningError` naming the ``kvshard up`` that holds it."""
        self._run_lock.acquire()

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
