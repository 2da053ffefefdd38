"""The operator's colocation timer entry against a real etcd over TLS (client certificate from the
CacheShard's Secret): disabled or not due → nothing; due → the routers' reports become a colocated
generation within the budget."""

from __future__ import annotations

import collections
import random
from typing import Any

from emulated import ETCD_TLS_SECRET, etcd_spec

from kvshard import placement_schema as ps
from kvshard_local.testing_servers import EtcdServer
from kvshard_operator.learned import LearnedState, colocate_shard
from kvshard_operator.settings import Settings
from kvshard_router.corequest import CoRequestSketch

NS = "default"
SETTINGS = Settings(etcd_timeout_seconds=2)


def read_secret(etcd: EtcdServer) -> Any:
    def read(namespace: str, name: str) -> dict[str, bytes]:
        assert (namespace, name) == (NS, ETCD_TLS_SECRET)
        return etcd.tls_secret_data()

    return read


async def test_the_timer_colocates_once_per_interval(etcd_server: EtcdServer) -> None:
    name = "learned-timer"
    pods = 4
    assignment: dict[int, tuple[str, ...]] = {c: (f"pod-{c % pods}",) for c in range(16)}
    topics = [[0, 5, 10, 15], [1, 6, 11, 12], [2, 7, 8, 13], [3, 4, 9, 14]]  # each scattered over 4 pods
    rng = random.Random(0)
    trace = [rng.sample(rng.choice(topics), 3) for _ in range(2000)]
    async with etcd_server.store(timeout=3) as store:
        await store.publish(NS, name, ps.Placement(1, assignment, {f"i{c}": c for c in range(16)},
                                                   pods=tuple(f"pod-{j}" for j in range(pods))), expected=0)
        sketch = CoRequestSketch()
        for request in trace:
            sketch.add(request)
        await store.put_corequest(NS, name, sketch.take("router-0", 500, 0.0), ttl_seconds=60)

        state = LearnedState()
        spec = {"etcd": etcd_spec(etcd_server), "colocation": {"enabled": False}}
        args = {"namespace": NS, "name": name, "state": state, "settings": SETTINGS,
                "read_secret": read_secret(etcd_server)}
        assert await colocate_shard(spec=spec, now=1000.0, **args) is None  # disabled

        spec["colocation"] = {"enabled": True, "intervalSeconds": 60, "maxMovesPerInterval": 4, "maxLoadPercent": 110}
        first = await colocate_shard(spec=spec, now=1000.0, **args)
        assert first is not None and first.reason == "Colocated" and first.published == 2
        assert 0 < len(first.moved) <= 4 and first.local_after > first.local_before
        assert await colocate_shard(spec=spec, now=1030.0, **args) is None  # not due yet
        for k in range(1, 8):
            outcome = await colocate_shard(spec=spec, now=1000.0 + 60 * k, **args)
            assert outcome is not None and len(outcome.moved) <= 4
        current = await store.read_current(NS, name)
        assert current is not None
        assert collections.Counter(h[0] for h in current.assignment.values()) == collections.Counter(
            h[0] for h in assignment.values())  # four clusters per pod, as before
        together = sum(len({current.assignment[c][0] for c in r}) == 1 for r in trace) / len(trace)
        assert together > 0.9  # every topic ended on one pod (initially no request was)
