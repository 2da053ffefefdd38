"""Background prefill: the queue that warms blocks between requests.

Why a queue of its own: placement, history warming and ``POST /v1/blocks/prefill`` all ask for
blocks, but the model runs one thing at a time. Units wait here by priority and take the compute
semaphore only while they run, so a request waits behind at most one unit; the work itself is the
service's (:meth:`kvshard_sidecar.serving.service.SidecarService.warm_unit`), reached through
:class:`Warmer` so this module does not import the service.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar, TypeVarTuple

from kvshard.tasks import cancel_and_wait
from kvshard_sidecar.metrics import SidecarMetrics

log = logging.getLogger(__name__)

R = TypeVar("R")
Args = TypeVarTuple("Args")


class Warmer(Protocol):
    """What the queue needs of the service: the work, and where to count it."""

    @property
    def metrics(self) -> SidecarMetrics: ...
    @property
    def model_name(self) -> str: ...

    def warm_unit(self, unit: WarmUnit) -> int: ...


@dataclass(frozen=True)
class WarmUnit:
    """One unit of background prefill: some items' blocks (computed in one batched pass) or one
    user's history block. ``wanted`` is asked right before computing (placement may have moved the
    cluster away meanwhile); ``done`` runs on the event loop after the attempt, success or not, so
    the caller can check the store for what actually got stored."""

    kind: Literal["item", "user"]
    idents: tuple[str, ...]
    wanted: Callable[[], bool] | None = None
    done: Callable[[WarmUnit], Awaitable[None]] | None = None


class PrefillQueue:
    """Warms blocks in the background, one unit at a time, taking turns with requests.

    Each unit holds the compute semaphore only while it runs, so a request waits for at most one
    unit. Units run by priority (0 first: placement's clusters and explicit prefill calls; 1:
    history warmed ahead), then in submission order.
    """

    def __init__(self, service: Warmer) -> None:
        self._service = service
        self._queue: asyncio.PriorityQueue[tuple[int, int, WarmUnit]] = asyncio.PriorityQueue()
        self._order = itertools.count()
        self._pending_blocks = 0
        self._task: asyncio.Task[None] | None = None
        self._pool: Executor | None = None
        self._compute = asyncio.Semaphore(1)

    def submit(self, items: Iterable[str], users: Iterable[str]) -> int:
        """Queue items and users one block each (``POST /v1/blocks/prefill``); returns blocks pending."""
        return self.submit_units([*(WarmUnit("item", (i,)) for i in items),
                                  *(WarmUnit("user", (u,)) for u in users)])

    def submit_units(self, units: Iterable[WarmUnit], priority: int = 0) -> int:
        for unit in units:
            self._queue.put_nowait((priority, next(self._order), unit))
            self._pending_blocks += len(unit.idents)
        self._gauge()
        return self._pending_blocks

    @property
    def pending_blocks(self) -> int:
        return self._pending_blocks

    def _gauge(self) -> None:
        self._service.metrics.prefill_pending.labels(self._service.model_name).set(self._pending_blocks)

    def start(self, loop: asyncio.AbstractEventLoop, pool: Executor, compute: asyncio.Semaphore) -> None:
        self._pool, self._compute = pool, compute
        self._task = loop.create_task(self._run())

    async def exclusive(self, work: Callable[[*Args], R], *args: *Args) -> R:
        """Run ``work(*args)`` in the worker pool holding the compute semaphore, so no request or
        prefill unit runs meanwhile (a catalog switch replaces the builder and the engine's identity)."""
        async with self._compute:
            return await asyncio.get_running_loop().run_in_executor(self._pool, work, *args)

    async def _run(self) -> None:
        loop, pool, compute = asyncio.get_running_loop(), self._pool, self._compute
        while True:
            _, _, unit = await self._queue.get()
            try:
                async with compute:
                    if unit.wanted is None or unit.wanted():
                        await loop.run_in_executor(pool, self._service.warm_unit, unit)
                        self._service.metrics.prefill_done.labels(self._service.model_name).inc(len(unit.idents))
            except Exception:
                log.exception("prefill of %s %s failed", unit.kind, ", ".join(unit.idents))
            finally:
                self._pending_blocks -= len(unit.idents)
                self._gauge()
            if unit.done is not None:
                try:
                    await unit.done(unit)
                except Exception:
                    log.exception("after prefill of %s %s", unit.kind, ", ".join(unit.idents))

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
