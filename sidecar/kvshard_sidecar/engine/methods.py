"""Named blend methods: one name → one :class:`BlendSettings`, for requests (``blend.method``) and benchmarks.

Why. A comparison is only fair when every method runs as its authors defined it, and a request that
says ``"method": "cacheblend"`` should get exactly what the benchmark measured under that name. The
two published baselines therefore fix every setting their papers fix:

* ``cacheblend`` — LMCache's CacheBlend: blocks prefilled standalone (each at position 0), K deviation
  at check layer 1, the top r kept, no gradual narrowing, no attention weighting;
* ``epic`` — EPIC's LegoLink: blocks prefilled standalone, the first k tokens of every block
  recomputed (``epic_k``; unset, k is the largest that fits the ratio's budget).

``none`` recomputes only the question; ``full`` recomputes every blended row (r = 1: a full prefill,
reusing only the exact prefix). The others are the engine's own selectors on the caller's settings
(prefill context, corrections).

A method may carry corrections after ``+`` (:mod:`.corrections`, :mod:`.calibration`):
``deviation+structure``, ``tail+segment``, ``boundary+tail`` (closeness weighting, weight
:data:`TAIL_WEIGHT`), ``none+ape`` (the model's calibrated attention temperature and scale).
"""

from __future__ import annotations

from kvshard_sidecar.engine.settings import BlendSettings

METHODS = ("none", "full", "boundary", "deviation", "hybrid", "tail", "cacheblend", "epic")
CORRECTIONS = ("tail", "structure", "labels", "segment", "ape")
TAIL_WEIGHT = 0.5
_PLAIN = {"tail_weight": 0.0, "structure": False, "labels_first": False, "granularity": "token",
          "attention_temperature": 1.0, "attention_scale": 1.0, "recompute_free": False}


def method_settings(spec: str, ratio: float, base: BlendSettings | None = None,
                    calibration: tuple[float, float] | None = None) -> BlendSettings:
    """The settings method ``spec`` (``NAME[+CORRECTION...]``) runs at ratio ``ratio`` on top of ``base``;
    ``calibration`` is the model's ``(temperature, scale)``, needed by ``+ape``."""
    name, *corrections = spec.split("+")
    settings = _named(name, ratio, base or BlendSettings())
    changes: dict[str, object] = {}
    for correction in corrections:
        if correction not in CORRECTIONS or correction in corrections[:corrections.index(correction)]:
            raise ValueError(f"unknown or repeated correction {correction!r} in {spec!r}; "
                             f"known: {', '.join(CORRECTIONS)}")
        if correction == "tail":
            changes["tail_weight"] = TAIL_WEIGHT
        elif correction == "structure":
            changes["structure"] = True
        elif correction == "labels":
            changes["labels_first"] = True
        elif correction == "segment":
            changes["granularity"] = "segment"
        else:
            if calibration is None:
                raise ValueError(f"{spec!r} needs the model's attention calibration (temperature, scale)")
            changes["attention_temperature"], changes["attention_scale"] = calibration
    return settings.with_(**changes) if changes else settings


def _named(name: str, ratio: float, base: BlendSettings) -> BlendSettings:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(METHODS)}")
    if name == "none":
        return base.with_(selector="none", ratio=0.0, schedule=())
    if name == "full":
        return base.with_(**_PLAIN, selector="tail", ratio=1.0, schedule=())
    if name == "cacheblend":
        return base.with_(**_PLAIN, selector="cacheblend", ratio=ratio, prefill_context="standalone",
                          neutral_context=(), averaged_contexts=(), check_layers=(1,), schedule=(), deviation_on="k",
                          deviation_weight="none")
    if name == "epic":
        return base.with_(**_PLAIN, selector="epic", ratio=ratio, prefill_context="standalone",
                          neutral_context=(), averaged_contexts=())
    return base.with_(selector=name, ratio=ratio, schedule=() if name in ("boundary", "tail") else base.schedule)
