"""One traffic-learned colocation interval of one CacheShard: the routers' co-request reports in
etcd → :func:`kvshard_operator.colocation.colocate` → a new placement generation.

The decision is pure (:mod:`kvshard_operator.colocation`); this is the I/O around it, kept free of
kopf so tests drive it with a real etcd, like :mod:`kvshard_operator.rebalancer`:

1. read the current placement (nothing to learn before the first one);
2. read every live router's report under ``corequest/`` and merge them; with none (no traffic, or
   the routers' leases ran out) stop — silence must not look like a reason to move anything;
3. fold them into the decayed graph kept in :class:`LearnedState` between intervals (one interval is
   a noisy sample; swapping on it alone churns);
4. swap clusters within the movement budget, cluster counts per pod (capacity) and pod load;
5. publish a change as generation G+1 with compare-and-swap on G (items and history policy kept), so a
   concurrent writer (a reconcile, the rebalancer) wins cleanly and this interval is skipped.

Make-before-break as for rebalancing: the new generation names the new holders, their sidecars warm
the clusters, and the routers keep counting the old holder (still warm) until the new one reports.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from kvshard import etcd_store
from kvshard import placement_schema as ps
from kvshard.corequest_schema import merge
from kvshard_operator import colocation, etcd_clients, metrics
from kvshard_operator.reconcile import SecretReader, etcd_access
from kvshard_operator.settings import Settings

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LearnedSettings:
    max_moves: int = 16
    """Clusters whose primary holder may change per interval (two per swap)."""
    keep: float = 0.5
    """Weight the graph keeps from one interval to the next."""
    max_load: float = 1.1
    """No pod's request share above this × the mean."""
    min_gain: float = 0.0
    graph_limit: int = 8192


@dataclasses.dataclass
class LearnedState:
    """The decayed co-request graph and cluster shares, kept between intervals."""

    pairs: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)
    rates: dict[int, float] = dataclasses.field(default_factory=dict)
    at: float | None = None
    """Unix time of the last interval (the next waits ``spec.colocation.intervalSeconds``)."""


def settings_of(colocation_spec: Mapping[str, Any]) -> LearnedSettings:
    """``spec.colocation`` as :class:`LearnedSettings` (defaults as in the CRD)."""
    return LearnedSettings(max_moves=int(colocation_spec.get("maxMovesPerInterval", 8)),
                           max_load=int(colocation_spec.get("maxLoadPercent", 110)) / 100)


async def colocate_shard(*, namespace: str, name: str, spec: Mapping[str, Any], state: LearnedState,
                         settings: Settings, read_secret: SecretReader | None, now: float,
                         slack_seconds: float = 0.0,
                         etcd: etcd_clients.EtcdClients | None = None) -> LearnedOutcome | None:
    """The timer's entry: one interval when ``spec.colocation.enabled`` and the interval has passed
    (None otherwise). The caller holds the CacheShard's lock, so this never interleaves with a
    reconcile or a rebalance (both also publish generations)."""
    config = spec.get("colocation") or {}
    if not config.get("enabled"):
        return None
    interval = float(config.get("intervalSeconds") or 300)
    if state.at is not None and now - state.at < interval - slack_seconds:
        return None
    state.at = now
    try:
        access = await etcd_access(spec, namespace, read_secret)
        async with etcd_clients.session(access, timeout=settings.etcd_timeout_seconds, clients=etcd) as store:
            return await learn_shard(store, namespace, name, state, settings_of(config))
    except (ValueError, etcd_store.EtcdStoreError) as exc:
        logger.warning("colocation skipped: %s", exc)
        return LearnedOutcome("EtcdUnavailable", str(exc))


@dataclasses.dataclass(frozen=True)
class LearnedOutcome:
    reason: str
    """``NoPlacement``, ``NoReports``, ``Unchanged``, ``Colocated``, ``GenerationConflict``, ``EtcdUnavailable``."""
    message: str
    published: int | None = None
    moved: tuple[int, ...] = ()
    local_before: float = 0.0
    local_after: float = 0.0


async def learn_shard(store: etcd_store.EtcdStore, namespace: str, name: str, state: LearnedState,
                      settings: LearnedSettings) -> LearnedOutcome:
    """Run one interval; never raises for etcd trouble (the outcome says what happened)."""
    try:
        current = await store.read_current(namespace, name)
        if current is None:
            return LearnedOutcome("NoPlacement", "no placement published yet")
        reports = await store.read_corequest(namespace, name)
        if not reports:
            return LearnedOutcome("NoReports", "no router published co-requests in the last intervals")
        pairs, rates = merge(reports.values())
        state.pairs = colocation.remember(state.pairs, pairs, keep=settings.keep, limit=settings.graph_limit)
        state.rates = colocation.remember(state.rates, rates, keep=settings.keep, limit=settings.graph_limit)
        result = colocation.colocate(current.assignment, state.pairs, max_moves=settings.max_moves,
                                     rates=state.rates, max_load=settings.max_load, min_gain=settings.min_gain)
        if not result.moved:
            return LearnedOutcome("Unchanged", f"generation {current.generation}: no swap gains",
                                  local_before=result.local_before, local_after=result.local_after)
        new = dataclasses.replace(current, generation=current.generation + 1, assignment=result.assignment)
        written = store.bytes_written
        published = await store.publish(namespace, name, new, expected=current.generation)
        metrics.PLACEMENT_BYTES_WRITTEN.labels(metrics.shard_label(namespace, name)).set(store.bytes_written - written)
    except etcd_store.GenerationConflictError as exc:
        logger.warning("colocation skipped this interval: %s", exc)
        return LearnedOutcome("GenerationConflict", str(exc))
    except (etcd_store.EtcdStoreError, ps.PlacementFormatError) as exc:
        logger.warning("colocation skipped: %s", exc)
        return LearnedOutcome("EtcdUnavailable", str(exc))
    logger.info("colocated: published generation %d, moved clusters %s (co-requested weight on one pod "
                "%.3f → %.3f)", published, list(result.moved), result.local_before, result.local_after)
    return LearnedOutcome("Colocated", f"generation {published}: moved {len(result.moved)} clusters", published,
                          result.moved, result.local_before, result.local_after)
