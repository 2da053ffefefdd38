"""The replay of ``kvshard demo``: its three phases (steady, burst, after) against a running local cluster,
then a sample of the same requests re-sent straight to their sidecars, blended and as full prefill.

Why a module of its own. :mod:`demo` decides what to run and writes the report; this is the one part
that talks to the cluster while it runs — the router, etcd through :mod:`demo_watch`, each sidecar — in
one asyncio loop, and hands back plain records (:class:`ReplayResult`) for :mod:`demo_report`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import aiohttp

from kvshard.datasets import Dataset
from kvshard.placement_schema import Placement
from kvshard.retrieval import RetrievalIndex
from kvshard.splits import UserSplit
from kvshard_bench import demo_fidelity
from kvshard_bench import demo_report as report
from kvshard_bench.demo_reference import FullPrefillReference
from kvshard_bench.demo_trace import DemoRequest, DemoTrace, DemoTraceSettings, ItemSpace, items_in, pick_hot_clusters
from kvshard_bench.demo_watch import PlacementWatch

if TYPE_CHECKING:  # the demo imports this module
    from kvshard_bench.demo import DemoSettings

log = logging.getLogger(__name__)

HOT_SHARE = 0.7
"""Share of burst-phase requests whose candidates come from the hot clusters."""


@dataclasses.dataclass
class ReplayResult:
    records: list[report.Record]
    pairs: list[report.PrefillPair]
    samples: list[report.PlacementSample]
    changes: dict[int, list[str]]
    pods: list[str]
    notes: dict[str, Any]
    fidelity: list[demo_fidelity.FidelitySample] = dataclasses.field(default_factory=list)
    trace: DemoTrace | None = None
    """The session trace, which the autoscaling ramp continues."""
    pairs_failed: int = 0
    """Requests re-sent for the comparison with full prefill that got no answer (blended or full)."""


class Replay:
    """The phases of the demo against a running local cluster (one asyncio loop)."""

    def __init__(self, cluster: Any, dataset: Dataset, settings: DemoSettings) -> None:
        self.cluster, self.dataset, self.settings = cluster, dataset, settings
        self.ns, self.name = str(cluster.namespace), str(cluster.name)
        self.t0 = time.monotonic()
        self.records: list[report.Record] = []
        self.requests: dict[int, DemoRequest] = {}
        self.pairs_failed = 0
        self.notes: dict[str, Any] = {"model": settings.model, "candidates": _CANDIDATE_NOTES[settings.candidate_set]}
        if settings.engine == "vllm":
            self.notes["engine"] = ("vllm: each pod's own vLLM computes what no block holds; the full-prefill "
                                    "reference is computed in the demo's process with the blend engine "
                                    "(the pods' sidecars hold no weights)")

    # ---------------------------------------------------------------------------------- the run

    async def run(self) -> ReplayResult:
        steady_n, burst_min, after_n = self.settings.plan()
        async with self.cluster.etcd_store() as store, aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=180)) as http:
            self.http = http
            watch = self.watch = PlacementWatch(store, self.ns, self.name, self.cluster.cacheshard, self._now)
            await watch.poll()
            if watch.current is None:
                raise RuntimeError(f"no placement of {self.ns}/{self.name} in etcd although the CacheShard is Ready")
            item_clusters = watch.current.item_clusters  # the clustering stays; generations re-assign
            await self._set_fidelity()
            trace = self._trace()
            poller = asyncio.create_task(watch.run())
            try:
                self.t0 = time.monotonic()
                watch.samples.clear()
                watch.fidelity.clear()
                await watch.poll()
                await watch.poll_conditions()
                await self._phase(trace, "steady", lambda n: n < steady_n, steady_n)
                hot_pod, hot = pick_hot_clusters(watch.current.assignment, item_clusters, self.settings.hot_clusters)
                pool = items_in(item_clusters, hot)
                self.notes["hot clusters"] = (f"{hot} on {hot_pod} ({len(pool)} items, "
                                              f"{HOT_SHARE:.0%} of burst requests)")
                print(f"burst: {HOT_SHARE:.0%} of requests now take candidates from clusters {hot} "
                      f"(held by {hot_pod} only)", flush=True)
                since = watch.generation
                deadline = time.monotonic() + self.settings.burst_timeout_s
                await self._phase(trace, "burst",
                                  lambda n: (n < burst_min or not watch.rebalanced(since, hot, hot_pod))
                                  and time.monotonic() < deadline,
                                  burst_min, pool)
                if not watch.rebalanced(since, hot, hot_pod):
                    self.notes["rebalance"] = (f"no new generation within {self.settings.burst_timeout_s:.0f} s "
                                               "of burst; the 'after' phase runs on the same placement")
                    print(self.notes["rebalance"], flush=True)
                # at least two rebalance intervals, so the operator's follow-up generations show too
                settle = time.monotonic() + 2 * self._interval()
                await self._phase(trace, "after", lambda n: n < after_n or time.monotonic() < settle, after_n, pool)
                pairs = await self._pairs()
            finally:
                poller.cancel()
                await asyncio.gather(poller, return_exceptions=True)
        pods = sorted({p for pl in watch.placements.values() for p in pl.pods}
                      | {r.pod for r in self.records if r.pod})
        self.notes["operator rebalances seen (Rebalancing=True transitions)"] = watch.rebalances
        self.notes["round-robin"] = ("counterfactual: request i would go to healthy pod i mod N; "
                                     "held = its candidates whose cluster that pod was assigned")
        return ReplayResult(self.records, pairs, list(watch.samples), watch.changes(), pods, self.notes,
                            list(watch.fidelity), trace, self.pairs_failed)

    async def _set_fidelity(self) -> None:
        """Set the demo's ``spec.fidelity`` on the CacheShard (a merge patch through the local Kubernetes
        API, as ``kubectl patch`` would); the operator publishes the sample rate with the blend in force."""
        from kvshard_local.kubeapi import CACHESHARDS

        spec = self.settings.fidelity_spec()
        if spec is None:
            return
        path = CACHESHARDS.format(ns=self.ns) + f"/{self.name}"
        await asyncio.to_thread(self.cluster.api.patch, path, {"spec": {"fidelity": spec}})
        print(f"fidelity guard: target {spec['targetAgreementPercent']} % agreement, "
              f"{spec['sampleRatePercent']} % of requests shadow-checked, a decision every "
              f"{spec['intervalSeconds']} s", flush=True)

    def _interval(self) -> float:
        """The CacheShard's rebalance interval in seconds (the local cluster's setting)."""
        return float(getattr(getattr(self.cluster, "settings", None), "rebalance_interval_seconds", 15))

    def _trace(self) -> DemoTrace:
        from kvshard_operator.embedding import embed_catalog

        settings = DemoTraceSettings(users=self.settings.users, seed=self.settings.seed,
                                     requests_per_user=max(1, math.ceil(self.settings.requests / self.settings.users)),
                                     candidate_set=self.settings.candidate_set)
        ids = sorted(self.dataset.items)  # the operator's catalog order: its embedding cache is reused
        vectors = embed_catalog(ids, [self.dataset.items[i].text for i in ids])
        # the fine-tuning split: the stage counts what training saw, sessions come from the other users
        retrieval = (RetrievalIndex.fit(self.dataset, UserSplit()) if settings.candidate_set == "retrieval" else None)
        return DemoTrace(self.dataset, ItemSpace.build(self.dataset, vectors, settings, ids), settings, retrieval)

    # -------------------------------------------------------------------------------- requests

    async def _phase(self, trace: DemoTrace, phase: str, more: Callable[[int], bool], planned: int,
                     hot_pool: list[str] | None = None) -> None:
        sent = 0
        done = [0]
        last = [time.monotonic()]

        async def worker() -> None:
            nonlocal sent
            while more(sent):
                sent += 1
                request = trace.next(hot_pool or (), HOT_SHARE if hot_pool else 0.0)
                await self._send(request, phase)
                done[0] += 1
                if done[0] % 10 == 0 or time.monotonic() - last[0] > 5:
                    last[0] = time.monotonic()
                    self._progress(phase, done[0], max(planned, sent))

        await asyncio.gather(*(worker() for _ in range(self.settings.concurrency)))
        self._progress(phase, done[0], done[0])

    def _progress(self, phase: str, done: int, total: int) -> None:
        records = [r for r in self.records if r.phase == phase and r.ok]
        shares = report.load_share(records[-30:], sorted((self.watch.current or _EMPTY).pods))
        load = " ".join(f"{p}={s:.0%}" for p, s in shares.items())
        errors = sum(1 for r in self.records if r.phase == phase and not r.ok)
        print(f"[{phase:<6}] {done:4d}/{total:<4d} requests  generation {self.watch.generation}  "
              f"recent load {load}  errors {errors}  t={self._now():.0f}s", flush=True)

    async def _send(self, request: DemoRequest, phase: str) -> None:
        self.requests[request.index] = request
        generation = self.watch.generation
        placement = self.watch.current
        sent = self._now()
        record = report.Record(request.index, phase, sent, 0.0, 0, None, generation, request.target,
                               request.trending, from_retrieval=request.from_retrieval,
                               retrieval_rank=request.retrieval_rank)
        try:
            url = f"{self.cluster.router_url}/v1/recommend"
            async with self.http.post(url, json=request.body()) as resp:
                record.status = resp.status
                record.pod = resp.headers.get("X-Kvshard-Pod")
                body = await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
            body = None
        record.latency_s = self._now() - sent
        if isinstance(body, dict) and record.ok:
            record.pod = record.pod or body.get("pod")
            record.ttft_ms = float(body["timings"]["ttft_ms"])
            record.query = {k: int(v) for k, v in body["tokens"]["query"].items()}
            record.hit = {k: {t: int(n) for t, n in v.items()} for k, v in body["tokens"]["hit"].items()}
            record.label, record.candidate = body.get("label"), body.get("candidate")
            record.target_rank = report.target_rank(body, request.target)
            record.num_candidates = len(request.candidates)
            weight = body.get("retrieval_weight")
            record.retrieval_weight = float(weight) if isinstance(weight, (int, float)) else None
        elif isinstance(body, dict):
            record.error = json.dumps(body.get("error", body))[:300]
        if placement is not None:
            healthy = sorted(placement.pods)
            if record.pod:
                record.held = report.held_share(request.candidates, placement.item_clusters,
                                                placement.clusters_of(record.pod))
            rr = report.round_robin_pod(request.index, healthy)
            if rr is not None:
                record.rr_held = report.held_share(request.candidates, placement.item_clusters,
                                                   placement.clusters_of(rr))
        if not record.ok:
            log.warning("request %d: HTTP %s %s", request.index, record.status, record.error)
        self.records.append(record)

    async def _pairs(self) -> list[report.PrefillPair]:
        """The same requests, one at a time, to the same sidecar: blended, then full prefill (r = 1) — asked of
        that sidecar, or with ``--engine vllm`` (whose sidecars have no engine) computed here
        (:class:`~kvshard_bench.demo_reference.FullPrefillReference`)."""
        ok = [r for r in self.records if r.ok and r.pod in self.cluster.sidecar_urls]
        if not ok or not self.settings.pairs:
            return []
        step = max(1, len(ok) // self.settings.pairs)
        chosen = ok[::step][: self.settings.pairs]
        reference: FullPrefillReference | None = None
        if self.settings.engine == "vllm":
            print(f"re-sending {len(chosen)} requests to their sidecars (vLLM computes), and computing their full "
                  "prefill in this process with the blend engine", flush=True)
            reference = await asyncio.to_thread(FullPrefillReference, self.cluster.model_path, self.dataset)
        else:
            print(f"re-sending {len(chosen)} requests to their sidecars: blended, then full prefill "
                  "(blend.method=full)", flush=True)
        pairs = []
        for record in chosen:
            request = self.requests[record.index]
            url = f"{self.cluster.sidecar_urls[record.pod]}/v1/recommend"
            blended = await self._direct(url, request.body())
            if reference is not None:
                full: dict[str, Any] | None = await asyncio.to_thread(reference.answer, request.body())
            else:
                full = await self._direct(url, request.body(blend={"method": "full"}))
            if blended is None or full is None:
                self.pairs_failed += 1
                continue
            assert record.pod is not None
            pairs.append(report.PrefillPair(record.index, record.pod, float(blended["timings"]["ttft_ms"]),
                                            float(full["timings"]["ttft_ms"]), blended.get("label"),
                                            full.get("label"), report.target_rank(blended, request.target),
                                            report.target_rank(full, request.target), len(request.candidates)))
        return pairs

    async def _direct(self, url: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
        try:
            async with self.http.post(url, json=body) as resp:
                data = await resp.json(content_type=None)
                if resp.status == 200 and isinstance(data, dict):
                    return data
                log.warning("%s answered %s: %s", url, resp.status, data)
        except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
            log.warning("%s failed: %s", url, exc)
        return None

    def _now(self) -> float:
        return time.monotonic() - self.t0


_EMPTY = Placement(0, {}, {})
_CANDIDATE_NOTES = {
    "retrieval": ("session requests: the retrieval stage's items (item-kNN of the history over the training users, "
                  "topped up with popular items; held-out users' sessions), the target only where retrieved; "
                  "burst requests: the hot pool plus the target"),
    "neighbours": "the target plus Zipf-sampled embedding neighbours of the history (or of the burst's hot pool)",
}
