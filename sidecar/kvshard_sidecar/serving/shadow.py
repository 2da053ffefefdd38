"""Shadow checks: is the blended answer the one a full prefill would give? Measured in production.

Why. A blend's fidelity was measured offline on benchmark users; a user's own catalog, prompt and
traffic may differ, and the fidelity controller in the operator needs live evidence to steer the
recompute ratio. So a sampled share of requests (``sampleRate`` of the blend in force) is checked:
*after* its blended answer is sent, the same prompt is prefilled in full and the two are compared —
same chosen candidate (the argmax over the candidates' label logits, :mod:`kvshard.ranking`), KL of the
first-token distribution, Kendall τ over the label logits.

The check never costs a request more than one scheduling unit:

* it runs only while no request is in the building, and holds the compute semaphore like a prefill
  unit, so a request that arrives meanwhile waits for at most this one full prefill;
* it has a budget — a token bucket that fills at ``budget`` seconds of compute per wall-clock second —
  so an idle-but-busy pod does not spend its spare time on checks alone;
* it sheds first: a bounded queue (the oldest job goes when full) and a maximum age; a job shed or
  never run is counted ``skipped``, so the controller and the dashboards see how much evidence was lost.

Only requests blended with the settings in force are sampled (a per-call ``blend`` override measures
something the controller does not steer), and only on the embedded engine: with ``--engine vllm`` the
blended answer's logits live in vLLM, which returns the label tokens' log-probabilities but not the
first-token distribution the KL needs (a vLLM shadow would be a second completion without the
exchange; not built yet).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvshard.blend_policy import ratio_label
from kvshard.ranking import best_index, kendall_tau
from kvshard.segments import Prompt
from kvshard.tasks import cancel_and_wait
from kvshard_sidecar.metrics import SidecarMetrics

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

QUEUE_LIMIT = 8
"""Jobs waiting for idle time; beyond it the oldest is skipped (shed first)."""
MAX_AGE_S = 30.0
"""A job not run within this long is skipped: its evidence belongs to a ratio that may be gone."""
BURST_S = 5.0
"""Most compute seconds the budget saves up while idle."""
POLL_S = 0.02


@dataclass(frozen=True)
class ShadowJob:
    """One sampled request: its prompt and what the blend answered, under the settings in force."""

    prompt: Prompt
    label_token_ids: tuple[int, ...]
    blended_logits: torch.Tensor  # float32 [vocab] of the first token
    method: str
    ratio: str
    queued_at: float


@dataclass(frozen=True)
class Comparison:
    """A shadow check's verdict."""

    agree: bool
    kl: float
    tau: float


def compare(full_logits: torch.Tensor, blended_logits: torch.Tensor, label_token_ids: tuple[int, ...]) -> Comparison:
    """Same chosen candidate, KL(full ‖ blended) over the vocabulary (nats), τ over the label logits
    (``*_logits`` are torch tensors)."""
    labels = list(label_token_ids)
    full_labels, blended_labels = full_logits[labels].tolist(), blended_logits[labels].tolist()
    p, q = full_logits.double().log_softmax(-1), blended_logits.double().log_softmax(-1)
    kl = max(0.0, float((p.exp() * (p - q)).sum()))
    return Comparison(best_index(full_labels) == best_index(blended_labels), kl, kendall_tau(full_labels,
                                                                                             blended_labels))


class Budget:
    """A token bucket of compute seconds: fills at ``share`` per wall-clock second, up to ``burst``."""

    def __init__(self, share: float, burst: float = BURST_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.share, self.burst, self._clock = share, burst, clock
        self._tokens = min(burst, share * burst)
        self._at = clock()

    def _fill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.share)
        self._at = now

    def allows(self, cost: float) -> bool:
        self._fill()
        return self.share > 0 and self._tokens >= min(cost, self.burst)

    def spend(self, seconds: float) -> None:
        self._fill()
        self._tokens -= seconds


class ShadowChecker:
    """Samples requests (any thread) and checks them in idle time (the event loop)."""

    def __init__(self, metrics: SidecarMetrics, full_logits: Callable[[Prompt], torch.Tensor], *, budget_share: float,
                 sample_rate: float = 0.0, seed: int | None = None) -> None:
        self.metrics = metrics
        self.sample_rate = sample_rate
        self.budget = Budget(budget_share)
        self._full_logits = full_logits
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._jobs: collections.deque[ShadowJob] = collections.deque()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._cost = 0.0
        """Seconds the last full prefill took: what the next one is expected to cost."""
        self.checked = 0
        self.skipped = 0

    def announce(self, method: str, ratio: float) -> None:
        """Export the check counters of a blend at 0 before its first check: Prometheus' ``increase()``
        cannot count a series' first value, so the controller would miss the first check at each rung."""
        if self.sample_rate > 0:
            for result in ("agree", "disagree", "skipped"):
                self.metrics.fidelity_checks.labels(self.metrics.model_name, result, method, ratio_label(ratio))

    # ----------------------------------------------------------------- sampling (worker thread)

    def offer(self, prompt: Prompt, label_token_ids: tuple[int, ...], blended_logits: torch.Tensor, method: str,
              ratio: float) -> bool:
        """Sample this request with probability ``sample_rate``; queue it when sampled. Returns whether."""
        with self._lock:
            if self.sample_rate <= 0 or self._random.random() >= self.sample_rate:
                return False
            job = ShadowJob(prompt, tuple(label_token_ids), blended_logits.detach().float().cpu(), method,
                            ratio_label(ratio), time.monotonic())
            shed = self._jobs.popleft() if len(self._jobs) >= QUEUE_LIMIT else None
            self._jobs.append(job)
        if shed is not None:
            self._skip(shed, "queue full")
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)
        return True

    def _skip(self, job: ShadowJob, why: str) -> None:
        self.skipped += 1
        self.metrics.fidelity_checks.labels(self.metrics.model_name, "skipped", job.method, job.ratio).inc()
        log.debug("shadow check skipped (%s)", why)

    def _pop(self) -> ShadowJob | None:
        with self._lock:
            return self._jobs.popleft() if self._jobs else None

    # ----------------------------------------------------------------- checking (event loop)

    def start(self, pool: Executor, compute: asyncio.Semaphore, busy: Callable[[], bool]) -> None:
        """Run checks in ``pool`` holding ``compute``, only while ``busy()`` is false."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._task = self._loop.create_task(self._run(pool, compute, busy), name="shadow-checks")

    async def _run(self, pool: Executor, compute: asyncio.Semaphore, busy: Callable[[], bool]) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while (job := self._pop()) is not None:
                try:
                    await self._check(job, pool, compute, busy)
                except Exception:
                    log.exception("shadow check failed")
                    self._skip(job, "error")

    async def _check(self, job: ShadowJob, pool: Executor, compute: asyncio.Semaphore,
                     busy: Callable[[], bool]) -> None:
        while busy() or compute.locked() or not self.budget.allows(self._cost):
            if time.monotonic() - job.queued_at > MAX_AGE_S:
                self._skip(job, "no idle time or budget")
                return
            await asyncio.sleep(POLL_S)
        async with compute:
            started = time.perf_counter()
            full = await asyncio.get_running_loop().run_in_executor(pool, self._full_logits, job.prompt)
            spent = time.perf_counter() - started
        self._cost = spent
        self.budget.spend(spent)
        verdict = compare(full, job.blended_logits, job.label_token_ids)
        metrics, name = self.metrics, self.metrics.model_name
        metrics.shadow_seconds.labels(name).inc(spent)
        metrics.fidelity_checks.labels(name, "agree" if verdict.agree else "disagree", job.method, job.ratio).inc()
        metrics.fidelity_kl.labels(name, job.method, job.ratio).observe(verdict.kl)
        metrics.fidelity_rank_correlation.labels(name, job.method, job.ratio).observe(verdict.tau)
        self.checked += 1

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
