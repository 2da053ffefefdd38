"""The pure parts of the autoscaling load ramp: the levels derived from the target, and the timeline's
arithmetic (segments, before/during/after hit ratio, decision-to-warm times, moved clusters), fed
hand-made records whose right answers are known; the demo's text and picture of them.

The ramp itself, on a real cluster with the real autoscaler, is ``test_autoscaling_e2e.py`` (slow).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, cast

import pytest

from kvshard.autoscaling import DirectionRule, ScalingRules, duration_seconds, raw_recommendation
from kvshard.placement_schema import Placement
from kvshard_bench import demo_ramp
from kvshard_local import ramp_timeline
from kvshard_local.ramp import RampResult, plan_ramp
from kvshard_local.ramp_timeline import RampChange, RampRequest, RampSample, headline, moved_fraction, segments
from kvshard_local.scaling import LOCAL_AUTOSCALING


def rules(min_replicas: int = 2, max_replicas: int = 3, target: float = 1.0, window: str = "10s") -> ScalingRules:
    return ScalingRules(min_replicas, max_replicas, target, window, DirectionRule(0, 1, 30), DirectionRule(30, 1, 30))


# ------------------------------------------------------------------------------------------ the plan


def test_the_local_rules_ramp_one_two_three_in_flight_then_two_one() -> None:
    plan = plan_ramp(ScalingRules.from_values(LOCAL_AUTOSCALING), period_s=5.0)
    assert plan.rise == (1, 2, 3) and plan.fall == (2, 1)
    assert plan.dwell_s == 10 + 2 * 5 and plan.fall_dwell_s == 20 + 30 and plan.unit == 1
    assert plan.after_s == 2 * plan.dwell_s, "after scale-in, as long as the rise below the top"


@pytest.mark.parametrize("target", [0.7, 1.0, 1.5, 2.0, 3.0])
@pytest.mark.parametrize(("low", "high"), [(1, 2), (2, 3), (2, 4), (3, 5)])
@pytest.mark.parametrize("concurrency", [1, 2, 4])
def test_the_levels_cross_the_target_both_ways_whatever_the_target(target: float, low: int, high: int,
                                                                    concurrency: int) -> None:
    """With closed-loop load, the query's sum is ≈ in flight / max_concurrency: the HPA's own rule on
    those sums must add a pod at the top level and come back to the minimum at the bottom one."""
    if 1 / (concurrency * target) > low:  # one request in flight is more than the minimum pods' worth
        with pytest.raises(ValueError, match="cannot fall below"):
            plan_ramp(rules(low, high, target), period_s=2.0, max_concurrency=concurrency)
        return
    plan = plan_ramp(rules(low, high, target), period_s=2.0, max_concurrency=concurrency)
    assert list(plan.rise) == sorted(set(plan.rise)) and list(plan.fall) == sorted(set(plan.fall), reverse=True)
    assert raw_recommendation(plan.rise[0] / concurrency, low, target) <= low, "the ramp starts below the target"
    assert raw_recommendation(plan.rise[-1] / concurrency, low, target) > low, "the top adds a pod"
    assert raw_recommendation(plan.fall[-1] / concurrency, low + 1, target) <= low, "the bottom removes it"
    assert plan.fall[0] < plan.rise[-1]


def test_a_target_below_one_request_in_flight_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="cannot fall below 2 pods"):
        plan_ramp(rules(target=0.2), period_s=5.0)


def test_prometheus_durations() -> None:
    assert [duration_seconds(d) for d in ("500ms", "10s", "2m", "1h")] == [0.5, 10.0, 120.0, 3600.0]
    with pytest.raises(ValueError):
        duration_seconds("10")


# ------------------------------------------------------------------------------------------ the timeline

PODS2 = ("engine-0", "engine-1")
PODS3 = ("engine-0", "engine-1", "engine-2")


def placement(generation: int, assignment: dict[int, tuple[str, ...]]) -> Placement:
    pods = tuple(sorted({p for holders in assignment.values() for p in holders}))
    return Placement(generation, assignment, {f"i{c}": c for c in assignment}, pods)


GEN1 = placement(1, {c: (PODS2[c % 2],) for c in range(6)})
GEN2 = placement(2, {**GEN1.assignment, 0: ("engine-2",), 3: ("engine-2",)})  # 2 of 6 clusters move to the new pod
GEN3 = placement(3, {**GEN2.assignment, 0: ("engine-1",), 3: ("engine-0",)})


def request(sent: float, pod: str, hit: int = 50, held: float | None = 1.0, status: int = 200) -> RampRequest:
    return RampRequest(sent, sent + 0.5, 2, status, pod, 100 if status == 200 else 0, hit if status == 200 else 0,
                       held if status == 200 else None, "" if status == 200 else "boom")


def sample(t: float, pods: dict[str, str], gen: Placement, warm: tuple[str, ...] = ()) -> RampSample:
    return RampSample(t, "rise", 2, pods, dict.fromkeys(pods, 0.5), gen.generation, gen.pods, warm)


def ramp_records() -> tuple[list[RampRequest], list[RampSample], list[RampChange], list[tuple[float, Placement]]]:
    """Decided to grow at 10 s (running at 12 s, warm at 20 s, first answer 21 s); decided to shrink at
    40 s (engine-2 drained and stopped by 43 s, the placement without it serving at 45 s); ends at 60 s."""
    serving2 = dict.fromkeys(PODS2, "serving")
    serving3 = dict.fromkeys(PODS3, "serving")
    samples = ([sample(t, serving2, GEN1, PODS2) for t in range(0, 12)]
               + [sample(t, {**serving2, "engine-2": "warming"}, GEN2 if t >= 14 else GEN1, PODS2)
                  for t in range(12, 20)]
               + [sample(t, serving3, GEN2, PODS3) for t in range(20, 41)]
               + [sample(t, {**serving2, "engine-2": "draining"}, GEN2, PODS2) for t in range(41, 43)]
               + [sample(t, serving2, GEN2, PODS2) for t in range(43, 45)]
               + [sample(t, serving2, GEN3, PODS2) for t in range(45, 61)])
    requests = ([request(t, PODS2[int(t) % 2], hit=80) for t in range(0, 10)]
                + [request(t + 0.5, PODS2[int(t) % 2], hit=60, held=0.5) for t in range(10, 21)]
                + [request(21.0, "engine-2", hit=20, held=1.0), request(30.0, "engine-2"), request(35.0, "engine-1")]
                + [request(41.0, "engine-0", status=502)]
                + [request(t, PODS2[int(t) % 2], hit=90) for t in range(45, 60)])
    changes = [RampChange(PODS2, PODS3, 2.0, decided=10.0, pressure=3.2),
               RampChange(PODS3, PODS2, 3.0,
                          {"engine-2": {"drained": True, "seconds": 1.5, "served_while_draining": 2}},
                          decided=40.0, pressure=1.1)]
    return requests, samples, changes, [(0.0, GEN1), (14.0, GEN2), (45.0, GEN3)]


def test_moved_fraction_counts_clusters_whose_holders_changed() -> None:
    assert moved_fraction(GEN1, GEN1) == 0.0
    assert moved_fraction(GEN1, GEN2) == pytest.approx(2 / 6)
    assert moved_fraction(GEN2, GEN3) == pytest.approx(2 / 6)


def test_each_decision_reports_its_times_and_the_moved_share_against_the_bound() -> None:
    requests, samples, changes, placements = ramp_records()
    doc = ramp_timeline.summarize(requests, samples, changes, placements, end=60.0)
    out, back = doc["decisions"]
    assert (out["from"], out["to"], out["added"], out["pressure"]) == (2, 3, ["engine-2"], 3.2)
    assert out["running_s"] == 2.0
    assert out["warm_s"] == 10.0, "engine-2's warm report complete and routable at 20 s"
    assert out["serving_s"] == 11.0, "its first answer was sent at 21 s"
    assert out["settled_s"] == 10.0
    assert out["generations"] == [1, 2] and out["moved_fraction"] == pytest.approx(1 / 3)
    assert out["bound"] == pytest.approx(1.1 / 3) and out["within_bound"]
    assert (back["from"], back["to"], back["removed"], back["warm_s"], back["serving_s"]) == (3, 2, ["engine-2"],
                                                                                               None, None)
    assert back["settled_s"] == 5.0, "the first poll at or after 43 s with the placement on the two pods serving"
    assert back["generations"] == [2, 3] and back["within_bound"]
    assert back["drains"]["engine-2"]["drained"] is True
    assert doc["requests"] == len(requests) and doc["failed"] == 1 and doc["failures"][0]["status"] == 502


def test_segments_and_before_during_after_split_at_decisions_and_settling() -> None:
    requests, samples, changes, placements = ramp_records()
    rows = ramp_timeline.summarize(requests, samples, changes, placements, end=60.0)["decisions"]
    cut = segments(requests, rows, end=60.0)
    assert [(s["segment"], s["from"], s["to"]) for s in cut] == [
        ("before", 0.0, 10.0), ("scale-out 2→3", 10.0, 20.0), ("3 pods", 20.0, 40.0),
        ("scale-in 3→2", 40.0, 45.0), ("2 pods, after", 45.0, 60.0)]
    assert [s["requests"] for s in cut] == [10, 10, 4, 1, 15]
    assert cut[0]["hit_ratio"] == pytest.approx(0.8) and cut[1]["locality"] == pytest.approx(0.5)
    assert cut[3]["failed"] == 1 and cut[3]["hit_ratio"] is None
    head = headline(requests, rows, end=60.0)
    assert head["before"] == {"requests": 10, "hit_ratio": pytest.approx(0.8), "locality": 1.0}
    during = [r for r in requests if 10 <= r.sent < 45 and r.ok]
    assert head["during"]["requests"] == 15
    assert head["during"]["hit_ratio"] == pytest.approx(sum(r.hit_tokens for r in during) / (100 * len(during)))
    assert head["after"]["hit_ratio"] == pytest.approx(0.9)


def test_without_a_decision_everything_is_before_and_an_unsettled_change_runs_to_the_end() -> None:
    requests, samples, changes, placements = ramp_records()
    assert headline(requests, [], 60.0)["during"] is None
    assert headline(requests, [], 60.0)["before"]["requests"] == len(requests)
    rows = ramp_timeline.summarize(requests, samples[:15], changes[:1], placements, end=60.0)["decisions"]
    assert rows[0]["settled_s"] is None and rows[0]["warm_s"] is None
    assert [s["segment"] for s in segments(requests, rows, 60.0)] == ["before", "scale-out 2→3"]
    assert headline(requests, rows, 60.0)["after"] is None


def test_timeline_rows_give_pods_by_state_load_per_pod_and_ratios_over_the_window() -> None:
    requests, samples, _, _ = ramp_records()
    rows = ramp_timeline.timeline(samples, requests, window=10.0)
    at = {row["t"]: row for row in rows}
    assert at[15]["pods"] == {"serving": ["engine-0", "engine-1"], "warming": ["engine-2"], "draining": []}
    assert at[42]["pods"]["draining"] == ["engine-2"]
    assert at[9]["offered_per_s"] == pytest.approx(9 / 9), "requests sent at 1..9 s over the first 9 s"
    assert at[30]["served_per_s"]["engine-2"] == pytest.approx(1 / 10)
    assert at[30]["pressure_sum"] == pytest.approx(1.5)
    assert at[59]["hit_ratio"] == pytest.approx(0.9) and at[59]["locality"] == 1.0


# ------------------------------------------------------------------------------------------ the demo's report


def ramp_result() -> RampResult:
    requests, samples, changes, placements = ramp_records()
    local = ScalingRules.from_values(LOCAL_AUTOSCALING)
    return RampResult(plan_ramp(local, 5.0), local, "sum(avg_over_time(kvshard_sidecar_pressure[10s]))", 0.0, 60.0,
                      "complete", requests, samples, changes, placements,
                      [{"t": 9.5, "value": 3.2, "pods": 2, "desired": 3}])


def test_the_demo_section_text_and_picture(tmp_path: Path) -> None:
    requests, samples, _, _ = ramp_records()
    doc = demo_ramp.document(ramp_result())
    json.dumps(doc)  # ramp.json
    assert doc["completed"] and len(doc["requests_log"]) == len(requests) and len(doc["timeline"]) == len(samples)
    section = demo_ramp.section(doc)
    assert "requests_log" not in section and len(section["timeline"]) <= demo_ramp.TIMELINE_ROWS + 1
    assert section["timeline"][-1]["t"] == samples[-1].t
    text = "\n".join(demo_ramp.render(json.loads(json.dumps(section))))
    assert "rise 1 → 2 → 3, fall 2 → 1" in text and "1 failed" in text and "outcome: complete" in text
    assert re.search(r"scale-out\s+10 s\s+2→3\s+3\.20\s+2\.0 s\s+10\.0 s\s+11\.0 s\s+10\.0 s\s+0\.333\s+"
                     r"0\.367 yes", text)
    assert re.search(r"2 pods, after\s+45 s\s+60 s\s+15\s+0\s+1\.00\s+90\.0%\s+100\.0%", text)
    assert "drain of engine-2: drained (1.5 s, 2 served while draining)" in text
    assert "hit ratio before / during / after the changes: 80.0% /" in text and "/ 90.0%;" in text
    assert demo_ramp.render({"outcome": "no ramp: reasons"})[1] == "  no ramp: reasons"
    png = demo_ramp.plot(doc, tmp_path / "ramp.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_demo_writes_the_ramp_files_and_a_ramp_that_cannot_run_is_a_note(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from kvshard_bench import demo
    from kvshard_bench import demo_report as report

    class Trace:
        def next(self) -> Any:
            raise AssertionError("the fake ramp sends nothing")

    settings = demo.DemoSettings(out=tmp_path)
    monkeypatch.setattr(demo_ramp, "run", lambda *args, **kwargs: ramp_result())
    section, files = demo._ramp(object(), cast(Any, Trace()), settings)
    assert files == [tmp_path / "ramp.json", tmp_path / "ramp.png"] and all(f.exists() for f in files)
    written = json.loads((tmp_path / "ramp.json").read_text())
    assert len(written["timeline"]) == len(ramp_records()[1]) and written["outcome"] == "complete"
    text = report.render(report.summarize([], [], [], {}, [], 1.0, ramp=section))
    assert "Autoscaling load ramp: 2–3 pods" in text and "scale-in 3→2" in text

    monkeypatch.setattr(demo_ramp, "run", lambda *args, **kwargs: "no ramp: the reason")
    assert demo._ramp(object(), cast(Any, Trace()), settings) == ({"outcome": "no ramp: the reason"}, [])

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("etcd went away")

    monkeypatch.setattr(demo_ramp, "run", broken)
    section, files = demo._ramp(object(), cast(Any, Trace()), settings)
    assert section == {"outcome": "the ramp failed: RuntimeError: etcd went away"} and files == []
    assert "the ramp failed: RuntimeError" in report.render(report.summarize([], [], [], {}, [], 1.0, ramp=section))
    assert demo._ramp(object(), None, settings)[0]["outcome"].startswith("no ramp")
