"""Leaving without failing a request: the drain a pod runs before it exits (scale-in, rollout).

Order matters. First the pod stops being *chosen*: ``/readyz`` answers 503 and the warm report is
withdrawn from etcd, so every router drops the pod from its snapshot (it has no URL any more) at
its next watch event, and health checks agree. Requests the routers already chose still arrive for
a moment; they are *served*, not refused — refusing would cost a failover at best. The drain is done
when nothing is inside (waiting or computing) and nothing arrived for ``settle_seconds``: by then the
routers' last choices have landed. The chart's ``preStop`` hook and the local cluster's scale-in both
call ``GET /v1/drain`` on loopback and wait for its answer before the process is stopped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


class Drain:
    """The drain state of one sidecar; ``inside`` reads how many requests are in the building."""

    def __init__(self, inside: Callable[[], int], *, settle_seconds: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._inside = inside
        self.settle_seconds = settle_seconds
        self._clock = clock
        self.draining = False
        self.started_at: float | None = None
        self.last_arrival = clock()
        self.served_while_draining = 0

    def arrived(self) -> None:
        """A /v1/recommend came in (call before admission)."""
        self.last_arrival = self._clock()
        if self.draining:
            self.served_while_draining += 1

    def quiet(self) -> bool:
        return self._inside() == 0 and self._clock() - self.last_arrival >= self.settle_seconds

    async def run(self, withdraw: Callable[[], Awaitable[None]], *, timeout: float,
                  poll: float = 0.05) -> dict[str, Any]:
        """Start draining (once; later calls wait for the same drain) and wait until quiet or
        ``timeout``; the answer says which, how long it took and what was served meanwhile."""
        if not self.draining:
            self.draining = True
            self.started_at = self._clock()
            await withdraw()
        deadline = self._clock() + timeout
        while not self.quiet() and self._clock() < deadline:
            await asyncio.sleep(poll)
        drained = self.quiet()
        assert self.started_at is not None
        return {"drained": drained, "seconds": round(self._clock() - self.started_at, 3),
                "served_while_draining": self.served_while_draining, "inside": self._inside()}
