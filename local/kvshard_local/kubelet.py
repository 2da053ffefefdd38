"""The kubelet of the local cluster: sidecar processes as Kubernetes pods.

The operator places clusters on *ready pods it sees in the API*, so the local cluster needs what a
kubelet does, on a smaller scale: one Pod object per sidecar process, its ``Ready`` condition
following the sidecar's ``/readyz`` (readiness probe), and a process that died started again
(``restartPolicy: Always``) after a back-off that doubles with each crash, like CrashLoopBackOff.
That is what makes ``kill_pod`` a faithful fault: the operator sees the pod go not-ready, moves
its clusters, and sees it come back.

A pod may hold more than the sidecar (:class:`PodContainers`: with ``--engine vllm``, the pod's own
vLLM server): then its containers start, crash, restart and stop together with the pod, and it is
ready only when every container answers its probe, as a multi-container pod is.

It is a thread of the process that runs the cluster; all its I/O is blocking HTTP on loopback.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvshard.processes import ManagedProcess, http_ok
from kvshard_local.kubeapi import PODS, KubeApi, KubeApiError, pod_status

log = logging.getLogger(__name__)

ENGINE_LABELS: Mapping[str, str] = {"app.kubernetes.io/name": "kvshard-engine"}


class PodContainers(ManagedProcess):
    """A pod of several containers: the sidecar (this process) and ``companions`` (its vLLM).

    Why one object: the kubelet, the scaler and the cluster's stop already treat a pod as one
    :class:`ManagedProcess`; making the pod's other containers part of it means every path that starts,
    kills, restarts or stops a pod (``kill_pod``, scale-in, ``stop()``, a crash restart) takes them along,
    and none can leave a vLLM behind. Companions start first (the sidecar's requests need them) but
    nobody waits on them here: the pod is *ready* (:meth:`ready`) once every container answers its probe.
    A container that died is started again alone, as a kubelet restarts one container of a pod; what
    its process group left (vLLM's engine core) is killed first."""

    def __init__(self, command: list[str], log_path: Path, ready_url: str, *, companions: Sequence[ManagedProcess],
                 env: Mapping[str, str] | None = None, start_timeout: float = 120.0) -> None:
        super().__init__(command, log_path, ready_url, env=env, start_timeout=start_timeout)
        self.companions = list(companions)

    @property
    def containers(self) -> list[ManagedProcess]:
        """The companions and the sidecar (``self``), in start order."""
        return [*self.companions, self]

    @property
    def running(self) -> bool:
        return super().running and all(c.running for c in self.companions)

    def start(self, wait: bool = True) -> None:
        for companion in self.companions:
            if not companion.running:
                companion.stop(0.0)  # reap what a dead container's group left
                companion.start(wait=False)
        if not super().running:
            super().stop(0.0)
            super().start(wait=False)
        if wait:
            self.wait_ready()

    def ready(self) -> bool:
        """Every container answers its readiness probe (the sidecar's ``/readyz``, vLLM's ``/health``)."""
        return all(http_ok(c.ready_url) for c in self.containers)

    def wait_ready(self) -> None:
        for companion in self.companions:
            companion.wait_ready()
        super().wait_ready()

    def kill(self) -> None:
        super().kill()
        for companion in self.companions:
            companion.kill()

    def stop(self, grace: float = 10.0) -> None:
        super().stop(grace)  # the sidecar first: it stops asking its vLLM
        for companion in self.companions:
            companion.stop(grace)

    def log_tail(self, chars: int = 3000) -> str:
        tails = [super().log_tail(chars)]
        tails += [f"--- {c.log_path.name} ---\n{c.log_tail(chars)}" for c in self.companions]
        return "\n".join(tails)


def probe(process: ManagedProcess) -> bool:
    """The pod's readiness: every container's probe for a :class:`PodContainers`, else the sidecar's."""
    return process.ready() if isinstance(process, PodContainers) else http_ok(process.ready_url)


@dataclasses.dataclass
class PodProcess:
    """One pod: its name, the sidecar process behind it and what the kubelet last saw."""

    name: str
    process: ManagedProcess
    url: str
    ready: bool = False
    restarts: int = 0
    restart_at: float | None = None
    published: tuple[bool, int] | None = None


class Kubelet:
    """Keeps one Pod object per sidecar in step with the process (a background thread)."""

    def __init__(self, api: KubeApi, namespace: str, pods: list[PodProcess], *, period: float = 0.5,
                 backoff: float = 1.0, backoff_max: float = 30.0, labels: Mapping[str, str] = ENGINE_LABELS) -> None:
        self.api = api
        self.namespace = namespace
        self.pods = {p.name: p for p in pods}
        self.period = period
        self.backoff = backoff
        self.backoff_max = backoff_max
        self.labels = dict(labels)
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kubelet", daemon=True)

    def start(self) -> None:
        """Create the Pod objects (not ready yet) and start following the processes."""
        for pod in self.pods.values():
            self._create(pod)
        self._thread.start()

    def _create(self, pod: PodProcess) -> None:
        self.api.create(PODS.format(ns=self.namespace), {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod.name, "namespace": self.namespace, "labels": self.labels,
                         "annotations": {"kvshard.io/url": pod.url}},
            "spec": {"restartPolicy": "Always", "containers": [{"name": "sidecar", "image": "kvshard"}]},
        })
        self._publish(pod, False, 0)

    def add(self, pod: PodProcess) -> None:
        """A pod more (a StatefulSet scaled up): its Pod object, then its process, then followed."""
        with self.lock:
            if pod.name in self.pods:
                raise ValueError(f"pod {pod.name} exists")
            self._create(pod)
            pod.process.start(wait=False)
            self.pods[pod.name] = pod
        log.info("pod %s created", pod.name)

    def remove(self, name: str, grace: float = 10.0) -> PodProcess:
        """Stop following a pod, stop its process and delete its Pod object (scaled down); the
        caller drains it first, as a preStop hook does."""
        with self.lock:
            pod = self.pods.pop(name)
        pod.process.stop(grace)
        try:
            self.api.delete(PODS.format(ns=self.namespace) + f"/{name}")
        except KubeApiError as exc:
            log.warning("could not delete pod %s: %s", name, exc)
        log.info("pod %s deleted", name)
        return pod

    def stop(self) -> None:
        """Stop following (processes are left to their owner); idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def kill(self, name: str) -> None:
        """SIGKILL the pod's process group, as a crash would; the loop restarts it after a back-off."""
        pod = self.pods[name]
        with self.lock:
            pod.process.kill()
        log.info("pod %s killed (SIGKILL)", name)

    def all_ready(self) -> bool:
        return all(p.ready for p in self.pods.values())

    def _loop(self) -> None:
        while not self._stop.is_set():
            for pod in list(self.pods.values()):
                if self._stop.is_set():
                    break
                if pod.name not in self.pods:  # removed meanwhile
                    continue
                try:
                    self.sync(pod)
                except (KubeApiError, OSError) as exc:
                    log.warning("kubelet: cannot sync pod %s: %s", pod.name, exc)
            self._stop.wait(self.period)

    def sync(self, pod: PodProcess) -> None:
        """One probe: restart a dead process when its back-off is over, publish readiness changes."""
        with self.lock:
            if self.pods.get(pod.name) is not pod:  # removed (scaled down): nothing to restart or publish
                return
            running = pod.process.running
            if not running and pod.restart_at is None:
                pod.restarts += 1
                delay = min(self.backoff * 2 ** (pod.restarts - 1), self.backoff_max)
                pod.restart_at = time.monotonic() + delay
                code = pod.process.process.returncode if pod.process.process is not None else None
                log.warning("pod %s: process exited (code %s); restarting in %.0f s (restart %d)",
                            pod.name, code, delay, pod.restarts)
            elif not running and pod.restart_at is not None and time.monotonic() >= pod.restart_at:
                pod.restart_at = None
                pod.process.start(wait=False)
                running = True
                log.info("pod %s: process restarted (pid %s)", pod.name, pod.process.pid)
        pod.ready = running and probe(pod.process)
        if (pod.ready, pod.restarts) != pod.published:
            self._publish(pod, pod.ready, pod.restarts)
            log.info("pod %s: Ready=%s (restarts %d)", pod.name, pod.ready, pod.restarts)

    def _publish(self, pod: PodProcess, ready: bool, restarts: int) -> None:
        """Write the pod's status, through the status subresource as a kubelet does."""
        self.api.patch(PODS.format(ns=self.namespace) + f"/{pod.name}/status",
                       {"status": pod_status(ready, restarts)})
        pod.published = (ready, restarts)
