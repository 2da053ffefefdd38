"""Indexed Jobs as local processes: what the Job controller and a kubelet do for the operator's
embedding Jobs (issue 19), so the local cluster runs the very chunks a cluster runs.

:class:`IndexedJob` runs one ``batch/v1`` Job of ``completionMode: Indexed`` from its manifest: one
process per completion index (the pod's container command, ``python`` being this interpreter), at
most ``parallelism`` at once, lowest pending index first, each with the pod's environment —
the container's ``env`` and ``JOB_COMPLETION_INDEX`` — and its output in ``<logs>/<pod>.log``. A
process that exits non-zero is a failed pod: its index is run again by a new pod after a back-off
that doubles with each failure (the Job controller's, shortened), until more than ``backoffLimit``
pods failed; then the Job gets the ``Failed`` condition (``BackoffLimitExceeded``) and what still
runs is stopped. Once every index succeeded it gets ``Complete``. :meth:`IndexedJob.status` is the
Job's ``status`` as the Job controller writes it (``active``, ``succeeded``, ``failed``,
``completedIndexes``, conditions).

The container's volume mount paths are used as they are: locally the "volume" is a host folder
whose path the manifest already names (the local operator's ``embedding_root`` is that folder).

:class:`JobController` (:mod:`kvshard_local.job_controller`) follows the Jobs in the local API and
publishes pods and status; ``kvshard bench embedding`` runs an :class:`IndexedJob` directly.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvshard.processes import ManagedProcess
from kvshard_local.kubeapi import timestamp

log = logging.getLogger(__name__)

PYTHONS = ("python", "python3")


def index_ranges(indexes: set[int]) -> str:
    """``completedIndexes`` as Kubernetes writes it: ``"0-2,4"``."""
    runs: list[list[int]] = []
    for i in sorted(indexes):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    return ",".join(parts)


@dataclasses.dataclass
class JobPod:
    """One pod of the Job: a process running one completion index."""

    name: str
    index: int
    process: ManagedProcess
    phase: str = "Running"
    exit_code: int | None = None


class IndexedJob:
    """One Indexed Job's pods as processes; call :meth:`step` periodically (or :meth:`run`)."""

    def __init__(self, manifest: Mapping[str, Any], logs_dir: Path, *, backoff: float = 1.0,
                 backoff_max: float = 30.0, base_env: Mapping[str, str] | None = None) -> None:
        spec = manifest["spec"]
        if spec.get("completionMode") != "Indexed":
            raise ValueError(f"Job {manifest['metadata']['name']}: only completionMode Indexed runs locally")
        containers = spec["template"]["spec"]["containers"]
        if len(containers) != 1:
            raise ValueError(f"Job {manifest['metadata']['name']}: one container per pod runs locally")
        container = containers[0]
        self.name = str(manifest["metadata"]["name"])
        self.labels = dict((spec["template"].get("metadata") or {}).get("labels") or {})
        self.completions = int(spec.get("completions") or 1)
        self.parallelism = max(1, int(spec.get("parallelism") or 1))
        self.backoff_limit = int(spec.get("backoffLimit", 6))
        command = [*container.get("command", []), *container.get("args", [])]
        if command and command[0] in PYTHONS:
            command[0] = sys.executable
        self.command = command
        self.container = {"name": str(container.get("name", "job")), "image": str(container.get("image", ""))}
        self.env = {**(os.environ if base_env is None else base_env),
                    **{e["name"]: str(e.get("value", "")) for e in container.get("env") or () if "name" in e}}
        self.logs_dir = logs_dir
        self.backoff = backoff
        self.backoff_max = backoff_max
        self.pods: list[JobPod] = []
        self.succeeded: set[int] = set()
        self.failed = 0
        self.not_before = 0.0
        self.start_time: str | None = None
        self.completion_time: str | None = None
        self.condition: dict[str, str] | None = None

    # ------------------------------------------------------------------------------- state

    @property
    def active(self) -> list[JobPod]:
        return [p for p in self.pods if p.phase == "Running"]

    @property
    def finished(self) -> bool:
        return self.condition is not None

    @property
    def complete(self) -> bool:
        return self.condition is not None and self.condition["type"] == "Complete"

    def status(self) -> dict[str, Any]:
        """The Job's ``status`` (zeros written out, so a merge patch clears earlier counts)."""
        out: dict[str, Any] = {"active": len(self.active), "succeeded": len(self.succeeded), "failed": self.failed,
                               "ready": len(self.active), "completedIndexes": index_ranges(self.succeeded),
                               "conditions": [self.condition] if self.condition else []}
        if self.start_time:
            out["startTime"] = self.start_time
        if self.completion_time:
            out["completionTime"] = self.completion_time
        return out

    # ------------------------------------------------------------------------------- running

    def step(self) -> list[JobPod]:
        """Reap exited pods, decide the Job's fate, start pods for pending indexes; returns the pods
        whose phase changed or that were started (for the caller to publish)."""
        changed = self._reap()
        if self.finished:
            return changed
        if len(self.succeeded) >= self.completions:
            self._finish("Complete", "", "")
            return changed
        if self.failed > self.backoff_limit:
            self._finish("Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")
            for pod in self.active:
                pod.process.stop(5.0)
                pod.phase, pod.exit_code = "Failed", None
                changed.append(pod)
            return changed
        if self.start_time is None:
            self.start_time = timestamp()
        if time.monotonic() < self.not_before:
            return changed
        running = {p.index for p in self.active}
        pending = [i for i in range(self.completions) if i not in self.succeeded and i not in running]
        for index in pending[:max(0, self.parallelism - len(running))]:
            changed.append(self._start(index))
        return changed

    def _reap(self) -> list[JobPod]:
        changed = []
        for pod in self.active:
            code = pod.process.process.poll() if pod.process.process is not None else -1
            if code is None:
                continue
            pod.exit_code = code
            changed.append(pod)
            if code == 0:
                pod.phase = "Succeeded"
                self.succeeded.add(pod.index)
                continue
            pod.phase = "Failed"
            self.failed += 1
            delay = min(self.backoff * 2 ** (self.failed - 1), self.backoff_max)
            self.not_before = time.monotonic() + delay
            log.warning("job %s: pod %s (index %d) failed with exit code %s (%d failed, backoffLimit %d); "
                        "retrying its index in %.0f s", self.name, pod.name, pod.index, code, self.failed,
                        self.backoff_limit, delay)
        return changed

    def _start(self, index: int) -> JobPod:
        name = f"{self.name}-{index}-{secrets.token_hex(3)[:5]}"
        env = {**self.env, "JOB_COMPLETION_INDEX": str(index), "HOSTNAME": name}
        process = ManagedProcess(self.command, self.logs_dir / f"{name}.log", ready_url="", env=env)
        process.start(wait=False)
        pod = JobPod(name, index, process)
        self.pods.append(pod)
        log.info("job %s: pod %s runs index %d (pid %s)", self.name, name, index, process.pid)
        return pod

    def _finish(self, type_: str, reason: str, message: str) -> None:
        at = timestamp()
        self.condition = {"type": type_, "status": "True", "lastTransitionTime": at, "lastProbeTime": at,
                          **({"reason": reason} if reason else {}), **({"message": message} if message else {})}
        if type_ == "Complete":
            self.completion_time = timestamp()
        log.info("job %s: %s (%d/%d indexes succeeded, %d pods failed)", self.name, type_, len(self.succeeded),
                 self.completions, self.failed)

    def run(self, timeout: float, period: float = 0.05) -> bool:
        """Step until the Job finished (True when Complete); stop its pods after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        try:
            while not self.finished:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"job {self.name} not finished after {timeout:.0f} s: {self.status()}")
                self.step()
                if not self.finished:
                    time.sleep(period)
        finally:
            self.stop()
        return self.complete

    def stop(self, grace: float = 5.0) -> None:
        """Stop every pod that still runs (the Job deleted, or the cluster stopping)."""
        for pod in self.active:
            pod.process.stop(grace)
