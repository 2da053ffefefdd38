"""The chart's autoscaler and the local cluster's are one: same PromQL, same target, same behaviour.

The local autoscaler (``kvshard up --autoscale``) builds its query with
:func:`kvshard.autoscaling.pressure_query` and its rules with :meth:`ScalingRules.from_values`; these
tests render the chart from values and check that the KEDA trigger and the HPA carry exactly that,
so the expression exercised against the local Prometheus is the one the chart ships.
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import CHART, NAMESPACE, VALUES_CASES, container, engine_pod, find, promtool, render

from kvshard.autoscaling import PRESSURE_METRIC, ScalingRules, behavior_manifest, pressure_query

SETS = ["autoscaling.pressureWindow=45s", "autoscaling.targetPressure=1.5",
        "autoscaling.behavior.scaleDown.stabilizationWindowSeconds=120",
        "autoscaling.behavior.scaleUp.periodSeconds=30"]


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _values(case: str, sets: list[str]) -> dict[str, Any]:
    """The values helm sees: the chart's defaults, the case's file, then ``--set`` items."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    path = VALUES_CASES[case]
    if path is not None:
        values = _merge(values, yaml.safe_load(path.read_text()))
    for item in sets:
        dotted, raw = item.split("=", 1)
        *parents, leaf = dotted.split(".")
        node = values
        for key in parents:
            node = node[key]
        node[leaf] = yaml.safe_load(raw) if not isinstance(node.get(leaf), str) else raw
    return values


@pytest.mark.parametrize("sets", [[], SETS], ids=["defaults", "overridden"])
def test_keda_trigger_is_the_local_autoscalers_query_and_rules(helm_bin: Path, sets: list[str]) -> None:
    objects = render(helm_bin, VALUES_CASES["autoscaling-keda"], sets=sets)
    scaled = find(objects, "ScaledObject")
    statefulset = scaled["spec"]["scaleTargetRef"]["name"]
    rules = ScalingRules.from_values(_values("autoscaling-keda", sets)["autoscaling"])
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["metadata"]["query"] == pressure_query(NAMESPACE, statefulset, rules.window)
    assert float(trigger["metadata"]["threshold"]) == rules.target
    assert trigger["metricType"] == "AverageValue"
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == \
        (rules.min_replicas, rules.max_replicas)
    assert scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == behavior_manifest(rules)
    if sets:
        assert "[45s]" in trigger["metadata"]["query"] and rules.target == 1.5


def test_hpa_scales_on_pressure_with_the_same_behaviour(helm_bin: Path) -> None:
    objects = render(helm_bin, VALUES_CASES["autoscaling"], sets=SETS)
    hpa = find(objects, "HorizontalPodAutoscaler")
    rules = ScalingRules.from_values(_values("autoscaling", SETS)["autoscaling"])
    metric = hpa["spec"]["metrics"][0]["pods"]
    assert metric["metric"]["name"] == PRESSURE_METRIC
    assert float(metric["target"]["averageValue"]) == rules.target
    assert hpa["spec"]["behavior"] == behavior_manifest(rules)


def test_pressure_query_is_valid_promql(helm_bin: Path, tmp_path: Path) -> None:
    tool = promtool()
    if tool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    query = find(render(helm_bin, VALUES_CASES["autoscaling-keda"]), "ScaledObject")["spec"]["triggers"][0][
        "metadata"]["query"]
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [{"record": "kvshard:pressure:sum",
                                                                          "expr": query}]}]}))
    result = subprocess.run([tool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_both_engine_containers_wait_for_the_drain_before_sigterm(rendered: dict[str, Any]) -> None:
    pod = engine_pod(rendered["default"])
    values = yaml.safe_load((CHART / "values.yaml").read_text())["engine"]["sidecar"]
    for name in ("sidecar", "vllm"):
        command = container(pod, name)["lifecycle"]["preStop"]["exec"]["command"]
        assert command[:2] == ["python3", "-c"]
        assert f"127.0.0.1:{values['port']}/v1/drain?timeout={values['drainTimeoutSeconds']}" in command[2]
        compile(command[2], "preStop", "exec")  # the script is valid Python
    assert pod["terminationGracePeriodSeconds"] > values["drainTimeoutSeconds"]
