"""What a router publishes under ``corequest/<router>``: its top co-requested cluster pairs and the
clusters' request shares over one interval (shared by the router, which writes it, and the operator,
which reads it — neither may import the other).

Pairs, not a Prometheus label per pair: clusters² label values would be a cardinality bomb, while
this value is bounded by the router's ``top`` (a few thousand pairs, well under etcd's 1 MiB) and
lives under a lease, so a router that died stops counting after a few intervals.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvshard.placement_schema import MAX_VALUE_BYTES

SCHEMA = 1
Pair = tuple[int, int]


class CoRequestFormatError(ValueError):
    """A published co-request report is unreadable or too large."""


@dataclass(frozen=True)
class CoRequestReport:
    """One router's interval: pair weights (``s_a · s_b`` summed over requests), per-cluster shares
    (Σ ``s_c``), the requests counted, and when (unix seconds) the interval ended."""

    router: str
    pairs: Mapping[Pair, float]
    rates: Mapping[int, float]
    requests: int
    at: float

    def encode(self) -> bytes:
        body = {
            "schema": SCHEMA, "router": self.router, "requests": self.requests, "at": self.at,
            "pairs": [[a, b, round(w, 6)] for (a, b), w in self.pairs.items()],
            "rates": [[c, round(w, 6)] for c, w in self.rates.items()],
        }
        data = json.dumps(body, separators=(",", ":")).encode()
        if len(data) > MAX_VALUE_BYTES:
            raise CoRequestFormatError(f"co-request report of {len(self.pairs)} pairs is {len(data)} bytes "
                                       f"(> 1 MiB); publish fewer pairs")
        return data

    @classmethod
    def decode(cls, data: bytes) -> CoRequestReport:
        try:
            body = json.loads(data)
            if body.get("schema") != SCHEMA:
                raise CoRequestFormatError(f"co-request schema {body.get('schema')!r}, expected {SCHEMA}")
            pairs = {(min(int(a), int(b)), max(int(a), int(b))): float(w) for a, b, w in body["pairs"]}
            rates = {int(c): float(w) for c, w in body["rates"]}
            return cls(str(body["router"]), pairs, rates, int(body["requests"]), float(body["at"]))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            if isinstance(exc, CoRequestFormatError):
                raise
            raise CoRequestFormatError(f"unreadable co-request report: {exc}") from exc


def merge(reports: Iterable[CoRequestReport]) -> tuple[dict[Pair, float], dict[int, float]]:
    """Every router's interval as one graph: weights add (each router saw its own requests)."""
    pairs: dict[Pair, float] = {}
    rates: dict[int, float] = {}
    for report in reports:
        for (a, b), w in report.pairs.items():
            key = (min(a, b), max(a, b))
            pairs[key] = pairs.get(key, 0.0) + w
        for c, w in report.rates.items():
            rates[c] = rates.get(c, 0.0) + w
    return pairs, rates
