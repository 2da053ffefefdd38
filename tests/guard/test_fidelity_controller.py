"""The fidelity controller's decisions, replayed on recorded shadow-check series: it raises the ratio
for a strict target, lowers it for a lax one, holds on too few samples or without Prometheus (and
says so), stops at maxRatio, never takes more than one step per interval and does not flap."""

from __future__ import annotations

import pytest

from kvshard.blend_policy import RATIO_LADDER
from kvshard_operator.fidelity_policy import Counts, Decision, Memory, Target, decide, wilson

# Recorded agreement per rung (agree of 60 checks per interval), shaped like tail's frontier: monotone.
MONOTONE = {0.1: 44, 0.15: 48, 0.2: 53, 0.3: 58, 0.4: 59, 0.5: 60, 0.7: 60, 1.0: 60}


def replay(start: float, target: Target, series: dict[float, list[int]] | dict[float, int], intervals: int = 10,
           n: int = 60) -> list[Decision]:
    """Run ``intervals`` decisions; at each, the checks counted at the ratio in force come from ``series``
    (a fixed count per rung, or a recorded sequence per rung, consumed in order)."""
    ratio, memory, out = start, Memory(), []
    seen: dict[float, int] = {}
    for _ in range(intervals):
        recorded = series[ratio]
        if isinstance(recorded, list):
            agree = recorded[seen.get(ratio, 0) % len(recorded)]
            seen[ratio] = seen.get(ratio, 0) + 1
        else:
            agree = recorded
        decision = decide(ratio, Counts(agree, n - agree), target, memory)
        out.append(decision)
        ratio, memory = decision.ratio, decision.memory
    return out


def direction_changes(decisions: list[Decision]) -> int:
    steps = [d.step for d in decisions if d.step]
    return sum(1 for a, b in zip(steps, steps[1:], strict=False) if a != b)


def test_wilson_matches_the_textbook_interval() -> None:
    low, high = wilson(18, 20)
    assert low == pytest.approx(0.699, abs=1e-3) and high == pytest.approx(0.972, abs=1e-3)
    assert wilson(0, 0) == (0.0, 1.0)


def test_a_strict_target_raises_the_ratio_one_rung_per_interval_until_met() -> None:
    decisions = replay(0.15, Target(0.95, min_ratio=0.05, max_ratio=0.7), MONOTONE)
    ratios = [d.ratio for d in decisions]
    assert ratios[:3] == [0.2, 0.3, 0.3], ratios
    assert [d.reason for d in decisions[:2]] == ["BelowTarget", "BelowTarget"]
    # 58/60 at .3: 96.7 %, but the lower bound is 88.6 % < 95 %: held there, and not reported as met
    assert (decisions[-1].status, decisions[-1].reason) == ("Unknown", "NotYetShown")
    assert all(abs(RATIO_LADDER.index(b.ratio) - RATIO_LADDER.index(a.ratio)) <= 1
               for a, b in zip(decisions, decisions[1:], strict=False))
    assert direction_changes(decisions) == 0


def test_a_lax_target_lowers_the_ratio_and_stops_where_the_bound_would_fail() -> None:
    decisions = replay(0.3, Target(0.70, min_ratio=0.0, max_ratio=1.0), MONOTONE)
    ratios = [d.ratio for d in decisions]
    assert ratios[:3] == [0.2, 0.15, 0.15], ratios  # 48/60: lower bound .68 < .70, so it stays at .15
    assert decisions[0].reason == "AboveTarget" and decisions[2].reason == "NotYetShown"
    assert direction_changes(decisions) == 0


def test_a_rung_that_barely_misses_does_not_make_the_ratio_flap_over_ten_intervals() -> None:
    # At .2 the target is sometimes confidently missed, at .3 always confidently met: without the
    # cooldown the ratio would go .2 → .3 → .2 → .3 …
    series = {0.2: [45, 56, 45, 56], 0.3: [60], 0.4: [60]}
    decisions = replay(0.2, Target(0.90, max_ratio=0.5), series)
    ratios = [d.ratio for d in decisions]
    assert ratios[0] == 0.3 and set(ratios) == {0.3}, ratios
    assert direction_changes(decisions) == 0
    assert all("missed the target recently" in d.message for d in decisions[1:])


def test_after_the_cooldown_a_rung_is_tried_again() -> None:
    decisions = replay(0.2, Target(0.90, max_ratio=0.5, cooldown_intervals=2), {0.2: [45, 60], 0.3: [60]},
                       intervals=4)
    assert [d.ratio for d in decisions] == [0.3, 0.3, 0.3, 0.2]
    assert [d.step for d in decisions] == [1, 0, 0, -1]


def test_too_few_samples_hold_and_say_how_many() -> None:
    decision = decide(0.15, Counts(agree=3, disagree=4, skipped=9), Target(0.95, min_samples=20))
    assert (decision.ratio, decision.step, decision.status, decision.reason) == (0.15, 0, "Unknown",
                                                                                   "InsufficientSamples")
    assert "7 of 20" in decision.message and "9 skipped" in decision.message


def test_prometheus_down_holds_and_says_so() -> None:
    decision = decide(0.3, None, Target(0.95), problem="prometheus at http://x unreachable")
    assert (decision.ratio, decision.step, decision.status, decision.reason) == (0.3, 0, "Unknown",
                                                                                   "PrometheusUnavailable")
    assert "unreachable" in decision.message


def test_below_target_at_max_ratio_reports_at_max_ratio_and_holds() -> None:
    decision = decide(0.5, Counts(40, 20), Target(0.95, max_ratio=0.5))
    assert (decision.ratio, decision.step, decision.status, decision.reason) == (0.5, 0, "False", "AtMaxRatio")


def test_an_inconclusive_shortfall_holds_without_stepping() -> None:
    decision = decide(0.2, Counts(55, 5), Target(0.95))  # 91.7 %, CI up to 96.4 %: not significant
    assert (decision.ratio, decision.step, decision.status, decision.reason) == (0.2, 0, "Unknown", "NotYetShown")


# ------------------------------------------------------------------ FidelityMet: met, missed, not yet shown


def test_five_of_five_is_not_shown_to_meet_a_90_percent_target() -> None:
    """5/5 agree: a 100 % point estimate, but the Wilson lower bound is 56 %: "not shown to miss" is not
    "met". The ratio is held (as before): only the condition changes."""
    decision = decide(0.3, Counts(5, 0), Target(0.90, min_samples=5))
    assert decision.lower is not None and decision.lower < 0.90 <= (decision.upper or 0)
    assert (decision.ratio, decision.step, decision.status, decision.reason) == (0.3, 0, "Unknown", "NotYetShown")
    assert "straddles" in decision.message


def test_a_large_sample_well_above_the_target_is_met() -> None:
    decision = decide(0.3, Counts(980, 20), Target(0.90, min_ratio=0.3))  # lower bound 96.9 %
    assert decision.lower is not None and decision.lower >= 0.90
    assert (decision.ratio, decision.step, decision.status, decision.reason) == (0.3, 0, "True", "MeetsTarget")
    lowered = decide(0.3, Counts(980, 20), Target(0.90))  # a rung below is allowed: still met, and it steps down
    assert (lowered.step, lowered.status, lowered.reason) == (-1, "True", "AboveTarget")


def test_a_large_sample_well_below_the_target_is_missed() -> None:
    decision = decide(0.3, Counts(700, 300), Target(0.90, max_ratio=0.3))  # upper bound 72.8 %
    assert decision.upper is not None and decision.upper < 0.90
    assert (decision.ratio, decision.step, decision.status, decision.reason) == (0.3, 0, "False", "AtMaxRatio")
    raised = decide(0.3, Counts(700, 300), Target(0.90))
    assert (raised.step, raised.status, raised.reason) == (1, "False", "BelowTarget")


def test_met_within_the_margin_is_met_but_holds() -> None:
    """Lower bound at or above the target but not by ``margin``: True/MeetsTarget, no step down."""
    decision = decide(0.3, Counts(980, 20), Target(0.95, margin=0.05))  # lower 96.9 % ≥ 95 %, < 100 %
    assert (decision.step, decision.status, decision.reason) == (0, "True", "MeetsTarget")


def test_the_straddling_interval_reaches_the_condition_the_guard_writes() -> None:
    from kvshard import blend_policy as bp
    from kvshard_operator import guard

    decision = decide(0.3, Counts(5, 0), Target(0.90, min_samples=5))
    fidelity = {"targetAgreementPercent": 90, "windowSeconds": 60}
    status = guard._status({}, 3, bp.BlendPolicy("tail", 0.3, 0.1), fidelity, decision, 0.0)
    met = [c for c in status["conditions"] if c["type"] == guard.FIDELITY_MET]
    assert [(c["status"], c["reason"]) for c in met] == [("Unknown", "NotYetShown")]
    assert status["fidelity"]["lowerBoundPercent"] == 56 and status["fidelity"]["agreementPercent"] == 100
