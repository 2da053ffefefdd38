"""The etcd side of placement: key layout, atomic publish, reads, watches, heat and warm sets.

This is the only module that imports ``etcd3aio`` (import-linter checks it), so the operator, the
router and the sidecars share one key layout (:mod:`kvshard.etcd_keys`, DESIGN §6) and one set of
semantics.

Publishing writes the whole generation first and only then compare-and-swaps ``current``, so a
reader that follows ``current`` never sees a half-written generation, and two writers cannot both
win. When everything fits in one request the writes and the swap are a single transaction.

Every failure to reach etcd surfaces as :class:`EtcdUnavailableError`, a failed TLS handshake as
:class:`EtcdTLSError` naming the mistake (:mod:`kvshard.etcd_tls`); callers never see gRPC or
etcd3aio exceptions.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import etcd3aio
import grpc

from kvshard import blend_policy as bp
from kvshard import catalog_schema as cs
from kvshard import corequest_schema as crs
from kvshard import placement_schema as ps
from kvshard.etcd_keys import (
    assignment_key,
    blend_key,
    catalog_chunk_key,
    catalog_manifest_key,
    catalog_prefix,
    corequest_key,
    corequest_prefix,
    current_key,
    generation_prefix,
    heat_prefix,
    items_key,
    shard_prefix,
    warm_key,
    warm_prefix,
)
from kvshard.etcd_tls import EtcdTLS, diagnose, endpoint_host, is_ip

KEEP_GENERATIONS = 2
_TXN_LIMIT = ps.MAX_VALUE_BYTES
_ERRORS = (etcd3aio.EtcdError, grpc.aio.AioRpcError, TimeoutError, OSError)
# etcd 3.4 reports missing or wrong credentials as INVALID_ARGUMENT with these details.
_AUTH_DETAILS = re.compile(r"user name is empty|authentication failed|invalid auth token|permission denied")
_UNAVAILABLE = (etcd3aio.EtcdConnectionError, etcd3aio.EtcdTransientError, TimeoutError, OSError)

# gRPC shares one subchannel per address across all channels of a process and, after a refused
# connection, backs off reconnecting for up to 120 s. So a store opened right after etcd came back
# could inherit a sibling's backoff and fail at once with "connections to all backends failing", and a
# long-lived store could take minutes to notice etcd is back. Each store keeps its own subchannels and
# retries a refused connection within 2 s. (Not ``grpc.min_reconnect_backoff_ms``: gRPC reads it as the
# connect timeout, and 200 ms would fail handshakes with a slow or briefly frozen etcd.)
_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class EtcdStoreError(Exception):
    """Base of every error this module raises."""


class EtcdUnavailableError(EtcdStoreError, ConnectionError):
    """etcd could not be reached or did not answer in time (transient: retry later)."""


class EtcdAuthError(EtcdStoreError):
    """etcd refused the username/password (or the user lacks permission on our keys)."""


class EtcdTLSError(EtcdStoreError):
    """TLS with etcd failed: its certificate is not signed by our CA or does not name the host, or it
    refused our client certificate. A configuration mistake, not an outage: retrying will not help."""


class GenerationConflictError(EtcdStoreError):
    """``current`` was not the generation the writer expected: someone else published first."""


class EtcdStore:
    """An async connection to etcd speaking the kvshard key layout.

        tls = EtcdTLS.from_files(Path("ca.crt"), Path("tls.crt"), Path("tls.key"))
        async with EtcdStore(["127.0.0.1:2379"], tls=tls) as store:
            generation = await store.publish("default", "movielens", placement, expected=0)

    Endpoints are ``host:port``; a host name is resolved by gRPC (one endpoint) or when connecting
    (several), so a Service name works as well as an address.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        username: str | None = None,
        password: str | None = None,
        tls: EtcdTLS | None = None,
        timeout: float = 5.0,
        attempts: int = 2,
    ) -> None:
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.tls = tls
        self._username = username
        self._password = password
        conn_args: dict[str, Any] = tls.channel_args(self.endpoints) if tls is not None else {}
        self._client = etcd3aio.Etcd3Client(self.endpoints, rpc_max_attempts=attempts, **conn_args)
        self._client._manager.grpc_options.extend(_CHANNEL_OPTIONS)  # etcd3aio has no channel-options argument
        self._connected = False

    async def _target(self) -> str:
        """The gRPC target: etcd3aio's ``ipv4:`` list takes addresses only, so one host name goes to
        gRPC's DNS resolver (which follows the Service's addresses) and several are resolved here."""
        hosts = [endpoint_host(e) for e in self.endpoints]
        if all(is_ip(h) for h in hosts):
            return str(self._client._manager.target)
        if len(self.endpoints) == 1:
            return f"dns:///{self.endpoints[0]}"
        loop = asyncio.get_running_loop()
        addresses: list[str] = []
        for endpoint, host in zip(self.endpoints, hosts, strict=True):
            port = endpoint.rsplit(":", 1)[1]
            if is_ip(host):
                addresses.append(f"{host}:{port}")
                continue
            try:
                infos = await loop.getaddrinfo(host, int(port), family=socket.AF_INET, type=socket.SOCK_STREAM)
            except OSError as exc:
                raise EtcdUnavailableError(f"etcd endpoint {endpoint}: cannot resolve {host}: {exc}") from exc
            addresses += sorted({f"{info[4][0]}:{port}" for info in infos})
        return "ipv4:" + ",".join(dict.fromkeys(addresses))

    async def connect(self) -> None:
        """Open the channel (and authenticate when a username is given)."""
        if self._connected:
            return
        self._client._manager.target = await self._target()
        await self._client.connect()
        self._connected = True  # _call needs the channel; undone below if the login fails
        if self._username:
            auth = self._client.auth
            assert auth is not None
            try:
                resp = await self._call("authenticate",
                                        auth.authenticate(self._username, self._password or "", timeout=self.timeout))
            except EtcdStoreError as exc:
                await self.close()
                if isinstance(exc, EtcdUnavailableError | EtcdTLSError):
                    raise
                raise EtcdAuthError(f"etcd refused user {self._username!r}: {exc.__cause__ or exc}") from exc
            self._client.set_token(resp.token)

    async def close(self) -> None:
        if self._connected:
            await self._client.close()
            self._connected = False

    async def __aenter__(self) -> EtcdStore:
        await self.connect()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @property
    def _kv(self) -> Any:
        if not self._connected or self._client.kv is None:
            raise EtcdStoreError("EtcdStore is not connected; use `async with` or connect()")
        return self._client.kv

    async def _call(self, what: str, coro: Any) -> Any:
        try:
            return await coro
        except _ERRORS as exc:
            transient = isinstance(exc, _UNAVAILABLE) or (
                isinstance(exc, grpc.aio.AioRpcError)
                and exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            )
            denied = isinstance(exc, etcd3aio.EtcdUnauthenticatedError | etcd3aio.EtcdPermissionDeniedError) or (
                isinstance(exc, grpc.aio.AioRpcError) and _AUTH_DETAILS.search(exc.details() or "") is not None
            )
            tls_problem = diagnose(str(exc), self.tls, self.endpoints) if transient else None
            if tls_problem and self.tls is not None:
                raise EtcdTLSError(tls_problem) from exc
            error = EtcdUnavailableError if transient else EtcdAuthError if denied else EtcdStoreError
            hint = f" ({tls_problem})" if tls_problem else ""
            raise error(f"etcd {what} failed on {','.join(self.endpoints)}: {exc}{hint}") from exc

    async def ping(self) -> None:
        """Raise :class:`EtcdUnavailableError` unless etcd answers a read."""
        await self._call("ping", self._kv.get("/kvshard/ping", timeout=self.timeout))

    # ---------------------------------------------------------------------------------- placement

    async def read_assignment(self, namespace: str, name: str) -> ps.Placement | None:
        """The current generation without its items (cluster → pods only), None before the first
        publish: the cheap read for whoever follows which pod should warm what."""
        resp = await self._call("read", self._kv.get(current_key(namespace, name), timeout=self.timeout))
        if not resp.kvs:
            return None
        generation = int(resp.kvs[0].value)
        got = await self._call("read", self._kv.get(assignment_key(namespace, name, generation), timeout=self.timeout))
        if not got.kvs:
            raise ps.PlacementFormatError(f"{namespace}/{name} has no generation {generation}")
        return ps.decode_assignment(bytes(got.kvs[0].value))[0]

    async def current_generation(self, namespace: str, name: str) -> int:
        """The published generation, 0 when none has been published."""
        resp = await self._call("read", self._kv.get(current_key(namespace, name), timeout=self.timeout))
        return int(resp.kvs[0].value) if resp.kvs else 0

    async def publish(self, namespace: str, name: str, placement: ps.Placement, *, expected: int) -> int:
        """Write ``placement`` as generation ``placement.generation`` and make it current, provided
        ``current`` is still ``expected`` (0: nothing published yet). Returns the generation.

        Raises :class:`GenerationConflictError` when ``current`` moved, :class:`EtcdUnavailableError`
        when etcd fails; in both cases ``current`` still names a complete generation.
        """
        generation = placement.generation
        if generation <= expected:
            raise ValueError(f"generation {generation} must be newer than {expected}")
        assignment, chunks = ps.encode(placement)
        kv = self._kv
        gen_prefix = generation_prefix(namespace, name, generation)
        ckey = current_key(namespace, name)
        compare = (
            kv.txn_compare_create_revision(ckey, 0)
            if expected == 0
            else kv.txn_compare_value(ckey, str(expected))
        )
        writes = [kv.txn_op_put(assignment_key(namespace, name, generation), assignment)]
        writes += [kv.txn_op_put(items_key(namespace, name, generation, i), c) for i, c in enumerate(chunks)]
        swap = kv.txn_op_put(ckey, str(generation))
        clear = kv.txn_op_delete(gen_prefix, range_end=etcd3aio.prefix_range_end(gen_prefix))
        # Leftovers of an earlier failed attempt at this generation go first (only while current is
        # still ``expected``, so another writer's generation is never touched).
        await self._call("publish", kv.txn([compare], [clear], timeout=self.timeout))
        if len(assignment) + sum(map(len, chunks)) <= _TXN_LIMIT:
            resp = await self._call("publish", kv.txn([compare], [*writes, swap], timeout=self.timeout))
        else:
            resp = await self._publish_in_steps(kv, gen_prefix + "writer", compare, writes, swap)
        if not resp.succeeded:
            raise GenerationConflictError(
                f"{namespace}/{name}: current is no longer generation {expected}; re-read and retry"
            )
        await self._prune(namespace, name, generation)
        return generation

    async def _publish_in_steps(self, kv: Any, writer_key: str, compare: Any, writes: list[Any], swap: Any) -> Any:
        """Write a generation too big for one request, then swap ``current``.

        Two writers racing for the same generation would otherwise interleave their chunks, and the
        winner's swap could make a mix of both current. So the writer first *claims* the generation
        (``gen/<G>/writer`` = a random token) and every later write, the swap included, is a
        transaction that also checks the claim is still its own: whoever claims last writes the whole
        generation, every other writer fails its next step with a conflict and stops.
        """
        token = uuid.uuid4().hex
        claim = await self._call("publish", kv.txn([compare], [kv.txn_op_put(writer_key, token)],
                                                    timeout=self.timeout))
        if not claim.succeeded:
            return claim
        mine = kv.txn_compare_value(writer_key, token)
        for op in writes:
            step = await self._call("publish", kv.txn([compare, mine], [op], timeout=self.timeout))
            if not step.succeeded:
                return step
        return await self._call("publish", kv.txn([compare, mine], [swap, kv.txn_op_delete(writer_key)],
                                                  timeout=self.timeout))

    async def _prune(self, namespace: str, name: str, newest: int) -> None:
        """Drop generations older than the last :data:`KEEP_GENERATIONS` (readers may still be
        reading the previous one)."""
        oldest_kept = newest - KEEP_GENERATIONS + 1
        base = shard_prefix(namespace, name) + "gen/"
        resp = await self._range("list", base, keys_only=True)
        stale = {int(kv.key.decode()[len(base):].split("/", 1)[0]) for kv in resp.kvs}
        for g in sorted(x for x in stale if x < oldest_kept):
            prefix = generation_prefix(namespace, name, g)
            await self._call("prune", self._kv.delete(prefix, range_end=etcd3aio.prefix_range_end(prefix),
                                                      timeout=self.timeout))

    async def read_generation(self, namespace: str, name: str, generation: int, *, revision: int = 0) -> ps.Placement:
        """One stored generation, whole (raises :class:`ps.PlacementFormatError` if incomplete).

        ``revision`` reads it as etcd held it then (0: now). :meth:`read_current` and
        :meth:`watch_current` pass the revision at which ``current`` named the generation, so a reader
        never loses it to a prune by writers publishing two more generations in between. Should etcd
        have compacted that revision away, the generation is read as it is now.
        """
        prefix = generation_prefix(namespace, name, generation)
        try:
            resp = await self._range("read", prefix, revision)
        except EtcdStoreError as exc:
            cause = exc.__cause__
            if not (revision and isinstance(cause, grpc.aio.AioRpcError)
                    and cause.code() == grpc.StatusCode.OUT_OF_RANGE):
                raise
            resp = await self._range("read", prefix, 0)
        values = {kv.key.decode()[len(prefix):]: bytes(kv.value) for kv in resp.kvs}
        if "assignment" not in values:
            raise ps.PlacementFormatError(f"{namespace}/{name} has no generation {generation}")
        chunks = [values[k] for k in sorted(k for k in values if k.startswith("items/"))]
        return ps.decode(values["assignment"], chunks)

    async def _range(self, what: str, prefix: str, revision: int = 0, *, keys_only: bool = False) -> Any:
        """Every key under ``prefix`` (at ``revision``; 0: now)."""
        return await self._call(what, self._kv.get(prefix, range_end=etcd3aio.prefix_range_end(prefix),
                                                   revision=revision, keys_only=keys_only, timeout=self.timeout))

    async def read_current(self, namespace: str, name: str) -> ps.Placement | None:
        """The current placement, or None before the first publish; one consistent snapshot (the
        generation is read at the revision ``current`` was read at)."""
        resp = await self._call("read", self._kv.get(current_key(namespace, name), timeout=self.timeout))
        if not resp.kvs:
            return None
        return await self.read_generation(namespace, name, int(resp.kvs[0].value), revision=resp.header.revision)

    async def watch_current(self, namespace: str, name: str) -> AsyncIterator[ps.Placement]:
        """Yield the current placement (if any) and then every newly published one; the router and
        sidecars follow placement with this. Reconnects are handled by the etcd client."""
        ckey = current_key(namespace, name)
        resp = await self._call("read", self._kv.get(ckey, timeout=self.timeout))
        last = int(resp.kvs[0].value) if resp.kvs else 0
        if last:
            yield await self.read_generation(namespace, name, last, revision=resp.header.revision)
        watch = self._client.watch
        assert watch is not None
        try:
            async for event_batch in watch.watch(ckey, start_revision=resp.header.revision + 1):
                for event in event_batch.events:
                    if event.type != 0 or not event.kv.value:  # 0 == PUT
                        continue
                    generation = int(event.kv.value)
                    if generation > last:
                        last = generation
                        yield await self.read_generation(namespace, name, generation, revision=event.kv.mod_revision)
        except _ERRORS as exc:
            raise EtcdUnavailableError(f"etcd watch failed: {exc}") from exc

    async def delete_all(self, namespace: str, name: str) -> int:
        """Remove every key of one CacheShard (its finalizer calls this). Returns how many."""
        prefix = shard_prefix(namespace, name)
        resp = await self._call("delete", self._kv.delete(prefix, range_end=etcd3aio.prefix_range_end(prefix),
                                                          timeout=self.timeout))
        return int(resp.deleted)

    async def keys(self, namespace: str, name: str) -> list[str]:
        """Every key of one CacheShard, sorted (for inspection and tests)."""
        prefix = shard_prefix(namespace, name)
        resp = await self._range("list", prefix, keys_only=True)
        return sorted(kv.key.decode() for kv in resp.kvs)

    # ---------------------------------------------------------------------------------- heat, warm

    async def put_heat(
        self, namespace: str, name: str, snapshot: Mapping[str, Any], *, ttl_seconds: int,
        timestamp: float | None = None,
    ) -> str:
        """Store a hit-rate snapshot that etcd deletes by itself after ``ttl_seconds``."""
        lease_svc = self._client.lease
        assert lease_svc is not None
        lease = await self._call("lease", lease_svc.grant(ttl_seconds, timeout=self.timeout))
        ms = int((time.time() if timestamp is None else timestamp) * 1000)
        key = heat_prefix(namespace, name) + f"{ms:015d}"
        await self._call("put", self._kv.put(key, json.dumps(dict(snapshot)), lease=lease.ID, timeout=self.timeout))
        return key

    async def read_heat(self, namespace: str, name: str) -> list[tuple[float, dict[str, Any]]]:
        """Live heat snapshots, oldest first, as ``(unix seconds, snapshot)``."""
        prefix = heat_prefix(namespace, name)
        resp = await self._range("read", prefix)
        out = [(int(kv.key.decode()[len(prefix):]) / 1000, json.loads(kv.value)) for kv in resp.kvs]
        return sorted(out, key=lambda pair: pair[0])

    async def put_warm(self, namespace: str, name: str, pod: str, report: ps.WarmReport) -> None:
        """A sidecar reports the clusters it has warmed and where it answers."""
        await self._call("put", self._kv.put(warm_key(namespace, name, pod), report.encode(), timeout=self.timeout))

    async def read_warm(self, namespace: str, name: str) -> dict[str, ps.WarmReport]:
        """Pod → its last warm report; the router moves traffic only to warm replicas. Unreadable
        reports are skipped (a reader never fails because one pod wrote garbage)."""
        prefix = warm_prefix(namespace, name)
        return _warm_reports(prefix, (await self._range("read", prefix)).kvs)

    async def watch_warm(self, namespace: str, name: str) -> AsyncIterator[dict[str, ps.WarmReport]]:
        """Yield the whole warm map now and again after every change (a pod reported or left);
        the router moves traffic to a new replica only once it shows up here. The map is read once
        and then kept up to date from the watch's events (every pod reports up to twice a second,
        and every router and sidecar watches)."""
        prefix = warm_prefix(namespace, name)
        resp = await self._range("read", prefix)
        reports = _warm_reports(prefix, resp.kvs)
        yield dict(reports)
        watch = self._client.watch
        assert watch is not None
        try:
            async for batch in watch.watch(prefix, range_end=etcd3aio.prefix_range_end(prefix),
                                           start_revision=resp.header.revision + 1):
                for event in batch.events:
                    pod = event.kv.key.decode()[len(prefix):]
                    report = _warm_report(event.kv.value) if event.type == 0 else None  # 0 == PUT
                    if report is None:
                        reports.pop(pod, None)  # withdrawn, or unreadable
                    else:
                        reports[pod] = report
                if batch.events:
                    yield dict(reports)
        except _ERRORS as exc:
            raise EtcdUnavailableError(f"etcd watch failed: {exc}") from exc

    async def delete_warm(self, namespace: str, name: str, pod: str) -> None:
        """Forget a pod's warm set (it left the placement)."""
        await self._call("delete", self._kv.delete(warm_key(namespace, name, pod), timeout=self.timeout))

    # ---------------------------------------------------------------------------------- co-requests

    async def put_corequest(self, namespace: str, name: str, report: crs.CoRequestReport, *,
                            ttl_seconds: int) -> None:
        """A router publishes its interval's top pairs; etcd deletes them after ``ttl_seconds`` unless
        the router publishes again (a new lease each interval, as for heat snapshots)."""
        data = report.encode()
        lease_svc = self._client.lease
        assert lease_svc is not None
        lease = await self._call("lease", lease_svc.grant(ttl_seconds, timeout=self.timeout))
        await self._call("put", self._kv.put(corequest_key(namespace, name, report.router), data,
                                             lease=lease.ID, timeout=self.timeout))

    async def read_corequest(self, namespace: str, name: str) -> dict[str, crs.CoRequestReport]:
        """Router → its live report. Unreadable reports are skipped (one bad writer fails no reader)."""
        prefix = corequest_prefix(namespace, name)
        out: dict[str, crs.CoRequestReport] = {}
        for kv in (await self._range("read", prefix)).kvs:
            try:
                out[kv.key.decode()[len(prefix):]] = crs.CoRequestReport.decode(kv.value)
            except crs.CoRequestFormatError as exc:
                logging.getLogger(__name__).warning("skipping %s: %s", kv.key.decode(), exc)
        return out

    # ---------------------------------------------------------------------------------- catalog versions

    async def put_catalog(self, namespace: str, name: str, catalog: cs.Catalog) -> int:
        """Store one catalog version (chunks first, the manifest last: a version is complete once its
        manifest exists). A version already stored is not written again (its key is its content).
        Returns the bytes written (0 when it was there)."""
        version = catalog.version
        manifest_key = catalog_manifest_key(namespace, name, version)
        got = await self._call("read", self._kv.get(manifest_key, timeout=self.timeout))
        if got.kvs:
            return 0
        manifest, chunks = cs.encode(catalog)
        for i, chunk in enumerate(chunks):
            await self._call("put", self._kv.put(catalog_chunk_key(namespace, name, version, i), chunk,
                                                 timeout=self.timeout))
        await self._call("put", self._kv.put(manifest_key, manifest, timeout=self.timeout))
        return len(manifest) + sum(map(len, chunks))

    async def read_catalog_manifest(self, namespace: str, name: str, version: str) -> dict[str, Any] | None:
        """A stored version's manifest (items, chunks, bytes), None when it is not (completely) stored."""
        got = await self._call("read", self._kv.get(catalog_manifest_key(namespace, name, version),
                                                    timeout=self.timeout))
        return cs.decode_manifest(bytes(got.kvs[0].value)) if got.kvs else None

    async def read_catalog(self, namespace: str, name: str, version: str) -> cs.Catalog:
        """One stored version, whole and checked against its hash (:class:`cs.CatalogError` when it is
        missing or damaged). Chunks are read one request each, so a 1 M-item catalog never needs one
        gRPC message larger than a chunk."""
        got = await self._call("read", self._kv.get(catalog_manifest_key(namespace, name, version),
                                                    timeout=self.timeout))
        if not got.kvs:
            raise cs.CatalogError("CatalogNotFound", f"{namespace}/{name} has no catalog version {version}")
        manifest = bytes(got.kvs[0].value)
        chunks: list[bytes] = []
        for i in range(int(cs.decode_manifest(manifest)["chunks"])):
            key = catalog_chunk_key(namespace, name, version, i)
            resp = await self._call("read", self._kv.get(key, timeout=self.timeout))
            if not resp.kvs:
                raise cs.CatalogError("CatalogCorrupt", f"catalog version {version} lacks chunk {i}")
            chunks.append(bytes(resp.kvs[0].value))
        return cs.decode(manifest, chunks)

    async def prune_catalogs(self, namespace: str, name: str, keep: set[str]) -> int:
        """Drop every catalog version not in ``keep`` (those the kept generations name); returns how many."""
        prefix = catalog_prefix(namespace, name)
        resp = await self._range("list", prefix, keys_only=True)
        stored = {kv.key.decode()[len(prefix):].split("/", 1)[0] for kv in resp.kvs}
        stale = sorted(stored - keep)
        for version in stale:
            vprefix = prefix + version + "/"
            await self._call("prune", self._kv.delete(vprefix, range_end=etcd3aio.prefix_range_end(vprefix),
                                                      timeout=self.timeout))
        return len(stale)


    # ---------------------------------------------------------------------------------- blend in force

    async def read_blend(self, namespace: str, name: str) -> tuple[bp.BlendPolicy | None, int]:
        """The blend settings in force and the key's version (``(None, 0)`` before the first publish);
        pass the version to :meth:`publish_blend` as ``expected``."""
        resp = await self._call("read", self._kv.get(blend_key(namespace, name), timeout=self.timeout))
        if not resp.kvs:
            return None, 0
        return bp.BlendPolicy.decode(bytes(resp.kvs[0].value)), int(resp.kvs[0].version)

    async def publish_blend(self, namespace: str, name: str, policy: bp.BlendPolicy, *, expected: int) -> int:
        """Make ``policy`` the blend in force provided the key is still at version ``expected`` (0: never
        written); returns the new version. :class:`GenerationConflictError` when someone wrote first."""
        kv, key = self._kv, blend_key(namespace, name)
        resp = await self._call("publish", kv.txn([kv.txn_compare_version(key, expected)],
                                                  [kv.txn_op_put(key, policy.encode())], timeout=self.timeout))
        if not resp.succeeded:
            raise GenerationConflictError(f"{namespace}/{name}: blend is no longer at version {expected}; re-read")
        return expected + 1

    async def watch_blend(self, namespace: str, name: str) -> AsyncIterator[bp.BlendPolicy | None]:
        """Yield the blend in force first — ``None`` when none is published (or it is unreadable), so a
        follower knows it has read — then every new one; unreadable new values are skipped."""
        key = blend_key(namespace, name)
        resp = await self._call("read", self._kv.get(key, timeout=self.timeout))
        yield _blend(resp.kvs[0].value) if resp.kvs else None
        watch = self._client.watch
        assert watch is not None
        try:
            async for batch in watch.watch(key, start_revision=resp.header.revision + 1):
                for event in batch.events:
                    if event.type == 0 and (policy := _blend(event.kv.value)) is not None:  # 0 == PUT
                        yield policy
        except _ERRORS as exc:
            raise EtcdUnavailableError(f"etcd watch failed: {exc}") from exc


def _warm_report(value: bytes) -> ps.WarmReport | None:
    try:
        return ps.WarmReport.decode(bytes(value))
    except ps.PlacementFormatError:
        return None


def _warm_reports(prefix: str, kvs: Any) -> dict[str, ps.WarmReport]:
    """Pod → report of the ``warm/`` keys read, the unreadable ones skipped."""
    return {kv.key.decode()[len(prefix):]: report for kv in kvs if (report := _warm_report(kv.value)) is not None}


def _blend(value: bytes) -> bp.BlendPolicy | None:
    try:
        return bp.BlendPolicy.decode(bytes(value))
    except bp.BlendPolicyError:
        logging.getLogger(__name__).warning("ignoring an unreadable blend value: %r", bytes(value)[:100])
        return None


async def wait_for(store: EtcdStore, *, timeout: float) -> None:
    """Ping until etcd answers or ``timeout`` passes (then :class:`EtcdUnavailableError`)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            await store.ping()
            return
        except EtcdUnavailableError:
            if asyncio.get_running_loop().time() >= deadline:
                raise
            await asyncio.sleep(0.2)
