"""Scaling the local cluster: pods added and removed like a StatefulSet's, and the chart's autoscaler.

``scale_pods`` is what a StatefulSet controller and kubelet do when ``replicas`` changes: the highest
ordinals come and go (``engine-2`` is added after ``engine-1``, and removed first). A new pod starts
and appears in the API; the operator places it (minimal movement), it warms, and the router routes
to it once its warm report shows every assigned cluster warm. A leaving pod is drained first, as the
chart's ``preStop`` hook does: ``GET /v1/drain`` makes it leave routing and serve what is inside,
and only then is its process stopped and its Pod object deleted (the operator re-places its clusters;
their other replicas or peer fetches serve the misses meanwhile).

``LocalAutoscaler`` is the HPA the chart configures, run here for real: every period it evaluates
:func:`kvshard.autoscaling.pressure_query` — the very expression the chart's KEDA trigger ships —
against this cluster's Prometheus and applies :class:`kvshard.autoscaling.Autoscaler` (the HPA's
replica rule, min/max and ``behavior``) to the answer. Its timeline (every evaluation and every
change, with the drain answers) is what tests and the demo report.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from kvshard.autoscaling import Autoscaler, ScalingRules, pressure_query
from kvshard_local.kubelet import PodProcess
from kvshard_local.testing_servers import free_port

if TYPE_CHECKING:
    from kvshard_local.cluster import LocalCluster
    from kvshard_local.settings import LocalClusterSettings

log = logging.getLogger(__name__)

STATEFULSET = "engine"
"""The local cluster's engine pods are ``engine-<ordinal>``, as the chart's StatefulSet names them."""
LOCAL_AUTOSCALING: dict[str, Any] = {
    "minReplicas": 2, "maxReplicas": 3, "targetPressure": "1", "pressureWindow": "10s",
    "behavior": {"scaleUp": {"stabilizationWindowSeconds": 0, "pods": 1, "periodSeconds": 30},
                 "scaleDown": {"stabilizationWindowSeconds": 30, "pods": 1, "periodSeconds": 30}},
}
"""The chart's ``autoscaling`` shape with windows a laptop test can wait for (the chart's are minutes)."""
_LOCK = threading.Lock()


def local_rules(settings: LocalClusterSettings) -> ScalingRules:
    """The rules the local autoscaler runs: :data:`LOCAL_AUTOSCALING`, overridden by the
    ``autoscaling:`` map of ``settings.autoscale_values`` (a chart values file works as is)."""
    values = json.loads(json.dumps(LOCAL_AUTOSCALING))
    if settings.autoscale_values is not None:
        given = (yaml.safe_load(Path(settings.autoscale_values).read_text()) or {}).get("autoscaling", {})
        for key, value in given.items():
            if key == "behavior":
                for direction, rule in value.items():
                    values["behavior"].setdefault(direction, {}).update(rule)
            elif key in values:
                values[key] = value
    return ScalingRules.from_values(values)


@dataclass(frozen=True)
class ScaleChange:
    """One change of the pod count and how it went."""

    before: tuple[str, ...]
    after: tuple[str, ...]
    seconds: float
    """From the decision to the pods running (new ones started, leaving ones drained and stopped)."""
    drains: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Leaving pod → the sidecar's drain answer (``drained``, ``seconds``, ``served_while_draining``)."""

    @property
    def added(self) -> tuple[str, ...]:
        return tuple(p for p in self.after if p not in self.before)

    @property
    def removed(self) -> tuple[str, ...]:
        return tuple(p for p in self.before if p not in self.after)


def drain(url: str, timeout: float) -> dict[str, Any]:
    """``GET <url>/v1/drain`` and its JSON answer; ``drained: False`` with the reason on failure."""
    query = urllib.parse.urlencode({"timeout": f"{timeout:g}"})
    try:
        with urllib.request.urlopen(f"{url}/v1/drain?{query}", timeout=timeout + 10) as response:
            return dict(json.loads(response.read()))
    except urllib.error.HTTPError as error:
        body = error.read().decode(errors="replace")
        try:
            return dict(json.loads(body))
        except ValueError:
            return {"drained": False, "error": f"HTTP {error.code}: {body[:200]}"}
    except (urllib.error.URLError, OSError, ValueError) as error:
        return {"drained": False, "error": f"{type(error).__name__}: {error}"}


def scale_pods(cluster: LocalCluster, pods: int, *, drain_timeout: float = 60.0) -> ScaleChange:
    """Make ``cluster`` run ``pods`` sidecar pods (see the module docstring)."""
    if pods < 1:
        raise ValueError("a local cluster needs at least one pod")
    kubelet = cluster._kubelet
    if kubelet is None:
        raise RuntimeError("the cluster is not running")
    with _LOCK:
        started = time.monotonic()
        before = tuple(cluster.pod_names)
        drains: dict[str, dict[str, Any]] = {}
        for ordinal in range(len(before), pods):
            name = f"{STATEFULSET}-{ordinal}"
            url = f"http://127.0.0.1:{free_port()}"
            cluster.sidecar_urls[name] = url
            cluster.pod_names.append(name)
            kubelet.add(PodProcess(name, cluster._sidecar(name, cluster.peer_token_file), url))
            log.info("scale: pod %s added at %s", name, url)
        while len(cluster.pod_names) > pods:
            name = cluster.pod_names[-1]
            answer = drain(cluster.sidecar_urls[name], drain_timeout)
            drains[name] = answer
            log.info("scale: pod %s drained (%s); stopping it", name, answer)
            kubelet.remove(name)
            cluster.pod_names.pop()
            del cluster.sidecar_urls[name]
        if tuple(cluster.pod_names) != before:
            cluster.write_prometheus_config()
        change = ScaleChange(before, tuple(cluster.pod_names), time.monotonic() - started, drains)
    if change.before != change.after:
        log.info("scale: %d → %d pods in %.1f s", len(change.before), len(change.after), change.seconds)
    return change


@dataclass(frozen=True)
class Evaluation:
    """One autoscaler evaluation: the query's value (None: no data) and the decision."""

    at: float
    value: float | None
    pods: int
    desired: int


class LocalAutoscaler:
    """The chart's autoscaler as a thread of the process that runs the cluster."""

    def __init__(self, cluster: LocalCluster, rules: ScalingRules, *, period: float | None = None) -> None:
        self.cluster = cluster
        self.rules = rules
        self.query = pressure_query(cluster.namespace, STATEFULSET, rules.window)
        self.period = period if period is not None else cluster.settings.autoscale_period_seconds
        self.decider = Autoscaler(rules)
        self.evaluations: list[Evaluation] = []
        self.changes: list[tuple[float, ScaleChange]] = []
        """(wall time of the decision, the change)."""
        self.pending: tuple[float, int, int] | None = None
        """(wall time of the decision, pods before, pods wanted) while a change runs: which pods are
        joining or draining right now, for timelines (``changes`` only has a change once it is done)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="autoscaler", daemon=True)

    def start(self) -> None:
        log.info("autoscaler: %d-%d pods, target %g per pod, query %s", self.rules.min_replicas,
                 self.rules.max_replicas, self.rules.target, self.query)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=120)

    def evaluate(self) -> float | None:
        """The query's value now (None: no series yet, or Prometheus did not answer)."""
        url = f"{self.cluster.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": self.query})
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                doc = json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError) as error:
            log.warning("autoscaler: Prometheus query failed: %s", error)
            return None
        result = doc.get("data", {}).get("result", [])
        return float(result[0]["value"][1]) if result else None

    def step(self) -> Evaluation:
        """One evaluation and, if the rules say so, one change (blocking until it is done)."""
        value = self.evaluate()
        current = len(self.cluster.pod_names)
        desired = self.decider.decide(time.monotonic(), current, value)
        evaluation = Evaluation(time.time(), value, current, desired)
        self.evaluations.append(evaluation)
        if desired != current:
            log.info("autoscaler: pressure %s over %d pods → %d pods", value, current, desired)
            decided = time.time()
            self.pending = (decided, current, desired)
            try:
                self.changes.append((decided, self.cluster.scale(desired)))
            finally:
                self.pending = None
        return evaluation

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.step()
            except Exception:  # a failed step must not end autoscaling for good
                log.exception("autoscaler step failed")
