"""One item lookup per request, through either front end.

Looking the candidates up in the 10 M-item index is the dearest part of a decision; the router once did
it four times per request (the choice, the chosen pod's cached tokens, the per-cluster metrics, the
affinity policy's record of what the pod now holds). These tests count the real
:meth:`ItemIndex.probe` calls of whole requests — HTTP (forwarded to real loopback pods, a fail-over
included) and ext_proc — and :func:`decide`'s reuse of a lookup across snapshots.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence

import aiohttp
import pytest
from router_helpers import FakePod
from test_epp import A_BODY, Envoy, picker_for, respond, world

from kvshard.placement_schema import Placement, WarmReport
from kvshard_local.testing_servers import free_port
from kvshard_router.decision import decide
from kvshard_router.epp import destination, start_grpc
from kvshard_router.policies import AffinityPolicy, LoadTable, RouteRequest
from kvshard_router.service import Router
from kvshard_router.snapshot import ItemIndex, Probe
from kvshard_router.state import RouterState

ITEMS = {**{f"a{i}": 0 for i in range(8)}, **{f"b{i}": 1 for i in range(8)}}


@pytest.fixture
def lookups(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every real probe of an item index from now on (``ItemIndex.probe``: a ``lookup``, or the affinity
    policy's compiled decision looking the items up itself), by the number of ids looked up."""
    calls: list[int] = []
    real = ItemIndex.probe

    def counted(self: ItemIndex, ids: Sequence[str]) -> Probe:
        calls.append(len(ids))
        return real(self, ids)

    monkeypatch.setattr(ItemIndex, "probe", counted)
    yield calls


def http_router(state: RouterState, session: aiohttp.ClientSession) -> Router:
    picker = picker_for(state)
    return Router(picker, session, request_timeout=10, connect_timeout=2)


async def test_an_http_request_looks_its_items_up_once_even_with_a_fail_over(
    pods: tuple[FakePod, FakePod], lookups: list[int],
) -> None:
    a, b = pods
    state = RouterState()
    state.set_placement(Placement(1, {0: ("a",), 1: ("b",)}, ITEMS, pods=("a", "b")))
    state.set_reports({"a": WarmReport(1, (0,), a.url), "b": WarmReport(1, (1,), b.url)})
    state.set_health("a", True)
    state.set_health("b", True)
    async with aiohttp.ClientSession() as session:
        router = http_router(state, session)
        raw = json.dumps({"user_id": "u", "candidates": ["a0", "a1", "b0"]}).encode()
        lookups.clear()
        response = await router.recommend(raw, "application/json")
        assert (response.status, response.headers["X-Kvshard-Pod"]) == (200, "a")
        assert lookups == [3]  # choice, cached tokens, metrics, co-requests and the served record share it

        a.ready, a.status = False, 503  # a answers 503: the router retries on b
        lookups.clear()
        response = await router.recommend(raw, "application/json")
        assert (response.status, response.headers["X-Kvshard-Pod"]) == (200, "b")
        assert lookups == [3]


async def test_an_ext_proc_request_looks_its_items_up_once(lookups: list[int]) -> None:
    picker = picker_for(world())
    port = free_port()
    server = await start_grpc(picker, "127.0.0.1", port)
    envoy = Envoy(port)
    try:
        lookups.clear()
        call, answers = await envoy.request(A_BODY)
        await respond(call, 200)  # the 2xx teaches the affinity policy what the pod holds now
        await call.done_writing()
        assert destination(answers) is not None
        assert lookups == [4]
    finally:
        await envoy.close()
        await server.stop(grace=None)


def test_a_lookup_is_reused_while_the_item_index_is_the_same_and_redone_when_it_changed(lookups: list[int]) -> None:
    state = world()
    snapshot = state.snapshot
    assert snapshot is not None
    request = RouteRequest("u", ("a0", "b1", "zz"))
    policy = AffinityPolicy()
    lookup = decide(policy, request, snapshot, LoadTable()).lookup
    assert lookup.clusters.tolist() == [0, 1, -1] and lookup.distinct_clusters() == [0, 1] and lookups == [3]
    lookups.clear()
    degraded = snapshot.with_health({"a": False})  # health, warm and assignment changes keep the index
    assert decide(policy, request, degraded, LoadTable(), lookup).lookup is lookup
    assert lookups == []
    state.set_placement(Placement(2, {0: ("a", "c"), 1: ("b",)}, {**ITEMS, "zz": 1}, pods=("a", "b", "c")))
    assert state.snapshot is not None and not lookup.valid_for(state.snapshot)  # items re-mapped
    fresh = decide(policy, request, state.snapshot, LoadTable(), lookup)
    assert fresh.lookup.clusters.tolist() == [0, 1, 1] and lookups == [3]
