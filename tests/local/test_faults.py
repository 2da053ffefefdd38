"""Faults on the local cluster: a crashed sidecar, an etcd outage, two operators racing, a corrupt block.

One cluster serves the whole module (two pods on a 48-item MovieLens subset, rebalancing off so
every placement generation comes from the change a test makes, and a memory tier of 0 bytes so
every block lookup reads the disk tier). The tests run in file order; each one waits for the cluster
to be warm first and leaves it warm again. Measured times are printed as ``FAULT:`` lines
(``pytest -s`` shows them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest
import yaml
from polling import wait_until
from prometheus_client.parser import text_string_to_metric_families

from kvshard import etcd_store
from kvshard.placement_schema import Placement, PlacementFormatError
from kvshard_local import LocalCluster, manifests
from kvshard_local.kubeapi import CACHESHARDS, condition

pytestmark = [pytest.mark.slow, pytest.mark.model]

VICTIM = "engine-1"
"""The pod the crash test kills."""
CORRUPTED = "engine-0"
"""The pod whose disk block the corruption test damages."""


# ----------------------------------------------------------------------------------------- helpers


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def post(url: str, body: Any, timeout: float = 120.0) -> tuple[int, dict[str, str], Any]:
    """``(status, headers, JSON or text)``; status 0 when no HTTP answer came at all."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as error:
        return 0, {}, f"{type(error).__name__}: {error}"


def samples(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample called ``name`` on the ``/metrics`` page at ``url``."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return [(dict(s.labels), s.value) for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name]


def pod_healthy(cluster: LocalCluster, pod: str) -> float | None:
    """The router's ``kvshard_router_pod_healthy{pod}`` (None: the router's placement omits the pod)."""
    found = [v for labels, v in samples(cluster.router_url + "/metrics", "kvshard_router_pod_healthy")
             if labels.get("pod") == pod]
    return found[0] if found else None


def router_inflight(cluster: LocalCluster, pod: str) -> float:
    return sum(v for labels, v in samples(cluster.router_url + "/metrics", "kvshard_router_inflight_requests")
               if labels.get("pod") == pod)


def router_retries(cluster: LocalCluster) -> float:
    return sum(v for _, v in samples(cluster.router_url + "/metrics", "kvshard_router_retries_total"))


def corrupt_count(cluster: LocalCluster, pod: str) -> float:
    """The pod's ``kvshard_sidecar_cache_events_total{tier="disk", event="corrupt"}``."""
    return sum(v for labels, v in samples(cluster.sidecar_urls[pod] + "/metrics", "kvshard_sidecar_cache_events_total")
               if labels.get("tier") == "disk" and labels.get("event") == "corrupt")


def shard_path(cluster: LocalCluster) -> str:
    return CACHESHARDS.format(ns=cluster.namespace) + f"/{cluster.name}"


def converged(cluster: LocalCluster) -> str:
    """'' once the CacheShard is Ready and not Degraded, the router routes by etcd's current
    generation and follows etcd without errors, and every placement pod reports that generation
    warm; else what is still missing."""
    shard = cluster.cacheshard()
    if condition(shard, "Degraded").get("status") == "True":
        return f"Degraded: {condition(shard, 'Degraded').get('message')}"
    if condition(shard, "Ready").get("status") != "True":
        return f"Ready={condition(shard, 'Ready').get('status')}"
    try:
        placement, reports = cluster.warm_reports()
    except etcd_store.EtcdStoreError as error:
        return f"etcd: {error}"
    if placement is None:
        return "no placement"
    view = get_json(cluster.router_url + "/v1/placement")
    if view["generation"] != placement.generation:
        return f"router at generation {view['generation']}, etcd at {placement.generation}"
    if view["etcd"]["errors"]:
        return f"router etcd errors {view['etcd']['errors']}"
    stale = [p for p in placement.pods
             if (r := reports.get(p)) is None or r.generation != placement.generation or r.warming]
    return f"not warm for generation {placement.generation}: {stale}" if stale else ""


def current_generation(cluster: LocalCluster) -> int:
    placement, _ = cluster.warm_reports()
    assert placement is not None
    return placement.generation


@dataclasses.dataclass(frozen=True)
class Sent:
    """One request of :class:`Traffic` and how it ended."""

    started: float
    finished: float
    status: int
    pod: str
    detail: str


class Traffic:
    """``workers`` threads each sending one ``/v1/recommend`` after the other through the router
    (so ``workers`` requests are in flight), five random candidates each, until the block ends."""

    def __init__(self, router_url: str, items: list[str], workers: int = 2) -> None:
        self.url = router_url + "/v1/recommend"
        self.items = items
        self.sent: list[Sent] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(w,), name=f"traffic-{w}", daemon=True)
                         for w in range(workers)]

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=150)

    def _run(self, worker: int) -> None:
        rng = random.Random(worker)
        count = 0
        while not self._stop.is_set():
            count += 1
            body = {"user_id": f"fault-{worker}-{count}", "history": [], "candidates": rng.sample(self.items, 5),
                    "max_tokens": 1}
            started = time.monotonic()
            status, headers, answer = post(self.url, body)
            done = Sent(started, time.monotonic(), status, headers.get("X-Kvshard-Pod", ""),
                        "" if status == 200 else str(answer)[:300])
            with self._lock:
                self.sent.append(done)

    def snapshot(self) -> list[Sent]:
        with self._lock:
            return list(self.sent)

    def failures(self) -> list[Sent]:
        return [s for s in self.snapshot() if s.status != 200]

    def answered(self, pod: str | None = None, since: float = 0.0) -> list[Sent]:
        """Requests sent at ``since`` or later that ``pod`` (any pod: None) answered 200."""
        return [s for s in self.snapshot() if s.status == 200 and s.started >= since and pod in (None, s.pod)]


def placement_items(cluster: LocalCluster) -> list[str]:
    placement, _ = cluster.warm_reports()
    assert placement is not None
    return sorted(placement.item_clusters)


# ----------------------------------------------------------------------------------------- the cluster

@pytest.fixture(scope="module")
def cluster(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    folder = tmp_path_factory.mktemp("faults")
    manifest = manifests.load_cacheshard()
    manifest["spec"].update(catalog=manifests.catalog_source(str(small_dataset)), clusters=8, itemReplicas=1)
    manifest["spec"]["rebalance"] = {"enabled": False, "intervalSeconds": 15}  # only the tests publish
    (folder / "cacheshard.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    local = LocalCluster(pods=2, dir=folder / "run", dataset=str(small_dataset), cacheshard=folder / "cacheshard.yaml",
                         memory_bytes=0, scrape_interval_seconds=1.0, start_timeout_seconds=240)
    started = time.monotonic()
    with local:
        local.wait_ready(timeout=240, progress=lambda line: None)
        print(f"FAULT: cluster up and warm in {time.monotonic() - started:.1f} s")
        yield local


# ----------------------------------------------------------------------------------------- the faults

def test_a_killed_sidecar_is_routed_around_then_rejoins_warm(cluster: LocalCluster) -> None:
    cluster.wait_ready(timeout=120, progress=lambda line: None)
    with Traffic(cluster.router_url, placement_items(cluster)) as traffic:
        wait_until(lambda: traffic.answered(VICTIM), timeout=60, what=f"{VICTIM} answering before the kill")
        # kill it while the router has a request on it: that request must be retried, not failed
        inflight = wait_until(lambda: router_inflight(cluster, VICTIM), timeout=30, every=0.01,
                              what=f"a request in flight to {VICTIM}")
        retries_before = router_retries(cluster)
        killed_at = time.monotonic()
        cluster.kill_pod(VICTIM)

        wait_until(lambda: not pod_healthy(cluster, VICTIM), timeout=10, every=0.05,
                   what=f"kvshard_router_pod_healthy{{pod={VICTIM}}} == 0")
        detected = time.monotonic() - killed_at

        wait_until(lambda: cluster.restarts(VICTIM) == 1 and cluster.pod_ready(VICTIM), timeout=120,
                   what=f"{VICTIM} restarted and Ready")
        ready = time.monotonic() - killed_at

        def victim_warm() -> bool:
            placement, reports = cluster.warm_reports()
            report = reports.get(VICTIM)
            return (placement is not None and VICTIM in placement.pods and report is not None
                    and report.generation == placement.generation and report.warming == 0
                    and bool(report.clusters))

        wait_until(victim_warm, timeout=120, what=f"{VICTIM} warm for the current generation")
        rewarmed = time.monotonic() - killed_at
        wait_until(lambda: traffic.answered(VICTIM, since=killed_at + rewarmed), timeout=60,
                   what=f"{VICTIM} answering again")
        serving = time.monotonic() - killed_at
        retried = router_retries(cluster) - retries_before

    sent = traffic.snapshot()
    failures = traffic.failures()
    print(f"FAULT: kill -9 {VICTIM}: router stopped choosing it after {detected:.2f} s "
          f"({retried:.0f} requests retried on the other pod); Ready again {ready:.1f} s, "
          f"warm for the current generation {rewarmed:.1f} s, answering again {serving:.1f} s after the kill; "
          f"{len(sent)} requests, {len(failures)} failed ({inflight:.0f} were in flight to {VICTIM} at the kill)")
    assert detected < 3.0
    assert not failures, f"the router retries a dropped connection once on another pod: {failures}"
    assert {s.pod for s in sent if s.status == 200} == {"engine-0", "engine-1"}


def test_an_etcd_outage_keeps_routing_then_converges(cluster: LocalCluster) -> None:
    cluster.wait_ready(timeout=120, progress=lambda line: None)
    before = current_generation(cluster)
    with Traffic(cluster.router_url, placement_items(cluster)) as traffic:
        stopped_at = time.monotonic()
        cluster.stop_etcd()
        try:
            # the operator learns of the outage on its next write: a label edit makes it reconcile
            cluster.api.patch(shard_path(cluster), {"metadata": {"labels": {"kvshard.io/fault": "etcd-outage"}}})
            degraded = wait_until(lambda: (c := condition(cluster.cacheshard(), "Degraded")).get("status") == "True"
                                  and c, timeout=30, what="Degraded=True")
            degraded_after = time.monotonic() - stopped_at
            time.sleep(max(0.0, 10.0 - (time.monotonic() - stopped_at)))
            served = traffic.answered(since=stopped_at)
            outage = time.monotonic() - stopped_at
            failed_in_outage = traffic.failures()
            assert served and not failed_in_outage, failed_in_outage
        finally:
            restarted_at = time.monotonic()
            cluster.start_etcd()
        last = ""
        deadline = restarted_at + 90
        while (last := converged(cluster)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not last, f"not converged 90 s after etcd came back: {last}"
        converged_after = time.monotonic() - restarted_at
        ready = condition(cluster.cacheshard(), "Ready")

    print(f"FAULT: etcd outage {outage:.1f} s: CacheShard Degraded ({degraded['reason']}) "
          f"{degraded_after:.1f} s after the stop; {len(served)} requests answered during the outage, "
          f"{len(traffic.failures())} failed; converged {converged_after:.1f} s after etcd came back "
          f"(Ready, not Degraded, router and every pod at generation {current_generation(cluster)})")
    assert degraded["reason"] == "EtcdUnavailable"
    assert degraded_after < 15.0
    assert ready["status"] == "True"
    assert not traffic.failures()
    assert current_generation(cluster) == before, "a label edit changes no placement"
    assert converged_after < 30.0


RACE_ATTEMPTS = 3
"""Spec changes tried until one lines the race up: an operator that takes a change only after etcd
thawed (a slow watch under a loaded machine) reads the new ``current`` and has nothing to race for."""


def test_two_operators_publish_exactly_one_generation_per_change(cluster: LocalCluster) -> None:
    cluster.wait_ready(timeout=120, progress=lambda line: None)
    second = cluster.start_operator("operator-2")
    first_log = cluster.logs_dir / "operator.log"
    attempts: list[dict[str, Any]] = []
    try:
        second_log = second.log_path
        wait_until(lambda: "resume_shard" in second_log.read_text(errors="replace"), timeout=60,
                   what="the second operator to resume the CacheShard")

        def count(text: str) -> int:
            return sum(log.read_text(errors="replace").count(text) for log in (first_log, second_log))

        seen: list[tuple[str, int]] = []
        errors: list[str] = []
        stop = threading.Event()
        items = len(placement_items(cluster))
        reader = threading.Thread(target=asyncio.run, args=(_read_placements(cluster, items, seen, errors, stop),),
                                  name="placement-reader", daemon=True)
        reader.start()
        try:
            wait_until(lambda: seen, timeout=10, what="the reader's first placement")
            (etcd,) = [info for info in cluster.processes() if info.name == "etcd"]
            for attempt in range(RACE_ATTEMPTS):
                replicas = 2 if attempt % 2 == 0 else 1
                before, conflicts_before = current_generation(cluster), count("GenerationConflict")
                handled = [log.read_text(errors="replace").count("update_shard") for log in (first_log, second_log)]
                # line the race up: etcd is frozen while both operators take the change, so both read
                # `current` when it thaws and both try to publish the next generation
                os.kill(etcd.pid, signal.SIGSTOP)
                try:
                    cluster.api.patch(shard_path(cluster), {"spec": {"itemReplicas": replicas}})
                    time.sleep(2.5)  # both take the change in well under that; the etcd deadline is 5 s
                finally:
                    os.kill(etcd.pid, signal.SIGCONT)
                changed_at = time.monotonic()
                wait_until(lambda b=before: current_generation(cluster) > b, timeout=60, what="a new generation")
                published = time.monotonic() - changed_at
                # both operators handled the change; the loser's retry (backoff 2 s) must publish nothing more
                wait_until(lambda h=handled: all(log.read_text(errors="replace").count("update_shard") > n
                                              for log, n in zip((first_log, second_log), h, strict=True)),
                           timeout=60, what="both operators to handle the spec change")
                wait_until(lambda: condition(cluster.cacheshard(), "Degraded").get("status") != "True"
                           and condition(cluster.cacheshard(), "Ready").get("status") == "True", timeout=60,
                           what="the CacheShard Ready and not Degraded")
                time.sleep(8.0)  # longer than the first two retry delays (2 s, 4 s)
                attempts.append({"before": before, "settled": current_generation(cluster), "replicas": replicas,
                                 "published_s": round(published, 1), "final": cluster.cacheshard(),
                                 "conflicts": count("GenerationConflict") - conflicts_before})
                if attempts[-1]["conflicts"]:
                    break
        finally:
            stop.set()
            reader.join(timeout=30)
    finally:
        cluster.stop_operator("operator-2")

    print(f"FAULT: two operators: {[{k: v for k, v in a.items() if k != 'final'} for a in attempts]}; reader saw "
          f"generations {sorted({g for _, g in seen})} in {len(seen)} reads, {len(errors)} errors")
    for outcome in attempts:  # every change, raced or not, publishes exactly one generation
        assert outcome["settled"] == outcome["before"] + 1, outcome
        assert condition(outcome["final"], "Ready")["status"] == "True"
        assert condition(outcome["final"], "Degraded")["status"] == "False"
    assert attempts[-1]["conflicts"] == 1, "in no attempt did both operators race for the same generation"
    assert not errors, errors
    first = attempts[0]["before"]
    assert {g for _, g in seen} == set(range(first, first + len(attempts) + 1)), seen
    for source in ("watch", "read"):
        generations = [g for s, g in seen if s == source]
        assert generations == sorted(generations), (source, generations)  # never back to an older one
    assert not reader.is_alive()
    cluster.wait_ready(timeout=180, progress=lambda line: None)  # the pods now warm every cluster's replicas
    placement, _ = cluster.warm_reports()
    replicas = attempts[-1]["replicas"]
    assert placement is not None and all(len(h) == replicas for h in placement.assignment.values())


async def _read_placements(cluster: LocalCluster, items: int, seen: list[tuple[str, int]], errors: list[str],
                           stop: threading.Event) -> None:
    """Follow ``current`` with a watch and with back-to-back reads until ``stop``; every placement
    must be whole (all ``items`` items, every cluster assigned) and every error is recorded."""
    async with cluster.etcd_store(timeout=5.0) as store:

        def check(source: str, placement: Placement | None) -> None:
            if placement is None or len(placement.item_clusters) != items or \
                    set(placement.assignment) != set(placement.item_clusters.values()):
                errors.append(f"{source}: incomplete placement {placement!r}")
            else:
                seen.append((source, placement.generation))

        async def watch() -> None:
            try:
                async for placement in store.watch_current(cluster.namespace, cluster.name):
                    check("watch", placement)
            except (PlacementFormatError, etcd_store.EtcdStoreError) as error:
                errors.append(f"watch: {type(error).__name__}: {error}")

        watcher = asyncio.create_task(watch())
        while not stop.is_set():
            try:
                check("read", await store.read_current(cluster.namespace, cluster.name))
            except (PlacementFormatError, etcd_store.EtcdStoreError) as error:
                errors.append(f"read: {type(error).__name__}: {error}")
            await asyncio.sleep(0.005)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)


def test_a_corrupt_block_file_is_never_served(cluster: LocalCluster) -> None:
    cluster.wait_ready(timeout=180, progress=lambda line: None)
    from kvshard_sidecar.blockstore import verify_block

    url = cluster.sidecar_urls[CORRUPTED]
    folder = cluster.pod_disk_dir(CORRUPTED)
    placement, reports = cluster.warm_reports()
    assert placement is not None
    cluster_id = reports[CORRUPTED].clusters[0]
    x, y, *others = placement.items_of(cluster_id)

    def files() -> dict[Path, int]:
        return {p: p.stat().st_mtime_ns for p in folder.glob("??/*.safetensors")}

    def touched_by(candidates: list[str]) -> set[Path]:
        """Block files a request read (the disk tier bumps a file's mtime on every verified read;
        with no memory tier every lookup reads the disk)."""
        before = files()
        status, _, answer = post(url + "/v1/recommend", {"user_id": "fault-probe", "history": [],
                                                         "candidates": candidates, "max_tokens": 1})
        assert status == 200, answer
        after = files()
        return {p for p, mtime in before.items() if after.get(p, mtime) != mtime}

    touched_by([x, y])  # every block both requests share (labels, headers) is on disk before measuring
    read_x, read_y = touched_by([x]), touched_by([y])
    (file_x,), (file_y,) = read_x - read_y, read_y - read_x  # the system block is read by both
    key_x, key_y = file_x.name.removesuffix(".safetensors"), file_y.name.removesuffix(".safetensors")

    request = {"user_id": "fault-check", "history": [], "candidates": [x, *others[:4]]}
    status, _, intact = post(url + "/v1/recommend", request)  # the same blend, every block intact
    assert status == 200, intact

    def damage(path: Path) -> bytes:
        data = bytearray(path.read_bytes())
        middle = len(data) // 2
        data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
        path.write_bytes(bytes(data))
        return bytes(data)

    corrupt_before = corrupt_count(cluster, CORRUPTED)
    damaged_x = damage(file_x)
    status, headers, answer = post(url + "/v1/recommend", request)
    assert status == 200, answer
    # the damaged block is a miss and is recomputed (or fetched verified): the answer is the intact one
    assert [r["candidate"] for r in answer["ranking"]] == [r["candidate"] for r in intact["ranking"]]
    assert all(abs(a["logprob"] - b["logprob"]) < 1e-4
               for a, b in zip(answer["ranking"], intact["ranking"], strict=True))
    after_request = corrupt_count(cluster, CORRUPTED)
    assert after_request == corrupt_before + 1
    if file_x.exists():  # recomputed or fetched from the peer, and stored again
        replaced = file_x.read_bytes()
        assert replaced != damaged_x
        verify_block(key_x, replaced)

    # a peer asking for a damaged block gets a miss or a verified block, never the damaged bytes
    damaged_y = damage(file_y)
    token = cluster.peer_token_file.read_text().strip()
    peer = urllib.request.Request(f"{url}/v1/blocks/{key_y}", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(peer, timeout=10) as response:
            peer_status, body = response.status, response.read()
    except urllib.error.HTTPError as error:
        peer_status, body = error.code, error.read()
    assert peer_status in (200, 404), body[:300]
    if peer_status == 200:
        assert body != damaged_y
        verify_block(key_y, body)
    assert corrupt_count(cluster, CORRUPTED) == after_request + 1
    if file_y.exists():  # only a valid block may stay behind
        verify_block(key_y, file_y.read_bytes())
    print(f"FAULT: corrupt block: item {x} ({key_x[:12]}) on {CORRUPTED} counted corrupt, answered 200 with "
          f"label {answer['label']!r} as with intact blocks, file {'replaced' if file_x.exists() else 'removed'}; "
          f"peer GET of damaged {key_y[:12]} -> {peer_status}, file {'kept' if file_y.exists() else 'removed'}")

    # the pod heals: the next request with y recomputes or fetches its block
    status, _, answer = post(url + "/v1/recommend", {**request, "candidates": [y, *others[:4]]})
    assert status == 200, answer
    assert file_y.exists()
    verify_block(key_y, file_y.read_bytes())
