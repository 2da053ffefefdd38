"""Conditions behave as a list-map keyed by type; transition time moves only with status."""

from __future__ import annotations

import pytest

from kvshard_operator import conditions as cond


def test_new_condition_is_appended_with_its_transition_time() -> None:
    out = cond.set_condition([], cond.READY, cond.TRUE, "Published", "ok", at="2026-01-01T00:00:00Z",
                             observed_generation=3)
    assert out == [{"type": "Ready", "status": "True", "reason": "Published", "message": "ok",
                    "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 3}]


def test_same_status_keeps_the_transition_time_but_updates_reason_and_message() -> None:
    first = cond.set_condition([], cond.READY, cond.FALSE, "NoPods", "none", at="2026-01-01T00:00:00Z")
    second = cond.set_condition(first, cond.READY, cond.FALSE, "CatalogNotFound", "gone", at="2026-02-02T00:00:00Z")
    assert second[0]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert (second[0]["reason"], second[0]["message"]) == ("CatalogNotFound", "gone")


def test_status_change_moves_the_transition_time() -> None:
    first = cond.set_condition([], cond.READY, cond.FALSE, "NoPods", at="2026-01-01T00:00:00Z")
    second = cond.set_condition(first, cond.READY, cond.TRUE, "Published", at="2026-02-02T00:00:00Z")
    assert second[0]["lastTransitionTime"] == "2026-02-02T00:00:00Z"


def test_other_conditions_are_left_untouched_and_in_order() -> None:
    start = cond.ensure_all([], at="2026-01-01T00:00:00Z")
    out = cond.set_condition(start, cond.PLACED, cond.TRUE, "Placed", at="2026-02-02T00:00:00Z")
    assert [c["type"] for c in out] == list(cond.TYPES)
    assert [c for c in out if c["type"] != "Placed"] == [c for c in start if c["type"] != "Placed"]
    assert cond.is_true(out, cond.PLACED) and not cond.is_true(out, cond.READY)


def test_ensure_all_writes_unknown_on_first_sight_without_overwriting() -> None:
    ready = cond.set_condition([], cond.READY, cond.TRUE, "Published")
    out = cond.ensure_all(ready)
    assert cond.get(out, cond.READY) == ready[0]
    assert cond.get(out, cond.DEGRADED)["status"] == cond.UNKNOWN  # type: ignore[index]


@pytest.mark.parametrize(("status", "reason"), [("Yes", "Fine"), ("True", "not camel"), ("True", "")])
def test_bad_status_or_reason_is_refused(status: str, reason: str) -> None:
    with pytest.raises(ValueError):
        cond.set_condition([], cond.READY, status, reason)


def test_a_timer_merges_only_its_own_condition_into_the_freshest_status() -> None:
    """The rebalance timer's view may predate the placement just published: its stale Ready must not
    overwrite the Ready the change handler wrote meanwhile."""
    stale = cond.ensure_all([], observed_generation=1)  # Ready Unknown/Pending, as the timer read it
    fields = {"conditions": cond.set_condition(stale, cond.REBALANCING, cond.FALSE, "NoTraffic", "no requests"),
              "lastRebalanceTime": "2026-12-01T00:00:00Z"}
    fresh = {"status": {"placementGeneration": 1, "conditions": cond.set_condition(
        cond.ensure_all([], observed_generation=1), cond.READY, cond.TRUE, "Published", "generation 1")}}
    cond.merge_status(fresh, fields, (cond.REBALANCING,), observed_generation=1)
    status = fresh["status"]
    assert cond.get(status["conditions"], cond.READY)["status"] == cond.TRUE
    assert cond.get(status["conditions"], cond.REBALANCING)["reason"] == "NoTraffic"
    assert (status["lastRebalanceTime"], status["placementGeneration"]) == ("2026-12-01T00:00:00Z", 1)
