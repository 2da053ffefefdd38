"""One reconciliation of one CacheShard, from the whole object: validate → pods → catalog →
clusters (:mod:`clustering`) → assignment (minimal moves from what etcd holds) → publish → status.

The catalog is published beside the generation (:mod:`kvshard.catalog_schema`) and a changed
catalog is applied as a diff (:mod:`catalog_update`): unchanged items keep their clusters. A
catalog that cannot be read or checked never replaces the last good one: placement goes on with
the last good version and ``Degraded`` names the source and its first bad lines.

Kept free of kopf so tests can drive it directly; ``handlers`` only gathers its inputs and applies
its :class:`Outcome`. User-input errors end in conditions with a reason and no retry (a spec or pod
change triggers the next attempt); transient errors (etcd down, a lost compare-and-swap) end in
``Degraded`` plus ``retry_after``, which the pod-following timer honours with exponential backoff.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvshard import etcd_store
from kvshard import placement_schema as ps
from kvshard.etcd_tls import EtcdTLS
from kvshard.prompt_template import DEFAULT_TEMPLATE, PromptTemplate, TemplateError, missing_fields
from kvshard.rebalance import RebalanceState
from kvshard_operator import catalog as catalogs
from kvshard_operator import catalog_update as updates
from kvshard_operator import catalog_vectors as given
from kvshard_operator import (
    clustering,
    embed_job,
    etcd_clients,
    metrics,
    placement,
    selectors,
    validation,
)
from kvshard_operator import conditions as cond
from kvshard_operator.settings import Settings

SecretReader = Callable[[str, str], Mapping[str, bytes]]
"""(namespace, name) → a Secret's data, decoded; raises ValueError when it cannot be read."""


@dataclasses.dataclass(frozen=True)
class PodView:
    """What the operator needs to know about one pod (from the kopf pod index)."""

    name: str
    labels: Mapping[str, str]
    ready: bool


@dataclasses.dataclass
class ShardState:
    """Per-CacheShard memory between reconciliations (kept in kopf's per-object memo)."""

    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    attempted_pods: tuple[str, ...] | None = None
    """Ready pods seen by the last attempt; the timer re-places when the live set differs."""
    failures: int = 0
    retry_at: float | None = None
    """Monotonic time of the next retry after a transient error, None when none is due."""
    labels_key: tuple[Any, ...] | None = None
    labels: dict[str, int] = dataclasses.field(default_factory=dict)
    """Cached clustering (item → cluster) for ``labels_key``; clustering is the expensive step."""
    rebalanced_at: float | None = None
    """Unix time of the last rebalance attempt (the rebalancer waits ``intervalSeconds`` after it)."""
    rebalance: RebalanceState = dataclasses.field(default_factory=RebalanceState)
    """The rebalance policy's memory (interval counter, per-cluster cooldowns) between intervals."""
    catalog: catalogs.Catalog | None = None
    """The last good catalog (published, or about to be): the diff base and the fallback."""
    vectors: given.HalfArray | None = None
    """The last good catalog's given vectors (``spec.catalog.embeddings`` Field or File), else None."""
    centroids: updates.Centroids | None = None
    centroids_key: tuple[str, int] | None = None
    """(catalog version, k) the centroid sums belong to."""
    catalog_seen: str | None = None
    """What the catalog timer last saw (a version, or an error): it re-places only on a change."""
    catalog_checked_at: float | None = None
    last_change: str = ""
    """``+N ~M −K`` of the last catalog change applied, `` reclustered`` appended when it re-clustered."""
    last_change_moved: int = 0
    """Unchanged items the last catalog change moved to another cluster (0 unless it re-clustered)."""
    embedding: dict[str, Any] | None = None
    """``status.embedding`` of the last embedding Job (:mod:`embed_job`), None when none ran."""


@dataclasses.dataclass
class Outcome:
    """What a reconciliation decided: the status fields to patch, and whether to retry."""

    status: dict[str, Any]
    published: int | None = None
    retry_after: float | None = None
    reason: str = ""


def ready_pods(pods: Sequence[PodView], selector: Mapping[str, Any]) -> list[str]:
    """Names of ready pods that the CacheShard's selector picks, sorted."""
    return sorted(p.name for p in pods if p.ready and selectors.matches(selector, p.labels))


def _fail(status: Mapping[str, Any], generation: int | None, reason: str, message: str,
          *, placed: bool = False) -> dict[str, Any]:
    conditions = cond.ensure_all(status.get("conditions"), observed_generation=generation)
    if not placed:
        conditions = cond.set_condition(conditions, cond.PLACED, cond.FALSE, reason, message,
                                        observed_generation=generation)
    conditions = cond.set_condition(conditions, cond.READY, cond.FALSE, reason, message,
                                    observed_generation=generation)
    return {"observedGeneration": generation, "conditions": conditions}


@dataclasses.dataclass(frozen=True)
class EtcdAccess:
    """How the operator reaches one CacheShard's etcd: ``spec.etcd`` with what its Secrets hold."""

    endpoints: tuple[str, ...]
    username: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    tls: EtcdTLS | None = None

    def store(self, *, timeout: float, attempts: int = 1) -> etcd_store.EtcdStore:
        return etcd_store.EtcdStore(self.endpoints, username=self.username, password=self.password, tls=self.tls,
                                    timeout=timeout, attempts=attempts)


def etcd_error_kind(exc: etcd_store.EtcdStoreError) -> str:
    """The ``kind`` label of ``kvshard_operator_publish_errors_total`` for an etcd error."""
    if isinstance(exc, etcd_store.GenerationConflictError):
        return "conflict"
    if isinstance(exc, etcd_store.EtcdAuthError):
        return "auth"
    return "tls" if isinstance(exc, etcd_store.EtcdTLSError) else "unavailable"


async def etcd_access(spec: Mapping[str, Any], namespace: str, read_secret: SecretReader | None) -> EtcdAccess:
    """``spec.etcd`` resolved: username and password from the Secret ``secretRef`` names, the CA and
    client certificate from the Secret ``tls.secretRef`` names (``ca.crt``, ``tls.crt``, ``tls.key``).
    Both are read on every call, so a renewed certificate is used from the next reconcile on.
    ValueError when a Secret cannot be read or lacks a key (no API access, missing Secret, no CA)."""
    etcd = spec["etcd"]
    ref, tls_spec = etcd.get("secretRef"), etcd.get("tls")
    if (ref or tls_spec) and read_secret is None:
        raise ValueError("no API access to read the etcd Secret")
    username = password = None
    tls = None
    if ref and read_secret is not None:
        data = await asyncio.to_thread(read_secret, namespace, ref["name"])
        if "username" not in data or "password" not in data:
            raise ValueError(f"Secret {namespace}/{ref['name']} needs keys username and password")
        username, password = data["username"].decode(), data["password"].decode()
    if tls_spec and read_secret is not None:
        name = tls_spec["secretRef"]["name"]
        data = await asyncio.to_thread(read_secret, namespace, name)
        tls = EtcdTLS.from_secret(data, secret=f"{namespace}/{name}", server_name=tls_spec.get("serverName", ""))
    return EtcdAccess(tuple(etcd["endpoints"]), username, password, tls)


async def reconcile(
    *,
    namespace: str,
    name: str,
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    generation: int | None,
    pods: Sequence[PodView],
    settings: Settings,
    state: ShardState,
    trigger: str,
    logger: logging.Logger | logging.LoggerAdapter[logging.Logger],
    read_configmap: catalogs.ConfigMapReader | None = None,
    read_secret: SecretReader | None = None,
    read_secret_key: catalogs.SecretKeyReader | None = None,
    preloaded: given.Loaded | catalogs.Catalog | catalogs.CatalogError | None = None,
    jobs: embed_job.JobApi | None = None,
    etcd: etcd_clients.EtcdClients | None = None,
) -> Outcome:
    """Place one CacheShard and publish it; never raises for user input or etcd trouble.

    ``preloaded`` is the catalog (or its error) the catalog timer just read, so it is not read twice
    (a bare :class:`Catalog` is read again when ``spec.catalog.embeddings`` gives vectors). ``etcd``
    is the process's shared stores (:mod:`etcd_clients`); without it a store is opened for this call.
    """
    started = time.perf_counter()
    try:
        spec = validation.validate_spec(spec)
    except validation.InvalidCacheShardError as exc:
        metrics.INVALID.labels("InvalidSpec").inc()
        return Outcome(_fail(status, generation, "InvalidSpec", str(exc)), reason="InvalidSpec")

    live = ready_pods(pods, spec["podSelector"])
    state.attempted_pods = tuple(live)
    if not live:
        metrics.INVALID.labels("NoPods").inc()
        return Outcome(_fail(status, generation, "NoPods", "no ready pod matches spec.podSelector"),
                       reason="NoPods")

    try:
        template = PromptTemplate.from_spec(spec.get("prompt"))
    except TemplateError as exc:
        metrics.INVALID.labels("InvalidSpec").inc()
        return Outcome(_fail(status, generation, "InvalidSpec", str(exc)), reason="InvalidSpec")
    problem: catalogs.CatalogError | None = None
    try:
        if isinstance(preloaded, catalogs.CatalogError):
            raise preloaded
        if isinstance(preloaded, given.Loaded):
            loaded = preloaded
        elif isinstance(preloaded, catalogs.Catalog) and given.VectorSpec.of(spec["catalog"]).source == given.MODEL:
            loaded = given.Loaded(preloaded)
        else:
            loaded = await asyncio.to_thread(given.load, spec["catalog"], namespace, read_configmap, read_secret_key)
        cat = loaded.catalog
        bad = missing_fields(template, ((i, f) for i, _t, f in cat.records()))
        if bad:
            raise catalogs.CatalogError("CatalogInvalid", f"{catalogs.describe(spec['catalog'], namespace)}: "
                                        + "; ".join(bad), bad)
        state.catalog_seen = cat.version
    except catalogs.CatalogError as exc:
        metrics.INVALID.labels(exc.reason).inc()
        state.catalog_seen = f"error: {exc}"
        if state.catalog is None or missing_fields(template, ((i, f) for i, _t, f in state.catalog.records())):
            failed = _fail(status, generation, exc.reason, str(exc))
            failed["conditions"] = cond.set_condition(failed["conditions"], cond.DEGRADED, cond.TRUE, exc.reason,
                                                      str(exc), observed_generation=generation)
            return Outcome(failed, reason=exc.reason)
        problem, cat = exc, state.catalog  # the last good version stays in force
        assert cat is not None
        loaded = given.Loaded(cat, state.vectors)

    if loaded.vectors is None and settings.embedding_volume_claim and jobs is not None:
        embedded = await _embed(loaded, spec, namespace, name, status, generation, settings, state, jobs)
        if isinstance(embedded, Outcome):
            return embedded
        loaded = embedded

    try:
        access = await etcd_access(spec, namespace, read_secret)
    except ValueError as exc:
        metrics.INVALID.labels("EtcdSecretInvalid").inc()
        return Outcome(_fail(status, generation, "EtcdSecretInvalid", str(exc)), reason="EtcdSecretInvalid")

    capacity = placement.parse_bytes(spec["capacityPerPod"])
    history = spec.get("userHistory") or {"policy": "ReplicateAll"}
    history_bytes = placement.parse_bytes(history["perPodBytes"]) if history.get("perPodBytes") else 0
    plan = placement.history_plan(history["policy"], history_bytes, live)
    k = int(spec["clusters"])
    change: updates.Update | None = None

    try:
        async with etcd_clients.session(access, timeout=settings.etcd_timeout_seconds, clients=etcd) as store:
            current = await store.current_generation(namespace, name)
            previous = await store.read_generation(namespace, name, current) if current else None
            try:
                labels, change = await clustering.catalog_labels(loaded, k, previous, store, namespace, name,
                                                                 settings, state, logger)
            except catalogs.CatalogError as exc:
                metrics.INVALID.labels(exc.reason).inc()
                return Outcome(_fail(status, generation, exc.reason, str(exc)), reason=exc.reason)
            clusters = sorted(set(labels.values()))
            if change is not None and previous is not None:  # keep emptied clusters: k stays k
                clusters = sorted(set(clusters) | {c for c in previous.assignment if c < k})
            if previous is None:
                prior: Mapping[int, Sequence[str]] = {}
            elif dict(previous.item_clusters) == labels or change is not None:
                prior = previous.assignment
            else:
                prior = placement.inherit_assignment(previous.item_clusters, labels, previous.assignment)
            try:
                # pods/resume/retry keep the rebalancer's extra replicas of hot clusters; a spec edit re-places
                keep_hot = trigger != "spec"
                replicas = int(spec["itemReplicas"])
                sizes = clustering.cluster_bytes(cat, labels, settings.kv_bytes_per_token)
                capacities = dict.fromkeys(live, capacity)
                assignment = placement.assign_clusters(
                    clusters, capacities, replicas=replicas,
                    previous=placement.base_replicas(prior, replicas) if keep_hot else prior, cluster_bytes=sizes,
                )
                if keep_hot:
                    assignment = placement.keep_extra_replicas(assignment, prior, capacities,
                                                               replicas=replicas, cluster_bytes=sizes)
            except placement.PlacementError as exc:
                reason = "InsufficientCapacity" if isinstance(exc, placement.InsufficientCapacityError) else "NoPods"
                metrics.INVALID.labels(reason).inc()
                return Outcome(_fail(status, generation, reason, str(exc)), reason=reason)
            new = ps.Placement(
                generation=current + 1,
                assignment={c: tuple(h) for c, h in assignment.items()},
                item_clusters=labels,
                pods=tuple(live),
                model=spec["model"]["name"],
                revision=spec["model"].get("revision", ""),
                history_policy=plan.policy,
                history_bytes_per_pod=plan.bytes_per_pod,
                catalog=cat.version,
                prompt=template.as_spec() if template != DEFAULT_TEMPLATE else {},
            )
            if previous is not None and dataclasses.replace(previous, generation=new.generation) == new:
                published = current  # nothing changed: an idempotent resume publishes nothing
            else:
                moved = placement.moved_replicas(prior, assignment)
                written = store.bytes_written
                await store.put_catalog(namespace, name, cat)
                published = await store.publish(namespace, name, new, expected=current)
                await store.prune_catalogs(namespace, name, {cat.version, previous.catalog if previous else ""})
                metrics.PLACEMENT_BYTES_WRITTEN.labels(metrics.shard_label(str(namespace), name)).set(
                    store.bytes_written - written)
                if change is not None:
                    state.last_change = change.diff.summary() + (" reclustered" if change.reclustered else "")
                    state.last_change_moved = change.moved_unchanged
                    logger.info("catalog change %s (%d edited items re-assigned, %d unchanged moved)",
                                state.last_change, len(change.reassigned), change.moved_unchanged)
                metrics.REBALANCES.labels(trigger).inc()
                metrics.MOVED_REPLICAS.inc(moved)
                metrics.PLACEMENT_GENERATION.labels(metrics.shard_label(str(namespace), name)).set(published)
                logger.info("published generation %d: %d items, %d clusters on %d pods, %d replicas moved",
                            published, len(labels), len(clusters), len(live), moved)
    except etcd_store.GenerationConflictError as exc:
        metrics.PUBLISH_ERRORS.labels("conflict").inc()
        return _transient(status, generation, state, settings, "GenerationConflict", str(exc))
    except etcd_store.EtcdAuthError as exc:
        metrics.PUBLISH_ERRORS.labels("auth").inc()
        return _transient(status, generation, state, settings, "EtcdAuthFailed", str(exc))
    except etcd_store.EtcdTLSError as exc:  # retried: cert-manager may issue or renew the Secret meanwhile
        metrics.PUBLISH_ERRORS.labels("tls").inc()
        return _transient(status, generation, state, settings, "EtcdTLSFailed", str(exc))
    except etcd_store.EtcdStoreError as exc:
        metrics.PUBLISH_ERRORS.labels("unavailable").inc()
        return _transient(status, generation, state, settings, "EtcdUnavailable", str(exc))
    finally:
        metrics.PLACEMENT_SECONDS.observe(time.perf_counter() - started)

    state.failures, state.retry_at = 0, None
    state.catalog, state.vectors = cat, loaded.vectors
    message = f"{len(labels)} items in {len(clusters)} clusters on {len(live)} pods, generation {published}"
    conditions = cond.ensure_all(status.get("conditions"), observed_generation=generation)
    conditions = cond.set_condition(conditions, cond.PLACED, cond.TRUE, "Placed", message,
                                    observed_generation=generation)
    if problem is not None:
        conditions = cond.set_condition(
            conditions, cond.DEGRADED, cond.TRUE, problem.reason,
            f"{problem}; the last good catalog (version {cat.version[:12]}, {len(cat)} items) stays in force",
            observed_generation=generation)
    else:
        conditions = cond.set_condition(conditions, cond.DEGRADED, cond.FALSE, "Healthy",
                                        "etcd reachable, catalog valid", observed_generation=generation)
    conditions = cond.set_condition(conditions, cond.READY, cond.TRUE, "Published", message,
                                    observed_generation=generation)
    rebalance = spec.get("rebalance") or {}
    if not rebalance.get("enabled"):
        conditions = cond.set_condition(conditions, cond.REBALANCING, cond.FALSE, "Disabled",
                                        "spec.rebalance.enabled is false", observed_generation=generation)
    elif (cond.get(conditions, cond.REBALANCING) or {}).get("reason") in ("Pending", "Disabled"):
        conditions = cond.set_condition(conditions, cond.REBALANCING, cond.FALSE, "Waiting",
                                        f"first rebalance within {rebalance['intervalSeconds']} s",
                                        observed_generation=generation)
    return Outcome(
        {"observedGeneration": generation, "conditions": conditions, "placementGeneration": published,
         "pods": len(live), "clusters": len(clusters), "itemsPlaced": len(labels),
         "catalog": {"version": cat.version, "items": len(cat), "lastChange": state.last_change,
                     "lastChangeMoved": state.last_change_moved,
                     "imbalancePercent": round(updates.imbalance(labels) * 100)},
         **({"embedding": state.embedding} if state.embedding is not None else {})},
        published=published,
        reason="Published",
    )


async def _embed(loaded: given.Loaded, spec: Mapping[str, Any], namespace: str, name: str,
                 status: Mapping[str, Any], generation: int | None, settings: Settings, state: ShardState,
                 jobs: embed_job.JobApi) -> given.Loaded | Outcome:
    """The catalog with its vectors from the shared volume once its embedding Job has written every
    chunk; until then an Outcome that reports the Job's progress and polls again."""
    texts = list(loaded.catalog.texts)
    parallelism = int((spec["catalog"].get("embeddings") or {}).get("parallelism", settings.embedding_parallelism))
    try:
        store, plan, report = await asyncio.to_thread(embed_job.stage, namespace, name, texts, parallelism,
                                                      settings, jobs)
        if report is None:
            vectors = await asyncio.to_thread(store.assemble, texts)
    except (OSError, KeyError, ValueError, RuntimeError) as exc:  # the volume or the Job API (ApiException)
        return _transient(status, generation, state, settings, "EmbeddingUnavailable", f"{type(exc).__name__}: {exc}")
    if report is None:
        if state.embedding is not None and state.embedding.get("state") != "Complete":
            state.embedding = {**state.embedding, "chunksDone": state.embedding.get("chunks", 0), "activePods": 0,
                               "state": "Complete", "message": f"all chunks in ({len(texts)} items)"}
        return given.Loaded(loaded.catalog, vectors)
    state.embedding = {**report.status, "state": "Failed" if report.failed else "Running", "message": report.message}
    state.retry_at = time.monotonic() + settings.embedding_poll_seconds
    conditions = cond.ensure_all(status.get("conditions"), observed_generation=generation)
    if not cond.is_true(conditions, cond.PLACED):
        conditions = cond.set_condition(conditions, cond.PLACED, cond.FALSE, "Embedding", report.message,
                                        observed_generation=generation)
        conditions = cond.set_condition(conditions, cond.READY, cond.FALSE, "Embedding", report.message,
                                        observed_generation=generation)
    if report.failed or report.status["failedPods"]:
        reason = "EmbeddingFailed" if report.failed else "EmbeddingPodFailed"
        conditions = cond.set_condition(conditions, cond.DEGRADED, cond.TRUE, reason, report.message,
                                        observed_generation=generation)
    return Outcome({"observedGeneration": generation, "conditions": conditions, "embedding": state.embedding},
                   retry_after=settings.embedding_poll_seconds, reason="Embedding")


def _transient(status: Mapping[str, Any], generation: int | None, state: ShardState, settings: Settings,
               reason: str, message: str) -> Outcome:
    """Degraded with a reason, and a retry after an exponentially growing delay."""
    state.failures += 1
    delay = min(settings.retry_backoff_seconds * 2 ** (state.failures - 1), settings.retry_backoff_max)
    state.retry_at = time.monotonic() + delay
    conditions = cond.ensure_all(status.get("conditions"), observed_generation=generation)
    conditions = cond.set_condition(conditions, cond.DEGRADED, cond.TRUE, reason,
                                    f"{message}; retrying in {delay:.1f} s", observed_generation=generation)
    return Outcome({"observedGeneration": generation, "conditions": conditions}, retry_after=delay, reason=reason)
