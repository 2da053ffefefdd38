"""Logging filters for long-running components.

Why: a dependency that logs every retry of an outage (etcd3aio's watch warns on each reconnect
attempt, every ≤ 5 s) buries the one line that says what happened; a filter on its logger keeps the
first record and then one per interval, so the outage is still visible and the log stays readable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class QuietRepeats(logging.Filter):
    """Let a logger's first record through, then at most one per ``interval`` seconds.

    etcd3aio's watch reconnects by itself and warns on every attempt (every ≤ 5 s for as long as etcd
    is away); installed on its logger this keeps an outage to one line a minute.
    """

    def __init__(self, interval: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval = interval
        self._clock = clock
        self._last: float | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        now = self._clock()
        if self._last is not None and now - self._last < self.interval:
            return False
        self._last = now
        return True


def quiet_watch_reconnects(interval: float = 60.0) -> None:
    """Keep etcd3aio's per-attempt watch warnings to one per ``interval`` (idempotent); every
    long-running component that follows a watch calls this at startup."""
    logger = logging.getLogger("etcd3aio.watch")
    if not any(isinstance(f, QuietRepeats) for f in logger.filters):
        logger.addFilter(QuietRepeats(interval))
