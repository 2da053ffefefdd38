"""What ``kvshard demo`` watches while it replays: placement generations, warm reports, conditions.

The replay needs to know, at every request, which generation is current (to score the
round-robin counterfactual against the same placement) and when the operator has answered the
hot-shard burst (to end the burst phase). It reads what the router and the sidecars follow — the
generations and the warm reports in etcd — once a second, and the CacheShard's conditions every few
seconds, and keeps a :class:`~kvshard_bench.demo_report.PlacementSample` per poll for the picture. The
same CacheShard read gives the fidelity guard's state (``status.blend``, ``status.fidelity``,
``FidelityMet``), kept as a :class:`~kvshard_bench.demo_fidelity.FidelitySample` per poll.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from kvshard.etcd_store import EtcdStore, EtcdStoreError
from kvshard.placement_schema import Placement, WarmReport
from kvshard_bench import demo_fidelity
from kvshard_bench import demo_report as report

log = logging.getLogger(__name__)

SETTLE_SECONDS = 30.0
"""After a new generation, the burst phase ends at the latest this much later."""


class PlacementWatch:
    """Polls etcd (and the CacheShard) and remembers every generation seen."""

    def __init__(self, store: EtcdStore, namespace: str, name: str,
                 cacheshard: Callable[[], Mapping[str, Any]], clock: Callable[[], float]) -> None:
        self.store, self.namespace, self.name = store, namespace, name
        self._cacheshard, self._clock = cacheshard, clock
        self.placements: dict[int, Placement] = {}
        self.warm: dict[str, WarmReport] = {}
        self.generation = 0
        self.samples: list[report.PlacementSample] = []
        self.conditions: dict[str, str] = {}
        self.rebalances = 0
        """Rebalancing=True transitions of the CacheShard seen."""
        self.fidelity: list[demo_fidelity.FidelitySample] = []

    @property
    def current(self) -> Placement | None:
        return self.placements.get(self.generation)

    async def run(self, interval: float = 1.0) -> None:
        """Poll until cancelled; a failed poll is logged and retried."""
        tick = 0
        while True:
            await asyncio.sleep(interval)
            tick += 1
            try:
                await self.poll()
                if tick % 3 == 0:
                    await self.poll_conditions()
            except (EtcdStoreError, OSError) as exc:
                log.warning("placement poll failed: %s", exc)

    async def poll(self) -> None:
        generation = await self.store.current_generation(self.namespace, self.name)
        if generation and generation not in self.placements:
            self.placements[generation] = await self.store.read_generation(self.namespace, self.name, generation)
            if self.current is not None:
                lines = report.placement_changes(self.current.assignment, self.placements[generation].assignment)
                print(f"placement generation {generation} published at t={self._clock():.0f}s: "
                      f"{'; '.join(lines) or 'no assignment change'}", flush=True)
        self.generation = max(self.generation, generation)
        self.warm = await self.store.read_warm(self.namespace, self.name)
        placement = self.current
        if placement is not None:
            assigned = {p: len(placement.clusters_of(p)) for p in placement.pods}
            warm = {p: len(r.clusters) for p, r in self.warm.items() if r.generation == self.generation}
            self.samples.append(report.PlacementSample(self._clock(), self.generation, assigned, warm))

    async def poll_conditions(self) -> None:
        shard = await asyncio.to_thread(self._cacheshard)
        sample = demo_fidelity.sample_of(shard, self._clock())
        if sample is not None:
            if not self.fidelity or sample.state() != self.fidelity[-1].state():
                print(f"fidelity guard at t={sample.t:.0f}s: ratio {sample.ratio_percent}%, "
                      f"{sample.samples} checks, agreement {sample.agreement_percent}%, "
                      f"FidelityMet={sample.met} ({sample.reason})", flush=True)
            self.fidelity.append(sample)
        for condition in shard.get("status", {}).get("conditions", []) or []:
            kind, state = condition.get("type", ""), condition.get("status", "")
            text = f"{state} ({condition.get('reason', '')}: {condition.get('message', '')})"
            if kind == "Rebalancing" and self.conditions.get(kind) != text:
                print(f"CacheShard condition Rebalancing={text} at t={self._clock():.0f}s", flush=True)
                self.rebalances += state == "True"
            self.conditions[kind] = text

    def rebalanced(self, since: int, hot: list[int], hot_pod: str) -> bool:
        """A generation newer than ``since`` is published and every hot cluster is warm on a pod other
        than ``hot_pod`` (so the router can spread the burst), or :data:`SETTLE_SECONDS` have passed since
        it was published (the rebalancer may have fixed the load another way, e.g. moving cold clusters)."""
        if not any(g > since for g in self.placements):
            return False
        spread = all(any(c in r.clusters for pod, r in self.warm.items()
                         if pod != hot_pod and r.generation == self.generation) for c in hot)
        first_seen = next((s.t for s in self.samples if s.generation > since), None)
        return spread or (first_seen is not None and self._clock() - first_seen > SETTLE_SECONDS)

    def changes(self) -> dict[int, list[str]]:
        """generation → what it changed against the previous generation seen."""
        gens = sorted(self.placements)
        return {g: report.placement_changes(self.placements[a].assignment, self.placements[g].assignment)
                for a, g in zip(gens, gens[1:], strict=False)}
