"""kopf handlers for CacheShard — thin: gather inputs, call :mod:`reconcile`, patch status.

* create / update / resume → place and publish (update re-places with minimal movement, because
  the previous generation in etcd seeds the assignment);
* every ready pod is indexed; a per-CacheShard timer compares the selected ready pods with those of
  the last attempt and re-places incrementally when they differ (this is what makes HPA scaling
  work), and retries transient failures (etcd down) with exponential backoff;
* delete → the finalizer removes every etcd key of the CacheShard first;
* a rebalance timer re-replicates hot clusters and drops cold replicas once per
  ``spec.rebalance.intervalSeconds``, from Prometheus rates (:mod:`rebalancer`);
* a warm daemon watches the pods' warm reports in etcd, and a warm timer writes what it decided into
  the ``Warm`` condition and the ``warmPods``/``warmClusters`` counts (:mod:`warmth`);
* every etcd call goes through the process's shared connections (:mod:`etcd_clients`), and the etcd
  Secrets come from a Secret index, not from the API on every tick;
* a catalog timer re-reads ``spec.catalog`` every ``spec.catalog.refreshSeconds`` (ConfigMap edited,
  file replaced, URL content changed) and re-places when it changed: polling, because a file and a URL
  cannot be watched, and one mechanism is easier to reason about than three.

Settings (:class:`~kvshard_operator.settings.Settings`) are taken when this module is imported, because
kopf fixes timer intervals at registration: those ``kvshard operator run`` configured (its flags over the
``KVSHARD_OPERATOR_*`` environment), else the environment's (``kopf run -m kvshard_operator.handlers``).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
import time
from collections.abc import Mapping
from typing import Any

import kopf

from kvshard import etcd_store
from kvshard_operator import (
    catalog,
    catalog_vectors,
    crd,
    etcd_clients,
    guard,
    kube,
    learned,
    metrics,
    rebalancer,
    validation,
    warmth,
)
from kvshard_operator import conditions as cond
from kvshard_operator import settings as settings_mod
from kvshard_operator.reconcile import (
    EtcdAccess,
    PodView,
    SecretReader,
    ShardState,
    etcd_access,
    etcd_error_kind,
    ready_pods,
    reconcile,
)

SETTINGS = settings_mod.current()
RESOURCE = (crd.GROUP, crd.VERSION, crd.PLURAL)
PodIndex = kopf.Index[str | None, PodView]
SecretIndex = kopf.Index[tuple[str | None, str], dict[str, bytes]]
ETCD_SECRET_KEYS = frozenset({"ca.crt", "username"})
"""A Secret holding one of these keys may be a ``spec.etcd`` Secret (``tls.secretRef``: ``ca.crt``,
``tls.crt``, ``tls.key``; ``secretRef``: ``username``, ``password``): only those are indexed."""


def _is_ready(status: Mapping[str, Any], meta: Mapping[str, Any]) -> bool:
    if meta.get("deletionTimestamp"):
        return False
    for condition in status.get("conditions") or ():
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return False


@kopf.on.startup()
def configure(*, settings: kopf.OperatorSettings, logger: kopf.Logger, **_: Any) -> None:
    """Our finalizer, progress kept in annotations (not in status), peering per settings."""
    settings.persistence.finalizer = SETTINGS.finalizer
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=SETTINGS.annotation_prefix)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=SETTINGS.annotation_prefix)
    settings.peering.standalone = not SETTINGS.peering
    settings.posting.level = logging.WARNING
    etcd_clients.CLIENTS.backoff_seconds = SETTINGS.retry_backoff_seconds
    etcd_clients.CLIENTS.backoff_max = SETTINGS.retry_backoff_max
    metrics.ETCD_QUOTA_BYTES.set(SETTINGS.etcd_quota_bytes)
    logger.info("kvshard operator configured: finalizer %s, peering %s", SETTINGS.finalizer,
                "on" if SETTINGS.peering else "off")


@kopf.on.cleanup()
async def close_etcd(*, logger: kopf.Logger, **_: Any) -> None:
    """Close the process's etcd connections (:mod:`etcd_clients`)."""
    logger.info("closing %d etcd connections (%d opened since start)", len(etcd_clients.CLIENTS),
                etcd_clients.CLIENTS.opened)
    await etcd_clients.CLIENTS.close()


@kopf.index("pods")
def pod_index(*, namespace: str | None, name: str, labels: Mapping[str, str], status: kopf.Status,
              meta: kopf.Meta, **_: Any) -> dict[str | None, PodView]:
    """Every pod by namespace, with its labels and readiness (selectors are evaluated later)."""
    return {namespace: PodView(name=name, labels=dict(labels), ready=_is_ready(status, meta))}


def _holds_etcd_material(body: kopf.Body, **_: Any) -> bool:
    return bool(ETCD_SECRET_KEYS & set(body.get("data") or {}))


@kopf.index("secrets", when=_holds_etcd_material)
def secret_index(*, namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[tuple[str | None, str],
                                                                                      dict[str, bytes]]:
    """The etcd Secrets (CA and client certificate, or username and password) by (namespace, name),
    decoded: every timer resolves ``spec.etcd`` from here instead of reading the Secret from the API
    on every tick (a renewed certificate arrives with the watch). Other Secrets are not kept."""
    data = body.get("data") or {}
    return {(namespace, name): {key: base64.b64decode(value) for key, value in data.items()}}


def _secrets(index: SecretIndex | None) -> SecretReader:
    """A reader of etcd Secrets from ``index``, falling back to the API on a miss (the watch may not
    have delivered a Secret created a moment ago, and an unindexed Secret gets its error from there)."""
    def read(namespace: str, name: str) -> Mapping[str, bytes]:
        if index is not None:
            for data in index.get((namespace, name), ()):
                return data
        return kube.read_secret(namespace, name)

    return read


def _state(memo: Any) -> ShardState:
    state = getattr(memo, "kvshard_shard", None)
    if state is None:
        state = ShardState()
        memo.kvshard_shard = state
    return state


def _changed(status: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of ``new`` that differ from ``status``: a patch that changes nothing still costs
    a call, and kopf then waits for an event that never comes (a real API server keeps the
    resourceVersion of a no-op write) before it handles the next change."""
    return {k: v for k, v in new.items() if status.get(k) != v}


def _pods(index: PodIndex | None, namespace: str | None) -> list[PodView]:
    return list(index.get(namespace, [])) if index is not None else []


def _owner(name: str, meta: kopf.Meta) -> dict[str, str] | None:
    """The CacheShard as the owner of what the operator creates for it (its embedding Jobs)."""
    uid = meta.get("uid")
    if not uid:
        return None
    return {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND, "name": name, "uid": str(uid)}


async def _place(
    trigger: str, *, namespace: str | None, name: str, spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta,
    patch: kopf.Patch, memo: Any, pod_index: PodIndex | None, logger: kopf.Logger,
    preloaded: catalog_vectors.Loaded | catalog.CatalogError | None = None, secret_index: SecretIndex | None = None,
) -> None:
    state = _state(memo)
    async with state.lock:
        state.catalog_checked_at = time.monotonic()
        outcome = await reconcile(
            namespace=str(namespace), name=name, spec=dict(spec), status=dict(status),
            generation=meta.get("generation"), pods=_pods(pod_index, namespace), settings=SETTINGS, state=state,
            trigger=trigger, logger=logger,
            read_configmap=kube.read_configmap, read_secret=_secrets(secret_index),
            read_secret_key=kube.read_secret_key, preloaded=preloaded,
            jobs=kube.Jobs(owner=_owner(name, meta)), etcd=etcd_clients.CLIENTS,
        )
    published = outcome.published
    if published is not None and published != status.get("placementGeneration"):
        patch.status.update(_changed(status, warmth.reset(outcome.status, meta.get("generation"), published)))
    else:
        patch.status.update(_changed(status, outcome.status))
    if outcome.retry_after is not None:
        logger.warning("placement not published (%s); retrying in %.1f s", outcome.reason, outcome.retry_after)
    elif outcome.published is None:
        logger.warning("placement stopped: %s", outcome.reason)


@kopf.on.create(*RESOURCE)
async def create_shard(
    *, namespace: str | None, name: str, spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta,
    patch: kopf.Patch, memo: Any, logger: kopf.Logger, pod_index: PodIndex | None = None,
    secret_index: SecretIndex | None = None, **_: Any,
) -> None:
    """A new CacheShard: first placement, generation 1."""
    await _place("created", namespace=namespace, name=name, spec=spec, status=status, meta=meta, patch=patch,
                 memo=memo, pod_index=pod_index, logger=logger, secret_index=secret_index)


@kopf.on.update(*RESOURCE)
async def update_shard(
    *, namespace: str | None, name: str, spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta,
    patch: kopf.Patch, memo: Any, logger: kopf.Logger, pod_index: PodIndex | None = None,
    secret_index: SecretIndex | None = None, **_: Any,
) -> None:
    """The spec changed: re-place, keeping every cluster replica that may stay where it is."""
    await _place("spec", namespace=namespace, name=name, spec=spec, status=status, meta=meta, patch=patch,
                 memo=memo, pod_index=pod_index, logger=logger, secret_index=secret_index)


@kopf.on.resume(*RESOURCE)
async def resume_shard(
    *, namespace: str | None, name: str, spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta,
    patch: kopf.Patch, memo: Any, logger: kopf.Logger, pod_index: PodIndex | None = None,
    secret_index: SecretIndex | None = None, **_: Any,
) -> None:
    """Operator restart: reconcile; publishes nothing if etcd already holds this placement."""
    await _place("resume", namespace=namespace, name=name, spec=spec, status=status, meta=meta, patch=patch,
                 memo=memo, pod_index=pod_index, logger=logger, secret_index=secret_index)


@kopf.timer(*RESOURCE, interval=SETTINGS.pod_sync_seconds, initial_delay=SETTINGS.pod_sync_seconds)
async def follow_pods(
    *, namespace: str | None, name: str, spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta,
    patch: kopf.Patch, memo: Any, logger: kopf.Logger, pod_index: PodIndex | None = None,
    secret_index: SecretIndex | None = None, **_: Any,
) -> None:
    """Re-place when the selected ready pods changed, or when a transient-error retry is due."""
    state = _state(memo)
    if state.lock.locked():
        return
    due = state.retry_at is not None and time.monotonic() >= state.retry_at
    selector = spec.get("podSelector") or {}
    try:
        live = tuple(ready_pods(_pods(pod_index, namespace), selector))
    except ValueError:
        return  # an invalid selector is reported by the change handlers
    if state.attempted_pods is None or (live == state.attempted_pods and not due):
        return
    await _place("pods" if live != state.attempted_pods else "retry", namespace=namespace, name=name, spec=spec,
                 status=status, meta=meta, patch=patch, memo=memo, pod_index=pod_index, logger=logger,
                 secret_index=secret_index)


@kopf.timer(*RESOURCE, interval=SETTINGS.catalog_check_seconds, initial_delay=SETTINGS.catalog_check_seconds)
async def follow_catalog(
    *, namespace: str | None, name: str, spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta,
    patch: kopf.Patch, memo: Any, logger: kopf.Logger, pod_index: PodIndex | None = None,
    secret_index: SecretIndex | None = None, **_: Any,
) -> None:
    """Re-read the catalog once per ``spec.catalog.refreshSeconds``; re-place when what it holds
    (its version, or the error reading it) differs from what the last placement saw."""
    source = spec.get("catalog") or {}
    state = _state(memo)
    if "builtin" in source or state.lock.locked() or state.catalog_seen is None:
        return  # built-ins never change; before the first placement the change handlers own the shard
    refresh = float(source.get("refreshSeconds") or 60)
    if state.catalog_checked_at is not None and time.monotonic() - state.catalog_checked_at < refresh:
        return
    state.catalog_checked_at = time.monotonic()
    found: catalog_vectors.Loaded | catalog.CatalogError
    try:  # with its vectors (spec.catalog.embeddings), checked as the placement will check them
        loaded = await asyncio.to_thread(catalog_vectors.load, dict(source), str(namespace), kube.read_configmap,
                                         kube.read_secret_key)
        found, seen = loaded, loaded.catalog.version
    except catalog.CatalogError as exc:
        found, seen = exc, f"error: {exc}"
    if seen == state.catalog_seen:
        return
    logger.info("catalog changed (%s); re-placing", seen if isinstance(found, catalog.CatalogError)
                else f"version {seen[:12]}, {len(found.catalog)} items")
    await _place("catalog", namespace=namespace, name=name, spec=spec, status=status, meta=meta, patch=patch,
                 memo=memo, pod_index=pod_index, logger=logger, secret_index=secret_index, preloaded=found)


@kopf.timer(*RESOURCE, interval=SETTINGS.rebalance_check_seconds, initial_delay=SETTINGS.rebalance_check_seconds)
async def rebalance(
    *, namespace: str | None, name: str, spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta,
    patch: kopf.Patch, memo: Any, logger: kopf.Logger, secret_index: SecretIndex | None = None, **_: Any,
) -> None:
    """Hot/cold rebalancing: once per ``spec.rebalance.intervalSeconds``, skipped while a
    (re)placement holds the shard's lock (the next tick tries again)."""
    rebalance_spec = spec.get("rebalance") or {}
    if not rebalance_spec.get("enabled"):
        return
    state = _state(memo)
    interval = float(rebalance_spec.get("intervalSeconds") or 300)
    if state.lock.locked() or not rebalancer.due(state, status, interval, time.time(),
                                                 slack_seconds=SETTINGS.rebalance_check_seconds / 2):
        return
    async with state.lock:
        outcome = await rebalancer.rebalance_shard(
            namespace=str(namespace), name=name, spec=dict(spec), status=dict(status),
            generation=meta.get("generation"), settings=SETTINGS, state=state, logger=logger,
            read_secret=_secrets(secret_index), etcd=etcd_clients.CLIENTS)
    if outcome is not None and _changed(status, outcome.status):
        # against the freshest object: this tick's ``status`` may predate a placement just published
        patch.fns.append(functools.partial(cond.merge_status, fields=outcome.status, owned=(cond.REBALANCING,),
                                           observed_generation=meta.get("generation")))


@kopf.timer(*RESOURCE, interval=SETTINGS.rebalance_check_seconds, initial_delay=SETTINGS.rebalance_check_seconds)
async def colocate(
    *, namespace: str | None, name: str, spec: kopf.Spec, memo: Any, logger: kopf.Logger,
    secret_index: SecretIndex | None = None, **_: Any,
) -> None:
    """Traffic-learned colocation (:mod:`learned`): once per ``spec.colocation.intervalSeconds``,
    skipped while a (re)placement or rebalance holds the shard's lock (the next tick tries again)."""
    if not (spec.get("colocation") or {}).get("enabled"):
        return
    state = _state(memo)
    if state.lock.locked():
        return
    if getattr(memo, "kvshard_learned", None) is None:
        memo.kvshard_learned = learned.LearnedState()
    async with state.lock:
        outcome = await learned.colocate_shard(
            namespace=str(namespace), name=name, spec=dict(spec), state=memo.kvshard_learned, settings=SETTINGS,
            read_secret=_secrets(secret_index), now=time.time(), slack_seconds=SETTINGS.rebalance_check_seconds / 2,
            etcd=etcd_clients.CLIENTS)
    if outcome is not None and outcome.published is not None:
        metrics.PLACEMENT_GENERATION.labels(metrics.shard_label(str(namespace), name)).set(outcome.published)
        logger.info("colocation: %s", outcome.message)


@kopf.timer(*RESOURCE, interval=SETTINGS.fidelity_check_seconds, initial_delay=SETTINGS.fidelity_check_seconds)
async def follow_fidelity(
    *, namespace: str | None, name: str, spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta,
    patch: kopf.Patch, memo: Any, logger: kopf.Logger, secret_index: SecretIndex | None = None, **_: Any,
) -> None:
    """The blend in force: publish ``spec.blend`` to etcd and, with ``spec.fidelity``, steer the ratio
    to the agreement target once per interval (:mod:`guard`); ``FidelityMet`` is written as a patch
    function so it never overwrites what a concurrent reconcile wrote."""
    if not status.get("placementGeneration"):
        return  # nothing published yet: the change handlers own the shard until then
    state = getattr(memo, "kvshard_guard", None)
    if state is None:
        state = memo.kvshard_guard = guard.GuardState()
    outcome = await guard.guard_shard(namespace=str(namespace), name=name, spec=dict(spec), status=dict(status),
                                      generation=meta.get("generation"), settings=SETTINGS, state=state,
                                      logger=logger, now=time.time(), read_secret=_secrets(secret_index),
                                      etcd=etcd_clients.CLIENTS)
    if outcome is not None and _changed(status, outcome.status):
        patch.fns.append(functools.partial(cond.merge_status, fields=outcome.status, owned=(guard.FIDELITY_MET,),
                                           observed_generation=meta.get("generation")))


def _warm_watch(memo: Any) -> warmth.WarmWatch:
    watch = getattr(memo, "kvshard_warm", None)
    if watch is None:
        watch = memo.kvshard_warm = warmth.WarmWatch()
    return watch


@kopf.daemon(*RESOURCE, cancellation_timeout=5.0)
async def watch_warm(
    *, namespace: str | None, name: str, spec: kopf.Spec, status: kopf.Status, memo: Any, logger: kopf.Logger,
    stopped: kopf.DaemonStopped, retry: int, secret_index: SecretIndex | None = None, **_: Any,
) -> None:
    """Follow the pods' warm reports in etcd (a watch on the shared connection, :func:`warmth.follow`)
    into the shard's memo, where :func:`follow_warm` picks the decision up. ``spec`` and ``status`` are
    kopf's live views. etcd trouble is decided as ``Warm=Unknown`` and retried by kopf after a growing
    delay (``kopf.TemporaryError``)."""
    watch = _warm_watch(memo)
    while not stopped:
        if not status.get("placementGeneration"):
            await stopped.wait(SETTINGS.pod_sync_seconds)  # the change handlers own the shard until then
            continue
        try:
            valid = validation.validate_spec(spec)
        except validation.InvalidCacheShardError:
            await stopped.wait(SETTINGS.pod_sync_seconds)  # the change handlers report the spec
            continue
        try:
            access = await etcd_access(valid, str(namespace), _secrets(secret_index))
            async with etcd_clients.session(access, timeout=SETTINGS.etcd_timeout_seconds,
                                            clients=etcd_clients.CLIENTS) as store:
                await warmth.follow(store, str(namespace), name, watch, lambda: status.get("placementGeneration"))
        except (ValueError, etcd_store.EtcdStoreError) as exc:  # PlacementFormatError is a ValueError
            watch.decide(warmth.Warmth(cond.UNKNOWN, warmth.ETCD_UNAVAILABLE, f"cannot read warm reports: {exc}"),
                         None)
            watch.placement = None
            delay = min(SETTINGS.retry_backoff_seconds * 2 ** retry, SETTINGS.retry_backoff_max)
            raise kopf.TemporaryError(f"warm report watch: {exc}", delay=delay) from exc


@kopf.timer(*RESOURCE, interval=SETTINGS.warm_check_seconds, initial_delay=SETTINGS.warm_check_seconds)
async def follow_warm(
    *, namespace: str | None, name: str, spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta,
    patch: kopf.Patch, memo: Any, logger: kopf.Logger, secret_index: SecretIndex | None = None, **_: Any,
) -> None:
    """The ``Warm`` condition and the warm counts as the warm daemon decided them (no etcd read here);
    written as a patch function (a JSON patch of just these fields against the freshest object). Also
    etcd's DB size (``kvshard_operator_etcd_db_bytes``), at most once per ``etcd_db_check_seconds``."""
    published = status.get("placementGeneration")
    if not published:
        return  # nothing published yet: the change handlers own the conditions until then
    checked = getattr(memo, "kvshard_db_checked_at", None)
    if checked is None or time.monotonic() - checked >= SETTINGS.etcd_db_check_seconds:
        memo.kvshard_db_checked_at = time.monotonic()
        try:
            valid = validation.validate_spec(spec)
        except validation.InvalidCacheShardError:
            return  # the change handlers report the spec
        await _export_db_size(str(namespace), name, valid, _secrets(secret_index), logger)
    found = warmth.due(_warm_watch(memo), int(published))
    if found is not None and not warmth.current(status, found):
        if found.status != (cond.get(status.get("conditions"), cond.WARM) or {}).get("status"):
            logger.info("Warm=%s (%s): %s", found.status, found.reason, found.message)
        patch.fns.append(functools.partial(warmth.apply, warmth=found, generation=meta.get("generation")))


async def _export_db_size(namespace: str, name: str, spec: Mapping[str, Any], read_secret: SecretReader,
                          logger: kopf.Logger) -> None:
    """``kvshard_operator_etcd_db_bytes`` of this CacheShard's etcd; a failure is logged, not raised."""
    try:
        access = await etcd_access(spec, namespace, read_secret)
        async with etcd_clients.session(access, timeout=SETTINGS.etcd_timeout_seconds,
                                        clients=etcd_clients.CLIENTS) as store:
            size = await store.db_size()
    except (ValueError, etcd_store.EtcdStoreError) as exc:
        logger.debug("cannot read etcd's DB size: %s", exc)
        return
    metrics.ETCD_DB_BYTES.labels(metrics.shard_label(namespace, name)).set(size)


@kopf.on.delete(*RESOURCE)
async def delete_shard(*, namespace: str | None, name: str, spec: kopf.Spec, logger: kopf.Logger, retry: int,
                       secret_index: SecretIndex | None = None, **_: Any) -> None:
    """The finalizer: remove every etcd key of this CacheShard before Kubernetes forgets it, then its
    metric series (kept while the keys are, so a retried delete still shows the generation in force)."""
    endpoints = (spec.get("etcd") or {}).get("endpoints") or []
    if not endpoints:
        metrics.forget_shard(str(namespace), name)
        return
    try:
        access = await etcd_access(spec, str(namespace), _secrets(secret_index))
    except (ValueError, KeyError, TypeError) as exc:  # the spec is not validated on delete
        logger.warning("cannot read the etcd Secrets (%s); trying without", exc)
        access = EtcdAccess(tuple(endpoints))
    try:
        # a store of its own, not the shared one: a delete is a one-off, and kopf's retry delay below
        # (not the holder's reconnect backoff) decides when it is tried again
        async with etcd_clients.session(access, timeout=SETTINGS.etcd_timeout_seconds) as store:
            deleted = await store.delete_all(str(namespace), name)
    except etcd_store.EtcdStoreError as exc:
        metrics.PUBLISH_ERRORS.labels(etcd_error_kind(exc)).inc()
        delay = min(SETTINGS.retry_backoff_seconds * 2 ** retry, SETTINGS.retry_backoff_max)
        raise kopf.TemporaryError(f"etcd unavailable, keys kept: {exc}", delay=delay) from exc
    metrics.forget_shard(str(namespace), name)
    logger.info("removed %d etcd keys of %s/%s", deleted, namespace, name)
