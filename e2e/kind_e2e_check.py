"""Requests and metric checks of the kind e2e (stdlib only, so it runs on any host Python).

    python3 e2e/kind_e2e_check.py recommend --url http://127.0.0.1:18100 --requests 6
    python3 e2e/kind_e2e_check.py metrics --url http://127.0.0.1:18100 --expect 'kvshard_sidecar_ready' ...

``recommend`` sends MovieLens-100k requests (item and user ids of the built-in catalog), twice each,
and fails unless every answer is 200 with a text; ``metrics`` fails unless every expected series
is present with a value > 0. Exit code 0 on success, 1 with a message naming what failed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.error
import urllib.request
from typing import Any

REQUESTS: list[dict[str, Any]] = [
    {"user_id": "1", "history": ["1", "2", "3", "4"], "candidates": ["50", "172", "181", "7"]},
    {"user_id": "2", "history": ["10", "11", "12"], "candidates": ["50", "100", "121", "7"]},
    {"user_id": "3", "history": ["181", "258", "286", "288"], "candidates": ["1", "2", "300", "301"]},
]


def _post(url: str, body: dict[str, Any], timeout: float) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, {"error": error.read().decode(errors="replace")}


def recommend(url: str, count: int, timeout: float) -> int:
    failures = 0
    for i in range(count):
        body = REQUESTS[i % len(REQUESTS)]
        started = time.monotonic()
        status, answer = _post(f"{url.rstrip('/')}/v1/recommend", body, timeout)
        elapsed = time.monotonic() - started
        ranked = [entry.get("candidate") for entry in answer.get("ranking") or []]
        ok = status == 200 and answer.get("candidate") in body["candidates"] and sorted(ranked) == sorted(
            body["candidates"])
        failures += not ok
        print(f"request {i + 1}/{count}: HTTP {status} in {elapsed:.1f} s, candidate={answer.get('candidate')!r}"
              + ("" if ok else f" FAILED: {answer}"))
    return 1 if failures else 0


def _samples(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            try:
                out[series] = float(value)
            except ValueError:
                continue
    return out


def metrics(url: str, expected: list[str], timeout: float) -> int:
    with urllib.request.urlopen(f"{url.rstrip('/')}/metrics", timeout=timeout) as response:
        samples = _samples(response.read().decode())
    missing = []
    for pattern in expected:
        regex = re.compile(pattern)
        values = [v for series, v in samples.items() if regex.search(series)]
        total = sum(values)
        print(f"{pattern}: {len(values)} series, sum {total:g}")
        if total <= 0:
            missing.append(pattern)
    if missing:
        print(f"FAILED: no series > 0 for {missing}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("recommend", help="send /v1/recommend requests")
    rec.add_argument("--url", required=True)
    rec.add_argument("--requests", type=int, default=6)
    rec.add_argument("--timeout", type=float, default=300.0)
    met = sub.add_parser("metrics", help="check /metrics series")
    met.add_argument("--url", required=True)
    met.add_argument("--expect", action="append", default=[], help="regex of a series that must be > 0")
    met.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args(argv)
    if args.command == "recommend":
        return recommend(args.url, args.requests, args.timeout)
    return metrics(args.url, args.expect, args.timeout)


if __name__ == "__main__":
    raise SystemExit(main())
