"""``kvshard bench guard``: what the fidelity guard's shadow checks cost a request, on the local cluster.

The issue's bar: shadow checks at ``sampleRate`` 5 % add at most 5 % to request p99 TTFT. A shadow check
is a full prefill run only while no request is in the building, but once it runs it holds the compute
slot, so a request arriving meanwhile waits for it — that wait is what this measures. One local cluster
(real SmolLM2 sidecars, etcd, Prometheus, operator, router), one seeded request trace replayed twice
through the router: first with the guard off (no ``spec.fidelity``: nothing sampled), then with it on
(``spec.fidelity`` at ``--sample-rate`` %, the ratio pinned with ``minRatioPercent = maxRatioPercent`` so
both phases blend alike). A warm-up pass before both puts every block in the pods' memory.

TTFT is the client's time to the answer of a ``max_tokens: 1`` request (queueing behind a shadow check
included), which is what a user of the router sees. ``shadow_checks`` and ``agreement`` come from the
sidecars' own ``kvshard_sidecar_fidelity_checks_total`` over the phase (after the queued checks drained),
with the Wilson 95 % interval, to set beside an offline ``kvshard bench fidelity`` at the same ratio.

The catalog is the ``--items`` most-rated MovieLens items and the histories of the users who rated them
(as the local-cluster tests use), so a two-core machine warms it in seconds. One run, one order (off,
then on): on a shared machine, run it twice before reading much into a few percent.
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
from pathlib import Path
from typing import Any

from kvshard.blend_policy import BlendPolicy
from kvshard.datasets import Dataset, load_dataset
from kvshard_operator.fidelity_policy import wilson

Row = dict[str, Any]
CHECKS = "kvshard_sidecar_fidelity_checks_total"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=150, help="requests per phase (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=20, help="requests before the phases (default: %(default)s)")
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


def format_table(rows: Sequence[Row]) -> str:
    lines = [f"{'guard':<6} {'requests':>8} {'p50_ttft_ms':>12} {'p99_ttft_ms':>12} {'shadow_checks':>14} "
             f"{'skipped':>8} {'agreement':>10} {'95% CI':>14}"]
    for row in rows:
        agreement = "-" if row["agreement"] is None else f"{row['agreement']:.3f}"
        ci = "-" if row["agreement_ci95"] is None else f"{row['agreement_ci95'][0]:.2f}–{row['agreement_ci95'][1]:.2f}"
        lines.append(f"{row['guard']:<6} {row['requests']:>8} {row['p50_ttft_ms']:>12.1f} {row['p99_ttft_ms']:>12.1f} "
                     f"{row['shadow_checks']:>14} {row['skipped']:>8} {agreement:>10} {ci:>14}")
    by = {row["guard"]: row for row in rows}
    if {"on", "off"} <= set(by) and by["off"]["p99_ttft_ms"] > 0:
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


def settled_checks(sidecar_urls: Sequence[str], quiet_s: float = 4.0, timeout_s: float = 60.0) -> dict[str, float]:
    """The check counters once no queued shadow check is left to finish (unchanged for ``quiet_s``)."""
    deadline = time.monotonic() + timeout_s
    last, since = _all_checks(sidecar_urls), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet_s:
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
    from kvshard.local import LocalCluster
    from kvshard.local.kubeapi import CACHESHARDS

    data = load_dataset("movielens-100k")
    ratio = args.ratio / 100
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kvshard-bench-guard-") as scratch:
        folder = small_catalog(data, args.items, Path(scratch) / "catalog")
        small = load_dataset(str(folder))
        trace = make_trace(small, args.requests, history=args.history, candidates=args.candidates, seed=args.seed)
        warmup = make_trace(small, args.warmup, history=args.history, candidates=args.candidates,
                            seed=args.seed + 1)
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

            def phase(guard: str, sample_rate: float, spec: dict[str, Any]) -> None:
                cluster.api.patch(path, {"spec": spec})
                _wait(lambda: (p := blend()) is not None and (p.ratio, p.sample_rate) == (ratio, sample_rate), 60,
                      f"the blend in force with sample rate {sample_rate}")
                before = settled_checks(sidecars)
                print(f"guard {guard}: {len(trace)} requests, {args.concurrency} in flight", flush=True)
                ttfts, failures = replay(url, trace, args.concurrency)
                after = settled_checks(sidecars)
                checks = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                rows.append(phase_row(guard, ttfts, checks, ratio=ratio, sample_rate=sample_rate, failures=failures))

            blend_spec = {"method": "tail", "ratioPercent": args.ratio}
            cluster.api.patch(path, {"spec": {"blend": blend_spec}})
            replay(url, warmup, args.concurrency)
            phase("off", 0.0, {"blend": blend_spec, "fidelity": None})
            phase("on", args.sample_rate / 100, {"blend": blend_spec, "fidelity": {
                "targetAgreementPercent": 90, "sampleRatePercent": args.sample_rate,
                "minRatioPercent": args.ratio, "maxRatioPercent": args.ratio}})
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return rows
