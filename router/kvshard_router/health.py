"""Active health checks of the pods the placement names: ``GET <url>/readyz`` every interval.

Every known pod with a URL is probed concurrently each round with a short timeout; 2xx is healthy,
anything else (refused, timeout, 503 while the model loads) is unhealthy. A pod that just appeared
(new placement or new warm report) is probed at once instead of waiting for the next round, since
the router does not send it traffic before its first passing check. The *passive* half — a
connection failure while forwarding — is in :mod:`kvshard_router.service`; both end in
:meth:`RouterState.set_health`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp

from kvshard.tasks import cancel_and_wait
from kvshard_router.state import RouterState

log = logging.getLogger(__name__)


class HealthChecker:
    """Probes every routable-candidate pod of ``state`` each ``interval`` seconds until :meth:`stop`."""

    def __init__(self, state: RouterState, session: aiohttp.ClientSession, *, interval: float,
                 timeout: float) -> None:
        self.state = state
        self.session = session
        self.interval = interval
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._wake = asyncio.Event()
        self._probed: frozenset[tuple[str, str]] = frozenset()
        self._task: asyncio.Task[None] | None = None
        state.listeners.append(self._on_change)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="health-checks")

    async def stop(self) -> None:
        if self._on_change in self.state.listeners:
            self.state.listeners.remove(self._on_change)
        await cancel_and_wait(self._task)
        self._task = None

    def _on_change(self) -> None:
        """A new snapshot: probe now if a pod or its URL is new."""
        if not set(self.state.urls().items()) <= self._probed:
            self._wake.set()

    async def probe(self, url: str) -> tuple[bool, str]:
        """One check: (healthy, reason when not)."""
        try:
            async with self.session.get(f"{url}/readyz", timeout=self.timeout, allow_redirects=False) as resp:
                if 200 <= resp.status < 300:
                    return True, ""
                return False, f"/readyz answered {resp.status}"
        except TimeoutError:
            return False, f"/readyz did not answer within {self.timeout.total:g} s"
        except aiohttp.ClientError as error:
            return False, f"/readyz failed: {error or type(error).__name__}"

    async def check_all(self) -> None:
        """One round over every placement pod; pods without a usable URL are marked unhealthy."""
        urls = self.state.urls()
        self._probed = frozenset(urls.items())
        pods = list(urls)
        results = await asyncio.gather(*(self.probe(urls[p]) for p in pods))
        for pod, (ok, reason) in zip(pods, results, strict=True):
            if self.state.url(pod) == urls[pod]:  # still the same pod at the same URL
                self.state.set_health(pod, ok, reason)
        for pod in self.state.pods():
            if pod not in urls and self.state.url(pod) is None:
                self.state.set_health(pod, False, "no usable URL in its warm report")

    async def _run(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # a bug here must not stop health checking for good
                log.exception("health check round failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.interval)
            self._wake.clear()
