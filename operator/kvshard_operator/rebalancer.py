"""One rebalance interval of one CacheShard: Prometheus → heat snapshot → policy → new generation.

The decision is :func:`kvshard.rebalance.rebalance` (pure, scenario-tested); this module is the I/O
around it, kept free of kopf so tests drive it with a real etcd and a real Prometheus:

1. read the current placement from etcd (nothing to rebalance before the first one);
2. query Prometheus (:mod:`kvshard_operator.prometheus`) for per-cluster request rates and per-pod
   load and hit ratio over the window;
3. store the snapshot under ``heat/<ms>`` with a lease of ~10 intervals, beside the placement it
   describes, so anyone can see what the decision was based on;
4. without traffic, stop (``NoTraffic``): missing metrics must not look like cold clusters whose
   replicas can go;
5. run the policy over the placement's pods, the warm sets the sidecars reported and the policy
   state kept between intervals (cooldowns);
6. publish any change as generation G+1 with compare-and-swap on G (items and history policy kept),
   so a concurrent writer wins cleanly and this interval is skipped.

Prometheus or etcd failures end the interval with a reason and publish nothing. The caller holds the
CacheShard's lock, so a rebalance never interleaves with a pod- or spec-triggered reconcile, and
:func:`kvshard_operator.placement.keep_extra_replicas` makes those reconciles keep the hot replicas.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from kvshard import etcd_store
from kvshard import placement_schema as ps
from kvshard.rebalance import Action, PodStats, RebalanceSettings, rebalance
from kvshard_operator import conditions as cond
from kvshard_operator import etcd_clients, metrics, validation
from kvshard_operator.prometheus import Heat, PrometheusClient, PrometheusError
from kvshard_operator.reconcile import SecretReader, ShardState, etcd_access, etcd_error_kind
from kvshard_operator.settings import Settings

HEAT_TTL_INTERVALS = 10
"""Heat snapshots live this many intervals (etcd deletes them with their lease)."""
_LISTED_ACTIONS = 8


@dataclasses.dataclass(frozen=True)
class RebalanceOutcome:
    """What one interval did: the status fields to patch (empty: leave status alone)."""

    reason: str
    message: str
    status: dict[str, Any]
    published: int | None = None
    actions: tuple[Action, ...] = ()
    heat_key: str | None = None


def parse_time(value: Any) -> float | None:
    """Unix seconds of an RFC 3339 timestamp such as ``status.lastRebalanceTime`` (None if absent/bad)."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def due(state: ShardState, status: Mapping[str, Any], interval_seconds: float, now: float,
        slack_seconds: float = 0.0) -> bool:
    """Whether the shard's interval has passed since its last attempt (remembered in memory, or
    ``status.lastRebalanceTime`` after an operator restart). ``slack_seconds`` (half a timer tick)
    keeps a tick that lands a hair early from postponing the interval by a whole tick."""
    last = state.rebalanced_at if state.rebalanced_at is not None else parse_time(status.get("lastRebalanceTime"))
    return last is None or now - last >= interval_seconds - slack_seconds


def policy_settings(rebalance_spec: Mapping[str, Any], window_seconds: float = 0.0) -> RebalanceSettings:
    """The policy knobs a CacheShard sets (``hotThresholdPercent``, ``maxMovesPerInterval``, which
    bounds additions and drops alike) and the Prometheus window the rates come from (so counting noise
    is not mistaken for heat); the rest keep the policy's defaults."""
    budget = int(rebalance_spec.get("maxMovesPerInterval", 10))
    return RebalanceSettings(hot_percent=int(rebalance_spec.get("hotThresholdPercent", 200)),
                             move_budget=budget, drop_budget=budget, window_seconds=round(window_seconds))


def summarize(actions: Sequence[Action]) -> str:
    """``"replicated 2, moved 1, dropped 0"``."""
    counts = Counter(a.kind for a in actions)
    return f"replicated {counts['replicate']}, moved {counts['move']}, dropped {counts['drop']}"


def describe(actions: Sequence[Action], limit: int = _LISTED_ACTIONS) -> str:
    """The actions compactly: ``+3@engine-2`` (replica added), ``5:engine-0→engine-1`` (moved),
    ``-7@engine-1`` (dropped); at most ``limit`` of them, then how many more."""
    parts = []
    for a in actions[:limit]:
        if a.kind == "replicate":
            parts.append(f"+{a.cluster}@{a.pod}")
        elif a.kind == "move":
            parts.append(f"{a.cluster}:{a.source}→{a.pod}")
        else:
            parts.append(f"-{a.cluster}@{a.pod}")
    if len(actions) > limit:
        parts.append(f"and {len(actions) - limit} more")
    return ", ".join(parts)


def snapshot(heat: Heat, generation: int, at: float) -> dict[str, Any]:
    """The JSON stored under ``heat/``: what the decision for ``generation`` was based on."""
    return {
        "at": round(at, 3),
        "generation": generation,
        "cluster_rates": {str(c): r for c, r in sorted(heat.cluster_rates.items())},
        "pod_load": dict(sorted(heat.pod_load.items())),
        "pod_hit_ratio": dict(sorted(heat.pod_hit_ratio.items())),
    }


def _timestamp(at: float) -> str:
    return datetime.datetime.fromtimestamp(int(at), datetime.UTC).isoformat().replace("+00:00", "Z")


def _status(status: Mapping[str, Any], generation: int | None, condition: str, reason: str, message: str,
            *, at: float | None = None, published: int | None = None) -> dict[str, Any]:
    conditions = cond.set_condition(cond.ensure_all(status.get("conditions"), observed_generation=generation),
                                    cond.REBALANCING, condition, reason, message, observed_generation=generation)
    out: dict[str, Any] = {"conditions": conditions}
    if at is not None:
        out["lastRebalanceTime"] = _timestamp(at)
    if published is not None:
        out["placementGeneration"] = published
    return out


async def rebalance_shard(
    *,
    namespace: str,
    name: str,
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    generation: int | None,
    settings: Settings,
    state: ShardState,
    logger: logging.Logger | logging.LoggerAdapter[logging.Logger],
    read_secret: SecretReader | None = None,
    etcd: etcd_clients.EtcdClients | None = None,
    now: float | None = None,
) -> RebalanceOutcome | None:
    """Run one interval (see the module docstring); None when there is nothing to do yet (invalid
    spec, rebalancing disabled, no placement published). Never raises for Prometheus or etcd trouble.
    The caller decides *when* (:func:`due`) and holds ``state.lock``."""
    try:
        spec = validation.validate_spec(spec)
    except validation.InvalidCacheShardError:
        return None  # the change handlers report the spec; there is nothing to rebalance
    config = spec.get("rebalance") or {}
    if not config.get("enabled"):
        return None
    at = time.time() if now is None else now
    interval = float(config["intervalSeconds"])
    window = settings.rebalance_window_seconds or interval

    def finish(outcome: str, condition: str, message: str, *, stamp: bool = True,
               published: int | None = None, **extra: Any) -> RebalanceOutcome:
        metrics.REBALANCE_INTERVALS.labels(outcome).inc()
        patch = _status(status, generation, condition, outcome, message, at=at if stamp else None,
                        published=published)
        return RebalanceOutcome(outcome, message, patch, published=published, **extra)

    try:
        access = await etcd_access(spec, namespace, read_secret)
    except ValueError as exc:
        state.rebalanced_at = at
        return finish("EtcdUnavailable", cond.FALSE, f"cannot read the etcd Secrets: {exc}", stamp=False)

    try:
        async with etcd_clients.session(access, timeout=settings.etcd_timeout_seconds, clients=etcd) as store:
            current = await store.read_current(namespace, name)
            if current is None:
                return None  # the first placement is not published yet
            state.rebalanced_at = at
            try:
                async with PrometheusClient(spec["prometheus"]["url"],
                                            timeout=settings.prometheus_timeout_seconds) as prom:
                    heat = await prom.heat(namespace, name, window)
            except PrometheusError as exc:
                logger.warning("rebalance skipped: %s", exc)
                return finish("PrometheusUnavailable", cond.FALSE, str(exc), stamp=False)
            key = await store.put_heat(namespace, name, snapshot(heat, current.generation, at),
                                       ttl_seconds=max(1, round(HEAT_TTL_INTERVALS * interval)), timestamp=at)
            if not heat.has_traffic:
                logger.info("rebalance: no traffic in the last %.0f s; placement left as is", window)
                return finish("NoTraffic", cond.FALSE, f"no requests in the last {window:.0f} s", heat_key=key)
            reports = await store.read_warm(namespace, name)
            pods = {p: PodStats(load=heat.pod_load.get(p, 0.0), hit_ratio=heat.pod_hit_ratio.get(p, 1.0))
                    for p in current.pods}
            warm = {p: set(r.clusters) for p, r in reports.items() if p in pods}
            result = rebalance(heat.cluster_rates, pods, current.assignment, warm, policy_settings(config, window),
                               state.rebalance)
            if not result.actions:
                state.rebalance = result.state
                return finish("Balanced", cond.FALSE,
                              f"generation {current.generation} is balanced: no cluster above "
                              f"{config['hotThresholdPercent']}% of the mean rate, no pod overloaded", heat_key=key)
            new = dataclasses.replace(current, generation=current.generation + 1, assignment=result.assignment)
            written = store.bytes_written
            published = await store.publish(namespace, name, new, expected=current.generation)
            metrics.PLACEMENT_BYTES_WRITTEN.labels(metrics.shard_label(str(namespace), name)).set(
                store.bytes_written - written)
            state.rebalance = result.state
    except etcd_store.GenerationConflictError as exc:
        metrics.PUBLISH_ERRORS.labels("conflict").inc()
        metrics.REBALANCE_INTERVALS.labels("GenerationConflict").inc()
        logger.warning("rebalance skipped this interval: %s", exc)
        return RebalanceOutcome("GenerationConflict", str(exc), {})
    except (etcd_store.EtcdStoreError, ps.PlacementFormatError) as exc:
        if isinstance(exc, etcd_store.EtcdStoreError):
            metrics.PUBLISH_ERRORS.labels(etcd_error_kind(exc)).inc()
        state.rebalanced_at = at
        logger.warning("rebalance skipped: %s", exc)
        return finish("EtcdUnavailable", cond.FALSE, str(exc), stamp=False)

    kinds = Counter(a.kind for a in result.actions)
    for kind, n in kinds.items():
        metrics.REBALANCE_ACTIONS.labels(kind).inc(n)
    metrics.REBALANCES.labels("rebalance").inc()
    metrics.MOVED_REPLICAS.inc(kinds["replicate"] + kinds["move"])
    metrics.PLACEMENT_GENERATION.labels(metrics.shard_label(str(namespace), name)).set(published)
    summary = summarize(result.actions)
    logger.info("rebalanced: published generation %d (%s): %s", published, summary,
                "; ".join(f"{a.kind} {a.cluster} → {a.pod} ({a.reason})" for a in result.actions))
    return finish("Rebalanced", cond.TRUE, f"generation {published}: {summary} ({describe(result.actions)})",
                  published=published, actions=tuple(result.actions), heat_key=key)
