"""A pod gets traffic only once warm, and stops getting it when it withdraws (scale-out, scale-in)."""

from __future__ import annotations

from kvshard.placement_schema import Placement, WarmReport
from kvshard_router.policies import POLICIES, LoadTable, RouteRequest
from kvshard_router.state import RouterState

ITEMS = {f"i{n}": n % 3 for n in range(30)}


def state_with(reports: dict[str, WarmReport]) -> RouterState:
    state = RouterState()
    state.set_placement(Placement(generation=2, assignment={0: ("a",), 1: ("b",), 2: ("c",)},
                                  item_clusters=ITEMS, pods=("a", "b", "c")))
    state.set_reports(reports)
    for pod in reports:
        state.set_health(pod, True)
    return state


def chosen(state: RouterState) -> set[str]:
    policy = POLICIES["round-robin"]()
    assert state.snapshot is not None
    return {policy.choose(RouteRequest("u", ("i2", "i5")), state.snapshot, LoadTable()) or "" for _ in range(12)}


def test_a_new_pod_is_not_routed_to_until_it_reported_every_cluster_warm() -> None:
    state = state_with({"a": WarmReport(2, (0,), "http://a:1"), "b": WarmReport(2, (1,), "http://b:1"),
                        "c": WarmReport(2, (), "http://c:1", warming=1)})
    assert chosen(state) == {"a", "b"} and not state.routable("c")
    # not placed yet: nothing assigned, nothing warming — still not warm
    state.set_reports({**state.reports, "c": WarmReport(2, (), "http://c:1")})
    assert chosen(state) == {"a", "b"}
    state.set_reports({**state.reports, "c": WarmReport(2, (2,), "http://c:1")})
    assert chosen(state) == {"a", "b", "c"}
    # a later rebalance makes it warm something new: it stays in routing meanwhile
    state.set_reports({**state.reports, "c": WarmReport(3, (2,), "http://c:1", warming=1)})
    assert state.routable("c")


def test_a_pod_that_withdrew_its_report_is_never_chosen_again() -> None:
    state = state_with({p: WarmReport(2, (i,), f"http://{p}:1") for i, p in enumerate("abc")})
    assert chosen(state) == {"a", "b", "c"}
    state.set_reports({p: r for p, r in state.reports.items() if p != "c"})  # c drains
    assert chosen(state) == {"a", "b"}
    state.set_reports({**state.reports, "c": WarmReport(2, (), "http://c:1", warming=1)})  # c back, cold
    state.set_health("c", True)
    assert chosen(state) == {"a", "b"}


def test_cold_pods_serve_when_no_pod_has_joined_yet() -> None:
    state = state_with({p: WarmReport(2, (), f"http://{p}:1", warming=1) for p in "abc"})
    assert chosen(state) == {"a", "b", "c"}
    state.set_reports({**state.reports, "a": WarmReport(2, (0,), "http://a:1")})
    assert chosen(state) == {"a"}
