"""``kvshard bench guard``: what the fidelity guard's shadow checks cost a request, on the local cluster.

The issue's bar: shadow checks at ``sampleRate`` 5 % add at most 5 % to request p99 TTFT. A shadow check
is a full prefill run only while no request is in the building, but once it runs it holds the compute
slot, so a request arriving meanwhile waits for it — that wait is what this measures. One local cluster
(real SmolLM2 sidecars, etcd, Prometheus, operator, router), one seeded request trace.

Why blocks: measuring guard off for a few minutes and then guard on for a few minutes lets whatever
else the machine does in between decide the result (on a shared two-core machine a first run read
p99 off 4873 ms vs on 1917 ms — the load changed, not the guard). So the run alternates short blocks
of the two arms on the same cluster: the trace is cut into ``--blocks`` / 2 chunks and each chunk is
replayed once per arm, back to back, the order mirrored from pair to pair (off,on,on,off,off,on,…) so a
drift in machine load falls on both arms alike and each arm sees exactly the same requests. Each arm's
TTFTs are pooled over its blocks; the per-block p50s are kept so the spread between blocks of one arm
(the noise) can be set beside the difference between the arms. Guard off is no ``spec.fidelity``
(nothing sampled); guard on is ``spec.fidelity`` at ``--sample-rate`` %, the ratio pinned with
``minRatioPercent = maxRatioPercent`` so both arms blend alike. A warm-up pass of the whole trace
first puts every block in the pods' memory — the items' and the users' histories' both: without it the
first replay of a chunk computes and stores its histories and the second reuses them, which a first run
showed as a 2x TTFT difference between the two blocks of every pair, whatever the arm.

A sampled request's shadow check runs (or is counted ``skipped``) within the sidecar's
:data:`SHADOW_MAX_AGE_S` of the request, so before an off block follows an on block the counters are
read only after that long: every check is counted in the on block that sampled it.

TTFT is the client's time to the answer of a ``max_tokens: 1`` request (queueing behind a shadow check
included), which is what a user of the router sees. ``shadow_checks`` and ``agreement`` come from the
sidecars' own ``kvshard_sidecar_fidelity_checks_total`` over each block (after its queued checks
drained, so a check never lands in the next block), with the Wilson 95 % interval, to set beside an
offline ``kvshard bench fidelity`` at the same ratio.

The catalog is the ``--items`` most-rated MovieLens items and the histories of the users who rated them
(as the local-cluster tests use), so a two-core machine warms it in seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvshard.blend_policy import BlendPolicy
from kvshard.datasets import Dataset, load_dataset
from kvshard_operator.fidelity_policy import wilson

Row = dict[str, Any]
CHECKS = "kvshard_sidecar_fidelity_checks_total"
ARMS = ("off", "on")
SHADOW_MAX_AGE_S = 30.0
"""``kvshard_sidecar.serving.shadow.MAX_AGE_S``: a queued shadow check runs or is skipped within this long."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=90,
                        help="requests per arm: the trace, replayed once guard off and once guard on "
                             "(default: %(default)s)")
    parser.add_argument("--blocks", type=int, default=8,
                        help="alternating off/on blocks, even (default: %(default)s: off,on,on,off,off,on,on,off)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="warm-up passes over the whole trace before the blocks (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=2, help="requests in flight (default: %(default)s)")
    parser.add_argument("--sample-rate", type=int, default=5,
                        help="spec.fidelity.sampleRatePercent with the guard on (default: %(default)s)")
    parser.add_argument("--ratio", type=int, default=30,
                        help="recompute ratio in percent, pinned in both phases (default: %(default)s)")
    parser.add_argument("--pods", type=int, default=1, help="sidecar pods (default: %(default)s)")
    parser.add_argument("--items", type=int, default=48, help="catalog: the most-rated items (default: %(default)s)")
    parser.add_argument("--history", type=int, default=20, help="history items per request (default: %(default)s)")
    parser.add_argument("--candidates", type=int, default=20, help="candidates per request (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="trace seed (default: %(default)s)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the rows as JSON")


# ----------------------------------------------------------------------------------------- pure core


def small_catalog(data: Dataset, items: int, folder: Path) -> Path:
    """``items.jsonl`` + ``interactions.jsonl`` of the ``items`` most-rated items in ``folder``."""
    popular = Counter(item for history in data.histories.values() for item in history)
    keep = [item for item, _ in popular.most_common(items)]
    kept = set(keep)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "items.jsonl").write_text(
        "".join(json.dumps({"id": i, "text": data.items[i].text}) + "\n" for i in keep))
    rows = [json.dumps({"user": user, "item": item, "timestamp": t}) + "\n"
            for user, history in sorted(data.histories.items())
            for t, item in enumerate([i for i in history if i in kept])]
    (folder / "interactions.jsonl").write_text("".join(rows))
    return folder


def make_trace(data: Dataset, requests: int, *, history: int, candidates: int, seed: int) -> list[dict[str, Any]]:
    """Seeded request bodies: a user's first ``history`` items and ``candidates`` catalog items."""
    rng = random.Random(seed)
    users = sorted(u for u, h in data.histories.items() if len(h) >= 2)
    items = sorted(data.items)
    trace = []
    for index in range(requests):
        user = rng.choice(users)
        trace.append({"user_id": f"bench-{user}", "history": list(data.histories[user][:history]),
                      "candidates": rng.sample(items, min(candidates, len(items))), "max_tokens": 1,
                      "_index": index})
    return trace


def block_order(blocks: int) -> list[tuple[str, int]]:
    """``(arm, chunk)`` for each block: pair ``i`` replays chunk ``i`` under both arms, off first in even
    pairs and on first in odd ones (off,on,on,off,off,on,…), so each arm sees the same requests and a
    steady drift in machine load weighs on both arms equally (exactly so for a multiple of four blocks)."""
    if blocks < 2 or blocks % 2:
        raise ValueError(f"--blocks must be an even number >= 2, got {blocks}")
    order: list[tuple[str, int]] = []
    for pair in range(blocks // 2):
        order += [(arm, pair) for arm in (ARMS if pair % 2 == 0 else ARMS[::-1])]
    return order


def chunks(trace: Sequence[Row], count: int) -> list[list[Row]]:
    """``trace`` cut into ``count`` contiguous chunks whose sizes differ by at most one."""
    if not 1 <= count <= len(trace):
        raise ValueError(f"cannot cut {len(trace)} requests into {count} chunks")
    base, extra = divmod(len(trace), count)
    out, start = [], 0
    for index in range(count):
        size = base + (1 if index < extra else 0)
        out.append(list(trace[start:start + size]))
        start += size
    return out


@dataclass(frozen=True)
class Block:
    """One block's measurements: its arm, the client TTFTs, the check counters' increase, failures."""

    arm: str
    ttfts_ms: list[float]
    checks: dict[str, float]
    failures: int


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0–1), linear between order statistics."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def phase_row(guard: str, ttfts_ms: Sequence[float], checks: Mapping[str, float], *, ratio: float,
              sample_rate: float, failures: int) -> Row:
    agree, disagree = round(checks.get("agree", 0.0)), round(checks.get("disagree", 0.0))
    n = agree + disagree
    low, high = wilson(agree, n) if n else (None, None)
    return {"guard": guard, "requests": len(ttfts_ms), "failures": failures, "ratio": ratio,
            "sample_rate": sample_rate, "p50_ttft_ms": round(percentile(ttfts_ms, 0.5), 1),
            "p99_ttft_ms": round(percentile(ttfts_ms, 0.99), 1),
            "mean_ttft_ms": round(statistics.fmean(ttfts_ms), 1) if ttfts_ms else None,
            "shadow_checks": n, "skipped": round(checks.get("skipped", 0.0)),
            "agreement": round(agree / n, 3) if n else None,
            "agreement_ci95": [round(low, 3), round(high, 3)] if low is not None and high is not None else None}


def arm_rows(blocks: Sequence[Block], *, ratio: float, sample_rate: float) -> list[Row]:
    """One row per arm, its blocks pooled (TTFTs concatenated, check counts summed), with the blocks'
    own p50s beside it (the noise between blocks of one arm) and, on the ``on`` row, the on/off ratios
    of p50 and p99 TTFT."""
    rows: list[Row] = []
    for arm in ARMS:
        mine = [block for block in blocks if block.arm == arm]
        checks: dict[str, float] = {}
        for block in mine:
            for result, value in block.checks.items():
                checks[result] = checks.get(result, 0.0) + value
        row = phase_row(arm, [t for block in mine for t in block.ttfts_ms], checks, ratio=ratio,
                        sample_rate=sample_rate if arm == "on" else 0.0,
                        failures=sum(block.failures for block in mine))
        row["blocks"] = len(mine)
        row["block_p50_ttft_ms"] = [round(percentile(block.ttfts_ms, 0.5), 1) for block in mine]
        rows.append(row)
    off, on = rows
    for q in ("p50", "p99"):
        on[f"{q}_on_off"] = round(on[f"{q}_ttft_ms"] / off[f"{q}_ttft_ms"], 3) if off[f"{q}_ttft_ms"] > 0 else None
    return rows


def format_blocks(blocks: Sequence[Block]) -> str:
    """The blocks in the order they ran: arm, requests, p50/p99 TTFT, checks (the drift over the run)."""
    lines = [f"{'block':>5} {'guard':<6} {'requests':>8} {'p50_ttft_ms':>12} {'p99_ttft_ms':>12} {'checks':>7}"]
    for index, block in enumerate(blocks):
        checks = round(block.checks.get("agree", 0.0) + block.checks.get("disagree", 0.0))
        lines.append(f"{index:>5} {block.arm:<6} {len(block.ttfts_ms):>8} {percentile(block.ttfts_ms, 0.5):>12.1f} "
                     f"{percentile(block.ttfts_ms, 0.99):>12.1f} {checks:>7}")
    return "\n".join(lines)


def format_table(rows: Sequence[Row]) -> str:
    lines = [f"{'guard':<6} {'blocks':>6} {'requests':>8} {'p50_ttft_ms':>12} {'p99_ttft_ms':>12} "
             f"{'block p50 range':>16} {'shadow_checks':>14} {'skipped':>8} {'agreement':>10} {'95% CI':>14}"]
    for row in rows:
        agreement = "-" if row["agreement"] is None else f"{row['agreement']:.3f}"
        ci = "-" if row["agreement_ci95"] is None else f"{row['agreement_ci95'][0]:.2f}–{row['agreement_ci95'][1]:.2f}"
        block_p50s = row.get("block_p50_ttft_ms") or []
        spread = f"{min(block_p50s):.0f}–{max(block_p50s):.0f}" if block_p50s else "-"
        lines.append(f"{row['guard']:<6} {row.get('blocks', 1):>6} {row['requests']:>8} {row['p50_ttft_ms']:>12.1f} "
                     f"{row['p99_ttft_ms']:>12.1f} {spread:>16} {row['shadow_checks']:>14} {row['skipped']:>8} "
                     f"{agreement:>10} {ci:>14}")
    by = {row["guard"]: row for row in rows}
    if {"on", "off"} <= set(by) and by["off"]["p99_ttft_ms"] > 0 and by["off"]["p50_ttft_ms"] > 0:
        lines.append(f"p99 TTFT on/off: {by['on']['p99_ttft_ms'] / by['off']['p99_ttft_ms']:.3f}   "
                     f"p50 on/off: {by['on']['p50_ttft_ms'] / by['off']['p50_ttft_ms']:.3f}")
    return "\n".join(lines)


def check_counts(metrics_text: str) -> dict[str, float]:
    """``kvshard_sidecar_fidelity_checks_total`` summed by ``result`` from one /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == CHECKS:
                out[sample.labels["result"]] = out.get(sample.labels["result"], 0.0) + sample.value
    return out


# ----------------------------------------------------------------------------------------- I/O


def _post(url: str, body: Mapping[str, Any]) -> float:
    """Milliseconds to the answer of one request (raises on an error answer)."""
    payload = json.dumps({k: v for k, v in body.items() if not k.startswith("_")}).encode()
    request = urllib.request.Request(url, data=payload, method="POST", headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=180) as response:
        response.read()
    return (time.perf_counter() - started) * 1000


def replay(url: str, trace: Sequence[Mapping[str, Any]], concurrency: int) -> tuple[list[float], int]:
    """The trace through ``url`` with ``concurrency`` requests in flight: (TTFTs in ms, failures)."""
    ttfts: list[float] = []
    failures = 0
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for future in [pool.submit(_post, url, body) for body in trace]:
            try:
                ttfts.append(future.result())
            except OSError:
                failures += 1
    return ttfts, failures


def _all_checks(sidecar_urls: Sequence[str]) -> dict[str, float]:
    total: dict[str, float] = {}
    for url in sidecar_urls:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
            for result, value in check_counts(response.read().decode()).items():
                total[result] = total.get(result, 0.0) + value
    return total


def settled_checks(sidecar_urls: Sequence[str], quiet_s: float = 4.0, timeout_s: float = 60.0,
                   at_least_s: float = 0.0) -> dict[str, float]:
    """The check counters once no queued shadow check is left to finish (unchanged for ``quiet_s``, and
    not before ``at_least_s``: a check waiting for budget leaves the counters unchanged meanwhile)."""
    started = time.monotonic()
    deadline = started + max(timeout_s, at_least_s + quiet_s)
    last, since = _all_checks(sidecar_urls), time.monotonic()
    while time.monotonic() < deadline and (time.monotonic() - since < quiet_s
                                           or time.monotonic() - started < at_least_s):
        time.sleep(0.5)
        now = _all_checks(sidecar_urls)
        if now != last:
            last, since = now, time.monotonic()
    return last


def _wait(fact: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not fact():
        if time.monotonic() > deadline:
            raise TimeoutError(f"kvshard bench guard: timed out waiting for {what}")
        time.sleep(0.5)


def run(args: argparse.Namespace) -> list[Row]:
    from kvshard_local import LocalCluster
    from kvshard_local.kubeapi import CACHESHARDS

    order = block_order(args.blocks)
    data = load_dataset("movielens-100k")
    ratio = args.ratio / 100
    sample_rate = args.sample_rate / 100
    blend_spec = {"method": "tail", "ratioPercent": args.ratio}
    specs: dict[str, dict[str, Any]] = {
        "off": {"blend": blend_spec, "fidelity": None},
        "on": {"blend": blend_spec, "fidelity": {
            "targetAgreementPercent": 90, "sampleRatePercent": args.sample_rate,
            "minRatioPercent": args.ratio, "maxRatioPercent": args.ratio}}}
    blocks: list[Block] = []
    with tempfile.TemporaryDirectory(prefix="kvshard-bench-guard-") as scratch:
        folder = small_catalog(data, args.items, Path(scratch) / "catalog")
        small = load_dataset(str(folder))
        trace = make_trace(small, args.requests, history=args.history, candidates=args.candidates, seed=args.seed)
        pieces = chunks(trace, args.blocks // 2)
        with LocalCluster(pods=args.pods, dir=Path(scratch) / "run", dataset=str(folder)) as cluster:
            cluster.wait_ready(timeout=300, progress=lambda line: print(line, flush=True))
            path = CACHESHARDS.format(ns=cluster.namespace) + f"/{cluster.name}"
            url = cluster.router_url + "/v1/recommend"
            sidecars = list(cluster.sidecar_urls.values())

            def blend() -> BlendPolicy | None:
                async def read() -> BlendPolicy | None:
                    async with cluster.etcd_store(timeout=2.0, attempts=1) as store:
                        return (await store.read_blend(cluster.namespace, cluster.name))[0]
                return asyncio.run(read())

            def switch(arm: str) -> None:
                rate = sample_rate if arm == "on" else 0.0
                cluster.api.patch(path, {"spec": specs[arm]})
                _wait(lambda: (p := blend()) is not None and (p.ratio, p.sample_rate) == (ratio, rate), 60,
                      f"the blend in force with sample rate {rate}")
                time.sleep(1.0)  # the sidecars' watch applies what etcd shows a moment later

            cluster.api.patch(path, {"spec": {"blend": blend_spec}})
            for _ in range(args.warmup):
                print(f"warm-up: the trace's {len(trace)} requests", flush=True)
                replay(url, trace, args.concurrency)
            before = settled_checks(sidecars)
            for index, (arm, chunk) in enumerate(order):
                if index == 0 or order[index - 1][0] != arm:
                    switch(arm)
                print(f"block {index}: guard {arm}, {len(pieces[chunk])} requests, {args.concurrency} in flight",
                      flush=True)
                ttfts, failures = replay(url, pieces[chunk], args.concurrency)
                switching_off = arm == "on" and (index + 1 == len(order) or order[index + 1][0] == "off")
                after = settled_checks(sidecars, at_least_s=SHADOW_MAX_AGE_S + 1.0 if switching_off else 0.0)
                blocks.append(Block(arm, ttfts, {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after},
                                    failures))
                before = after
    rows = arm_rows(blocks, ratio=ratio, sample_rate=sample_rate)
    print(format_blocks(blocks))
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return rows
