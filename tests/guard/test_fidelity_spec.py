"""spec.blend and spec.fidelity: the CRD refuses every mistake naming the field, applies the
defaults, and the blend in force derives from the spec over kvshard's one set of defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvshard import blend_policy as bp
from kvshard_operator import validation

ROOT = Path(__file__).resolve().parents[2]


def full() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "crds" / "examples" / "cacheshard-full.yaml").read_text())


MISTAKES: list[tuple[str, dict[str, Any], str]] = [
    ("unknown-method", {"blend": {"method": "magic"}}, "spec.blend.method"),
    ("unknown-correction", {"blend": {"method": "tail+sparkle"}}, "spec.blend.method"),
    ("ape-correction", {"blend": {"method": "none+ape"}}, "spec.blend.method"),
    ("ratio-off-ladder", {"blend": {"ratioPercent": 25}}, "spec.blend.ratioPercent"),
    ("ratio-as-float", {"blend": {"ratioPercent": 0.15}}, "spec.blend.ratioPercent"),
    ("blend-typo", {"blend": {"ratio": 15}}, "spec.blend.ratio"),
    ("target-missing", {"fidelity": {"sampleRatePercent": 2}}, "spec.fidelity.targetAgreementPercent"),
    ("target-over-100", {"fidelity": {"targetAgreementPercent": 101}}, "spec.fidelity.targetAgreementPercent"),
    ("target-as-fraction", {"fidelity": {"targetAgreementPercent": 0.95}}, "spec.fidelity.targetAgreementPercent"),
    ("sample-rate-zero", {"fidelity": {"targetAgreementPercent": 90, "sampleRatePercent": 0}},
     "spec.fidelity.sampleRatePercent"),
    ("max-off-ladder", {"fidelity": {"targetAgreementPercent": 90, "maxRatioPercent": 60}},
     "spec.fidelity.maxRatioPercent"),
    ("min-above-max", {"fidelity": {"targetAgreementPercent": 90, "minRatioPercent": 50, "maxRatioPercent": 20}},
     "spec.fidelity.minRatioPercent"),
    ("window-shorter-than-interval", {"fidelity": {"targetAgreementPercent": 90, "windowSeconds": 60,
                                                   "intervalSeconds": 120}}, "spec.fidelity.windowSeconds"),
    ("interval-too-short", {"fidelity": {"targetAgreementPercent": 90, "intervalSeconds": 1}},
     "spec.fidelity.intervalSeconds"),
    ("min-samples-zero", {"fidelity": {"targetAgreementPercent": 90, "minSamples": 0}}, "spec.fidelity.minSamples"),
]


@pytest.mark.parametrize(("name", "patch", "field"), MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_blend_or_fidelity_mistake_is_rejected_naming_the_field(name: str, patch: dict[str, Any],
                                                                  field: str) -> None:
    obj = full()
    obj["spec"].update(patch)
    with pytest.raises(validation.InvalidCacheShardError) as info:
        validation.validate(obj)
    fields = [v.field for v in info.value.violations]
    assert field in fields, f"{name}: {fields}"


def test_fidelity_needs_prometheus() -> None:
    obj = full()
    del obj["spec"]["prometheus"]
    obj["spec"]["rebalance"]["enabled"] = False
    with pytest.raises(validation.InvalidCacheShardError) as info:
        validation.validate(obj)
    assert "spec.prometheus" in [v.field for v in info.value.violations]
    assert "fidelity controller" in str(info.value)


def test_fidelity_defaults_are_applied() -> None:
    obj = full()
    obj["spec"]["fidelity"] = {"targetAgreementPercent": 90}
    fidelity = validation.validate(obj)["spec"]["fidelity"]
    assert fidelity == {"targetAgreementPercent": 90, "sampleRatePercent": 2, "minRatioPercent": 0,
                        "maxRatioPercent": 100, "windowSeconds": 600, "intervalSeconds": 300, "minSamples": 20}


def test_the_crd_ladder_and_methods_are_the_shared_ones() -> None:
    from kvshard_operator import crd
    from kvshard_sidecar.engine import methods

    spec = crd.version_schema(crd.load_crd())["properties"]["spec"]["properties"]
    assert spec["blend"]["properties"]["ratioPercent"]["enum"] == list(bp.LADDER_PERCENTS)
    assert spec["fidelity"]["properties"]["maxRatioPercent"]["enum"] == list(bp.LADDER_PERCENTS)
    assert spec["blend"]["properties"]["method"]["pattern"] == bp.METHOD_PATTERN
    assert bp.METHODS == methods.METHODS
    assert set(bp.CORRECTIONS) == set(methods.CORRECTIONS) - {"ape"}


def test_the_blend_in_force_comes_from_the_spec_over_the_defaults() -> None:
    assert bp.from_spec({}) == bp.BlendPolicy(bp.DEFAULT_METHOD, bp.DEFAULT_RATIO, 0.0)
    spec = validation.validate(full())["spec"]
    policy = bp.from_spec(spec)
    assert (policy.method, policy.ratio, policy.sample_rate) == ("tail", 0.15, 0.02)
    spec["blend"]["ratioPercent"] = 70  # outside [5, 50]: the controller starts inside its range
    assert bp.from_spec(spec).ratio == 0.5


def test_the_engine_defaults_are_the_shared_ones() -> None:
    from kvshard_sidecar.engine.settings import BlendSettings

    assert (BlendSettings().selector, BlendSettings().ratio) == (bp.DEFAULT_METHOD.split("+")[0], bp.DEFAULT_RATIO)


def test_a_blend_policy_round_trips_and_refuses_garbage() -> None:
    policy = bp.BlendPolicy("tail+structure", 0.3, 0.05, "BelowTarget")
    assert bp.BlendPolicy.decode(policy.encode()) == policy
    for raw in (b"{}", b"not json", b'{"schema": 1, "method": "magic", "ratio": 0.1}',
                b'{"schema": 1, "method": "tail", "ratio": 3}'):
        with pytest.raises(bp.BlendPolicyError):
            bp.BlendPolicy.decode(raw)
    assert bp.ratio_label(0.149) == "0.15" and bp.ratio_label(1.0) == "1" and bp.ratio_label(0.0) == "0"
