"""The warm daemon's loop (:func:`warmth.follow`): the Warm decision follows each change of the warm
reports at once, the assignment is read again only when the generation moved, and the timer
(:func:`warmth.due`) writes only a decision for the generation status names."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvshard import etcd_store
from kvshard import placement_schema as ps
from kvshard_operator import warmth


def placement(generation: int) -> ps.Placement:
    return ps.Placement(generation, {0: ("engine-0",), 1: ("engine-1",)}, {}, pods=("engine-0", "engine-1"))


def report(generation: int, *clusters: int) -> ps.WarmReport:
    return ps.WarmReport(generation, clusters, "http://pod", 0)


class FakeStore:
    """Warm reports fed by the test; the assignment of generation ``current``; counts its reads."""

    def __init__(self) -> None:
        self.events: asyncio.Queue[dict[str, ps.WarmReport] | Exception] = asyncio.Queue()
        self.current = 1
        self.assignment_reads = 0

    async def watch_warm(self, namespace: str, name: str) -> AsyncIterator[dict[str, ps.WarmReport]]:
        while True:
            event = await self.events.get()
            if isinstance(event, Exception):
                raise event
            yield event

    async def read_assignment(self, namespace: str, name: str) -> ps.Placement:
        self.assignment_reads += 1
        return placement(self.current)


async def settled(watch: warmth.WarmWatch, what: str) -> warmth.Warmth:
    for _ in range(200):
        if watch.warmth is not None and what in watch.warmth.message:
            return watch.warmth
        await asyncio.sleep(0.005)
    raise AssertionError(f"no decision with {what!r}: {watch.warmth}")


def test_the_decision_follows_each_report_and_reads_the_assignment_once_per_generation() -> None:
    async def run() -> None:
        store, watch, status = FakeStore(), warmth.WarmWatch(), {"placementGeneration": 1}
        task = asyncio.create_task(warmth.follow(store, "ns", "items", watch,  # type: ignore[arg-type]
                                                 lambda: status["placementGeneration"]))
        await store.events.put({})
        cold = await settled(watch, "0/2 clusters")
        assert (cold.status, watch.generation) == ("False", 1)
        for _ in range(5):  # sidecars re-report twice a second: no assignment read for those
            await store.events.put({"engine-0": report(1, 0)})
        half = await settled(watch, "1/2 clusters")
        await store.events.put({"engine-0": report(1, 0), "engine-1": report(1, 1)})
        warm = await settled(watch, "2/2 clusters")
        assert (warm.status, warm.reason, store.assignment_reads) == ("True", "ClustersWarm", 1)
        assert warmth.due(watch, 1) is warm and half.status == "False"

        # the operator published generation 2: the timer does not write generation 1's decision, and
        # asks the daemon to look again, which reads the assignment once
        store.current, status["placementGeneration"] = 2, 2
        assert warmth.due(watch, 2) is None
        again = await settled(watch, "generation 2")
        assert (again.status, store.assignment_reads, warmth.due(watch, 2)) == ("False", 2, again)

        # the rebalancer published generation 3 (status not told): a pod's report names it
        store.current = 3
        await store.events.put({"engine-0": report(3, 0), "engine-1": report(3, 1)})
        third = await settled(watch, "generation 3")
        assert (third.status, store.assignment_reads) == ("True", 3)

        await store.events.put(etcd_store.EtcdUnavailableError("etcd went away (test)"))
        with pytest.raises(etcd_store.EtcdUnavailableError):
            await asyncio.wait_for(task, 2)

    asyncio.run(run())
