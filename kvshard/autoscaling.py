"""The engine autoscaler's rule, pure: the PromQL it scales on and the HPA's replica arithmetic.

Why here and not in the chart only: the chart's KEDA ScaledObject and the local cluster's autoscaler
(:mod:`kvshard_local.autoscaler`) must evaluate *the same* expression with *the same* behaviour, or
the local cluster would exercise an expression nobody ships. :func:`pressure_query` is the one
builder; ``tests/chart`` renders the chart and checks that its trigger query equals this function's
output for the same values, so the two cannot drift apart.

What is scaled on — ``kvshard_sidecar_pressure`` (see :mod:`kvshard_sidecar.pressure`): per pod,
``max((waiting + in-flight) / max_concurrency, TTFT p90 over the window / TTFT target)``; 1.0 means
"at the concurrency it was sized for, or at its latency target". This follows what the serving
stacks do: vLLM production-stack's KEDA tutorial scales on ``vllm:num_requests_waiting`` (queue
depth), llm-d's workload autoscaling on queue depth, running requests and KV-cache pressure (its
WVA saturation analyzer) with an SLO-aware mode on latency, AIBrix on engine metrics such as queue
depth and KV-cache usage. Requests per second, what the chart used before, says nothing about a
pod's pressure: the same rate is idle on a warm pod and saturating on a cold one.

The replica rule is Kubernetes' HPA algorithm for an ``AverageValue`` target (which KEDA's generated
HPA also uses): ``desired = ceil(sum / target)``, no change within a 10 % tolerance, clamped to
[min, max]; then the ``behavior`` rules — a stabilisation window per direction (scale up to the
*lowest* recommendation of the up window, down to the *highest* of the down window) and a rate
policy (at most ``pods`` pods per ``periodSeconds``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

PRESSURE_METRIC = "kvshard_sidecar_pressure"
TOLERANCE = 0.1
"""The HPA's default ``--horizontal-pod-autoscaler-tolerance``."""
_DURATION = re.compile(r"^[0-9]+(ms|s|m|h)$")


def pressure_query(namespace: str, statefulset: str, window: str) -> str:
    """The PromQL the KEDA trigger and the local autoscaler evaluate: the engine pods' pressure,
    each averaged over ``window`` (a Prometheus duration), summed over the StatefulSet's pods."""
    return f"sum({pod_pressure_query(namespace, statefulset, window)})"


def pod_pressure_query(namespace: str, statefulset: str, window: str) -> str:
    """The terms :func:`pressure_query` sums, one series per pod (``pod`` label): what each pod adds
    to the autoscaler's total, for timelines and dashboards."""
    if not _DURATION.match(window):
        raise ValueError(f"window {window!r} is not a Prometheus duration such as 1m or 30s")
    selector = f'namespace="{namespace}",pod=~"{statefulset}-[0-9]+"'
    return f"avg_over_time({PRESSURE_METRIC}{{{selector}}}[{window}])"


def duration_seconds(window: str) -> float:
    """A Prometheus duration such as ``10s`` or ``1m`` in seconds."""
    match = _DURATION.match(window)
    if not match:
        raise ValueError(f"window {window!r} is not a Prometheus duration such as 1m or 30s")
    unit = match.group(1)
    return float(window[: -len(unit)]) * {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}[unit]


@dataclass(frozen=True)
class DirectionRule:
    """One direction of an HPA ``behavior``: stabilisation window and a ``Pods`` rate policy."""

    stabilization_window_seconds: float
    pods: int
    period_seconds: float


@dataclass(frozen=True)
class ScalingRules:
    """What the chart's ``autoscaling`` values say, in the units the loop needs."""

    min_replicas: int
    max_replicas: int
    target: float
    """Target pressure per pod (the KEDA threshold, the HPA averageValue)."""
    window: str
    scale_up: DirectionRule
    scale_down: DirectionRule

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= minReplicas ({self.min_replicas}) <= maxReplicas ({self.max_replicas})")
        if self.target <= 0:
            raise ValueError(f"target pressure must be > 0, not {self.target}")

    @classmethod
    def from_values(cls, autoscaling: Mapping[str, Any]) -> ScalingRules:
        """From the chart's ``.Values.autoscaling`` map (values.yaml, or a test's overrides)."""
        behavior = autoscaling["behavior"]

        def rule(direction: str) -> DirectionRule:
            d = behavior[direction]
            return DirectionRule(float(d["stabilizationWindowSeconds"]), int(d["pods"]), float(d["periodSeconds"]))

        return cls(int(autoscaling["minReplicas"]), int(autoscaling["maxReplicas"]),
                   float(autoscaling["targetPressure"]), str(autoscaling["pressureWindow"]),
                   rule("scaleUp"), rule("scaleDown"))


def raw_recommendation(total: float, current: int, target: float) -> int:
    """The HPA's unstabilised answer for an ``AverageValue`` target (not yet clamped)."""
    if current > 0 and abs(total / current / target - 1.0) <= TOLERANCE:
        return current
    return max(0, math.ceil(total / target - 1e-9))


@dataclass
class Autoscaler:
    """The HPA's decision loop state for one target; feed it one :meth:`decide` per evaluation."""

    rules: ScalingRules
    _recommendations: list[tuple[float, int]] = field(default_factory=list)
    _events: list[tuple[float, int]] = field(default_factory=list)

    def decide(self, now: float, current: int, total: float | None) -> int:
        """Replicas to run from ``now`` on, given ``current`` and the query's value (None: no data,
        e.g. before the first scrape — keep ``current``, as the HPA does on a missing metric)."""
        r = self.rules
        if total is None:
            return max(r.min_replicas, min(r.max_replicas, current))
        rec = max(r.min_replicas, min(r.max_replicas, raw_recommendation(total, current, r.target)))
        self._recommendations.append((now, rec))
        keep = max(r.scale_up.stabilization_window_seconds, r.scale_down.stabilization_window_seconds)
        self._recommendations = [(t, x) for t, x in self._recommendations if now - t <= keep]
        up = min(x for t, x in self._recommendations if now - t <= r.scale_up.stabilization_window_seconds)
        down = max(x for t, x in self._recommendations if now - t <= r.scale_down.stabilization_window_seconds)
        desired = up if up > current else down if down < current else current
        desired = self._rate_limited(now, current, desired)
        desired = max(r.min_replicas, min(r.max_replicas, desired))
        if desired != current:
            self._events.append((now, desired - current))
        return desired

    def _rate_limited(self, now: float, current: int, desired: int) -> int:
        r = self.rules
        if desired > current:
            used = sum(d for t, d in self._events if d > 0 and now - t < r.scale_up.period_seconds)
            return min(desired, current + max(0, r.scale_up.pods - used))
        if desired < current:
            used = sum(-d for t, d in self._events if d < 0 and now - t < r.scale_down.period_seconds)
            return max(desired, current - max(0, r.scale_down.pods - used))
        return desired


def behavior_manifest(rules: ScalingRules) -> dict[str, Any]:
    """The HPA ``spec.behavior`` these rules stand for (what the chart renders from the same values)."""

    def direction(rule: DirectionRule) -> dict[str, Any]:
        return {"stabilizationWindowSeconds": int(rule.stabilization_window_seconds),
                "policies": [{"type": "Pods", "value": rule.pods, "periodSeconds": int(rule.period_seconds)}]}

    return {"scaleUp": direction(rules.scale_up), "scaleDown": direction(rules.scale_down)}
