"""One connected etcd store per distinct access, per operator process, shared by every handler,
timer and daemon.

Before this holder every tick opened (and closed) its own TLS connection: the warm timer every 2 s,
the guard, the learned placement and the rebalancer each once per tick and per CacheShard. Now a
store is opened on first use for one *access* (endpoints, credentials, TLS material and per-call
timeout — :class:`~kvshard_operator.reconcile.EtcdAccess`), kept, and reused by every caller. The
gRPC channel under it multiplexes concurrent calls, so sharing it needs no lock.

* **Reopened after trouble.** A call that fails with a connection, TLS or auth error
  (:class:`~kvshard.etcd_store.EtcdUnavailableError`, :class:`~kvshard.etcd_store.EtcdTLSError`,
  :class:`~kvshard.etcd_store.EtcdAuthError` — an expired etcd auth token reads as the last) drops the
  store; the next use opens a new one, but not before a capped exponential backoff has passed (until
  then :meth:`EtcdClients.use` raises ``EtcdUnavailableError`` at once, which callers treat as any
  outage). A generation conflict or a malformed value keeps the store: the connection is fine.
* **Renewed Secrets.** A renewed client certificate or password is a new access, hence a new store;
  the old one is closed once nobody has used it for :attr:`EtcdClients.idle_seconds`.
* **Closed at cleanup.** ``@kopf.on.cleanup`` in :mod:`handlers` calls :meth:`EtcdClients.close`.
  Stores belong to the event loop they were opened on; a holder used from another loop (a second
  ``KopfRunner`` in one test process) forgets the old loop's stores first.

:attr:`EtcdClients.opened` counts connections opened (also the metric
``kvshard_operator_etcd_connections_opened_total``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Hashable
from typing import Protocol

from kvshard import etcd_store
from kvshard_operator import metrics

_DROPPING = (etcd_store.EtcdUnavailableError, etcd_store.EtcdTLSError, etcd_store.EtcdAuthError)
"""Errors after which a store is not trusted any more: closed, and reopened after a backoff."""


class Access(Hashable, Protocol):
    """What the holder needs of an access: hashable (the key), and how to build its store."""

    @property
    def endpoints(self) -> tuple[str, ...]: ...

    def store(self, *, timeout: float, attempts: int = 1) -> etcd_store.EtcdStore: ...


@dataclasses.dataclass
class _Entry:
    store: etcd_store.EtcdStore | None = None
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    users: int = 0
    used_at: float = 0.0
    failures: int = 0
    retry_at: float = 0.0


class EtcdClients:
    """Connected :class:`~kvshard.etcd_store.EtcdStore` objects by access (see the module docstring)."""

    def __init__(self, *, backoff_seconds: float = 0.5, backoff_max: float = 30.0,
                 idle_seconds: float = 600.0) -> None:
        self.backoff_seconds = backoff_seconds
        self.backoff_max = backoff_max
        self.idle_seconds = idle_seconds
        self.opened = 0
        """Connections opened since this holder was made (tests and the bench read it)."""
        self._entries: dict[tuple[Hashable, float], _Entry] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self._users_of: dict[etcd_store.EtcdStore, int] = {}
        """Callers inside :meth:`use` per store, so a dropped store is closed only after the last one."""
        self._dropped: set[etcd_store.EtcdStore] = set()

    def __len__(self) -> int:
        return sum(1 for e in self._entries.values() if e.store is not None)

    def _adopt_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # stores of a finished loop cannot be closed from this one
            self._entries.clear()
            self._closing = set()
            self._users_of, self._dropped = {}, set()
            self._loop = loop

    async def _open(self, entry: _Entry, access: Access, timeout: float) -> etcd_store.EtcdStore:
        async with entry.lock:
            if entry.store is not None:
                return entry.store
            wait = entry.retry_at - time.monotonic()
            if wait > 0:
                raise etcd_store.EtcdUnavailableError(
                    f"etcd {','.join(access.endpoints)} failed recently; reconnecting in {wait:.1f} s")
            store = access.store(timeout=timeout)
            try:  # connect (and log in; its calls have their own deadline, this bounds the rest)
                await asyncio.wait_for(store.__aenter__(), 2 * timeout + 1)
            except Exception:
                self._failed(entry)
                raise
            self.opened += 1
            metrics.ETCD_CONNECTIONS_OPENED.inc()
            entry.store = store
            return store

    def _failed(self, entry: _Entry) -> None:
        entry.failures += 1
        delay = min(self.backoff_seconds * 2 ** (entry.failures - 1), self.backoff_max)
        entry.retry_at = time.monotonic() + delay

    def _drop(self, entry: _Entry, store: etcd_store.EtcdStore) -> None:
        """Stop handing ``store`` out; it is closed once its last user is done with it. Closing it now
        would cancel the calls other handlers have in flight on it (gRPC cancels a closed channel's
        calls), and kopf stops a timer whose handler was cancelled for good."""
        if entry.store is store:
            entry.store = None
            self._failed(entry)
        self._dropped.add(store)

    def _release(self, store: etcd_store.EtcdStore) -> None:
        users = self._users_of.pop(store, 1) - 1
        if users:
            self._users_of[store] = users
        elif store in self._dropped:
            self._dropped.discard(store)
            task = asyncio.get_running_loop().create_task(_close_quietly(store))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    @contextlib.asynccontextmanager
    async def use(self, access: Access, *, timeout: float) -> AsyncIterator[etcd_store.EtcdStore]:
        """The shared store for ``access`` (opened on first use), as ``async with access.store()``
        gave one before, but not closed on exit. Raises what the store raises; connection trouble
        also drops the store (see the module docstring)."""
        self._adopt_loop()
        await self._sweep()
        key = (access, timeout)
        entry = self._entries.setdefault(key, _Entry())
        entry.users += 1
        entry.used_at = time.monotonic()
        try:
            store = await self._open(entry, access, timeout)
            self._users_of[store] = self._users_of.get(store, 0) + 1
            try:
                yield store
            except _DROPPING:
                self._drop(entry, store)
                raise
            else:
                entry.failures = 0
            finally:
                self._release(store)
        finally:
            entry.users -= 1
            entry.used_at = time.monotonic()

    async def _sweep(self) -> None:
        """Close stores nobody has used for ``idle_seconds`` (a renewed Secret left them behind)."""
        now = time.monotonic()
        for key, entry in list(self._entries.items()):
            if entry.users == 0 and now - entry.used_at > self.idle_seconds:
                del self._entries[key]
                if entry.store is not None:
                    await _close_quietly(entry.store)

    async def close(self) -> None:
        """Close every store (operator cleanup); the holder may be used again afterwards."""
        entries, self._entries = list(self._entries.values()), {}
        dropped, self._dropped = self._dropped, set()
        for store in [entry.store for entry in entries if entry.store is not None] + list(dropped):
            await _close_quietly(store)
        if self._closing:
            await asyncio.wait(list(self._closing), timeout=5)


async def _close_quietly(store: etcd_store.EtcdStore) -> None:
    with contextlib.suppress(Exception):  # closing a broken channel must not hide the real error
        await asyncio.wait_for(store.close(), 5)


CLIENTS = EtcdClients()
"""The operator process's holder (the handlers configure its backoff from the settings)."""


@contextlib.asynccontextmanager
async def session(access: Access, *, timeout: float,
                  clients: EtcdClients | None = None) -> AsyncIterator[etcd_store.EtcdStore]:
    """A store for ``access``: the shared one from ``clients``, or — without a holder (tests that
    drive one reconcile directly) — a store of its own, opened and closed around the block."""
    if clients is None:
        async with access.store(timeout=timeout) as store:
            yield store
        return
    async with clients.use(access, timeout=timeout) as store:
        yield store
