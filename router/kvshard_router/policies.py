"""Routing policies behind one small interface, so the router service and the simulator share them.

A policy answers ``choose(request, snapshot, load) -> pod name | None`` (None: no healthy pod). The
shape follows vLLM production-stack's one-method ``route_request`` router; unlike it, policies are
found by name in :data:`POLICIES` (filled by the :func:`register` decorator), not by an if/elif
factory, and none is a global singleton — the caller owns the instance and its state.

Every policy obeys two rules the tests pin down: an unhealthy pod is never chosen, and among equally
good pods the least loaded one wins.

* ``round-robin`` — the next healthy pod in turn; the baseline with perfect request balance and no
  cache awareness.
* ``least-loaded`` — the healthy pod with the fewest in-flight requests.
* ``prefix-aware`` — production-stack's prefix router: the pod that recently served the longest
  common prefix of this prompt's *segment sequence* (system, the user's history block, then the
  candidates in prompt order). It remembers at most ``capacity`` prefixes (LRU), so memory is bounded.
  Because candidates differ between requests, in practice it keeps a user on one pod.
* ``affinity`` — kvshard's scheduler (docs/architecture.md#placement-and-scheduling): score(p) = Σ cached
  tokens of the request's blocks on p (history blocks everywhere, item blocks by placement) − λ · in-flight(p);
  highest score wins.
  Given a :class:`BacklogView` (the router's :class:`~kvshard_router.backlog.Backlog`) instead of bare
  in-flight counts, score(p) = −cost(p): the pod's backlog plus the request's work there (cached
  tokens at their blending cost), i.e. where the request is expected to be done first.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar, cast

import numpy as np
import numpy.typing as npt

from kvshard_router import kernels
from kvshard_router.recent import RecentBlocks
from kvshard_router.snapshot import FloatArray, IntArray, Snapshot, item_token_array


class UnknownPolicyError(KeyError):
    """No routing policy is registered under the requested name."""


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the router knows about one ``/v1/recommend`` request before forwarding it.

    ``items`` are the candidate item ids in prompt order (one block each); ``item_tokens`` their block
    sizes when the caller knows them (else the snapshot's ``default_item_tokens`` is assumed).
    """

    user: str
    items: tuple[str, ...]
    history: tuple[str, ...] = ()
    item_tokens: tuple[int, ...] | None = None
    history_tokens: int = 0

    def prefix_keys(self) -> list[int]:
        """The prompt's segment sequence as hashes: the history block, then each candidate block (the
        system segment is the same for every request and so carries no information)."""
        return [hash(("history", self.user, self.history)), *(hash(("item", i)) for i in self.items)]


class LoadView(Protocol):
    """Live per-pod load (in-flight requests), aligned with a snapshot's ``pods``."""

    def inflight(self, snapshot: Snapshot) -> FloatArray: ...


class Pricing(NamedTuple):
    """What a :class:`BacklogView` prices a request from, per snapshot pod: cost(p) = max(0, backlog(p) −
    rate(p) × (now − at(p))) + fixed_work − cached_saving × cached tokens(p)."""

    backlog: FloatArray
    rate: FloatArray
    at: FloatArray
    now: float
    fixed_work: float
    cached_saving: float


NO_PRICING = Pricing(kernels.NOTHING, kernels.NOTHING, kernels.NOTHING, 0.0, 0.0, 0.0)
"""A load without a backlog (the affinity score subtracts λ × in-flight instead)."""

LoadTerms = tuple[IntArray, FloatArray, FloatArray, FloatArray, FloatArray, float, float, float]
"""What the affinity decision reads of a load: the active pods, the in-flight counts, then a
:class:`Pricing`'s fields (flat: one tuple built per request)."""


class BacklogView(Protocol):
    """Per-pod load that also prices a request: the router's :class:`~kvshard_router.backlog.Backlog`."""

    def inflight(self, snapshot: Snapshot) -> FloatArray: ...

    def pricing(self, snapshot: Snapshot, total_tokens: float) -> Pricing: ...


class LoadTable:
    """The router's own in-flight counters: ``start`` when forwarding, ``finish`` when the answer comes.

    Counts are kept by pod name and re-aligned to a snapshot's pod order only when that order changes,
    so reading them per decision is one identity check.
    """

    def __init__(self) -> None:
        self._counts: dict[str, float] = {}
        self._pods: tuple[str, ...] | None = None
        self._array: FloatArray = np.zeros(0, dtype=np.float64)
        self._index: dict[str, int] = {}
        self._active_at: dict[int, int] = {}
        """Pod index → its position in ``_active``: the pods with requests in flight or work queued, a
        list kept in place (added at the end, removed by moving the last one into the gap)."""
        self._active = np.zeros(0, dtype=np.int64)

    def inflight(self, snapshot: Snapshot) -> FloatArray:
        if snapshot.pods is not self._pods:
            self._pods = snapshot.pods
            self._index = dict(snapshot.pod_index) or {p: j for j, p in enumerate(snapshot.pods)}
            self._array = np.array([self._counts.get(p, 0.0) for p in snapshot.pods], dtype=np.float64)
            active = [j for j, p in enumerate(snapshot.pods) if self._busy(p)]
            self._active = np.zeros(len(snapshot.pods) + 1, dtype=np.int64)
            self._active[: len(active)] = active
            self._active_at = {j: k for k, j in enumerate(active)}
        return self._array

    def active(self, snapshot: Snapshot) -> IntArray:
        """Indices (in ``snapshot``'s pod order) of the pods with requests in flight or work queued; every
        other pod has none of either (what lets a decision skip them: :func:`kvshard_router.kernels.choose`)."""
        self.inflight(snapshot)
        return self._active[: len(self._active_at)]

    def decision_terms(self, snapshot: Snapshot, total_tokens: float) -> LoadTerms:
        """What the affinity decision reads of the load, in one call: :meth:`active`, :meth:`inflight` and
        the pricing of a request of ``total_tokens`` (here :data:`NO_PRICING`: in-flight requests only)."""
        inflight = self.inflight(snapshot)
        return self._active[: len(self._active_at)], inflight, *NO_PRICING

    def _busy(self, pod: str) -> bool:
        return self._counts.get(pod, 0.0) != 0.0

    def set(self, pod: str, value: float) -> None:
        """Overwrite a pod's load (e.g. from a queue-depth gauge)."""
        self._counts[pod] = value
        j = self._index.get(pod)
        if j is None:
            return
        self._array[j] = value
        at, listed = self._active_at, self._active
        if self._busy(pod):
            if j not in at:
                at[j] = len(at)
                listed[at[j]] = j
        elif (k := at.pop(j, None)) is not None and k < len(at):  # move the last one into the gap
            last = int(listed[len(at)])
            listed[k], at[last] = last, k

    def get(self, pod: str) -> float:
        return self._counts.get(pod, 0.0)

    def start(self, pod: str) -> None:
        self.set(pod, self.get(pod) + 1.0)

    def finish(self, pod: str) -> None:
        self.set(pod, max(0.0, self.get(pod) - 1.0))


class RoutingPolicy(Protocol):
    """Choose the pod for one request, or None when no pod is healthy."""

    def choose(self, request: RouteRequest, snapshot: Snapshot, load: LoadView) -> str | None: ...


POLICIES: dict[str, Callable[..., RoutingPolicy]] = {}
"""Policy name → constructor (keyword options only)."""

_P = TypeVar("_P")

DEFAULT_LOAD_PENALTY_TOKENS = 32.0
"""λ of :class:`AffinityPolicy` unless configured: one queued request outweighs two 16-token item blocks."""


def register(name: str) -> Callable[[_P], _P]:
    """Class decorator: make a policy constructible by ``name``; returns the class unchanged."""

    def decorate(cls: _P) -> _P:
        if name in POLICIES:
            raise ValueError(f"routing policy {name!r} is registered twice")
        POLICIES[name] = cls  # type: ignore[assignment]
        return cls

    return decorate


def make_policy(name: str, **options: Any) -> RoutingPolicy:
    """A fresh policy instance by registered name."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise UnknownPolicyError(f"unknown routing policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
    return factory(**options)


def request_tokens(request: RouteRequest, snapshot: Snapshot) -> int:
    """All tokens of the request's history and candidate blocks (the snapshot's default per unknown size)."""
    items = (sum(request.item_tokens) if request.item_tokens is not None
             else snapshot.default_item_tokens * len(request.items))
    return int(items) + request.history_tokens


def _item_tokens(request: RouteRequest, snapshot: Snapshot) -> Sequence[int] | int:
    return request.item_tokens if request.item_tokens is not None else snapshot.default_item_tokens


def cached_tokens(request: RouteRequest, snapshot: Snapshot, clusters: IntArray | None = None) -> FloatArray:
    """Tokens of the request's blocks each snapshot pod holds warm by placement (history blocks count
    everywhere when the snapshot says they are replicated to every pod); ``clusters`` are the items'
    clusters when the caller has looked them up already."""
    if clusters is None:
        clusters = snapshot.clusters_of(request.items)
    history = request.history_tokens if snapshot.history_everywhere else 0
    return snapshot.cached_tokens(clusters, _item_tokens(request, snapshot), history)


def _pricing(request: RouteRequest, snapshot: Snapshot, load: LoadView) -> Pricing:
    """The load's pricing of ``request`` (:data:`NO_PRICING` for a load without a backlog)."""
    if hasattr(load, "pricing"):  # the router's Backlog (isinstance on a Protocol costs ~9 µs)
        return cast(BacklogView, load).pricing(snapshot, request_tokens(request, snapshot))
    return NO_PRICING


def _load_terms(request: RouteRequest, snapshot: Snapshot, load: LoadView) -> LoadTerms:
    """What :meth:`LoadTable.decision_terms` gives, for another load: the pods with requests in flight
    as the active ones (every pod when it prices a backlog it does not list), its in-flight counts and
    pricing."""
    inflight, pricing = load.inflight(snapshot), _pricing(request, snapshot, load)
    active = (np.arange(len(inflight), dtype=np.int64) if pricing is not NO_PRICING
              else np.flatnonzero(inflight).astype(np.int64))
    return active, inflight, *pricing


def _least_loaded(candidates: npt.NDArray[np.int32] | npt.NDArray[np.int64], load: FloatArray) -> int:
    """Index (into the snapshot's pods) of the least-loaded candidate; ties → lowest index."""
    return int(candidates[int(np.argmin(load[candidates]))])


class _Rotation:
    """Takes turns among equally good pods, so ties never pile onto the lowest index."""

    def __init__(self, start: int = 0) -> None:
        self._turn = start

    def pick(self, candidates: npt.NDArray[np.int32] | npt.NDArray[np.int64]) -> int:
        j = int(candidates[self._turn % len(candidates)])
        self._turn += 1
        return j


@register("round-robin")
class RoundRobinPolicy:
    """Each healthy pod in turn."""

    def __init__(self) -> None:
        self._rotation = _Rotation()

    def choose(self, request: RouteRequest, snapshot: Snapshot, load: LoadView) -> str | None:
        healthy = snapshot.healthy_indices
        return snapshot.pods[self._rotation.pick(healthy)] if len(healthy) else None


@register("least-loaded")
class LeastLoadedPolicy:
    """The healthy pod with the fewest in-flight requests; ties rotate so idle pods share work."""

    def __init__(self) -> None:
        self._rotation = _Rotation(start=1)

    def choose(self, request: RouteRequest, snapshot: Snapshot, load: LoadView) -> str | None:
        healthy = snapshot.healthy_indices
        if not len(healthy):
            return None
        loads = load.inflight(snapshot)[healthy]
        return snapshot.pods[self._rotation.pick(healthy[loads == loads.min()])]


@register("prefix-aware")
class PrefixAwarePolicy:
    """Longest common prefix of the segment sequence with what each pod served recently.

    ``capacity`` bounds the remembered prefixes (each prefix remembers the pods that served it).
    Without any match the least-loaded healthy pod is chosen, as production-stack falls back.
    """

    def __init__(self, capacity: int = 100_000) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._seen: collections.OrderedDict[int, dict[str, None]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def choose(self, request: RouteRequest, snapshot: Snapshot, load: LoadView) -> str | None:
        healthy = snapshot.healthy_indices
        if not len(healthy):
            return None
        loads = load.inflight(snapshot)
        chain: list[int] = []
        h = 0
        for key in request.prefix_keys():
            h = hash((h, key))
            chain.append(h)
        chosen: int | None = None
        for h in reversed(chain):  # deepest remembered prefix served by a healthy pod
            pods = self._seen.get(h)
            if not pods:
                continue
            matched = [j for p in pods if (j := snapshot.pod_index.get(p)) is not None and snapshot.healthy[j]]
            if matched:
                chosen = _least_loaded(np.array(matched, dtype=np.int64), loads)
                break
        if chosen is None:
            chosen = _least_loaded(healthy, loads)
        pod = snapshot.pods[chosen]
        for h in chain:
            served = self._seen.get(h)
            if served is None:
                served = self._seen[h] = {}
            else:
                self._seen.move_to_end(h)
            served[pod] = None
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return pod


@register("affinity")
class AffinityPolicy:
    """kvshard's scheduler: most cached tokens of the request's blocks, minus λ per in-flight request
    (or, given a :class:`BacklogView`, minus the pod's outstanding work; see the module docstring).

    ``load_penalty_tokens`` (λ) is how many cached tokens one queued request is worth: with per-token
    costs ``c_full`` (prefill) and ``c_cached`` (blend) and a mean service time ``s``, λ = s /
    (c_full − c_cached) makes both terms seconds. Large λ degrades to least-loaded, λ = 0 to pure
    affinity (which piles a hot cluster's traffic onto its holders).

    ``recent_blocks_per_pod`` > 0 also counts, per pod, the last that many item blocks it answered
    outside its placement (:mod:`kvshard_router.recent`; the caller reports answers to :meth:`served`):
    the pod computed them and keeps them.
    """

    def __init__(self, load_penalty_tokens: float = DEFAULT_LOAD_PENALTY_TOKENS,
                 recent_blocks_per_pod: int = 0) -> None:
        if load_penalty_tokens < 0:
            raise ValueError("load_penalty_tokens must be >= 0")
        self.load_penalty_tokens = load_penalty_tokens
        self.recent = RecentBlocks(recent_blocks_per_pod) if recent_blocks_per_pod > 0 else None
        """Blocks each pod answered outside its placement (counted as cached there)."""
        self._turn = 0
        self._scratch = np.zeros(0, dtype=np.int32)
        """Pod → slot map the compiled decision borrows (all −1 between decisions)."""

    def scores(self, request: RouteRequest, snapshot: Snapshot, load: LoadView, *, clusters: IntArray | None = None,
               held: FloatArray | None = None) -> FloatArray:
        """score(p) for every pod of the snapshot; −inf for unhealthy pods. ``clusters`` (the candidates'
        clusters) and ``held`` (:func:`cached_tokens` of them) are the caller's lookup when it has made
        one (:mod:`kvshard_router.decision`); ``held`` is not modified."""
        if clusters is None:
            clusters = snapshot.clusters_of(request.items)
        if held is None:
            held = cached_tokens(request, snapshot, clusters)
        credit = (None if self.recent is None
                  else self.recent.credit(request.items, clusters, _item_tokens(request, snapshot), snapshot))
        score: FloatArray = kernels.affinity_scores(
            held, kernels.NOTHING if credit is None else credit, snapshot.healthy, load.inflight(snapshot),
            self.load_penalty_tokens, *_pricing(request, snapshot, load))
        return score

    def decide(self, request: RouteRequest, snapshot: Snapshot, load: LoadView,
               clusters: IntArray | None = None) -> tuple[str | None, float, IntArray]:
        """:meth:`choose`, the tokens of the request the chosen pod holds by placement (:func:`cached_tokens`
        of it, 0 without a pod) and the candidates' clusters, in one compiled call
        (:func:`kvshard_router.kernels.look_up_and_choose`: the lookup, the pricing of the pods the request
        can tell apart, and the choice). ``clusters``: the candidates' clusters when the caller looked them
        up already (:func:`kvshard_router.kernels.choose` then, without a second lookup)."""
        # Straight-line on purpose: between two requests the CPU's caches have moved on to other work, and
        # each further Python call here costs about a microsecond of the decision (docs/gateway-api.md).
        items = request.items
        sent = None if self.recent is None else self.recent.sent(items, snapshot)
        terms = getattr(load, "decision_terms", None)
        active, inflight, *pricing = (terms(snapshot, request_tokens(request, snapshot)) if terms is not None
                                      else _load_terms(request, snapshot, load))
        if len(self._scratch) != len(snapshot.pods):
            self._scratch = np.full(len(snapshot.pods), -1, dtype=np.int32)
        scoring = (item_token_array(_item_tokens(request, snapshot), len(items)), snapshot.indptr, snapshot.holders,
                   float(request.history_tokens if snapshot.history_everywhere else 0),
                   *(sent or (kernels.NO_ENTRIES, kernels.NO_ENTRIES)), snapshot.healthy,
                   len(snapshot.healthy_indices), active, inflight, self.load_penalty_tokens, *pricing,
                   self._scratch, self._turn)
        if clusters is None and snapshot.items.exact_by_probe:
            chosen, self._turn, held, clusters = kernels.look_up_and_choose(*snapshot.items.probe(request.items),
                                                                            *scoring)
        else:
            if clusters is None:
                clusters = snapshot.clusters_of(request.items)
            chosen, self._turn, held = kernels.choose(clusters, *scoring)
        return (snapshot.pods[chosen] if chosen >= 0 else None), held, clusters

    def choose(self, request: RouteRequest, snapshot: Snapshot, load: LoadView) -> str | None:
        """argmax of :meth:`scores`, ties (within 1e-9 relative) → least loaded, then in turn (so equal
        replicas share the traffic instead of the first one taking it all)."""
        return self.decide(request, snapshot, load)[0]

    def served(self, pod: str, request: RouteRequest, snapshot: Snapshot, *, clusters: IntArray | None = None) -> None:
        """``pod`` answered ``request``: it now holds the request's blocks (kept off the decision's
        path, and only for answers that came). ``clusters``: the request's lookup in ``snapshot``'s
        item index, when the caller kept it."""
        if self.recent is not None:
            if clusters is None:
                clusters = snapshot.clusters_of(request.items)
            self.recent.record(pod, request.items, clusters, snapshot)
