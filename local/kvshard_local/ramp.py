"""A load ramp against the local cluster's autoscaler: load rises until it adds a pod, falls until it removes one.

Why a library module: ``kvshard demo``'s autoscaling phase and the autoscaling end-to-end test drive
the same ramp, so the test checks what the demo shows. The autoscaler is the cluster's own
(:class:`~kvshard_local.scaling.LocalAutoscaler`: the chart's KEDA query on the local Prometheus, the
HPA's rule); the ramp only offers load and watches.

Load is closed-loop: ``level`` clients each keep one request in flight through the router. That maps
onto the pressure the autoscaler scales on whatever the machine's speed: a pod's queue term is
(waiting + in-flight) / ``max_concurrency``, so the query's sum over the pods is about
``level / max_concurrency`` — an open-loop rate would cross the target at a different requests per
second on every machine. :func:`plan_ramp` derives the levels from the target: with ``u`` = target ×
max_concurrency requests per pod at exactly the target and ``m`` = min replicas, load rises through
0.5, 1 and 1.5 × ``m·u`` (the last crosses the HPA's 10 % tolerance, so the autoscaler adds a pod, and
is where the added pod sits at the target), is held until the new pod answers warm, then falls through
``m·u`` and 0.5 × ``m·u`` (the HPA's ``ceil(sum / target)`` comes back to ``m``). Prometheus scrapes
each pod at its own moments, so the sum wanders around the level by about a tenth — as much as the
HPA's tolerance: at the target level (1 ×) the autoscaler may already act, which the ramp accepts
(it then holds at 1.5 × all the same, so the new pod is wanted until it answers, and falls from there);
1.5 × is clear of the noise, and so is the bottom of the fall. Each level lasts the query's window plus
two evaluation periods, so the query has seen it whole; a falling level adds the scale-down stabilisation
window. After scale-in the load drops to the bottom of the fall (at 1 × on the minimum pods noise could
add the pod back) and stays for as long as the rise took, counted from the last change settled: on a starved
machine the pressure's latency half can still add a pod, and 'after' then starts once that settled.
The whole ramp is bounded by ``timeout_s``: if the autoscaler never decides, the ramp ends with an
``outcome`` that says where it stopped and why, and what was recorded up to then is still reported
(:mod:`kvshard_local.ramp_timeline`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import math
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from kvshard.autoscaling import TOLERANCE, ScalingRules, duration_seconds, pod_pressure_query
from kvshard.placement_schema import Placement
from kvshard_local.ramp_timeline import RampChange, RampRequest, RampSample, held_share
from kvshard_local.scaling import STATEFULSET

if TYPE_CHECKING:
    from kvshard_local.cluster import LocalCluster
    from kvshard_local.scaling import LocalAutoscaler

log = logging.getLogger(__name__)

RISE = (0.5, 1.0, 1.5)
"""Rising levels as multiples of the minimum pods' load at the target."""
FALL = (1.0, 0.5)
"""Falling levels, the same way."""


@dataclasses.dataclass(frozen=True)
class RampPlan:
    """The levels (requests kept in flight) and how long each lasts."""

    rise: tuple[int, ...]
    """Ascending; the last is held until the autoscaler adds a pod."""
    fall: tuple[int, ...]
    """Descending; the last is held until the autoscaler removes a pod."""
    dwell_s: float
    """A rising level, and the hold after the new pod answers."""
    fall_dwell_s: float
    """A falling level (the scale-down stabilisation window on top)."""
    unit: float
    """Requests in flight per pod at exactly the target pressure."""

    @property
    def after_s(self) -> float:
        """The stretch after scale-in settled: as long as the rise before the top level, so the
        'after' hit ratio counts about as many requests as 'before'."""
        return self.dwell_s * max(1, len(self.rise) - 1)


def plan_ramp(rules: ScalingRules, period_s: float, max_concurrency: int = 1) -> RampPlan:
    """The ramp for ``rules`` evaluated every ``period_s`` on pods computing ``max_concurrency``
    requests at once (the sidecar's setting; the local cluster runs its default, 1)."""
    if max_concurrency < 1 or period_s <= 0:
        raise ValueError("max_concurrency must be >= 1 and period_s > 0")
    unit = rules.target * max_concurrency
    base = rules.min_replicas * unit
    rise = _distinct(max(1, math.ceil(f * base - 1e-9)) for f in RISE)
    crossing = math.floor(base * (1 + TOLERANCE) + 1e-9) + 1  # the HPA acts beyond its tolerance
    if rise[-1] < crossing:
        rise = (*rise, crossing)
    fall = _distinct(max(1, math.floor(f * base + 1e-9)) for f in FALL)
    if math.ceil(fall[-1] / unit - 1e-9) > rules.min_replicas:
        raise ValueError(f"one request in flight is already {1 / unit:.2f} × the target per pod: the ramp "
                         f"cannot fall below {rules.min_replicas} pods' worth of load (raise the target)")
    dwell = duration_seconds(rules.window) + 2 * period_s
    return RampPlan(rise, fall, dwell, dwell + rules.scale_down.stabilization_window_seconds, unit)


def _distinct(levels: Any) -> tuple[int, ...]:
    out: list[int] = []
    for level in levels:
        if level not in out:
            out.append(level)
    return tuple(out)


@dataclasses.dataclass
class RampResult:
    """Everything the ramp recorded (times in seconds since it started, wall clock ``t0``)."""

    plan: RampPlan
    rules: ScalingRules
    query: str
    t0: float
    end: float
    outcome: str
    """``complete``, or where and why the ramp stopped."""
    requests: list[RampRequest]
    samples: list[RampSample]
    changes: list[RampChange]
    placements: list[tuple[float, Placement]]
    """(first seen, placement) per generation seen."""
    evaluations: list[dict[str, Any]]
    """The autoscaler's evaluations during the ramp: ``t``, ``value``, ``pods``, ``desired``."""

    @property
    def completed(self) -> bool:
        return self.outcome == "complete"


class LoadRamp:
    """Drives one ramp (see the module docstring); :meth:`run` blocks until it is over."""

    def __init__(self, cluster: LocalCluster, autoscaler: LocalAutoscaler, plan: RampPlan,
                 make_body: Callable[[], Mapping[str, Any]], *, timeout_s: float = 600.0,
                 sample_every_s: float = 1.0, progress: Callable[[str], None] = lambda line: None) -> None:
        self.cluster, self.autoscaler, self.plan = cluster, autoscaler, plan
        self.make_body, self.progress = make_body, progress
        self.timeout_s, self.sample_every_s = timeout_s, sample_every_s
        self.pressure_query = pod_pressure_query(cluster.namespace, STATEFULSET, autoscaler.rules.window)
        self.requests: list[RampRequest] = []
        self.samples: list[RampSample] = []
        self.placements: dict[int, tuple[float, Placement]] = {}
        self.level = 0
        self.phase = "rise"
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t0 = time.time()
        self._changes0 = len(autoscaler.changes)
        self._evaluations0 = len(autoscaler.evaluations)

    # ------------------------------------------------------------------------------- the ramp

    def run(self) -> RampResult:
        self._t0 = time.time()
        deadline = time.monotonic() + self.timeout_s
        workers = [threading.Thread(target=self._worker, args=(i,), name=f"ramp-{i}", daemon=True)
                   for i in range(max((*self.plan.rise, *self.plan.fall)))]
        sampler = threading.Thread(target=lambda: asyncio.run(self._sample_loop()), name="ramp-sampler", daemon=True)
        for thread in (*workers, sampler):
            thread.start()
        try:
            outcome = self._drive(deadline)
        finally:
            self._stop.set()
            for thread in (*workers, sampler):
                thread.join(timeout=200)
        self.progress(f"ramp: {outcome}")
        return self._result(outcome)

    def _drive(self, deadline: float) -> str:
        plan, rules = self.plan, self.autoscaler.rules
        for i, level in enumerate(plan.rise):
            self._set("rise", level)
            last = i == len(plan.rise) - 1
            if self._wait(lambda: self._decided(grow=True), deadline if last else time.monotonic() + plan.dwell_s,
                          deadline):
                break
        else:
            peak = max((s.total for s in self.samples), default=0.0)
            return (f"the autoscaler did not add a pod within the ramp's {self.timeout_s:.0f} s: the query peaked at "
                    f"{peak:.2f}, it acts above {rules.min_replicas * rules.target * (1 + TOLERANCE):.2f} "
                    f"(min pods × target × (1 + tolerance))")
        # Held at the top level whatever level the decision came at: held at 1 × (a decision on the noise) the
        # sum sits at the minimum pods' target, the HPA may take the new pod back before the router sent it
        # anything (measured: `kvshard demo` 2026-12-06, scale-in 55 s after scale-out, no answer), and at
        # 1.5 × the added pod sits at the target.
        self._set("hold", plan.rise[-1])
        if not self._wait(self._grown_and_answered, deadline, deadline):
            return (f"the autoscaler decided to add a pod but it did not answer a request warm within the ramp's "
                    f"{self.timeout_s:.0f} s")
        self._wait(lambda: False, time.monotonic() + plan.dwell_s, deadline)
        fall = [level for level in plan.fall if level < self.level] or [plan.fall[-1]]  # below the hold
        for i, level in enumerate(fall):
            self._set("fall", level)
            last = i == len(fall) - 1
            if self._wait(lambda: self._decided(grow=False),
                          deadline if last else time.monotonic() + plan.fall_dwell_s, deadline):
                break
        else:
            return (f"the autoscaler did not remove a pod within the ramp's {self.timeout_s:.0f} s (last query value "
                    f"{self.samples[-1].total if self.samples else float('nan'):.2f}; it removes one at or below "
                    f"{rules.min_replicas * rules.target:.2f})")
        # The target level (1 ×) is where noise may act in either direction, so the load settles at the
        # bottom of the fall, clear of it, whatever level the decision came at.
        self._set("settle", plan.fall[-1])
        if not self._wait(self._shrunk_and_settled, deadline, deadline):
            return ("the autoscaler removed a pod but the placement did not settle within the ramp's "
                    f"{self.timeout_s:.0f} s")
        # 'after' is the stretch after the last change settled: a change within it (a starved machine's
        # latency half can still push the sum over) starts the stretch again once that change settled.
        while True:
            changed = functools.partial(self._changed_since, len(self._changes()))
            if not self._wait(changed, time.monotonic() + plan.after_s, deadline):
                return "complete"
            if not self._wait(self._last_change_settled, deadline, deadline):
                return (f"the autoscaler changed the pods again after scale-in ({len(self._changes())} changes) "
                        f"and the placement did not settle within the ramp's {self.timeout_s:.0f} s")

    def _set(self, phase: str, level: int) -> None:
        with self._lock:
            changed = (phase, level) != (self.phase, self.level)
            self.phase, self.level = phase, level
        if changed:
            pods = len(self.cluster.pod_names)
            self.progress(f"ramp: {phase}: {level} requests in flight (≈ {level / self.plan.unit / pods:.2f} × the "
                          f"target per pod on {pods} pods) at t={self._now():.0f}s")

    def _wait(self, fact: Callable[[], bool], until: float, deadline: float) -> bool:
        """Poll ``fact`` until ``min(until, deadline)``; a status line every ten seconds."""
        last = time.monotonic()
        while time.monotonic() < min(until, deadline):
            if fact():
                return True
            if time.monotonic() - last >= 10:
                last = time.monotonic()
                self.progress(self._status())
            time.sleep(0.25)
        return fact()

    def _status(self) -> str:
        sample = self.samples[-1] if self.samples else None
        pods = "" if sample is None else " ".join(f"{p}:{s}" for p, s in sorted(sample.pods.items()))
        failed = sum(1 for r in self.requests if not r.ok)
        return (f"[ramp  ] t={self._now():.0f}s {self.phase} {self.level} in flight, pods {pods}, pressure "
                f"{sample.total if sample else float('nan'):.2f}, {len(self.requests)} requests, {failed} failed")

    def _changes(self) -> list[tuple[float, Any]]:
        return list(self.autoscaler.changes[self._changes0:])

    def _decided(self, *, grow: bool) -> bool:
        pending = self.autoscaler.pending
        if pending is not None and (pending[2] > pending[1]) == grow:
            return True
        return any((len(c.after) > len(c.before)) == grow for _, c in self._changes())

    def _grown_and_answered(self) -> bool:
        added = {p for _, c in self._changes() if len(c.after) > len(c.before) for p in c.added}
        return bool(added) and any(r.ok and r.pod in added for r in list(self.requests))

    def _shrunk_and_settled(self) -> bool:
        shrunk = [c for _, c in self._changes() if len(c.after) < len(c.before)]
        return bool(shrunk) and self._serving_exactly(shrunk[-1].after)

    def _last_change_settled(self) -> bool:
        changes = self._changes()
        return (not self._decided_pending() and bool(changes)
                and self._serving_exactly(changes[-1][1].after))

    def _changed_since(self, seen: int) -> bool:
        return len(self._changes()) > seen or self._decided_pending()

    def _decided_pending(self) -> bool:
        return self.autoscaler.pending is not None

    def _serving_exactly(self, pods: Any) -> bool:
        """The latest poll's placement names exactly ``pods`` and every one of them serves."""
        if not self.samples:
            return False
        last = self.samples[-1]
        return set(last.placed) == set(pods) and all(last.pods.get(p) == "serving" for p in pods)

    def _now(self) -> float:
        return time.time() - self._t0

    # ------------------------------------------------------------------------------- requests

    def _worker(self, index: int) -> None:
        url = self.cluster.router_url + "/v1/recommend"
        while not self._stop.is_set():
            with self._lock:
                level = self.level
                body = dict(self.make_body()) if index < level else None
                placement = self._current()
            if body is None:
                self._stop.wait(0.2)
                continue
            sent = self._now()
            status, pod, answer = _post(url, body)
            record = RampRequest(sent, self._now(), level, status, pod)
            if status == 200 and isinstance(answer, dict):
                tokens = answer.get("tokens") or {}
                record.query_tokens = sum(int(v) for v in (tokens.get("query") or {}).values())
                record.hit_tokens = sum(int(n) for tiers in (tokens.get("hit") or {}).values() for n in tiers.values())
                if placement is not None and pod:
                    record.held = held_share([str(c) for c in body.get("candidates", [])], placement, pod)
            else:
                record.error = str(answer)[:300]
                log.warning("ramp request failed: HTTP %s %s", status, record.error)
            with self._lock:
                self.requests.append(record)

    def _current(self) -> Placement | None:
        if not self.placements:
            return None
        return self.placements[max(self.placements)][1]

    # ------------------------------------------------------------------------------- sampling

    async def _sample_loop(self) -> None:
        async with self.cluster.etcd_store(timeout=2.0, attempts=1) as store:
            while not self._stop.is_set():
                try:
                    await self._sample(store)
                except Exception as error:  # one failed poll (etcd busy, Prometheus restarting) is skipped
                    log.debug("ramp sample failed: %s", error)
                await asyncio.sleep(self.sample_every_s)

    async def _sample(self, store: Any) -> None:
        """One poll; stamped when it starts (what it reads was true then or later)."""
        t = self._now()
        ns, name = self.cluster.namespace, self.cluster.name
        generation = await store.current_generation(ns, name)
        if generation and generation not in self.placements:
            placement = await store.read_generation(ns, name, generation)
            with self._lock:
                self.placements[generation] = (self._now(), placement)
        reports = await store.read_warm(ns, name)
        view, pressure = await asyncio.gather(asyncio.to_thread(_get_json, self.cluster.router_url + "/v1/placement"),
                                              asyncio.to_thread(self._pod_pressure))
        current = self._current()
        routable = {p["name"] for p in view.get("pods", []) if p.get("healthy")}
        pending = self.autoscaler.pending
        names = list(self.cluster.pod_names)
        draining = set(names[pending[2]:]) if pending is not None and pending[2] < pending[1] else set()
        pods = {p: "draining" if p in draining else "serving" if p in routable else "warming" for p in names}
        warm = tuple(sorted(p for p, r in reports.items() if current is not None and r.generation == current.generation
                            and r.warming == 0 and set(current.clusters_of(p)) <= set(r.clusters)))
        with self._lock:
            self.samples.append(RampSample(t, self.phase, self.level, pods,
                                           {p: v for p, v in pressure.items() if p in pods},
                                           current.generation if current else 0,
                                           tuple(current.pods) if current else (), warm))

    def _pod_pressure(self) -> dict[str, float]:
        query = urllib.parse.urlencode({"query": self.pressure_query})
        doc = _get_json(f"{self.cluster.prometheus_url}/api/v1/query?{query}")
        return {r["metric"].get("pod", "?"): float(r["value"][1]) for r in doc.get("data", {}).get("result", [])}

    # ------------------------------------------------------------------------------- result

    def _result(self, outcome: str) -> RampResult:
        def pressure_at(decided: float) -> float | None:
            before = [e.value for e in self.autoscaler.evaluations[self._evaluations0:] if e.at <= decided + 1e-6]
            return before[-1] if before else None

        changes = [RampChange(change.before, change.after, change.seconds, change.drains, decided=decided - self._t0,
                              pressure=pressure_at(decided)) for decided, change in self._changes()]
        evaluations = [{"t": e.at - self._t0, "value": e.value, "pods": e.pods, "desired": e.desired}
                       for e in self.autoscaler.evaluations[self._evaluations0:]]
        with self._lock:
            return RampResult(self.plan, self.autoscaler.rules, self.autoscaler.query, self._t0, self._now(), outcome,
                              list(self.requests), list(self.samples), changes,
                              [self.placements[g] for g in sorted(self.placements)], evaluations)


def _post(url: str, body: Mapping[str, Any], timeout: float = 180.0) -> tuple[int, str, Any]:
    """``(status, X-Kvshard-Pod, JSON answer or error text)``; status 0 when no HTTP answer came."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.headers.get("X-Kvshard-Pod", ""), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get("X-Kvshard-Pod", ""), error.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, ValueError) as error:
        return 0, "", f"{type(error).__name__}: {error}"


def _get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return dict(json.loads(response.read()))
