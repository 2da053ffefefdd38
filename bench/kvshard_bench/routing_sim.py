"""The trace and the discrete-event model behind ``kvshard bench routing`` (see that module for the CLI).

**Trace.** Every MovieLens-100k rating after a user's fifth is one recommendation request: the user's
last ``history`` items (one history block) and ``candidates`` candidate item blocks — the item the user
actually rated next plus items a retrieval stage would propose: sampled, with Zipf-skewed popularity
(weight ∝ 1/rank^``zipf``, rank by rating count), from the nearest neighbours of the user's five most
recent items in item-vector space. Users' sessions are interleaved by a seeded random merge that keeps
each user's order; arrivals are Poisson. During the *burst* (the middle fifth of the trace) a few
clusters, drawn at random, become a trending topic: a ``burst_share`` of requests take their
candidates from those clusters (again popularity-weighted) instead. The trace is built once and
replayed unchanged for every policy.

**Item vectors.** The genre one-hot plus decade of each item, pulled 50 % towards the items it
co-occurs with in histories (the operator's :func:`pull_cooccurring`), then clustered with the
operator's balanced k-means and assigned with its rendezvous assignment. MiniLM embeddings can be used
instead (``--embeddings minilm``; slow on a CPU the first time, cached afterwards).

**Pods.** Each pod is one FIFO server (a vLLM engine serving one prefill at a time). Its cache holds the
item blocks of the clusters it has *warmed* (placement) plus an LRU of ``lru_slack`` × (catalog / pods)
other item blocks it computed or fetched; user-history blocks are replicated to every pod
(docs/architecture.md#placement-and-scheduling),
so they are hits for every policy. Service time = ``decode_ms`` + ``full_ms`` per uncached token +
``cached_ms`` per cached token (blending recomputes ~15 % of them and loads the rest) + ``full_ms`` for
the fixed system/question tokens. Token counts per item are ⌈characters/4⌉ + 2 (label and newline).
Every policy runs against the same pods, placement and trace; only the routing decision differs.

**Load.** The router's load view is either its in-flight counters (``load="inflight"``: λ per
in-flight request) or, as the router service has it, its :class:`~kvshard_router.backlog.Backlog`
(``load="backlog"``): each request's work estimated from the *placement* (the router cannot see a
pod's LRU), the pods' drain rates learned from when answers come back. The cost model's own numbers
are its settings: a cached token costs ``cached_ms / full_ms`` of a prefill token, a request's
overhead is ``decode_ms / full_ms + fixed_tokens``.

**Rebalancing.** Every interval the rebalance policy gets per-cluster request rates (each request
counted fractionally by its candidate tokens per cluster), per-pod busy fraction and hit ratio, the
assignment and warm sets; dropped replicas are evicted at once, added ones become warm (usable) only
``warmup_fraction`` of an interval later.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from kvshard.datasets import Dataset
from kvshard.placement_schema import Placement
from kvshard.rebalance import PodStats, RebalanceSettings, RebalanceState, rebalance
from kvshard_operator import colocation
from kvshard_operator import placement as op_placement
from kvshard_router.backlog import Backlog
from kvshard_router.corequest import CoRequestSketch
from kvshard_router.policies import RouteRequest, RoutingPolicy
from kvshard_router.snapshot import FloatArray, ItemIndex, Snapshot, build_snapshot


@dataclasses.dataclass(frozen=True)
class TraceSettings:
    requests: int = 60_000
    candidates: int = 20
    history: int = 20
    neighbours: int = 30
    zipf: float = 1.0
    burst_start: float = 0.4
    burst_end: float = 0.6
    burst_clusters: int = 3
    burst_share: float = 0.5
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    pods: int = 16
    clusters_per_pod: int = 8
    utilization: float = 0.7
    """Offered load as a fraction of capacity if every item block missed."""
    full_ms: float = 0.05
    cached_ms: float = 0.01
    decode_ms: float = 10.0
    fixed_tokens: int = 90
    lru_slack: float = 0.25
    intervals: int = 20
    warmup_fraction: float = 0.25


@dataclasses.dataclass
class Trace:
    """Requests (shared by every policy), arrival times, and the catalog's clustering."""

    requests: list[RouteRequest]
    item_rows: list[list[int]]
    arrivals: FloatArray
    item_ids: list[str]
    item_tokens: npt.NDArray[np.int64]
    labels: npt.NDArray[np.int64]
    hot_clusters: list[int]
    burst: tuple[float, float]


def item_vectors(dataset: Dataset, ids: Sequence[str]) -> npt.NDArray[np.float32]:
    """Genre one-hot + decade, unit length (the fallback to sentence embeddings)."""
    parsed = []
    for item in ids:
        head, _, tail = dataset.items[item].text.partition("), ")
        year = re.search(r"\((\d{4})$", head + ")") or re.search(r"\((\d{4})\)", dataset.items[item].text)
        parsed.append((int(year.group(1)) // 10 if year else 0, [g for g in tail.split(", ") if g]))
    genres = sorted({g for _, gs in parsed for g in gs})
    decades = sorted({d for d, _ in parsed})
    g_col, d_col = {g: j for j, g in enumerate(genres)}, {d: len(genres) + j for j, d in enumerate(decades)}
    x = np.zeros((len(ids), len(genres) + len(decades)), dtype=np.float32)
    for row, (decade, gs) in enumerate(parsed):
        for g in gs:
            x[row, g_col[g]] = 1.0
        x[row, d_col[decade]] = 0.5
    return op_placement.normalise(x)


def build_trace(
    dataset: Dataset, trace: TraceSettings, model: ModelSettings, vectors: npt.NDArray[np.float32] | None
) -> Trace:
    rng = np.random.default_rng(trace.seed)
    ids = list(dataset.items)
    row = {item: j for j, item in enumerate(ids)}
    histories = {u: [row[i] for i in h] for u, h in dataset.histories.items()}
    x = item_vectors(dataset, ids) if vectors is None else op_placement.normalise(vectors)
    x = op_placement.pull_cooccurring(x, histories.values(), 50)
    labels = op_placement.cluster_items(x, model.pods * model.clusters_per_pod, seed=trace.seed)
    counts = np.bincount([i for h in histories.values() for i in h], minlength=len(ids))
    rank = np.empty(len(ids), dtype=np.int64)
    rank[np.argsort(-counts, kind="stable")] = np.arange(1, len(ids) + 1)
    weight = 1.0 / rank.astype(np.float64) ** trace.zipf
    sims = x @ x.T
    np.fill_diagonal(sims, -np.inf)
    neighbours = np.argsort(-sims, axis=1)[:, : trace.neighbours]
    tokens = np.array([math.ceil(len(dataset.items[i].text) / 4) + 2 for i in ids], dtype=np.int64)

    events = [(float(t), u, k) for u, h in histories.items() for k, t in enumerate(np.sort(rng.random(len(h))))
              if k >= 5]
    events.sort()
    events = events[: trace.requests]
    n = len(events)
    burst = (trace.burst_start * n, trace.burst_end * n)
    hot = sorted(rng.choice(int(labels.max()) + 1, size=trace.burst_clusters, replace=False).tolist())
    hot_pool = np.flatnonzero(np.isin(labels, hot))

    def sample(pool: npt.NDArray[np.int64], exclude: int, k: int) -> list[int]:
        pool = pool[pool != exclude]
        p = weight[pool] / weight[pool].sum()
        chosen: list[int] = rng.choice(pool, size=min(k, len(pool)), replace=False, p=p).tolist()
        return chosen

    requests: list[RouteRequest] = []
    rows: list[list[int]] = []
    for j, (_, user, k) in enumerate(events):
        seen = histories[user][max(0, k - trace.history) : k]
        target = histories[user][k]
        trending = burst[0] <= j < burst[1] and rng.random() < trace.burst_share
        pool = hot_pool if trending else np.unique(neighbours[seen[-5:]].ravel())
        picks = sample(pool, target, trace.candidates - 1)
        if len(picks) < trace.candidates - 1:
            picks += sample(np.setdiff1d(np.arange(len(ids)), [*picks, target]), target,
                            trace.candidates - 1 - len(picks))
        cands = [target, *picks]
        rng.shuffle(cands)
        rows.append(cands)
        requests.append(RouteRequest(
            user=user,
            items=tuple(ids[c] for c in cands),
            history=tuple(ids[i] for i in seen),
            item_tokens=tuple(int(tokens[c]) for c in cands),
            history_tokens=int(tokens[seen].sum()),
        ))
    full = np.array([service_ms(model, q.history_tokens, int(tokens[r].sum()))
                     for r, q in zip(rows, requests, strict=True)])
    rate = model.utilization * model.pods / float(full.mean())  # requests per ms
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=n))
    return Trace(requests, rows, arrivals, ids, tokens, labels.astype(np.int64), hot, burst)


def lru_blocks(trace: Trace, model: ModelSettings) -> int:
    """Item blocks each pod keeps beyond its placement (its LRU of computed or fetched blocks)."""
    return max(1, int(model.lru_slack * len(trace.item_ids) / model.pods))


def service_ms(model: ModelSettings, cached_tokens: int, uncached_tokens: int) -> float:
    """Time one pod spends on a request (history tokens are cached on every pod: pass them as cached)."""
    return (model.decode_ms + model.full_ms * (uncached_tokens + model.fixed_tokens)
            + model.cached_ms * cached_tokens)


@dataclasses.dataclass
class Result:
    policy: str
    hit_ratio: float
    p99_ms: float
    latencies: FloatArray
    window_hit: list[float]
    window_imbalance: list[float]
    actions: int = 0


class _Load:
    """In-flight requests per pod, in the snapshot's pod order (the simulator owns the counters)."""

    def __init__(self, pods: int) -> None:
        self.counts = np.zeros(pods, dtype=np.float64)

    def inflight(self, snapshot: Snapshot) -> FloatArray:
        return self.counts


@dataclasses.dataclass(frozen=True)
class LearningSettings:
    """Traffic-learned placement: the routers' co-request sketch → the operator's colocation."""

    sketch_pairs: int = 4096
    top_pairs: int = 1024
    move_budget: int = 16
    """Clusters moved per interval at most (two per swap)."""
    keep: float = 0.5
    """Weight the operator's co-request graph keeps from one interval to the next."""
    min_gain: float = 0.0
    """Share of the graph's weight a swap must gain to be taken."""
    max_load: float | None = 1.1
    """No pod's request share above this × the mean (None: ignore load — measured to gain nothing:
    the topics traffic asks for pile onto a few pods, which saturate)."""


LoadModel = Literal["backlog", "inflight"]


class _Clock:
    """The simulation's time, as the router's Backlog reads it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Simulation:
    """Replays a trace against pods with one routing policy (optionally rebalancing every interval,
    optionally co-locating co-requested clusters every interval: ``learning``)."""

    def __init__(self, trace: Trace, model: ModelSettings, rebalancing: RebalanceSettings | None,
                 learning: LearningSettings | None = None, *, load: LoadModel = "backlog") -> None:
        self.trace, self.model, self.rebalancing, self.learning = trace, model, rebalancing, learning
        self.load = load
        self.sketch = CoRequestSketch(learning.sketch_pairs) if learning is not None else None
        self.leaving: dict[tuple[int, str], str] = {}
        """(cluster, new holder) → the old holder, which keeps serving until the new one is warm."""
        self.moves = 0
        self.graph: dict[tuple[int, int], float] = {}
        self.cluster_rates: dict[int, float] = {}
        self.pods = tuple(f"pod-{j:03d}" for j in range(model.pods))
        clusters = sorted(set(trace.labels.tolist()))
        self.assignment: dict[int, tuple[str, ...]] = {
            c: tuple(h) for c, h in op_placement.assign_clusters(clusters, dict.fromkeys(self.pods, 1)).items()
        }
        self.index = ItemIndex.from_items(trace.item_ids, trace.labels)
        self.warm = {p: {c for c, h in self.assignment.items() if p in h} for p in self.pods}
        self.lru_size = lru_blocks(trace, model)
        self._lru: list[collections.OrderedDict[int, None]] = []
        """Per pod index, the item blocks it holds outside its warm clusters (least recently used first)."""
        self.generation = 1
        self.snapshot = self._snapshot()

    def place_in_hindsight(self, learning: LearningSettings) -> int:
        """Start from the colocation the whole trace would teach (every request counted, no movement
        budget, the same load cap): an oracle the online learner cannot beat by much, so its hit ratio
        bounds what co-request-aware placement can do on this trace. Returns the clusters moved."""
        sketch = CoRequestSketch(capacity=1 << 30)
        for rows in self.trace.item_rows:
            sketch.add(int(self.trace.labels[item]) for item in rows)
        result = colocation.colocate(self.assignment, sketch.counts, rates=sketch.rates,
                                     max_load=learning.max_load or 1.0, max_moves=len(self.assignment) ** 2)
        self.assignment = result.assignment
        self.warm = {p: {c for c, h in self.assignment.items() if p in h} for p in self.pods}
        self.snapshot = self._snapshot()
        return len(result.moved)

    def _leave(self, pod: str, cluster: int) -> None:
        """``cluster`` moved off ``pod``: as its sidecar does, the pod evicts every block of the cluster,
        the copies it computed before it held the cluster included."""
        self.warm[pod].discard(cluster)
        if self._lru:
            cache, labels = self._lru[self.pods.index(pod)], self.trace.labels
            for item in [i for i in cache if int(labels[i]) == cluster]:
                del cache[item]

    def _snapshot(self) -> Snapshot:
        placement = Placement(self.generation, self.assignment, {}, pods=self.pods)
        return build_snapshot(placement, self.warm, items=self.index)

    def run(self, name: str, policy: RoutingPolicy, progress: Callable[[int], None] = lambda _: None) -> Result:
        trace, model = self.trace, self.model
        n, span = len(trace.requests), float(trace.arrivals[-1])
        interval = span / model.intervals * (1 + 1e-9)  # the last arrival falls inside the last interval
        labels, tokens = trace.labels, trace.item_tokens
        clock = _Clock()
        backlog = Backlog(cached_cost=model.cached_ms / model.full_ms,
                          overhead_tokens=model.decode_ms / model.full_ms + model.fixed_tokens, clock=clock)
        counts = _Load(len(self.pods))
        load = backlog if self.load == "backlog" else counts
        lru = self._lru = [collections.OrderedDict[int, None]() for _ in self.pods]
        done: list[tuple[float, int, float]] = []  # (finish, pod index, work the router estimated)
        last_finish = np.zeros(len(self.pods))
        latencies = np.empty(n)
        pending: list[tuple[float, int, str]] = []  # (warm at, cluster, pod)
        window = _Window(len(self.pods))
        windows_hit: list[float] = []
        windows_imb: list[float] = []
        hits = total = 0
        state, actions = RebalanceState(), 0
        next_tick = interval
        rates: collections.defaultdict[int, float] = collections.defaultdict(float)
        for j, (request, rows, now) in enumerate(zip(trace.requests, trace.item_rows, trace.arrivals, strict=True)):
            while now >= next_tick:
                windows_hit.append(window.hit_ratio())
                windows_imb.append(window.imbalance())
                if self.rebalancing is not None:
                    state, acted = self._rebalance(rates, window, interval, state, next_tick, pending)
                    actions += acted
                if self.sketch is not None:
                    actions += self._colocate(interval, next_tick, pending)
                rates.clear()
                window = _Window(len(self.pods))
                next_tick += interval
            if pending and pending[0][0] <= now:
                while pending and pending[0][0] <= now:
                    _, c, pod = heapq.heappop(pending)
                    if pod in self.assignment.get(c, ()):
                        self.warm[pod].add(c)
                    old = self.leaving.pop((c, pod), None)
                    if old is not None and old not in self.assignment.get(c, ()):
                        self._leave(old, c)  # make-before-break: the old copy goes once the new is warm
                self.snapshot = self._snapshot()
            while done and done[0][0] <= now:
                clock.now, q, work = heapq.heappop(done)
                counts.counts[q] -= 1
                backlog.finish(self.pods[q], work)
            clock.now = now
            chosen = policy.choose(request, self.snapshot, load)
            assert chosen is not None
            served = getattr(policy, "served", None)  # the pod will hold what it computes: the router learns it
            if served is not None:
                served(chosen, request, self.snapshot)
            p = self.snapshot.pod_index[chosen]
            cached = placed = 0
            warm, cache = self.warm[chosen], lru[p]
            req_tokens = int(tokens[rows].sum())
            if self.sketch is not None:
                self.sketch.add(int(labels[item]) for item in rows)
            for item in rows:
                c, t = int(labels[item]), int(tokens[item])
                rates[c] += t / req_tokens
                if c in warm:
                    cached += t
                    placed += t
                elif item in cache:
                    cache.move_to_end(item)
                    cached += t
                else:
                    cache[item] = None
                    if len(cache) > self.lru_size:
                        cache.popitem(last=False)
            svc = service_ms(model, cached + request.history_tokens, req_tokens - cached)
            start = max(now, last_finish[p])
            last_finish[p] = start + svc
            work = backlog.work(placed + request.history_tokens, req_tokens + request.history_tokens)
            heapq.heappush(done, (start + svc, p, work))
            counts.counts[p] += 1
            backlog.start(chosen, work)
            latencies[j] = start + svc - now
            hits += cached
            total += req_tokens
            window.add(p, svc, cached, req_tokens)
            progress(1)
        windows_hit.append(window.hit_ratio())
        windows_imb.append(window.imbalance())
        return Result(name, hits / max(1, total), float(np.percentile(latencies, 99)), latencies,
                      windows_hit, windows_imb, actions)

    def _colocate(self, interval: float, now: float, pending: list[tuple[float, int, str]]) -> int:
        assert self.sketch is not None and self.learning is not None
        learning = self.learning
        pairs, rates = dict(self.sketch.top(learning.top_pairs)), dict(self.sketch.top_rates(learning.top_pairs))
        self.sketch.reset()
        self.graph = colocation.remember(self.graph, pairs, keep=learning.keep, limit=learning.sketch_pairs)
        self.cluster_rates = colocation.remember(self.cluster_rates, rates, keep=learning.keep,
                                                 limit=learning.sketch_pairs)
        result = colocation.colocate(self.assignment, self.graph, max_moves=learning.move_budget,
                                     rates=self.cluster_rates if learning.max_load else None,
                                     max_load=learning.max_load or 1.0, min_gain=learning.min_gain)
        for c in result.moved:
            old, new = self.assignment[c][0], result.assignment[c][0]
            self.leaving[(c, new)] = old
            heapq.heappush(pending, (now + self.model.warmup_fraction * interval, c, new))
        if result.moved:
            self.assignment = result.assignment
            self.generation += 1
            self.snapshot = self._snapshot()
        self.moves += len(result.moved)
        return len(result.moved)

    def _rebalance(
        self,
        rates: collections.defaultdict[int, float],
        window: _Window,
        interval: float,
        state: RebalanceState,
        now: float,
        pending: list[tuple[float, int, str]],
    ) -> tuple[RebalanceState, int]:
        assert self.rebalancing is not None
        busy = window.work / interval
        stats = {p: PodStats(load=float(busy[j]), hit_ratio=window.pod_hit_ratio(j)) for j, p in enumerate(self.pods)}
        per_second = {c: rates.get(c, 0.0) * 1000.0 / interval for c in self.assignment}
        result = rebalance(per_second, stats, self.assignment, self.warm, self.rebalancing, state)
        for action in result.actions:
            if action.kind in ("move", "drop"):
                gone = action.source if action.kind == "move" else action.pod
                assert gone is not None
                self._leave(gone, action.cluster)
            if action.kind in ("replicate", "move"):
                heapq.heappush(pending, (now + self.model.warmup_fraction * interval, action.cluster, action.pod))
        self.assignment = result.assignment
        self.generation += 1
        self.snapshot = self._snapshot()
        return result.state, len(result.actions)


class _Window:
    """Per-interval accumulators: work (ms) and item-token hits per pod."""

    def __init__(self, pods: int) -> None:
        self.work = np.zeros(pods)
        self.hit = np.zeros(pods)
        self.tokens = np.zeros(pods)

    def add(self, pod: int, work: float, hit: int, tokens: int) -> None:
        self.work[pod] += work
        self.hit[pod] += hit
        self.tokens[pod] += tokens

    def hit_ratio(self) -> float:
        return float(self.hit.sum() / max(1.0, self.tokens.sum()))

    def pod_hit_ratio(self, pod: int) -> float:
        return float(self.hit[pod] / self.tokens[pod]) if self.tokens[pod] else 1.0

    def imbalance(self) -> float:
        mean = float(self.work.mean())
        return float(self.work.max()) / mean if mean else 1.0


def windows_of(trace: Trace, model: ModelSettings) -> Iterator[tuple[int, bool]]:
    """(window index, whether the burst is on during it) for every interval of the trace."""
    span = float(trace.arrivals[-1]) * (1 + 1e-9)
    start = float(trace.arrivals[int(trace.burst[0])])
    end = float(trace.arrivals[min(len(trace.arrivals) - 1, int(trace.burst[1]))])
    for w in range(model.intervals):
        lo, hi = w * span / model.intervals, (w + 1) * span / model.intervals
        yield w, lo < end and hi > start
