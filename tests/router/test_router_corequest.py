"""The router counts which clusters its requests ask for together and publishes them to a real etcd
(TLS): what the operator's traffic-learned colocation reads (lease expiry: tests/placement/
test_learned_etcd.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from router_helpers import FakePod, eventually, post, publish, running_router

from kvshard.placement_schema import Placement, WarmReport
from kvshard_local.testing_servers import EtcdServer

ITEMS = {**{f"a{i}": 0 for i in range(4)}, **{f"b{i}": 1 for i in range(4)}, "c0": 2}


@pytest.fixture
async def pod() -> AsyncIterator[FakePod]:
    a = FakePod("a")
    await a.start()
    yield a
    await a.stop()


async def test_requests_are_counted_and_published_with_a_lease(etcd_server: EtcdServer, pod: FakePod) -> None:
    shard = "default/corequest"
    await publish(etcd_server, shard, Placement(1, {0: ("a",), 1: ("a",), 2: ("a",)}, ITEMS, pods=("a",)),
                  {"a": WarmReport(1, (0, 1, 2), url=pod.url)})
    async with (running_router(etcd_server, shard, corequest_interval_seconds=3600, router_name="router-x")
                as (url, app), aiohttp.ClientSession() as session, etcd_server.store(timeout=3) as store):
        async def ready() -> bool:
            async with session.get(f"{url}/readyz") as resp:
                return resp.status == 200

        await eventually(ready, what="router ready")
        for user in range(6):  # three a's and one b each time: (0, 1) weighs 3/4 · 1/4; c0 once
            items = ["a0", "a1", "a2", "b0"] + (["c0"] if user == 0 else [])
            raw = json.dumps({"user_id": user, "candidates": items, "max_tokens": 2}).encode()
            assert (await post(session, f"{url}/v1/recommend", raw=raw))[0] == 200

        # the interval's publish, now rather than in an hour (the background task would do the same)
        assert app.publisher is not None and app.corequest is not None and app.corequest.requests == 6
        assert await app.publisher.publish_once() and app.corequest.requests == 0
        report = (await store.read_corequest("default", "corequest"))["router-x"]
        assert report.pairs[(0, 1)] == pytest.approx(5 * 0.75 * 0.25 + 0.6 * 0.2)
        assert report.pairs[(0, 2)] == pytest.approx(0.6 * 0.2) and report.rates[0] == pytest.approx(5 * 0.75 + 0.6)
