"""The fidelity controller's decision: one interval's shadow-check counts → the next recompute ratio.

Pure (no I/O, no clock), so recorded Prometheus series replay through it in tests. Why it is shaped
like this:

* **Statistics, not point estimates.** Agreement is a proportion over a few dozen shadow checks; 18 of
  20 is anything from 70 % to 97 % (Wilson 95 % interval). The ratio goes *up* only when the Wilson
  *upper* bound is below the target (confidently missed) and *down* only when the *lower* bound is at
  least the target plus ``margin`` (confidently met). Between the two it holds: that dead band is the
  hysteresis, and it widens as samples get scarce.
* **The condition says only what the interval shows.** ``FidelityMet`` is ``True`` (``MeetsTarget``,
  ``AboveTarget``) only when the lower bound is at or above the target, ``False`` (``BelowTarget``,
  ``AtMaxRatio``) only when the upper bound is below it, and ``Unknown`` (``NotYetShown``) while the
  interval straddles it: 5 of 5 agreeing is a lower bound of 56 %, which does not show a 90 % target
  met, however good the point estimate looks ("not shown to miss" is not "met").
* **Only evidence at the ratio in force counts.** The sidecars label every check with the ratio it
  ran at, and the adapter counts only the current rung's checks; after a step the new rung starts with
  no samples, so the controller holds (``InsufficientSamples``) until it has ``min_samples`` — at most
  one step per interval, and never a step on evidence about another ratio.
* **A rung found wanting is not retried soon.** After stepping up from rung r because r missed the
  target, stepping back down to r waits ``cooldown_intervals``: without it, a target that r meets
  *just barely* some intervals and misses in others would make the ratio climb and fall forever.
* **Hold, and say so,** when Prometheus cannot be read: no evidence is not evidence of a problem.

A method whose fidelity rises with the ratio (``tail``, measured monotone) is what makes "step up"
a remedy; :mod:`kvshard.blend_policy` holds the ladder.
"""

from __future__ import annotations

import dataclasses
import math

from kvshard.blend_policy import RATIO_LADDER, rung_index

Z_95 = 1.959963984540054


def wilson(successes: float, trials: float, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a proportion (``(0, 1)`` without trials)."""
    if trials <= 0:
        return 0.0, 1.0
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclasses.dataclass(frozen=True)
class Target:
    """What ``spec.fidelity`` asks for, as fractions."""

    agreement: float
    min_ratio: float = 0.0
    max_ratio: float = 1.0
    min_samples: int = 20
    margin: float = 0.0
    """How far above the target the lower bound must be before stepping down."""
    cooldown_intervals: int = 10


@dataclasses.dataclass(frozen=True)
class Counts:
    """Shadow checks at the ratio in force over the window (``None`` from the adapter: not readable)."""

    agree: int
    disagree: int
    skipped: int = 0

    @property
    def samples(self) -> int:
        return self.agree + self.disagree


@dataclasses.dataclass(frozen=True)
class Memory:
    """What the controller remembers between intervals: its interval counter and, per rung, the last
    interval that rung confidently missed the target."""

    interval: int = 0
    missed_at: tuple[tuple[float, int], ...] = ()

    def missed_recently(self, ratio: float, cooldown: int) -> bool:
        return any(r == ratio and self.interval - at <= cooldown for r, at in self.missed_at)

    def missed(self, ratio: float) -> Memory:
        return dataclasses.replace(self, missed_at=(*(m for m in self.missed_at if m[0] != ratio),
                                                    (ratio, self.interval)))


@dataclasses.dataclass(frozen=True)
class Decision:
    """The next ratio and what to say about it (the ``FidelityMet`` condition)."""

    ratio: float
    step: int
    """+1 up a rung, −1 down, 0 held."""
    status: str
    """``True`` / ``False`` / ``Unknown``."""
    reason: str
    message: str
    memory: Memory
    agreement: float | None = None
    lower: float | None = None
    upper: float | None = None
    samples: int = 0


def decide(ratio: float, counts: Counts | None, target: Target, memory: Memory = Memory(),
           problem: str = "") -> Decision:
    """One interval: ``ratio`` in force, ``counts`` at it (None: unreadable, ``problem`` says why)."""
    memory = dataclasses.replace(memory, interval=memory.interval + 1)
    index = rung_index(ratio)
    ratio = RATIO_LADDER[index]
    if counts is None:
        return Decision(ratio, 0, "Unknown", "PrometheusUnavailable",
                        f"holding ratio {ratio:g}: shadow-check counts unreadable ({problem or 'no answer'})", memory)
    n = counts.samples
    if n < target.min_samples:
        skipped = f", {counts.skipped} skipped under load" if counts.skipped else ""
        return Decision(ratio, 0, "Unknown", "InsufficientSamples",
                        f"holding ratio {ratio:g}: {n} of {target.min_samples} shadow checks at it in the "
                        f"window{skipped}", memory, samples=n,
                        agreement=counts.agree / n if n else None)
    agreement = counts.agree / n
    lower, upper = wilson(counts.agree, n)
    measured = (f"agreement {agreement:.1%} (95% CI {lower:.1%}–{upper:.1%}, {n} checks) at ratio {ratio:g}, "
                f"target {target.agreement:.1%}")

    def decision(new: float, step: int, status: str, reason: str, message: str, mem: Memory) -> Decision:
        return Decision(new, step, status, reason, message, mem, agreement, lower, upper, n)

    if upper < target.agreement:
        memory = memory.missed(ratio)
        above = [r for r in RATIO_LADDER[index + 1:] if r <= target.max_ratio + 1e-9]
        if not above:
            return decision(ratio, 0, "False", "AtMaxRatio", f"{measured}; already at maxRatio {target.max_ratio:g}",
                            memory)
        return decision(above[0], +1, "False", "BelowTarget", f"{measured}; raising the ratio to {above[0]:g}",
                        memory)
    if lower >= target.agreement + target.margin:
        below = [r for r in RATIO_LADDER[:index] if r >= target.min_ratio - 1e-9]
        if below and not memory.missed_recently(below[-1], target.cooldown_intervals):
            return decision(below[-1], -1, "True", "AboveTarget", f"{measured}; lowering the ratio to {below[-1]:g}",
                            memory)
        why = "minRatio" if not below else f"ratio {below[-1]:g} missed the target recently"
        return decision(ratio, 0, "True", "MeetsTarget", f"{measured}; holding ({why})", memory)
    if lower >= target.agreement:  # met, but not by ``margin``: no step down yet
        return decision(ratio, 0, "True", "MeetsTarget", f"{measured}; holding (not confidently above by the "
                        f"margin {target.margin:.1%})", memory)
    # the interval straddles the target: neither met nor missed is shown, whatever the point estimate says
    return decision(ratio, 0, "Unknown", "NotYetShown", f"{measured}; holding: the interval straddles the target, "
                    "so neither meeting nor missing it is shown yet", memory)
