"""Embedding scaled out: the operator runs an Indexed Job over a catalog's missing chunks, tracks it in
the CacheShard's status, and places once every chunk is in (issue 19).

Chosen only when the operator has the shared volume (``settings.embedding_volume_claim``); without it
the operator embeds in process as before. Per reconcile, :func:`stage` plans the chunks
(:mod:`embed_chunks`: only items never embedded), and then

* no chunk missing → the vectors are assembled from the volume and placement goes on, exactly as
  for vectors the catalog carries (so catalog changes read them too, nothing is embedded in process);
* chunks missing → the Job ``<shard>-embed-<plan id>`` is created if absent (completions = chunks,
  ``completionMode: Indexed``, parallelism from ``spec.catalog.embeddings.parallelism``), and
  ``status.embedding`` reports chunks done, active and failed pods; the reconcile polls again after
  ``settings.embedding_poll_seconds``. A failed pod is retried by the Job itself (``backoffLimit``) and
  the status says so; a Job that gave up (condition ``Failed``) sets ``Degraded=EmbeddingFailed`` and a
  new attempt ``<shard>-embed-<plan id>-r<n>`` is created (up to :data:`MAX_ATTEMPTS`; the operator
  never deletes Jobs — ``ttlSecondsAfterFinished`` removes finished ones), and chunks already written
  are not embedded twice.

Every Job is owned by its CacheShard (:func:`owned_by`, a controller ``ownerReference``), so deleting
the CacheShard lets Kubernetes' garbage collector delete a Job still running for it, and
``kubectl get jobs`` shows whose it is. ``blockOwnerDeletion`` stays false: setting it needs ``update``
on ``cacheshards/finalizers``, a verb the operator's role does not otherwise need, and nothing has to
wait for a Job before its CacheShard is gone (the chunks it wrote stay on the volume, reusable).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from kvshard_operator.embed_chunks import ChunkStore, Plan
from kvshard_operator.settings import Settings

PLAN_LABEL = "kvshard.io/embedding-plan"
MAX_ATTEMPTS = 4
SHARD_LABEL = "kvshard.io/cacheshard"


class JobApi(Protocol):
    """The two Job calls the operator makes (:mod:`kube` implements them against the API)."""

    def read_job(self, namespace: str, name: str) -> Mapping[str, Any] | None: ...

    def create_job(self, namespace: str, body: Mapping[str, Any]) -> None: ...


THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS")
"""The thread pools a worker sizes from its environment (numpy's BLAS, the Rust tokenizer)."""


def cpu_threads(quantity: str) -> int:
    """Threads for a CPU request (``"1"``, ``"1500m"``, ``"2.5"``): rounded up, at least one."""
    text = str(quantity).strip()
    cores = int(text[:-1]) / 1000 if text.endswith("m") else float(text)
    return max(1, math.ceil(cores))


def job_name(shard: str, plan: Plan, attempt: int = 0) -> str:
    """``<shard>-embed-<plan id>[-r<attempt>]``, within the 63 characters a Job's pods' labels allow."""
    return f"{shard[:63 - 22]}-embed-{plan.id}" + (f"-r{attempt}" if attempt else "")


def manifest(namespace: str, shard: str, plan: Plan, parallelism: int, settings: Settings,
             attempt: int = 0) -> dict[str, Any]:
    """The Indexed Job of ``plan``: pod ``i`` runs ``embed_worker`` on chunk ``i`` of the shared volume."""
    labels = {"app.kubernetes.io/name": "kvshard-embedding", "app.kubernetes.io/managed-by": "kvshard-operator",
              SHARD_LABEL: shard, PLAN_LABEL: plan.id}
    resources = {"requests": {"cpu": settings.embedding_cpu, "memory": settings.embedding_memory},
                 "limits": {"memory": settings.embedding_memory}}
    threads = str(cpu_threads(settings.embedding_cpu))
    container = {
        "name": "embed", "image": settings.embedding_image, "imagePullPolicy": "IfNotPresent",
        "command": ["python", "-m", "kvshard_operator.embed_worker", "--root", settings.embedding_root,
                    "--plan", plan.id],
        # a pod sees every core of its node: keep BLAS and the tokenizer to the cores it requested
        "env": [{"name": n, "value": threads} for n in THREAD_VARIABLES]
        + [{"name": "TOKENIZERS_PARALLELISM", "value": "false"}],
        "resources": resources,
        "volumeMounts": [{"name": "embeddings", "mountPath": settings.embedding_root}],
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
    }
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": job_name(shard, plan, attempt), "namespace": namespace, "labels": labels},
        "spec": {
            "completionMode": "Indexed", "completions": len(plan.addresses),
            "parallelism": max(1, min(parallelism, len(plan.addresses))),
            "backoffLimit": settings.embedding_backoff_limit, "ttlSecondsAfterFinished": 3600,
            "template": {"metadata": {"labels": labels}, "spec": {
                "restartPolicy": "Never", "automountServiceAccountToken": False,
                "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000,
                                    "seccompProfile": {"type": "RuntimeDefault"}},
                "containers": [container],
                "volumes": [{"name": "embeddings",
                             "persistentVolumeClaim": {"claimName": settings.embedding_volume_claim}}]}},
        },
    }


def owned_by(body: Mapping[str, Any], owner: Mapping[str, str]) -> dict[str, Any]:
    """``body`` with ``owner`` (``apiVersion``, ``kind``, ``name``, ``uid``) as its controller owner."""
    reference = {**{k: owner[k] for k in ("apiVersion", "kind", "name", "uid")}, "controller": True,
                 "blockOwnerDeletion": False}
    return {**body, "metadata": {**body["metadata"], "ownerReferences": [reference]}}


@dataclasses.dataclass(frozen=True)
class Progress:
    """Where an embedding stands: ``status.embedding`` and what the conditions should say."""

    status: dict[str, Any]
    message: str
    failed: bool = False


def gave_up(job: Mapping[str, Any] | None) -> bool:
    """The Job controller's ``Failed`` condition: its backoff limit is spent."""
    js = (job or {}).get("status") or {}
    return any(c.get("type") == "Failed" and c.get("status") == "True" for c in js.get("conditions") or [])


def progress(plan: Plan, done: int, job: Mapping[str, Any] | None, backoff_limit: int,
             attempt: int = 0) -> Progress:
    """The status of ``plan``'s Job (attempt ``attempt``) as the Job controller reports it, in words."""
    name = ((job or {}).get("metadata") or {}).get("name", "")
    js = (job or {}).get("status") or {}
    failed_pods, active = int(js.get("failed") or 0), int(js.get("active") or 0)
    status = {"job": name, "plan": plan.id, "items": plan.items, "chunks": len(plan.addresses), "chunksDone": done,
              "activePods": active, "failedPods": failed_pods, "attempt": attempt + 1}
    message = f"embedding {plan.items} items: {done}/{len(plan.addresses)} chunks in, {active} pods running"
    if gave_up(job):
        more = "no attempts left" if attempt + 1 >= MAX_ATTEMPTS else "a new attempt starts on the next poll"
        return Progress(status, f"embedding Job {name} failed after {failed_pods} failed pod(s) (backoffLimit "
                        f"{backoff_limit}); {more}; {done} chunks already in are kept", failed=True)
    if attempt:
        message += f"; attempt {attempt + 1} of {MAX_ATTEMPTS} (the earlier Job(s) gave up)"
        return Progress(status, message, failed=True)
    if failed_pods:
        message += f"; {failed_pods} pod(s) failed, the Job retries them (backoffLimit {backoff_limit})"
    return Progress(status, message)


def stage(namespace: str, shard: str, texts: list[str], parallelism: int, settings: Settings,
          jobs: JobApi) -> tuple[ChunkStore, Plan, Progress | None]:
    """Plan the catalog's chunks and drive their Job; ``Progress`` None when every vector is in (blocking:
    run it in a thread)."""
    from kvshard_operator.embed_worker import FINGERPRINT

    store = ChunkStore(Path(settings.embedding_root), FINGERPRINT)
    plan = store.plan(texts, settings.embedding_chunk_items)
    if not plan.addresses:
        return store, plan, None
    done = store.done(plan.addresses)
    if done == len(plan.addresses):
        return store, plan, None
    job: Mapping[str, Any] | None = None
    for attempt in range(MAX_ATTEMPTS):  # the first attempt that has not given up, created if absent
        name = job_name(shard, plan, attempt)
        job = jobs.read_job(namespace, name)
        if job is None:
            jobs.create_job(namespace, manifest(namespace, shard, plan, parallelism, settings, attempt))
            job = jobs.read_job(namespace, name)
            break
        if not gave_up(job):
            break
    return store, plan, progress(plan, done, job, settings.embedding_backoff_limit, attempt)
