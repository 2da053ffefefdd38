"""The blend settings in force for one CacheShard: the one place their defaults and ladder live.

Why a shared module. The operator (which reads ``spec.blend``, runs the fidelity controller and
publishes the settings in force), the sidecars (which blend by them and shadow-check them) and the
benchmarks must agree on three things, and none of them may import another component:

* the defaults — :data:`DEFAULT_METHOD` and :data:`DEFAULT_RATIO`, set from the fidelity-frontier
  measurement. The engine's :class:`~kvshard_sidecar.engine.settings.BlendSettings` defaults, the
  sidecar's flags and the operator's publication all read them here, so changing them is a one-line
  edit;
* the ratio ladder — the recompute ratios the fidelity controller steps along, one rung per
  interval. Fixed rungs keep the metric label ``ratio`` low-cardinality and make "one step" mean
  the same thing everywhere;
* the value stored in etcd under ``/kvshard/v1/<namespace>/<name>/blend`` (:class:`BlendPolicy`),
  published with compare-and-swap on the key's version like placement generations.

The CRD spells ratios and rates as integer percents (no floats in spec); this module converts.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

DEFAULT_METHOD = "tail"
"""The blend method served when ``spec.blend.method`` is not set (and the engine's default selector).

``tail`` (recompute the rows closest to the question) is the measured best at the speeds worth serving:
``kvshard bench fidelity --users 12 --methods none tail tail+segment boundary cacheblend epic --ratios
0.15 0.3 0.5`` (SmolLM2-135M, MovieLens, history 30, 20 candidates) — its KL to full prefill falls with
every step of the ratio (.443 none → .347 → .284 → .206), which the fidelity controller needs, and at
every speed-up ≥ 4× its KL is below ``cacheblend``'s and ``epic``'s (e.g. .347 at 7.3× vs epic's .425
at 5.5× and cacheblend's .370 at 4.0×). ``boundary`` has lower label KL but is not monotone (.314,
.339, .325)."""
DEFAULT_RATIO = 0.3
"""The recompute ratio served when ``spec.blend.ratioPercent`` is not set (and the engine's default):
the highest ladder rung at which ``tail`` still serves ≥ 4× faster than full prefill (5.2×) and ≥ 2×
faster than prefix reuse (2.3×) in the same measurement — below that speed a prefix cache would do."""

RATIO_LADDER: tuple[float, ...] = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0)
"""The ratios the controller steps along; the CRD's ``ratioPercent`` values are these × 100."""
LADDER_PERCENTS: tuple[int, ...] = tuple(round(r * 100) for r in RATIO_LADDER)

METHODS = ("none", "full", "boundary", "deviation", "hybrid", "tail", "cacheblend", "epic")
"""Method names a CacheShard may set (the engine's :data:`~kvshard_sidecar.engine.methods.METHODS`;
a test keeps the two equal)."""
CORRECTIONS = ("tail", "structure", "labels", "segment")
"""Corrections a CacheShard may add after ``+`` (``+ape`` needs a per-model calibration that
sidecars do not load, so it is a per-request benchmark option only)."""
METHOD_PATTERN = rf"^({'|'.join(METHODS)})(\+({'|'.join(CORRECTIONS)}))*$"
SCHEMA = 1


class BlendPolicyError(ValueError):
    """A stored blend value, or a method name, that this code does not understand."""


def check_method(method: str) -> str:
    """``method`` if it names a method with known, unrepeated corrections; else :class:`BlendPolicyError`."""
    if not re.fullmatch(METHOD_PATTERN, method):
        raise BlendPolicyError(f"blend method {method!r} is not NAME[+CORRECTION...] with NAME one of "
                               f"{', '.join(METHODS)} and corrections from {', '.join(CORRECTIONS)}")
    corrections = method.split("+")[1:]
    if len(set(corrections)) != len(corrections):
        raise BlendPolicyError(f"blend method {method!r} repeats a correction")
    return method


def rung(ratio: float) -> float:
    """The ladder rung closest to ``ratio`` (what the metric label says for an off-ladder ratio)."""
    return min(RATIO_LADDER, key=lambda r: (abs(r - ratio), r))


def rung_index(ratio: float) -> int:
    return RATIO_LADDER.index(rung(ratio))


def ratio_label(ratio: float) -> str:
    """The ``ratio`` label value of the fidelity metrics: the rung, shortest decimal (``0.15``)."""
    return f"{rung(ratio):g}"


@dataclasses.dataclass(frozen=True)
class BlendPolicy:
    """The blend settings in force for a CacheShard, as the operator publishes them.

    Attributes:
        method: a method spec (``tail``, ``boundary+structure``) every sidecar blends requests with,
            unless a request names its own.
        ratio: the recompute ratio in force.
        sample_rate: share of requests the sidecars shadow-check against a full prefill (0: off).
        reason: why this ratio is in force (``Spec``, ``BelowTarget``, ``AboveTarget``, ``Hold`` …), for
            whoever reads etcd.
    """

    method: str = DEFAULT_METHOD
    ratio: float = DEFAULT_RATIO
    sample_rate: float = 0.0
    reason: str = "Spec"

    def __post_init__(self) -> None:
        check_method(self.method)
        if not 0.0 <= self.ratio <= 1.0:
            raise BlendPolicyError(f"ratio must be in [0, 1], got {self.ratio}")
        if not 0.0 <= self.sample_rate <= 1.0:
            raise BlendPolicyError(f"sample_rate must be in [0, 1], got {self.sample_rate}")

    def same_settings(self, other: BlendPolicy | None) -> bool:
        """Whether ``other`` blends and samples the same way (the reason aside)."""
        return other is not None and (self.method, self.ratio, self.sample_rate) == (
            other.method, other.ratio, other.sample_rate)

    def encode(self) -> bytes:
        return json.dumps({"schema": SCHEMA, "method": self.method, "ratio": self.ratio,
                           "sample_rate": self.sample_rate, "reason": self.reason}, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> BlendPolicy:
        try:
            doc: Any = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
                raise BlendPolicyError(f"unknown blend schema in {raw[:100]!r}")
            return cls(method=str(doc["method"]), ratio=float(doc["ratio"]),
                       sample_rate=float(doc.get("sample_rate", 0.0)), reason=str(doc.get("reason", "")))
        except (ValueError, KeyError, TypeError) as exc:
            if isinstance(exc, BlendPolicyError):
                raise
            raise BlendPolicyError(f"not a blend policy: {raw[:100]!r} ({exc})") from exc


def from_spec(spec: Mapping[str, Any]) -> BlendPolicy:
    """What a (validated) CacheShard spec asks for before any controller step: ``spec.blend`` over the
    defaults, and ``spec.fidelity.sampleRatePercent`` (no fidelity: no shadow checks). A ratio outside
    ``[minRatioPercent, maxRatioPercent]`` is clamped into it, so the controller starts inside its range."""
    blend = spec.get("blend") or {}
    fidelity = spec.get("fidelity")
    ratio = float(blend["ratioPercent"]) / 100 if "ratioPercent" in blend else DEFAULT_RATIO
    sample_rate = 0.0
    if fidelity:
        sample_rate = float(fidelity.get("sampleRatePercent", 0)) / 100
        low, high = ratio_bounds(fidelity)
        ratio = min(max(ratio, low), high)
    return BlendPolicy(method=str(blend.get("method") or DEFAULT_METHOD), ratio=ratio, sample_rate=sample_rate)


def ratio_bounds(fidelity: Mapping[str, Any]) -> tuple[float, float]:
    """``(minRatio, maxRatio)`` of a ``spec.fidelity`` as ladder rungs."""
    return (float(fidelity.get("minRatioPercent", 0)) / 100, float(fidelity.get("maxRatioPercent", 100)) / 100)
