"""A pod's pressure, the one number the engine autoscaler scales on (see :mod:`kvshard.autoscaling`).

``pressure = max(queue, latency)`` where ``queue = (waiting + in-flight) / max_concurrency`` and
``latency = TTFT p90 over the last window / TTFT target``. 1.0 is "as busy as it was sized for":
the queue term reacts at once to a burst (a request waiting is pressure before it is slow), the
latency term catches what the queue misses — cold clusters after a rebalance make every request
slower at the same concurrency. Both parts are exported too, so a dashboard shows which one drives.

When vLLM does all the math (a scorer with ``--engine vllm``) the queue that matters is vLLM's: the
sidecar admits many recommendations at once and vLLM schedules their candidates. The queue term is
then the larger of the sidecar's and ``(vLLM running + waiting sequences) / vLLM's max_num_seqs``, as
the sidecar last read them from vLLM's own ``/metrics`` (:meth:`PressureTracker.engine_queue`).

Pure and thread-safe (requests finish on worker threads, scrapes read on the event loop); the TTFT
window is bounded by ``max_samples`` so memory stays flat under any request rate.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class PressureReading:
    waiting: int
    inflight: int
    ttft_p90_seconds: float
    """0 when no request finished within the window."""
    queue: float
    latency: float

    @property
    def pressure(self) -> float:
        return max(self.queue, self.latency)


class PressureTracker:
    """Counts requests waiting and computing, and keeps a window of recent TTFTs."""

    def __init__(self, max_concurrency: int, ttft_target_seconds: float, window_seconds: float, *,
                 max_samples: int = 2048, clock: Callable[[], float] = time.monotonic) -> None:
        if max_concurrency < 1 or ttft_target_seconds <= 0 or window_seconds <= 0:
            raise ValueError("max_concurrency, ttft_target_seconds and window_seconds must be positive")
        self.max_concurrency = max_concurrency
        self.ttft_target_seconds = ttft_target_seconds
        self.window_seconds = window_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._waiting = 0
        self._inflight = 0
        self._ttfts: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._engine: float | None = None

    def engine_queue(self, running: float, waiting: float, capacity: int) -> None:
        """vLLM's scheduler as last read: sequences running and waiting, of ``capacity`` it batches at once."""
        with self._lock:
            self._engine = (running + waiting) / max(1, capacity)

    def arrived(self) -> None:
        """A request was admitted and waits for compute."""
        with self._lock:
            self._waiting += 1

    def started(self) -> None:
        """A waiting request got compute."""
        with self._lock:
            self._waiting -= 1
            self._inflight += 1

    def left(self, *, started: bool) -> None:
        """A request finished (or failed, or was cancelled) — ``started``: whether it had compute."""
        with self._lock:
            if started:
                self._inflight -= 1
            else:
                self._waiting -= 1

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self._ttfts.append((self._clock(), seconds))

    def read(self) -> PressureReading:
        now = self._clock()
        with self._lock:
            while self._ttfts and now - self._ttfts[0][0] > self.window_seconds:
                self._ttfts.popleft()
            waiting, inflight, engine = self._waiting, self._inflight, self._engine
            recent = sorted(s for _, s in self._ttfts)
        p90 = recent[max(0, math.ceil(0.9 * len(recent)) - 1)] if recent else 0.0  # nearest rank
        queue = (waiting + inflight) / self.max_concurrency
        return PressureReading(waiting, inflight, p90, queue if engine is None else max(queue, engine),
                               p90 / self.ttft_target_seconds)
