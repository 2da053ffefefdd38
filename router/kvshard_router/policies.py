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
from typing import Any, Protocol, TypeVar, cast

import numpy as np
import numpy.typing as npt

from kvshard_router.recent import RecentBlocks
from kvshard_router.snapshot import FloatArray, IntArray, Snapshot


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


class BacklogView(Protocol):
    """Per-pod load that also prices a request: the router's :class:`~kvshard_router.backlog.Backlog`."""

    def inflight(self, snapshot: Snapshot) -> FloatArray: ...

    def cost(self, snapshot: Snapshot, cached_tokens: FloatArray, total_tokens: float) -> FloatArray: ...


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

    def inflight(self, snapshot: Snapshot) -> FloatArray:
        if snapshot.pods is not self._pods:
            self._pods = snapshot.pods
            self._index = dict(snapshot.pod_index) or {p: j for j, p in enumerate(snapshot.pods)}
            self._array = np.array([self._counts.get(p, 0.0) for p in snapshot.pods], dtype=np.float64)
        return self._array

    def set(self, pod: str, value: float) -> None:
        """Overwrite a pod's load (e.g. from a queue-depth gauge)."""
        self._counts[pod] = value
        j = self._index.get(pod)
        if j is not None:
            self._array[j] = value

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
    held = snapshot.cached_tokens(clusters, _item_tokens(request, snapshot))
    if snapshot.history_everywhere:
        held += request.history_tokens
    return held


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

    def scores(self, request: RouteRequest, snapshot: Snapshot, load: LoadView, *, clusters: IntArray | None = None,
               held: FloatArray | None = None) -> FloatArray:
        """score(p) for every pod of the snapshot; −inf for unhealthy pods. ``clusters`` (the candidates'
        clusters) and ``held`` (:func:`cached_tokens` of them) are the caller's lookup when it has made
        one (:mod:`kvshard_router.decision`); ``held`` is not modified."""
        if clusters is None:
            clusters = snapshot.clusters_of(request.items)
        score = cached_tokens(request, snapshot, clusters) if held is None else held
        if self.recent is not None:
            recent = self.recent.credit(request.items, clusters, _item_tokens(request, snapshot), snapshot)
            if recent is not None:
                score = score + recent
        if hasattr(load, "cost"):  # the router's Backlog (isinstance on a Protocol costs ~9 µs)
            score = -cast(BacklogView, load).cost(snapshot, score, request_tokens(request, snapshot))
        else:
            score = score - self.load_penalty_tokens * load.inflight(snapshot)
        if len(snapshot.healthy_indices) < len(snapshot.pods):  # usually none is down: skip two array ops
            score[~snapshot.healthy] = -np.inf
        return score

    def choose(self, request: RouteRequest, snapshot: Snapshot, load: LoadView, *, clusters: IntArray | None = None,
               held: FloatArray | None = None) -> str | None:
        """argmax of :meth:`scores`, ties → least loaded, then in turn (so equal replicas share the
        traffic instead of the first one taking it all). Vectorised over all pods: a dozen numpy calls
        beat a Python loop over the request's clusters from ~10 candidates up. A sparse choice (only the
        ~40 holders of a 20-candidate request priced in Python, the dense one deciding when a pod holding
        nothing might tie) gave the same pods but measured no faster at 1,000 pods (p50 79–81 vs 72–74 µs,
        ``decision_time(10_000_000, 1000, 20)``, 2026-12-05): per-pod Python costs what numpy's per-call
        overhead does. ``clusters``/``held``: as for :meth:`scores`."""
        if not len(snapshot.healthy_indices):
            return None
        score = self.scores(request, snapshot, load, clusters=clusters, held=held)
        best = float(score.max())
        tied = np.flatnonzero(score >= best - 1e-9 * max(1.0, abs(best)))
        if len(tied) > 1:
            loads = load.inflight(snapshot)[tied]
            tied = tied[loads == loads.min()]
            self._turn += 1
        return snapshot.pods[int(tied[self._turn % len(tied)])]

    def served(self, pod: str, request: RouteRequest, snapshot: Snapshot, *, clusters: IntArray | None = None) -> None:
        """``pod`` answered ``request``: it now holds the request's blocks (kept off the decision's
        path, and only for answers that came). ``clusters``: the request's lookup in ``snapshot``'s
        item index, when the caller kept it."""
        if self.recent is not None:
            if clusters is None:
                clusters = snapshot.clusters_of(request.items)
            self.recent.record(pod, request.items, clusters, snapshot)
