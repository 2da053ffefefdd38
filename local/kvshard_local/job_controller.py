"""The local cluster's Job controller: the Indexed Jobs created in the local API run as processes.

The operator embeds a catalog by creating an Indexed Job (:mod:`kvshard_operator.embed_job`) and
reading its ``status``; in a cluster the Job controller makes its pods and kubelets run them. Here
this loop does both, a thread of the process that runs the cluster, like :mod:`kvshard_local.kubelet`:
every ``period`` it lists the Jobs of the namespace, runs each new unfinished one as an
:class:`~kvshard_local.jobs.IndexedJob`, publishes a Pod object per pod (``Running``, then
``Succeeded`` or ``Failed``, labelled with the Job's name and completion index as Kubernetes labels
them) and writes the Job's ``status`` through its status subresource — active, succeeded and failed
pods, ``completedIndexes``, ``Complete`` or ``Failed`` (``BackoffLimitExceeded``). A Job deleted
from the API has its pods stopped. Jobs that finished before the loop saw them are left alone.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from kvshard_local.jobs import IndexedJob, JobPod
from kvshard_local.kubeapi import PODS, KubeApi, KubeApiError

log = logging.getLogger(__name__)

JOBS = "/apis/batch/v1/namespaces/{ns}/jobs"
EMBEDDING_CLAIM = "kvshard-embeddings"
"""The claim name the local operator puts in its Jobs (locally the volume is ``<run>/embeddings``)."""


def operator_env(root: Path, poll_seconds: float = 1.0) -> dict[str, str]:
    """The operator's settings that make it embed through Jobs on the shared folder ``root``."""
    return {"KVSHARD_OPERATOR_EMBEDDING_VOLUME_CLAIM": EMBEDDING_CLAIM,
            "KVSHARD_OPERATOR_EMBEDDING_ROOT": str(root), "KVSHARD_OPERATOR_EMBEDDING_IMAGE": "kvshard",
            "KVSHARD_OPERATOR_EMBEDDING_POLL_SECONDS": str(poll_seconds)}


def _finished(job: dict[str, Any]) -> bool:
    return any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
               for c in (job.get("status") or {}).get("conditions") or ())


class JobController:
    """Runs the namespace's Indexed Jobs as processes and keeps their Pods and status in the API."""

    def __init__(self, api: KubeApi, namespace: str, logs_dir: Path, *, period: float = 0.5,
                 backoff: float = 1.0, backoff_max: float = 30.0) -> None:
        self.api = api
        self.namespace = namespace
        self.logs_dir = logs_dir
        self.period = period
        self.backoff = backoff
        self.backoff_max = backoff_max
        self.jobs: dict[str, IndexedJob] = {}
        self._published: dict[str, dict[str, Any]] = {}
        self._skipped: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="job-controller", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop and every pod that still runs; idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        with self._lock:
            for job in self.jobs.values():
                job.stop()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except (KubeApiError, OSError) as exc:
                log.warning("job controller: cannot sync: %s", exc)
            self._stop.wait(self.period)

    def sync(self) -> None:
        """One pass: adopt new Jobs, forget deleted ones, step the rest and publish what changed."""
        listed = (self.api.get(JOBS.format(ns=self.namespace)) or {}).get("items") or []
        with self._lock:
            if self._stop.is_set():
                return
            names = set()
            for manifest in listed:
                name = str(manifest["metadata"]["name"])
                names.add(name)
                if name not in self.jobs and name not in self._skipped:
                    self._adopt(name, manifest)
            for name in [n for n in self.jobs if n not in names]:
                log.info("job %s deleted: stopping its pods", name)
                self.jobs.pop(name).stop()
                self._published.pop(name, None)
            for name, job in self.jobs.items():
                if job.finished and name in self._published:
                    continue
                for pod in job.step():
                    self._publish_pod(job, pod)
                status = job.status()
                if status != self._published.get(name):
                    self.api.patch(JOBS.format(ns=self.namespace) + f"/{name}/status", {"status": status})
                    self._published[name] = status

    def _adopt(self, name: str, manifest: dict[str, Any]) -> None:
        if _finished(manifest):
            self._skipped.add(name)
            return
        try:
            self.jobs[name] = IndexedJob(manifest, self.logs_dir, backoff=self.backoff, backoff_max=self.backoff_max)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("job %s is not run locally: %s", name, exc)
            self._skipped.add(name)
            return
        log.info("job %s: %d indexes, %d at once, backoffLimit %d", name, self.jobs[name].completions,
                 self.jobs[name].parallelism, self.jobs[name].backoff_limit)

    def _publish_pod(self, job: IndexedJob, pod: JobPod) -> None:
        path = PODS.format(ns=self.namespace)
        if pod.phase == "Running":
            labels = {**job.labels, "job-name": job.name, "batch.kubernetes.io/job-name": job.name,
                      "batch.kubernetes.io/job-completion-index": str(pod.index)}
            self.api.create(path, {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod.name, "namespace": self.namespace, "labels": labels,
                             "annotations": {"batch.kubernetes.io/job-completion-index": str(pod.index)}},
                "spec": {"restartPolicy": "Never", "containers": [dict(job.container)]}})
            state: dict[str, Any] = {"running": {}}
        else:
            code = pod.exit_code
            state = {"terminated": {"exitCode": -1 if code is None else code,
                                    "reason": "Completed" if code == 0 else "Error"}}
        self.api.patch(f"{path}/{pod.name}/status", {"status": {
            "phase": pod.phase, "podIP": "127.0.0.1", "hostIP": "127.0.0.1",
            "containerStatuses": [{"name": job.container["name"], "ready": pod.phase == "Running", "restartCount": 0,
                                   "state": state}]}})
