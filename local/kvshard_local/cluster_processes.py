"""How the local cluster starts each part: its command line, environment, port and files.

Why its own module: a part's process is described the same way whether the cluster starts it at
``up``, the kubelet restarts it after a crash, scaling adds a pod (:mod:`kvshard_local.scaling` calls
:meth:`ClusterProcesses._sidecar`) or a test races a second operator — and each description mirrors
what the chart gives the pod (flags, environment, the Secret's files). Everything here builds or
spawns processes; the order they start in and the waiting are :mod:`kvshard_local.cluster`'s.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import yaml

from kvshard import settings as settings_lib
from kvshard.models import model_scorer
from kvshard.processes import ManagedProcess, ProcessStartError
from kvshard_local import job_controller, manifests
from kvshard_local.kubelet import PodContainers
from kvshard_local.settings import LocalClusterSettings
from kvshard_local.testing_servers import PrometheusServer, free_port, free_ports

HOST = "127.0.0.1"
VLLM_KV_CACHE_GIB = "1"
"""``VLLM_CPU_KVCACHE_SPACE`` of each pod's vLLM: a recommendation's K candidates at a few hundred tokens
each fit many times over, and N pods' vLLMs must fit one small machine."""


class ClusterStartError(RuntimeError):
    """A part of the cluster did not come up; the message names it and carries its log's tail."""


def cli_command(*words: str) -> list[str]:
    """``python -m kvshard.cli <words>``: every part starts through the CLI, as in its pod."""
    return [sys.executable, "-m", "kvshard.cli", *words]


class ClusterProcesses:
    """The process half of :class:`~kvshard_local.cluster.LocalCluster` (which sets these attributes)."""

    settings: LocalClusterSettings
    run_dir: Path
    logs_dir: Path
    namespace: str
    name: str
    model_path: Path
    router_url: str
    sidecar_urls: dict[str, str]
    etcd_endpoint: str
    etcd_client_flags: list[str]
    _ports: dict[str, int]
    _processes: dict[str, ManagedProcess]
    _prometheus: PrometheusServer | None

    @property
    def kubeconfig(self) -> Path:
        return self.run_dir / "kubeconfig"

    @property
    def peer_token_file(self) -> Path:
        """The token sidecars demand of each other on ``GET /v1/blocks/{key}``."""
        return self.run_dir / "peer-token"

    def pod_disk_dir(self, pod: str) -> Path:
        """The pod's disk tier folder (``<run>/blocks/<pod>``); it outlives the pod's restarts."""
        return self.run_dir / "blocks" / pod

    def exchange_dir(self, pod: str) -> Path:
        """The KV exchange folder the pod's sidecar and vLLM share (``<run>/exchange/<pod>``; the connector
        writes its stats there)."""
        return self.run_dir / "exchange" / pod

    def start_operator(self, name: str) -> ManagedProcess:
        """One more operator process as the cluster's own is run (same API, same settings) on free
        ports, e.g. to race two replicas; :meth:`stop_operator` stops it, :meth:`stop` too."""
        if name in self._processes:
            raise ValueError(f"a process named {name!r} already runs")
        health_port, metrics_port = free_ports(2)
        health_url = f"http://{HOST}:{health_port}/healthz"
        command = cli_command("operator", "run", "--metrics-port", str(metrics_port), "--liveness-endpoint", health_url)
        return self._spawn(name, command, ready_url=health_url, env=self._operator_env(), timeout=120)

    def stop_operator(self, name: str) -> None:
        """Stop an operator started by :meth:`start_operator`."""
        self._processes.pop(name).stop()

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
        command = cli_command("sidecar", "vllm", "--model", str(self.model_path), "--port", str(port),
                              "--exchange-dir", str(self.exchange_dir(pod)), "--block-dir", str(self.pod_disk_dir(pod)))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": VLLM_KV_CACHE_GIB, "TOKENIZERS_PARALLELISM": "false"}
        return ManagedProcess(command,
                              self.logs_dir / f"{pod}-vllm.log", f"http://{HOST}:{port}/health", env=env,
                              start_timeout=self.settings.start_timeout_seconds)

    def _sidecar(self, pod: str, token_file: Path) -> ManagedProcess:
        """The pod's sidecar process; with ``engine: vllm`` a :class:`PodContainers` that also runs the
        pod's vLLM (started first, stopped and restarted with the sidecar, both probed for readiness)."""
        url = self.sidecar_urls[pod]
        threads = str(self.settings.threads)
        command = cli_command("sidecar", "serve", "--host", HOST, "--port", url.rsplit(":", 1)[1], "--pod-name", pod,
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
