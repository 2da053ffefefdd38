"""The router service: request parsing, following placement in a real etcd, health checks, forwarding
and failover over real HTTP to stand-in pods (the real sidecars are in ``test_router_e2e.py``)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from router_helpers import FakePod, eventually, metric, post, publish, running_router

from kvshard.log_filters import QuietRepeats
from kvshard.placement_schema import Placement, WarmReport
from kvshard.request_errors import RequestError
from kvshard_local.testing_servers import EtcdServer
from kvshard_router.follower import PlacementFollower
from kvshard_router.policies import RouteRequest
from kvshard_router.state import RouterState
from kvshard_router.validation import parse_recommend

ITEMS = {**{f"a{i}": 0 for i in range(8)}, **{f"b{i}": 1 for i in range(8)}}
A_ITEMS = ["a0", "a1", "a2", "a3"]
B_ITEMS = ["b0", "b1", "b2", "b3"]


def placement(generation: int, assignment: dict[int, tuple[str, ...]], items: dict[str, int] = ITEMS) -> Placement:
    pods = tuple(sorted({p for holders in assignment.values() for p in holders}))
    return Placement(generation=generation, assignment=assignment, item_clusters=items, pods=pods)


def reports(**pods: tuple[tuple[int, ...], str]) -> dict[str, WarmReport]:
    return {pod: WarmReport(1, clusters, url=url) for pod, (clusters, url) in pods.items()}


# ------------------------------------------------------------------------------------------ parsing


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b"{not json", "body"),
        (b"\xff\xfe", "body"),
        (b"[" * 100_000, "body"),
        (b'["user", "items"]', "body"),
        (b'{"candidates": ["1"]}', "user_id"),
        (b'{"user_id": true, "candidates": ["1"]}', "user_id"),
        (b'{"user_id": "", "candidates": ["1"]}', "user_id"),
        (b'{"user_id": "1"}', "candidates"),
        (b'{"user_id": "1", "candidates": "1,2"}', "candidates"),
        (b'{"user_id": "1", "candidates": ["1", {"id": 2}]}', "candidates[1]"),
        (b'{"user_id": "1", "candidates": ["1"], "history": "2"}', "history"),
        (b'{"user_id": "1", "candidates": ["1"], "history": [null]}', "history[0]"),
    ],
)
def test_a_malformed_body_is_a_400_naming_the_field(raw: bytes, field: str) -> None:
    with pytest.raises(RequestError) as caught:
        parse_recommend(raw)
    assert (caught.value.status, caught.value.field) == (400, field)
    assert caught.value.body()["error"]["message"]


def test_a_body_becomes_the_route_request_with_ids_as_strings() -> None:
    raw = json.dumps({"user_id": 7, "candidates": ["50", 172], "history": [1, "2"], "max_tokens": 3}).encode()
    assert parse_recommend(raw, history_tokens=40) == RouteRequest(
        user="7", items=("50", "172"), history=("1", "2"), history_tokens=40)


# ------------------------------------------------------------------------------------------ state


def test_only_pods_with_a_url_and_a_passed_check_are_routable() -> None:
    state = RouterState()
    state.set_placement(placement(1, {0: ("a",), 1: ("b",)}))
    state.set_reports(reports(a=((0,), "http://127.0.0.1:1"), b=((1,), "not a url"), gone=((0,), "http://x:2")))
    assert state.snapshot is not None and not state.snapshot.healthy.any()  # unverified until checked
    assert state.urls() == {"a": "http://127.0.0.1:1"}  # b's URL is unusable, "gone" left the placement
    state.set_health("a", True)
    state.set_health("b", True)
    assert state.snapshot.healthy.tolist() == [True, False]
    assert state.snapshot.pods == ("a", "b")
    state.set_health("a", False, "refused")
    assert not state.snapshot.healthy.any()


def test_a_pod_that_moves_to_a_new_url_is_unverified_until_checked_there() -> None:
    state = RouterState()
    state.set_placement(placement(1, {0: ("a",), 1: ("a",)}))
    state.set_reports(reports(a=((0, 1), "http://127.0.0.1:1")))
    state.set_health("a", True)
    assert state.routable("a")
    state.set_reports(reports(a=((0, 1), "http://127.0.0.1:2")))  # the pod restarted elsewhere
    assert not state.routable("a") and state.snapshot is not None and not state.snapshot.healthy.any()


# ------------------------------------------------------------------------------------------ follower


async def _follower(etcd: EtcdServer, name: str) -> tuple[PlacementFollower, RouterState]:
    state = RouterState()
    follower = PlacementFollower(etcd.store(timeout=1.0), "default", name, state, max_backoff=1.0)
    follower.start()
    return follower, state


async def test_the_follower_builds_snapshots_from_etcd_and_reuses_the_item_index(etcd: EtcdServer) -> None:
    follower, state = await _follower(etcd, "follow")
    try:
        await publish(etcd, "default/follow", placement(1, {0: ("a",), 1: ("b",)}),
                      reports(a=((0,), "http://127.0.0.1:1"), b=((1,), "")))
        await eventually(lambda: state.generation == 1 and set(state.reports) == {"a", "b"}, what="generation 1")
        first = state.snapshot
        assert first is not None and first.holders_of(0) == ("a",) and first.holders_of(1) == ("b",)
        assert state.urls() == {"a": "http://127.0.0.1:1"} and state.updated_at is not None

        # Only the assignment changes (a replica of cluster 1 on a): same item index, new holders once warm.
        await publish(etcd, "default/follow", placement(2, {0: ("a",), 1: ("b", "a")}),
                      reports(a=((0, 1), "http://127.0.0.1:1")))
        await eventually(lambda: state.generation == 2 and 1 in state.warm("a"), what="generation 2, a warm")
        assert state.snapshot is not None and state.snapshot.items is first.items
        assert state.snapshot.holders_of(1) == ("b", "a")

        # New items: the index is rebuilt.
        await publish(etcd, "default/follow", placement(3, {0: ("a",), 1: ("b",)}, {**ITEMS, "new": 1}),
                      {})
        await eventually(lambda: state.generation == 3, what="generation 3")
        assert state.snapshot is not None and state.snapshot.items is not first.items
        assert state.snapshot.clusters_of(["new"]).tolist() == [1]
    finally:
        await follower.stop()


async def test_the_router_keeps_its_snapshot_while_etcd_is_down_and_follows_again_after(etcd: EtcdServer) -> None:
    follower, state = await _follower(etcd, "outage")
    try:
        await publish(etcd, "default/outage", placement(1, {0: ("a",), 1: ("b",)}),
                      reports(a=((0,), "http://127.0.0.1:1")))
        await eventually(lambda: state.generation == 1 and "a" in state.reports, what="generation 1")
        snapshot = state.snapshot
        etcd.stop()
        await asyncio.sleep(1.5)
        assert state.snapshot is snapshot and state.generation == 1  # still routing by the last placement
        etcd.start()
        await publish(etcd, "default/outage", placement(2, {0: ("b",), 1: ("b",)}), {})
        await eventually(lambda: state.generation == 2, timeout=20, what="generation 2 after the outage")
    finally:
        await follower.stop()


async def test_a_router_started_while_etcd_is_down_logs_once_and_picks_up_placement_later(
    etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    etcd.stop()
    caplog.set_level(logging.WARNING, logger="kvshard_router.follower")
    follower, state = await _follower(etcd, "late")
    try:
        await eventually(lambda: not follower.connected, what="the follower noticing etcd is down")
        await asyncio.sleep(2.5)  # several retries
        warnings = [r for r in caplog.records if r.name == "kvshard_router.follower"]
        assert 1 <= len(warnings) <= 2, [r.getMessage() for r in warnings]  # once per watch, not per retry
        assert state.snapshot is None
        etcd.start()
        await publish(etcd, "default/late", placement(1, {0: ("a",), 1: ("b",)}), {})
        await eventually(lambda: state.generation == 1 and follower.connected, timeout=20, what="generation 1")
    finally:
        await follower.stop()


def test_repeated_reconnect_warnings_are_kept_to_one_a_minute() -> None:
    now = [0.0]
    quiet = QuietRepeats(interval=60, clock=lambda: now[0])
    record = logging.LogRecord("etcd3aio.watch", logging.WARNING, __file__, 1, "reconnecting", None, None)
    passed = []
    for t in (0, 1, 5, 59, 61, 62, 200):
        now[0] = t
        passed.append(quiet.filter(record))
    assert passed == [True, False, False, False, True, False, True]


# ------------------------------------------------------------------------------------------ router over fake pods


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


async def _ready(session: aiohttp.ClientSession, url: str, healthy: int = 2) -> None:
    async def check() -> bool:
        async with session.get(f"{url}/readyz") as resp:
            return resp.status == 200 and len((await resp.json())["healthy_pods"]) == healthy

    await eventually(check, what=f"router ready with {healthy} healthy pods")


async def _metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/metrics") as resp:
        return await resp.text()


async def _publish_two(etcd_server: EtcdServer, shard: str, a: FakePod, b: FakePod) -> None:
    await publish(etcd_server, shard, placement(1, {0: ("a",), 1: ("b",)}),
                  reports(a=((0,), a.url), b=((1,), b.url)))


async def test_requests_go_to_the_pod_holding_their_clusters(
    etcd_server: EtcdServer, pods: tuple[FakePod, FakePod], session: aiohttp.ClientSession
) -> None:
    a, b = pods
    shard = "default/holding"
    await _publish_two(etcd_server, shard, a, b)
    async with running_router(etcd_server, shard) as (url, _):
        await _ready(session, url)
        for user in range(3):
            for items, pod in ((A_ITEMS, "a"), (B_ITEMS[1:] + ["a0"], "b")):
                raw = json.dumps({"user_id": user, "candidates": items, "max_tokens": 2}).encode()
                status, headers, body = await post(session, f"{url}/v1/recommend", raw=raw)
                assert (status, body, headers["X-Kvshard-Pod"]) == (200, {"pod": pod}, pod)
                assert headers["X-Kvshard-Generation"] == "1"
                assert (a if pod == "a" else b).received[-1] == raw  # forwarded byte for byte

        text = await _metrics(session, url)
        assert metric(text, "kvshard_router_requests_total", cacheshard=shard, pod="a", code="2xx") == 3
        assert metric(text, "kvshard_router_requests_total", cacheshard=shard, pod="b", code="2xx") == 3
        assert metric(text, "kvshard_router_decision_seconds_count", cacheshard=shard) == 6
        # b's requests hold a0 too; only a has cluster 0 warm
        assert metric(text, "kvshard_router_cluster_requests_total", cacheshard=shard, cluster="0") == 6
        assert metric(text, "kvshard_router_cluster_requests_total", cacheshard=shard, cluster="1") == 3
        assert metric(text, "kvshard_router_cluster_hits_total", cacheshard=shard, cluster="0") == 3
        assert metric(text, "kvshard_router_cluster_hits_total", cacheshard=shard, cluster="1") == 3
        assert metric(text, "kvshard_router_pod_healthy", cacheshard=shard, pod="a") == 1
        assert metric(text, "kvshard_router_placement_generation", cacheshard=shard) == 1
        assert metric(text, "kvshard_router_upstream_seconds_count", cacheshard=shard, pod="a") == 3
        assert metric(text, "kvshard_router_inflight_requests", cacheshard=shard, pod="a") == 0
        # every series names the shard, so routers of several shards can share one Prometheus
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
        assert {s.labels.get("cacheshard") for s in samples} == {shard}

        async with session.get(f"{url}/v1/placement") as resp:
            view = await resp.json()
        assert view["generation"] == 1 and view["policy"] == "affinity" and view["items"] == len(ITEMS)
        assert view["pods"][0] == {"name": "a", "url": a.url, "healthy": True, "reason": None, "inflight": 0.0,
                                   "warm": [0], "assigned": [0]}


async def test_bad_requests_get_a_json_4xx_and_the_router_keeps_serving(
    etcd_server: EtcdServer, pods: tuple[FakePod, FakePod], session: aiohttp.ClientSession
) -> None:
    a, b = pods
    shard = "default/bad"
    await _publish_two(etcd_server, shard, a, b)
    async with running_router(etcd_server, shard) as (url, _):
        await _ready(session, url)
        cases: list[tuple[bytes, str, int, str]] = [
            (b"{not json", "application/json", 400, "body"),
            (b'{"candidates": ["a0"]}', "application/json", 400, "user_id"),
            (b'{"user_id": "1", "candidates": "a0"}', "application/json", 400, "candidates"),
            (b'{"user_id": "1", "candidates": ["a0"]}', "text/plain", 415, "body"),
            (b"x" * (2 << 20), "application/json", 413, "body"),
        ]
        for raw, content_type, status, field in cases:
            got, _, body = await post(session, f"{url}/v1/recommend", raw=raw, content_type=content_type)
            assert (got, body["error"]["field"]) == (status, field), body
        async with session.get(f"{url}/v1/nothing-here") as resp:
            assert resp.status == 404 and (await resp.json())["error"]["field"] == "request"
        assert a.received == [] and b.received == []
        assert (await post(session, f"{url}/v1/recommend", {"user_id": "1", "candidates": A_ITEMS}))[0] == 200
        text = await _metrics(session, url)
        assert metric(text, "kvshard_router_requests_total", cacheshard=shard, pod="none", code="4xx") == len(cases)


async def test_a_refused_connection_is_retried_once_on_the_other_pod(
    etcd_server: EtcdServer, pods: tuple[FakePod, FakePod], session: aiohttp.ClientSession
) -> None:
    a, b = pods
    shard = "default/refused"
    await _publish_two(etcd_server, shard, a, b)
    # Probes are far apart: the passive check (the failed forward) must be what takes a out.
    async with running_router(etcd_server, shard, health_interval_seconds=60) as (url, router):
        await _ready(session, url)
        await a.stop()
        status, headers, body = await post(session, f"{url}/v1/recommend", {"user_id": "1", "candidates": A_ITEMS})
        assert (status, headers["X-Kvshard-Pod"], body) == (200, "b", {"pod": "b"})
        assert not router.state.routable("a")
        text = await _metrics(session, url)
        assert metric(text, "kvshard_router_retries_total", cacheshard=shard) == 1
        assert metric(text, "kvshard_router_pod_healthy", cacheshard=shard, pod="a") == 0
        # b is cold for cluster 0
        assert metric(text, "kvshard_router_cluster_hits_total", cacheshard=shard, cluster="0") is None
        status, headers, _ = await post(session, f"{url}/v1/recommend", {"user_id": "2", "candidates": A_ITEMS})
        assert (status, headers["X-Kvshard-Pod"]) == (200, "b")
        # a is no longer tried
        assert metric(await _metrics(session, url), "kvshard_router_retries_total", cacheshard=shard) == 1


async def test_a_503_is_retried_elsewhere_but_other_pod_errors_pass_through(
    etcd_server: EtcdServer, pods: tuple[FakePod, FakePod], session: aiohttp.ClientSession
) -> None:
    a, b = pods
    shard = "default/passthrough"
    await _publish_two(etcd_server, shard, a, b)
    async with running_router(etcd_server, shard) as (url, _):
        await _ready(session, url)
        request = {"user_id": "1", "candidates": A_ITEMS}
        for code in (422, 429, 500):
            a.status = code
            status, headers, body = await post(session, f"{url}/v1/recommend", request)
            assert (status, headers["X-Kvshard-Pod"]) == (code, "a")
            assert body["error"]["message"] == "a says no"
        assert metric(await _metrics(session, url), "kvshard_router_retries_total", cacheshard=shard) == 0

        a.status = 503
        status, headers, body = await post(session, f"{url}/v1/recommend", request)
        assert (status, headers["X-Kvshard-Pod"], body) == (200, "b", {"pod": "b"})
        assert metric(await _metrics(session, url), "kvshard_router_retries_total", cacheshard=shard) == 1


async def test_no_healthy_pod_is_503_and_two_failures_are_502(
    etcd_server: EtcdServer, pods: tuple[FakePod, FakePod], session: aiohttp.ClientSession
) -> None:
    a, b = pods
    await _publish_two(etcd_server, "default/failing", a, b)
    async with running_router(etcd_server, "default/failing", health_interval_seconds=60) as (url, _):
        await _ready(session, url)
        await a.stop()
        b.status = 503
        status, headers, body = await post(session, f"{url}/v1/recommend", {"user_id": "1", "candidates": A_ITEMS})
        assert status == 502 and headers["Retry-After"]
        message = body["error"]["message"]
        assert "pod a could not be reached" in message and "pod b answered 503" in message

        status, headers, body = await post(session, f"{url}/v1/recommend", {"user_id": "1", "candidates": B_ITEMS})
        assert (status, body["error"]["field"]) == (503, "pods") and headers["Retry-After"] == "1"
        async with session.get(f"{url}/readyz") as resp:
            assert resp.status == 503 and "none of the 2 pods" in (await resp.json())["error"]["message"]


async def test_a_503_with_no_other_pod_is_passed_through(
    etcd_server: EtcdServer, pods: tuple[FakePod, FakePod], session: aiohttp.ClientSession
) -> None:
    a, _ = pods
    await publish(etcd_server, "default/single", placement(1, {0: ("a",), 1: ("a",)}),
                  reports(a=((0, 1), a.url)))
    async with running_router(etcd_server, "default/single", health_interval_seconds=60) as (url, _):
        await _ready(session, url, healthy=1)
        a.status = 503
        status, headers, _ = await post(session, f"{url}/v1/recommend", {"user_id": "1", "candidates": A_ITEMS})
        assert (status, headers["X-Kvshard-Pod"], headers["Retry-After"]) == (503, "a", "7")


async def test_health_checks_take_a_pod_out_and_bring_it_back(
    etcd_server: EtcdServer, pods: tuple[FakePod, FakePod], session: aiohttp.ClientSession
) -> None:
    a, b = pods
    shard = "default/health"
    await _publish_two(etcd_server, shard, a, b)
    async with running_router(etcd_server, shard) as (url, router):
        await _ready(session, url)
        a.ready = False
        await eventually(lambda: not router.state.routable("a"), timeout=3, what="a marked unhealthy")
        status, headers, _ = await post(session, f"{url}/v1/recommend", {"user_id": "1", "candidates": A_ITEMS})
        assert (status, headers["X-Kvshard-Pod"]) == (200, "b")
        async with session.get(f"{url}/v1/placement") as resp:
            assert (await resp.json())["pods"][0]["reason"] == "/readyz answered 503"
        a.ready = True
        await eventually(lambda: router.state.routable("a"), timeout=3, what="a healthy again")
        # a's other items: b computed A_ITEMS meanwhile, and the router remembers it holds them too
        status, headers, _ = await post(session, f"{url}/v1/recommend", {"user_id": "1", "candidates": ["a4", "a5"]})
        assert (status, headers["X-Kvshard-Pod"]) == (200, "a")
        assert metric(await _metrics(session, url), "kvshard_router_retries_total", cacheshard=shard) == 0


async def test_a_pod_without_a_url_is_never_chosen(
    etcd_server: EtcdServer, pods: tuple[FakePod, FakePod], session: aiohttp.ClientSession
) -> None:
    a, b = pods
    await publish(etcd_server, "default/nourl", placement(1, {0: ("a",), 1: ("b",)}),
                  reports(a=((0,), ""), b=((1,), b.url)))
    async with running_router(etcd_server, "default/nourl") as (url, _):
        await _ready(session, url, healthy=1)
        status, headers, _ = await post(session, f"{url}/v1/recommend", {"user_id": "1", "candidates": A_ITEMS})
        assert (status, headers["X-Kvshard-Pod"]) == (200, "b")
        async with session.get(f"{url}/v1/placement") as resp:
            view = await resp.json()
        assert view["pods"][0]["healthy"] is False and view["pods"][0]["reason"] == "no usable URL in its warm report"


async def test_before_any_placement_the_router_is_not_ready(
    etcd_server: EtcdServer, session: aiohttp.ClientSession
) -> None:
    shard = "default/empty"
    async with running_router(etcd_server, shard) as (url, _):
        async with session.get(f"{url}/healthz") as resp:
            assert resp.status == 200
        async with session.get(f"{url}/readyz") as resp:
            assert resp.status == 503 and (await resp.json())["error"]["field"] == "placement"
        status, headers, body = await post(session, f"{url}/v1/recommend", {"user_id": "1", "candidates": A_ITEMS})
        assert (status, body["error"]["field"], headers["Retry-After"]) == (503, "placement", "1")
        assert metric(await _metrics(session, url), "kvshard_router_placement_generation", cacheshard=shard) == 0
