"""One reconciliation of one CacheShard, from the whole object: validate → pods → catalog →
clusters → assignment (minimal moves from what etcd holds) → publish → status.

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

import numpy as np

from kvshard import etcd_store
from kvshard import placement_schema as ps
from kvshard.rebalance import RebalanceState
from kvshard_operator import catalog as catalogs
from kvshard_operator import conditions as cond
from kvshard_operator import embedding, metrics, placement, selectors, validation
from kvshard_operator.settings import Settings

SecretReader = Callable[[str, str], tuple[str, str]]


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


def _cluster(cat: catalogs.Catalog, k: int, settings: Settings, state: ShardState) -> dict[str, int]:
    """item → cluster, recomputed only when the catalog, k or the clustering settings change."""
    key = (cat.content_hash, k, settings.seed, settings.slack_percent, settings.cooccurrence_percent)
    if state.labels_key == key:
        return state.labels
    vectors = embedding.embed_catalog(cat.ids, cat.texts)
    if settings.cooccurrence_percent and cat.histories:
        row = {item: i for i, item in enumerate(cat.ids)}
        histories = [[row[i] for i in h if i in row] for h in cat.histories]
        vectors = placement.pull_cooccurring(vectors, histories, settings.cooccurrence_percent)
    labels = placement.cluster_items(vectors, k, seed=settings.seed, slack_percent=settings.slack_percent)
    state.labels_key, state.labels = key, {item: int(c) for item, c in zip(cat.ids, labels, strict=True)}
    return state.labels


def _cluster_bytes(cat: catalogs.Catalog, labels: Mapping[str, int], bytes_per_token: int) -> dict[int, int]:
    """Estimated KV bytes per cluster: ~4 characters per token, plus one token per item."""
    sizes = np.zeros(max(labels.values(), default=-1) + 1, dtype=np.int64)
    for item, text in zip(cat.ids, cat.texts, strict=True):
        sizes[labels[item]] += (len(text) // 4 + 1) * bytes_per_token
    return {c: int(b) for c, b in enumerate(sizes)}


async def etcd_credentials(spec: Mapping[str, Any], namespace: str,
                           read_secret: SecretReader | None) -> tuple[str | None, str | None]:
    """``(username, password)`` from the Secret ``spec.etcd.secretRef`` names, ``(None, None)`` without
    one; ValueError when it cannot be read (no API access, missing Secret or keys)."""
    ref = spec["etcd"].get("secretRef")
    if not ref:
        return None, None
    if read_secret is None:
        raise ValueError("no API access to read the etcd Secret")
    return await asyncio.to_thread(read_secret, namespace, ref["name"])


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
) -> Outcome:
    """Place one CacheShard and publish it; never raises for user input or etcd trouble."""
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
        cat = await asyncio.to_thread(catalogs.load_catalog, spec["catalog"], namespace, read_configmap)
        labels = await asyncio.to_thread(_cluster, cat, int(spec["clusters"]), settings, state)
    except catalogs.CatalogError as exc:
        metrics.INVALID.labels(exc.reason).inc()
        return Outcome(_fail(status, generation, exc.reason, str(exc)), reason=exc.reason)

    try:
        username, password = await etcd_credentials(spec, namespace, read_secret)
    except ValueError as exc:
        metrics.INVALID.labels("EtcdSecretInvalid").inc()
        return Outcome(_fail(status, generation, "EtcdSecretInvalid", str(exc)), reason="EtcdSecretInvalid")

    capacity = placement.parse_bytes(spec["capacityPerPod"])
    history = spec.get("userHistory") or {"policy": "ReplicateAll"}
    history_bytes = placement.parse_bytes(history["perPodBytes"]) if history.get("perPodBytes") else 0
    plan = placement.history_plan(history["policy"], history_bytes, live)
    clusters = sorted(set(labels.values()))

    store = etcd_store.EtcdStore(spec["etcd"]["endpoints"], username=username, password=password,
                                 timeout=settings.etcd_timeout_seconds, attempts=1)
    try:
        async with store:
            current = await store.current_generation(namespace, name)
            previous = await store.read_generation(namespace, name, current) if current else None
            if previous is None:
                prior: Mapping[int, Sequence[str]] = {}
            elif dict(previous.item_clusters) == labels:
                prior = previous.assignment
            else:
                prior = placement.inherit_assignment(previous.item_clusters, labels, previous.assignment)
            try:
                # pods/resume/retry keep the rebalancer's extra replicas of hot clusters; a spec edit re-places
                keep_hot = trigger != "spec"
                replicas, sizes = int(spec["itemReplicas"]), _cluster_bytes(cat, labels, settings.kv_bytes_per_token)
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
            )
            if previous is not None and dataclasses.replace(previous, generation=new.generation) == new:
                published = current  # nothing changed: an idempotent resume publishes nothing
            else:
                moved = placement.moved_replicas(prior, assignment)
                published = await store.publish(namespace, name, new, expected=current)
                metrics.REBALANCES.labels(trigger).inc()
                metrics.MOVED_REPLICAS.inc(moved)
                metrics.PLACEMENT_GENERATION.labels(f"{namespace}/{name}").set(published)
                logger.info("published generation %d: %d items, %d clusters on %d pods, %d replicas moved",
                            published, len(labels), len(clusters), len(live), moved)
    except etcd_store.GenerationConflictError as exc:
        metrics.PUBLISH_ERRORS.labels("conflict").inc()
        return _transient(status, generation, state, settings, "GenerationConflict", str(exc))
    except etcd_store.EtcdAuthError as exc:
        metrics.PUBLISH_ERRORS.labels("auth").inc()
        return _transient(status, generation, state, settings, "EtcdAuthFailed", str(exc))
    except etcd_store.EtcdStoreError as exc:
        metrics.PUBLISH_ERRORS.labels("unavailable").inc()
        return _transient(status, generation, state, settings, "EtcdUnavailable", str(exc))
    finally:
        metrics.PLACEMENT_SECONDS.observe(time.perf_counter() - started)

    state.failures, state.retry_at = 0, None
    message = f"{len(labels)} items in {len(clusters)} clusters on {len(live)} pods, generation {published}"
    conditions = cond.ensure_all(status.get("conditions"), observed_generation=generation)
    conditions = cond.set_condition(conditions, cond.PLACED, cond.TRUE, "Placed", message,
                                    observed_generation=generation)
    conditions = cond.set_condition(conditions, cond.DEGRADED, cond.FALSE, "Healthy", "etcd reachable",
                                    observed_generation=generation)
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
         "pods": len(live), "clusters": len(clusters), "itemsPlaced": len(labels)},
        published=published,
        reason="Published",
    )


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
