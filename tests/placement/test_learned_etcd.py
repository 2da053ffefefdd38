"""Traffic-learned placement end to end through a real etcd (TLS by default): routers publish their
co-request sketches under leases, the operator reads them and publishes a colocated generation."""

from __future__ import annotations

import asyncio
import collections
import random
from collections.abc import AsyncIterator

import pytest

from kvshard import etcd_keys, etcd_store
from kvshard import placement_schema as ps
from kvshard.corequest_schema import CoRequestFormatError, CoRequestReport
from kvshard_local.testing_servers import EtcdServer
from kvshard_operator.learned import LearnedSettings, LearnedState, learn_shard
from kvshard_router.corequest import CoRequestSketch
from kvshard_router.corequest_publisher import CoRequestPublisher

PODS, PER_POD = 6, 4


@pytest.fixture
async def store(etcd_server: EtcdServer) -> AsyncIterator[etcd_store.EtcdStore]:
    async with etcd_server.store(timeout=3) as s:
        yield s


def scattered() -> tuple[ps.Placement, list[list[int]]]:
    """Clusters placed round-robin and requests that each ask for one hidden topic of ``PER_POD``
    clusters, topics the placement scattered over several pods (all topics equally popular)."""
    clusters = PODS * PER_POD
    assignment = {c: (f"pod-{c % PODS}",) for c in range(clusters)}
    order = list(range(clusters))
    random.Random(1).shuffle(order)
    topics = [order[i:i + PER_POD] for i in range(0, clusters, PER_POD)]
    rng = random.Random(2)
    trace = [[c for c in rng.choice(topics) for _ in range(rng.randint(1, 3))] for _ in range(3000)]
    items = {f"item-{c}": c for c in range(clusters)}
    return ps.Placement(1, assignment, items, pods=tuple(f"pod-{j}" for j in range(PODS))), trace


def one_pod_share(assignment: dict[int, tuple[str, ...]] | ps.Placement, trace: list[list[int]]) -> float:
    a = assignment.assignment if isinstance(assignment, ps.Placement) else assignment
    return sum(len({a[c][0] for c in r}) == 1 for r in trace) / len(trace)


async def test_routers_publish_and_the_operator_colocates_within_the_budget(
    store: etcd_store.EtcdStore, etcd_server: EtcdServer
) -> None:
    shard = ("default", "learned-a")
    placement, trace = scattered()
    await store.publish(*shard, placement, expected=0)
    state, settings = LearnedState(), LearnedSettings(max_moves=8, max_load=1.25)
    assert (await learn_shard(store, *shard, state, settings)).reason == "NoReports"

    for k, router in enumerate(("router-a", "router-b")):  # each router sees half of the traffic
        sketch = CoRequestSketch(capacity=512)
        for request in trace[k::2]:
            sketch.add(request)
        publisher = CoRequestPublisher(store, *shard, router, sketch, interval_seconds=10, top=200)
        assert await publisher.publish_once()
        assert sketch.requests == 0 and not await publisher.publish_once()  # nothing new to say
    assert set(await store.read_corequest(*shard)) == {"router-a", "router-b"}

    before = one_pod_share(placement, trace)
    outcomes = []
    for _ in range(6):
        outcome = await learn_shard(store, *shard, state, settings)
        outcomes.append(outcome)
        assert len(outcome.moved) <= settings.max_moves
    assert outcomes[0].reason == "Colocated" and outcomes[0].published == 2
    current = await store.read_current(*shard)
    assert current is not None and current.generation == 1 + sum(o.reason == "Colocated" for o in outcomes)
    assert current.item_clusters == placement.item_clusters  # items kept
    per_pod = collections.Counter(h[0] for h in current.assignment.values())
    assert per_pod == collections.Counter(h[0] for h in placement.assignment.values())  # capacity kept
    assert one_pod_share(current, trace) > 0.8 > 0.2 > before
    assert outcomes[-1].reason == "Unchanged"


async def test_reports_expire_with_their_lease_and_garbage_is_skipped(store: etcd_store.EtcdStore) -> None:
    shard = ("default", "learned-b")
    placement, trace = scattered()
    await store.publish(*shard, placement, expected=0)
    sketch = CoRequestSketch()
    for request in trace[:100]:
        sketch.add(request)
    await store.put_corequest(*shard, sketch.take("router-a", 100, 0.0), ttl_seconds=1)
    await store._kv.put(etcd_keys.corequest_key(*shard, "router-bad"), b"{not json")
    reports = await store.read_corequest(*shard)
    assert set(reports) == {"router-a"} and reports["router-a"].requests == 100
    for _ in range(40):  # etcd expires leases within about a second of their TTL
        if "router-a" not in await store.read_corequest(*shard):
            break
        await asyncio.sleep(0.25)
    assert await store.read_corequest(*shard) == {}
    outcome = await learn_shard(store, *shard, LearnedState(), LearnedSettings())
    assert outcome.reason == "NoReports" and (await store.read_current(*shard)).generation == 1  # type: ignore[union-attr]


def test_a_report_round_trips_and_refuses_what_it_cannot_read() -> None:
    report = CoRequestReport("r", {(1, 2): 0.25, (0, 5): 1.5}, {1: 2.0, 2: 0.5}, 7, 12.5)
    assert CoRequestReport.decode(report.encode()) == report
    for bad in (b"[]", b'{"schema": 2}', b'{"schema": 1, "pairs": [[1]]}'):
        with pytest.raises(CoRequestFormatError):
            CoRequestReport.decode(bad)
