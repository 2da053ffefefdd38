"""The router's per-request policy core, shared by its two front ends.

``kvshard router serve`` (HTTP: it forwards the request itself) and ``kvshard router epp`` (a Gateway
API Inference Extension endpoint picker: Envoy forwards) answer the same question the same way: parse
the body, take the current snapshot, decide with one item lookup (:mod:`kvshard_router.decision`),
count the request's clusters. Only what happens around that differs — forwarding and fail-over in
:mod:`kvshard_router.service`, the ext_proc protocol in :mod:`kvshard_router.epp` — so a request and
a snapshot give the same pod through either front end (a property test pins that down).

No I/O and no clock here except the decision-time histogram; refusals are values, not exceptions,
so each front end renders them in its own protocol (a JSON error, an ext_proc ImmediateResponse).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from kvshard.request_errors import RequestError
from kvshard_router.backlog import Backlog
from kvshard_router.corequest import CoRequestSketch
from kvshard_router.decision import Decision, decide, record_served
from kvshard_router.metrics import RouterMetrics
from kvshard_router.policies import RouteRequest, RoutingPolicy
from kvshard_router.snapshot import Snapshot
from kvshard_router.state import RouterState
from kvshard_router.validation import parse_recommend

Parser = Callable[[bytes], RouteRequest]


@dataclass(frozen=True)
class Refusal:
    """The router answers the request itself: ``status`` with a JSON error naming ``field``."""

    status: int
    field: str
    message: str
    retry_after: bool = False
    """Whether trying again shortly may succeed (a ``Retry-After`` goes with the answer)."""
    generation: int | None = None


@dataclass(frozen=True)
class Pick:
    """A chosen pod for one request, and what the rest of the request's handling needs from it."""

    route: RouteRequest
    decision: Decision
    pod: str
    work: float
    """The request's work on ``pod`` in token equivalents (what the backlog adds and drains)."""
    clusters: list[int]
    """The distinct known clusters among the candidates."""

    @property
    def snapshot(self) -> Snapshot:
        return self.decision.snapshot


class Picker:
    """Parses, decides and counts for one router; the front end forwards (or lets Envoy forward)."""

    def __init__(self, state: RouterState, policy: RoutingPolicy, load: Backlog, metrics: RouterMetrics, *,
                 history_tokens: int = 0, corequest: CoRequestSketch | None = None,
                 parse: Parser | None = None) -> None:
        self.state = state
        self.policy = policy
        self.load = load
        self.metrics = metrics
        self.corequest = corequest
        self.history_tokens = history_tokens
        self.parse: Parser = parse or self._parse
        """Body → :class:`RouteRequest` (``parse_recommend`` unless a caller, e.g. the routing
        simulator replaying a trace with known token counts, brings its own)."""
        self.timings: list[tuple[int, int]] | None = None
        """Set to a list (the benchmark), every decision appends its wall and thread-CPU nanoseconds."""

    def _parse(self, raw: bytes) -> RouteRequest:
        return parse_recommend(raw, history_tokens=self.history_tokens)

    def pick(self, raw: bytes, *, only: Collection[str] | None = None) -> Pick | Refusal:
        """The pod for the request whose body is ``raw``; ``only`` restricts the choice to those pods
        (the GIE subset hint), every other pod counting as unhealthy for this request."""
        try:
            route = self.parse(raw)
        except RequestError as error:
            return Refusal(error.status, error.field, error.message)
        snapshot = self.state.snapshot
        if snapshot is None:
            return Refusal(503, "placement", "no placement loaded yet; the router follows etcd", retry_after=True)
        if only is not None:
            snapshot = snapshot.restricted_to(only)
        if self.timings is None:
            started = time.perf_counter()
            decision = decide(self.policy, route, snapshot, self.load)
            self.metrics.decision.observe(time.perf_counter() - started)
        else:
            wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
            decision = decide(self.policy, route, snapshot, self.load)
            cpu, wall = time.thread_time_ns() - cpu, time.perf_counter_ns() - wall
            self.timings.append((wall, cpu))
            self.metrics.decision.observe(wall / 1e9)
        if decision.pod is None:
            among = "" if only is None else f" (restricted to the {len(set(only))} pods of the subset hint)"
            return Refusal(503, "pods", f"none of the {len(snapshot.pods)} pods of generation {snapshot.generation} "
                           f"is healthy{among}", retry_after=True, generation=snapshot.generation)
        clusters = decision.lookup.distinct_clusters()
        self.metrics.count_clusters(self.metrics.cluster_requests, clusters)
        if self.corequest is not None:
            self.corequest.add(decision.lookup.clusters.tolist())
        return self._pick(route, decision, clusters)

    def _pick(self, route: RouteRequest, decision: Decision, clusters: list[int]) -> Pick:
        assert decision.pod is not None
        work = self.load.work(decision.cached, decision.total_tokens)
        return Pick(route, decision, decision.pod, work, clusters)

    def again(self, first: Pick, snapshot: Snapshot) -> Pick | None:
        """The best other pod for ``first``'s request on ``snapshot`` (where ``first.pod`` is marked
        failed), reusing its lookup; None when no other pod is healthy."""
        retry = snapshot.with_health({first.pod: False})
        decision = decide(self.policy, first.route, retry, self.load, first.decision.lookup)
        return None if decision.pod is None else self._pick(first.route, decision, first.clusters)

    def answered(self, pick: Pick, pod: str) -> None:
        """``pod`` answered ``pick``'s request with a 2xx: it now holds its blocks (the affinity policy
        remembers them) and its warm clusters count as hits."""
        record_served(self.policy, pod, pick.decision.lookup, pick.snapshot)
        warm = self.state.warm(pod)
        self.metrics.count_clusters(self.metrics.cluster_hits, (c for c in pick.clusters if c in warm))
