"""Follow one CacheShard's placement and warm reports in etcd into :class:`RouterState`.

Two asyncio tasks, one per etcd watch (``current`` and ``warm/``), each feeding every value it sees
into the state, which rebuilds the snapshot. The router must never stop serving because etcd is
away: the last snapshot stays in force, the outage is logged once (not once per retry), and the
watch is re-established with capped exponential backoff; when it comes back the watches start with
a full read, so nothing published meanwhile is missed. (An outage in the middle of a watch is
retried inside etcd3aio, which resumes from the last seen revision; :class:`~kvshard.log_filters.QuietRepeats` keeps its
per-attempt warnings to one a minute.)

A new generation's item index can take seconds to build for millions of items, so it is built in a
worker thread; request handlers keep using the previous snapshot until the new one is swapped in.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from kvshard.etcd_store import EtcdStore, EtcdStoreError
from kvshard.placement_schema import Placement, PlacementFormatError, WarmReport
from kvshard_router.snapshot import ItemIndex
from kvshard_router.state import RouterState

log = logging.getLogger(__name__)

T = TypeVar("T")
INITIAL_BACKOFF_SECONDS = 0.2
MAX_BACKOFF_SECONDS = 5.0


class PlacementFollower:
    """Runs the two watches against ``store`` until :meth:`stop`."""

    def __init__(self, store: EtcdStore, namespace: str, name: str, state: RouterState, *,
                 max_backoff: float = MAX_BACKOFF_SECONDS) -> None:
        self.store = store
        self.namespace = namespace
        self.name = name
        self.state = state
        self.max_backoff = max_backoff
        self.errors: dict[str, str] = {}
        """Watch name → the error it is currently retrying after ('' or absent: following)."""
        self._tasks: list[asyncio.Task[None]] = []
        self._connect_lock = asyncio.Lock()
        self._connected = False

    @property
    def connected(self) -> bool:
        """False while any watch is retrying after an etcd error."""
        return not any(self.errors.values())

    def start(self) -> None:
        shard = f"{self.namespace}/{self.name}"
        self._tasks = [
            asyncio.create_task(self._follow("placement", lambda: self.store.watch_current(self.namespace, self.name),
                                             self._apply_placement), name=f"follow-placement {shard}"),
            asyncio.create_task(self._follow("warm", lambda: self.store.watch_warm(self.namespace, self.name),
                                             self._apply_warm), name=f"follow-warm {shard}"),
        ]

    async def stop(self) -> None:
        """Cancel the watches and close the store."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self.store.close()
        self._connected = False

    async def _apply_placement(self, placement: Placement) -> None:
        index = await asyncio.to_thread(self._index_for, placement)
        self.state.set_placement(placement, index)

    def _index_for(self, placement: Placement) -> ItemIndex:
        reused = self.state.reusable_index(placement)
        return reused if reused is not None else ItemIndex.from_mapping(placement.item_clusters)

    async def _apply_warm(self, reports: dict[str, WarmReport]) -> None:
        self.state.set_reports(reports)

    async def _connect(self) -> None:
        """Open the store's channel once (authenticating if configured); a failed attempt is closed
        so the next one authenticates again."""
        async with self._connect_lock:
            if self._connected:
                return
            try:
                await self.store.connect()
            except EtcdStoreError:
                await self.store.close()
                raise
            self._connected = True

    async def _follow(self, what: str, watch: Callable[[], AsyncIterator[T]],
                      apply: Callable[[T], Awaitable[None]]) -> None:
        """Feed every value of ``watch()`` to ``apply``; on etcd errors keep the state, back off, retry."""
        backoff = INITIAL_BACKOFF_SECONDS
        shard = f"{self.namespace}/{self.name}"
        while True:
            try:
                await self._connect()
                async for value in watch():
                    if self.errors.get(what):
                        log.info("etcd answers again: following the %s of %s", what, shard)
                        self.errors[what] = ""
                    backoff = INITIAL_BACKOFF_SECONDS
                    await apply(value)
                reason = "the watch ended"
            except (EtcdStoreError, PlacementFormatError) as error:
                reason = str(error)
            if not self.errors.get(what):  # once per outage, not once per retry
                log.warning("cannot follow the %s of %s: %s; serving generation %d until etcd answers "
                            "(retrying, backoff up to %.0f s)", what, shard, reason, self.state.generation,
                            self.max_backoff)
            self.errors[what] = reason
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff)
