"""What a load ramp recorded, and what it means — pure functions over the ramp's records.

:mod:`kvshard_local.ramp` drives load through the router while the autoscaler runs and keeps three
kinds of records: one :class:`RampRequest` per request, one :class:`RampSample` per poll of the
cluster (pods and their state, the pressure the autoscaler reads, the placement generation) and one
:class:`RampChange` per change the autoscaler made. Everything a reader wants from them is computed
here, so it is tested without a cluster:

* the timeline: per sample, pods serving / warming / draining, load offered and served per pod,
  the pressure per pod and its sum (the autoscaler's query), hit ratio and locality of the requests
  of the last few seconds;
* per change: the time from the decision to the pods running, to the new pod being warm (routable)
  and to its first answer, and the share of item clusters whose holders changed against the bound
  of 1.1/N (N: the larger pod count) that minimal movement promises;
* hit ratio (tokens served from any tier) and locality (candidates whose cluster the serving pod
  holds) before the first decision, during the changes (decision until settled), and after the last.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from kvshard.placement_schema import Placement
from kvshard_local.scaling import ScaleChange

STATES = ("serving", "warming", "draining")
MOVE_BOUND = 1.1
"""A change of N pods may move at most ``MOVE_BOUND / N`` of the clusters (ideal: 1/N)."""


@dataclasses.dataclass
class RampRequest:
    """One request of the ramp as the client saw it (times: seconds since the ramp started)."""

    sent: float
    done: float
    level: int
    """Requests the ramp kept in flight when this one was sent."""
    status: int
    pod: str = ""
    query_tokens: int = 0
    hit_tokens: int = 0
    """Prompt tokens served from any tier (memory, disk, peer) of the serving pod."""
    held: float | None = None
    """Share of the candidates whose cluster the serving pod was assigned at send time."""
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200


@dataclasses.dataclass(frozen=True)
class RampSample:
    """One poll of the cluster while the ramp ran."""

    t: float
    phase: str
    level: int
    pods: Mapping[str, str]
    """Pod → ``serving`` (the router routes to it), ``warming`` (started, not yet routable) or
    ``draining`` (the autoscaler is removing it)."""
    pressure: Mapping[str, float]
    """Pod → its term of the autoscaler's query (pressure averaged over the query's window)."""
    generation: int
    placed: tuple[str, ...]
    """Pods of the placement generation in force."""
    warm: tuple[str, ...] = ()
    """Pods whose warm report in etcd covers every cluster assigned to them in that generation."""

    @property
    def total(self) -> float:
        return sum(self.pressure.values())


@dataclasses.dataclass(frozen=True)
class RampChange(ScaleChange):
    """One change the autoscaler made during the ramp: the pod change, when it was decided (seconds
    into the ramp) and the query's value it was decided on."""

    decided: float = dataclasses.field(kw_only=True)
    pressure: float | None = dataclasses.field(default=None, kw_only=True)


def held_share(candidates: Sequence[str], placement: Placement, pod: str) -> float | None:
    """Share of ``candidates`` whose cluster ``pod`` holds in ``placement`` (None: no candidates)."""
    if not candidates:
        return None
    held = set(placement.clusters_of(pod))
    return sum(1 for c in candidates if placement.item_clusters.get(c, -1) in held) / len(candidates)


def moved_fraction(before: Placement, after: Placement) -> float:
    """Share of the clusters whose set of holders differs between two placements."""
    clusters = set(before.assignment) | set(after.assignment)
    if not clusters:
        return 0.0
    changed = sum(1 for c in clusters if set(before.assignment.get(c, ())) != set(after.assignment.get(c, ())))
    return changed / len(clusters)


def placement_around(change: RampChange, placements: Sequence[tuple[float, Placement]]) -> \
        tuple[Placement | None, Placement | None]:
    """The placement in force at the decision and the first one after it whose pods are the
    change's ``after`` (``placements``: (first seen, placement) in generation order)."""
    before = None
    for seen, placement in placements:
        if seen <= change.decided:
            before = placement
    after = next((p for seen, p in placements if seen > change.decided and set(p.pods) == set(change.after)), None)
    return before, after


def settled_at(change: RampChange, samples: Sequence[RampSample]) -> float | None:
    """When the change settled: the first poll after the pods run whose placement names exactly the
    ``after`` pods and shows every one of them serving (None: not within the ramp)."""
    running = change.decided + change.seconds
    for s in samples:
        if s.t >= running and set(s.placed) == set(change.after) and \
                all(s.pods.get(p) == "serving" for p in change.after):
            return s.t
    return None


def change_rows(changes: Sequence[RampChange], samples: Sequence[RampSample], requests: Sequence[RampRequest],
                placements: Sequence[tuple[float, Placement]]) -> list[dict[str, Any]]:
    """Per change: times from the decision (to running, warm, first answer, settled) and the moved
    share against its bound."""
    rows = []
    for change in changes:
        before, after = placement_around(change, placements)
        moved = moved_fraction(before, after) if before is not None and after is not None else None
        bound = MOVE_BOUND / max(len(change.before), len(change.after), 1)
        warm = next((s.t for s in samples if s.t >= change.decided and change.added
                     and all(p in s.warm and s.pods.get(p) == "serving" for p in change.added)), None)
        answered = [r.sent for r in requests if r.ok and r.pod in change.added and r.sent >= change.decided]
        settled = settled_at(change, samples)
        rows.append({
            "t": change.decided, "from": len(change.before), "to": len(change.after),
            "added": list(change.added), "removed": list(change.removed), "pressure": change.pressure,
            "running_s": change.seconds, "warm_s": _since(warm, change.decided),
            "serving_s": _since(min(answered) if answered else None, change.decided),
            "settled_s": _since(settled, change.decided),
            "generations": [before.generation if before else None, after.generation if after else None],
            "moved_fraction": moved, "bound": bound, "within_bound": None if moved is None else moved <= bound,
            "drains": {pod: dict(answer) for pod, answer in change.drains.items()},
        })
    return rows


def _since(t: float | None, origin: float) -> float | None:
    return None if t is None else t - origin


def stats(requests: Sequence[RampRequest], start: float, end: float) -> dict[str, Any]:
    """Requests sent in ``[start, end)``: count, failures, served per second, hit ratio, locality."""
    chosen = [r for r in requests if start <= r.sent < end]
    ok = [r for r in chosen if r.ok]
    query = sum(r.query_tokens for r in ok)
    held = [r.held for r in ok if r.held is not None]
    share: dict[str, int] = {}
    for r in ok:
        share[r.pod] = share.get(r.pod, 0) + 1
    return {"from": start, "to": end, "requests": len(chosen), "failed": len(chosen) - len(ok),
            "per_s": len(ok) / (end - start) if end > start else None,
            "hit_ratio": sum(r.hit_tokens for r in ok) / query if query else None,
            "locality": sum(held) / len(held) if held else None,
            "per_pod": {p: n / len(ok) for p, n in sorted(share.items())}}


def segments(requests: Sequence[RampRequest], rows: Sequence[Mapping[str, Any]], end: float) -> list[dict[str, Any]]:
    """The ramp cut at each decision and each settling: ``before``, then per change its transition
    (decision → settled) and the steady stretch after it; the last stretch is ``after``."""
    cuts: list[tuple[str, float]] = [("before", 0.0)]
    for row in rows:
        direction = "scale-out" if row["to"] > row["from"] else "scale-in"
        cuts.append((f"{direction} {row['from']}→{row['to']}", row["t"]))
        if row["settled_s"] is not None:
            cuts.append((f"{row['to']} pods", row["t"] + row["settled_s"]))
    if len(cuts) > 1 and cuts[-1][0].endswith(" pods"):
        cuts[-1] = (f"{cuts[-1][0]}, after", cuts[-1][1])
    out = []
    for (name, start), (_, stop) in zip(cuts, [*cuts[1:], ("", end)], strict=True):
        out.append({"segment": name, **stats(requests, start, max(start, stop))})
    return out


def headline(requests: Sequence[RampRequest], rows: Sequence[Mapping[str, Any]], end: float) -> dict[str, Any]:
    """Hit ratio and locality before the first decision, during the changes (first decision until
    the last one settled) and after; None where the ramp never got there."""
    if not rows:
        parts = {"before": stats(requests, 0.0, end), "during": None, "after": None}
    else:
        first = rows[0]["t"]
        last = rows[-1]
        settled = None if last["settled_s"] is None else last["t"] + last["settled_s"]
        parts = {"before": stats(requests, 0.0, first),
                 "during": stats(requests, first, settled if settled is not None else end),
                 "after": stats(requests, settled, end) if settled is not None else None}
    return {name: (None if part is None else {k: part[k] for k in ("requests", "hit_ratio", "locality")})
            for name, part in parts.items()}


def timeline(samples: Sequence[RampSample], requests: Sequence[RampRequest], window: float) -> list[dict[str, Any]]:
    """One row per sample: pods by state, load offered and served per pod (requests per second over
    the last ``window`` seconds), pressure per pod and summed, hit ratio and locality over the window."""
    rows = []
    for s in samples:
        start = max(0.0, s.t - window)
        span = max(s.t - start, 1e-9)
        sent = [r for r in requests if start < r.sent <= s.t]
        done = [r for r in requests if start < r.done <= s.t and r.ok]
        per_pod: dict[str, float] = dict.fromkeys(s.pods, 0.0)
        for r in done:
            per_pod[r.pod] = per_pod.get(r.pod, 0.0) + 1 / span
        query = sum(r.query_tokens for r in done)
        held = [r.held for r in done if r.held is not None]
        rows.append({
            "t": s.t, "phase": s.phase, "level": s.level,
            "pods": {state: sorted(p for p, st in s.pods.items() if st == state) for state in STATES},
            "offered_per_s": len(sent) / span, "served_per_s": per_pod,
            "pressure": dict(s.pressure), "pressure_sum": s.total,
            "hit_ratio": sum(r.hit_tokens for r in done) / query if query else None,
            "locality": sum(held) / len(held) if held else None,
            "generation": s.generation,
        })
    return rows


def summarize(requests: Sequence[RampRequest], samples: Sequence[RampSample], changes: Sequence[RampChange],
              placements: Sequence[tuple[float, Placement]], end: float, *, window: float = 10.0) -> dict[str, Any]:
    """The ramp's numbers as one JSON-able document: ``decisions``, ``segments``, ``hit_ratio``
    (before/during/after), request counts and the ``timeline`` rows."""
    rows = change_rows(changes, samples, requests, placements)
    failed = [r for r in requests if not r.ok]
    return {
        "requests": len(requests), "failed": len(failed),
        "failures": [dataclasses.asdict(r) for r in failed[:5]],
        "decisions": rows,
        "segments": segments(requests, rows, end),
        "hit_ratio": headline(requests, rows, end),
        "timeline": timeline(samples, requests, window),
    }
