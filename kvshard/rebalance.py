"""The hot/cold shard rebalancing policy: one pure function from observed heat to a new assignment.

The operator calls :func:`rebalance` every interval with what Prometheus says (per-cluster request
rate, per-pod load and hit ratio), the current assignment and the warm sets from etcd, and publishes
the returned assignment as a new generation. Keeping the policy pure lets scenario tests drive many
intervals in milliseconds and lets the simulator apply exactly the code the operator runs.

Model. A cluster's traffic is split evenly over its replicas (the affinity router breaks score ties by
load, which does that), so moving or adding a replica of cluster c shifts rate(c) / replicas(c) of load.
A pod's load starts from what was *observed* (rescaled to request-rate units), because the router
does not split traffic exactly by cluster — a request goes whole to one pod, and spills when its holder
is busy — and it is the observed imbalance that must go; each action then adjusts it by the predicted
shift, so later decisions in the same interval see earlier ones. Without observed loads (all zero) the
load is Σ rate(c) / replicas(c) over the clusters a pod holds. Hit ratio and observed load also decide
which pods may receive a replica. Three passes, in order:

1. **Hot clusters** — while a cluster's rate per replica exceeds θ (``hot_percent``) % of the mean
   cluster rate, add a replica on the least-loaded eligible pod (hottest cluster first, one replica
   at a time so several hot clusters share the budget).
2. **Hot pods** — while the most loaded pod exceeds ``imbalance_percent`` % of the mean pod load, take
   the cluster on it whose relocation lowers the pair's maximum the most and either *move* it to the
   least-loaded pod (only if another replica of it is warm, so traffic never loses its last warm copy)
   or *replicate* it there. Every step strictly lowers the maximum, so the pass terminates.
3. **Cold clusters** — an extra replica is dropped (from its most loaded holder) when the rate per
   replica *after* the drop is still at most ``cold_percent`` % of the mean, the remaining holders stay
   under ``settle_percent`` % of the mean pod load, the cluster did not change in the last
   ``cooldown_intervals`` intervals, and another replica is warm.

Hysteresis: replicate above θ, drop only to at most ``cold_percent`` < θ and only while the result stays
below ``settle_percent`` < ``imbalance_percent``; so on steady load the policy reaches a fixed point
and does nothing further. Replica additions (replicate, move) count against ``move_budget`` — each is a
cache warm-up; drops against ``drop_budget``.

Counting noise: given ``window_seconds``, "above the threshold" means above it by ``noise_sigmas``
standard deviations of a Poisson count over the window, so a quiet shard (a few requests per pod per
window) is not reshuffled by chance skew, while a real burst, many sigmas out, still is.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Literal

ActionKind = Literal["replicate", "move", "drop"]


@dataclasses.dataclass(frozen=True)
class RebalanceSettings:
    """Knobs of the policy; integers (percent) as in a CacheShard spec, never floats."""

    hot_percent: int = 200
    """θ: a cluster is hot when its rate per replica exceeds this percent of the mean cluster rate."""
    cold_percent: int = 100
    """An extra replica is dropped only if the rate per replica after the drop is at most this percent
    of the mean cluster rate (must be below θ: the gap is the hysteresis)."""
    imbalance_percent: int = 120
    """A pod is hot when its predicted load exceeds this percent of the mean pod load."""
    settle_percent: int = 110
    """A drop may not push any remaining holder above this percent of the mean pod load."""
    move_budget: int = 8
    """Replica additions (replicate + move: cache warm-ups) allowed per interval."""
    drop_budget: int = 8
    """Replica drops allowed per interval."""
    max_replicas: int = 0
    """Upper bound of replicas per cluster; 0 means the number of pods."""
    min_hit_percent: int = 0
    """Pods whose cache hit ratio is below this percent receive no new replicas (cache under pressure)."""
    cooldown_intervals: int = 2
    """A cluster that gained or moved a replica is not dropped or moved again for this many intervals."""
    window_seconds: int = 0
    """Length of the window the rates were measured over. With it, a cluster or pod counts as hot only
    if it exceeds its threshold by ``noise_sigmas`` standard deviations of a Poisson count over that
    window: at a few requests per window most of the measured skew is noise, and acting on it would
    replicate clusters back and forth. 0 compares the rates as they are."""
    noise_sigmas: int = 2
    """How many standard deviations of counting noise a hot cluster or pod must stand out by."""

    def __post_init__(self) -> None:
        if not 0 <= self.cold_percent < self.hot_percent:
            raise ValueError("need 0 <= cold_percent < hot_percent (the hysteresis gap)")
        if not 100 <= self.settle_percent <= self.imbalance_percent:
            raise ValueError("need 100 <= settle_percent <= imbalance_percent")
        if self.move_budget < 0 or self.drop_budget < 0:
            raise ValueError("budgets must be >= 0")
        if self.window_seconds < 0 or self.noise_sigmas < 0:
            raise ValueError("window_seconds and noise_sigmas must be >= 0")


@dataclasses.dataclass(frozen=True)
class PodStats:
    """What Prometheus and health checks say about one pod over the last interval."""

    healthy: bool = True
    load: float = 0.0
    """Observed load (requests/s or in-flight); pods above ``imbalance_percent`` of the mean are no targets."""
    hit_ratio: float = 1.0


@dataclasses.dataclass(frozen=True)
class RebalanceState:
    """What the policy remembers between intervals (stored beside placement by the operator)."""

    interval: int = 0
    last_change: Mapping[int, int] = dataclasses.field(default_factory=dict)
    """Cluster → interval in which it last gained or moved a replica."""


@dataclasses.dataclass(frozen=True)
class Action:
    """One change: ``replicate`` adds ``pod``; ``move`` replaces ``source`` with ``pod``; ``drop`` removes ``pod``."""

    kind: ActionKind
    cluster: int
    pod: str
    source: str | None
    reason: str


@dataclasses.dataclass(frozen=True)
class RebalanceResult:
    assignment: dict[int, tuple[str, ...]]
    actions: list[Action]
    state: RebalanceState
    pod_load: dict[str, float]
    """Predicted load per pod under the new assignment (request-rate units)."""


class _Plan:
    """Mutable working copy of the assignment with incrementally maintained predicted loads."""

    def __init__(
        self, assignment: Mapping[int, Sequence[str]], rates: Mapping[int, float], pods: Mapping[str, PodStats]
    ) -> None:
        self.holders = {c: list(dict.fromkeys(h)) for c, h in assignment.items()}
        self.rates = {c: max(0.0, float(rates.get(c, 0.0))) for c in self.holders}
        self.load = dict.fromkeys(sorted(set(pods) | {p for h in self.holders.values() for p in h}), 0.0)
        for c, holders in self.holders.items():
            for p in holders:
                self.load[p] += self.share(c)
        observed = sum(max(0.0, s.load) for s in pods.values())
        self.scale = 1.0
        """Rate units per observed load unit (1 when the loads are predicted from the rates)."""
        if observed > 0:  # start from what was measured, in the same units as the rates
            self.scale = sum(self.load.values()) / observed
            for p, s in pods.items():
                self.load[p] = max(0.0, s.load) * self.scale

    def share(self, c: int, replicas: int | None = None) -> float:
        n = len(self.holders[c]) if replicas is None else replicas
        return self.rates[c] / n if n else 0.0

    def add(self, c: int, pod: str) -> None:
        old = self.share(c)
        for p in self.holders[c]:
            self.load[p] -= old
        self.holders[c].append(pod)
        new = self.share(c)
        for p in self.holders[c]:
            self.load[p] += new

    def remove(self, c: int, pod: str) -> None:
        old = self.share(c)
        for p in self.holders[c]:
            self.load[p] -= old
        self.holders[c].remove(pod)
        new = self.share(c)
        for p in self.holders[c]:
            self.load[p] += new

    def mean_load(self) -> float:
        return sum(self.load.values()) / len(self.load) if self.load else 0.0


def rebalance(
    rates: Mapping[int, float],
    pods: Mapping[str, PodStats],
    assignment: Mapping[int, Sequence[str]],
    warm: Mapping[str, Collection[int]],
    settings: RebalanceSettings = RebalanceSettings(),
    state: RebalanceState = RebalanceState(),
) -> RebalanceResult:
    """Decide one interval's replicate / move / drop actions (see the module docstring).

    ``rates``: cluster → request rate (clusters without a rate count as 0). ``pods``: every pod that may
    hold clusters, with its stats. ``warm``: pod → clusters it reported warm. Returns the new assignment
    (holders in the old order, additions appended), the actions with reasons, the next state, and the
    predicted pod loads.
    """
    interval = state.interval + 1
    plan = _Plan(assignment, rates, pods)
    last_change = dict(state.last_change)
    actions: list[Action] = []
    max_replicas = settings.max_replicas or max(1, len(plan.load))
    mean_rate = sum(plan.rates.values()) / len(plan.rates) if plan.rates else 0.0
    hot_rate = mean_rate * settings.hot_percent / 100
    observed = [s.load for s in pods.values()]
    observed_cap = (sum(observed) / len(observed)) * settings.imbalance_percent / 100 if observed else 0.0
    eligible = {
        p for p, s in pods.items()
        if s.healthy and s.hit_ratio * 100 >= settings.min_hit_percent and not (observed_cap and s.load > observed_cap)
    }
    budget = settings.move_budget

    def sigma(count_rate: float) -> float:
        """``noise_sigmas`` standard deviations of a rate measured as a Poisson count over the window."""
        if settings.window_seconds <= 0 or count_rate <= 0:
            return 0.0
        return settings.noise_sigmas * math.sqrt(count_rate / settings.window_seconds)

    def hot_share(c: int) -> float:
        """Cluster ``c``'s rate per replica, less its counting noise."""
        return plan.share(c) - sigma(plan.rates[c]) / max(1, len(plan.holders[c]))

    def pod_excess(p: str) -> float:
        """Pod ``p``'s load less its counting noise (loads are observed counts rescaled to rate units)."""
        return plan.load[p] - plan.scale * sigma(plan.load[p] / plan.scale)

    def target_for(c: int) -> str | None:
        free = [p for p in eligible if p not in plan.holders[c]]
        return min(free, key=lambda p: (plan.load[p], p)) if free else None

    def warm_elsewhere(c: int, pod: str) -> bool:
        return any(q != pod and c in warm.get(q, ()) for q in plan.holders[c])

    # 1. hot clusters: one replica at a time, hottest per-replica rate first.
    heap = [(-plan.share(c), c) for c in plan.holders if plan.holders[c] and hot_share(c) > hot_rate]
    heapq.heapify(heap)
    while heap and budget > 0:
        _, c = heapq.heappop(heap)
        if len(plan.holders[c]) >= max_replicas or (target := target_for(c)) is None:
            continue
        before = plan.share(c)
        plan.add(c, target)
        budget -= 1
        last_change[c] = interval
        actions.append(Action("replicate", c, target, None,
                              f"HotCluster: {before:.3g}/replica > θ={settings.hot_percent}% of mean {mean_rate:.3g}"))
        if hot_share(c) > hot_rate:
            heapq.heappush(heap, (-plan.share(c), c))

    # 2. hot pods: strictly lower the maximum each step.
    while budget > 0:
        mean_load = plan.mean_load()
        hottest = max(plan.load, key=lambda p: (plan.load[p], p), default=None)
        if hottest is None or pod_excess(hottest) <= mean_load * settings.imbalance_percent / 100:
            break
        best: tuple[float, int, ActionKind, int, str] | None = None
        for c in (c for c, h in plan.holders.items() if hottest in h and plan.rates[c] > 0):
            target = target_for(c)
            if target is None:
                continue
            share = plan.share(c)
            cooled = interval - last_change.get(c, -(10**9)) > settings.cooldown_intervals
            if cooled and warm_elsewhere(c, hottest):
                peak = max(plan.load[hottest] - share, plan.load[target] + share)
                if best is None or (peak, 0) < (best[0], best[1]):
                    best = (peak, 0, "move", c, target)
            if len(plan.holders[c]) < max_replicas:
                after = plan.share(c, len(plan.holders[c]) + 1)
                peak = max(plan.load[hottest] - share + after, plan.load[target] + after)
                if best is None or (peak, 1) < (best[0], best[1]):
                    best = (peak, 1, "replicate", c, target)
        if best is None or best[0] >= plan.load[hottest] - 1e-12:
            break
        _, _, kind, c, target = best
        reason = f"HotPod: {hottest} at {plan.load[hottest] / mean_load:.0%} of mean load"
        plan.add(c, target)
        if kind == "move":
            plan.remove(c, hottest)
        actions.append(Action(kind, c, target, hottest if kind == "move" else None, reason))
        budget -= 1
        last_change[c] = interval

    # 3. cold clusters: drop extra replicas, coldest first, never the last warm one.
    drops = settings.drop_budget
    cold_rate = mean_rate * settings.cold_percent / 100
    for c in sorted(plan.holders, key=lambda c: (plan.share(c), c)):
        if drops <= 0:
            break
        holders = plan.holders[c]
        if len(holders) < 2 or interval - last_change.get(c, -(10**9)) <= settings.cooldown_intervals:
            continue
        after = plan.share(c, len(holders) - 1)
        if after > cold_rate:
            continue
        settle = plan.mean_load() * settings.settle_percent / 100
        for pod in sorted(holders, key=lambda p: (-plan.load[p], p)):
            if not warm_elsewhere(c, pod):
                continue
            gain = after - plan.share(c)
            if any(plan.load[q] + gain > settle for q in holders if q != pod):
                continue
            plan.remove(c, pod)
            drops -= 1
            reason = f"ColdCluster: {after:.3g}/replica after the drop ≤ {settings.cold_percent}% of mean"
            actions.append(Action("drop", c, pod, None, reason))
            break

    new_assignment = {c: tuple(h) for c, h in plan.holders.items()}
    return RebalanceResult(new_assignment, actions, RebalanceState(interval, last_change), dict(plan.load))
