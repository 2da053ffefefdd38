"""What the rebalancer reads from Prometheus: one instant-query client and the PromQL, in one place.

The router and the sidecars export *counters* (docs/architecture.md#metrics); rates and ratios are computed here, in
PromQL, over a window ``W`` (the CacheShard's rebalance interval unless configured otherwise; keep it
at least 4× the scrape interval so ``rate()`` always has several samples):

* per-cluster request rate — ``kvshard_router_cluster_requests_total{cluster}`` counts, per routed
  request, each distinct known cluster among its candidates;
* per-pod load — ``kvshard_router_requests_total{pod,code}``, requests the router sent to each pod;
* per-pod item hit ratio — ``kvshard_sidecar_hit_tokens_total`` over ``kvshard_sidecar_query_tokens_total``
  (``kind="item"``), by the ``pod`` *target* label that the scrape config puts on each sidecar.

Every query selects ``{cacheshard="<namespace>/<name>"}``, the label the router and the sidecars put
on every series: cluster ids and pod names are only unique within one CacheShard, so without it a
Prometheus that scrapes two shards would add cluster 3 of one to cluster 3 of the other, and
same-named pods of two namespaces to each other.

Failures (unreachable, non-200, ``status: error``, not JSON, not a vector) raise one
:class:`PrometheusError`; a query that matches nothing yet is an empty result, not an error, because
a fresh deployment has no traffic.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from types import TracebackType
from typing import Any

import aiohttp

CLUSTER_RATES = "sum by (cluster) (rate(kvshard_router_cluster_requests_total{{{shard}}}[{window}]))"
POD_LOAD = "sum by (pod) (rate(kvshard_router_requests_total{{{shard}}}[{window}]))"
POD_HIT_RATIO = (
    'sum by (pod) (rate(kvshard_sidecar_hit_tokens_total{{{shard},kind="item"}}[{window}]))'
    ' / sum by (pod) (rate(kvshard_sidecar_query_tokens_total{{{shard},kind="item"}}[{window}]))'
)
"""The heat queries; ``{shard}`` is :func:`shard_selector`, ``{window}`` a :func:`window`."""


class PrometheusError(Exception):
    """Prometheus could not answer a query (the message says which and why)."""


@dataclasses.dataclass(frozen=True)
class Heat:
    """One interval's observations, keyed by label value."""

    cluster_rates: dict[int, float]
    """Cluster id → requests/s whose candidates included the cluster."""
    pod_load: dict[str, float]
    """Pod → requests/s the router sent it."""
    pod_hit_ratio: dict[str, float]
    """Pod → share of item prompt tokens served from cached blocks (pods without item traffic absent)."""

    @property
    def has_traffic(self) -> bool:
        return any(r > 0 for r in self.cluster_rates.values()) or any(v > 0 for v in self.pod_load.values())


def window(seconds: float) -> str:
    """A PromQL range duration: whole seconds, at least 1."""
    return f"{max(1, round(seconds))}s"


def promql_string(value: str) -> str:
    r"""``value`` as a double-quoted PromQL string literal. PromQL strings take Go's escapes, of which
    JSON's (``\"``, ``\\``, ``\n``, ``\u`` escapes for other control characters) are a subset, so JSON
    encoding quotes any value safely."""
    return json.dumps(value, ensure_ascii=False)


def shard_selector(namespace: str, name: str) -> str:
    """The label matcher of one CacheShard's series: ``cacheshard="<namespace>/<name>"``."""
    return f"cacheshard={promql_string(f'{namespace}/{name}')}"


def heat_queries(namespace: str, name: str, window_seconds: float) -> tuple[str, str, str]:
    """The PromQL of :meth:`PrometheusClient.heat`: cluster rates, pod load, pod item hit ratio."""
    fields = {"shard": shard_selector(namespace, name), "window": window(window_seconds)}
    return CLUSTER_RATES.format(**fields), POD_LOAD.format(**fields), POD_HIT_RATIO.format(**fields)


class PrometheusClient:
    """Instant queries against ``url`` (``GET /api/v1/query``); use as ``async with``."""

    def __init__(self, url: str, *, timeout: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> PrometheusClient:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def query(self, promql: str) -> list[tuple[dict[str, str], float]]:
        """The instant vector of ``promql`` as ``(labels, value)`` pairs (empty when nothing matches)."""
        if self._session is None:
            raise PrometheusError("PrometheusClient is not open; use `async with`")
        endpoint = f"{self.url}/api/v1/query"
        try:
            async with self._session.get(endpoint, params={"query": promql}) as resp:
                body = await resp.text()
                status = resp.status
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise PrometheusError(f"prometheus at {self.url} unreachable: {type(exc).__name__}: {exc}") from exc
        try:
            doc: Any = json.loads(body)
        except json.JSONDecodeError as exc:
            raise PrometheusError(f"prometheus at {self.url} answered HTTP {status} with non-JSON: {body[:200]!r}") \
                from exc
        if not isinstance(doc, dict):
            raise PrometheusError(f"prometheus at {self.url} answered HTTP {status} with {body[:200]!r}")
        if status != 200 or doc.get("status") != "success":
            raise PrometheusError(f"prometheus at {self.url} rejected {promql!r}: HTTP {status}, "
                                  f"{doc.get('errorType', 'error')}: {doc.get('error', body[:200])}")
        data = doc.get("data")
        if not isinstance(data, dict) or data.get("resultType") != "vector" or not isinstance(data.get("result"), list):
            kind = data.get("resultType") if isinstance(data, dict) else type(data).__name__
            raise PrometheusError(f"prometheus at {self.url}: {promql!r} is not an instant vector ({kind})")
        out: list[tuple[dict[str, str], float]] = []
        for sample in data["result"]:
            try:
                out.append(({str(k): str(v) for k, v in sample["metric"].items()}, float(sample["value"][1])))
            except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
                raise PrometheusError(f"prometheus at {self.url}: malformed sample {sample!r}") from exc
        return out

    async def by_label(self, promql: str, label: str) -> dict[str, float]:
        """``{value of label: sample value}``; samples without the label or with NaN/±Inf (a ratio
        over an empty window) are left out."""
        return {labels[label]: value for labels, value in await self.query(promql)
                if label in labels and math.isfinite(value)}

    async def heat(self, namespace: str, name: str, window_seconds: float) -> Heat:
        """The CacheShard ``namespace/name``'s per-cluster rates, per-pod load and hit ratio over the
        last ``window_seconds`` (other shards' series are not counted)."""
        cluster_rates, pod_load, pod_hit_ratio = heat_queries(namespace, name, window_seconds)
        clusters, load, hits = await asyncio.gather(
            self.by_label(cluster_rates, "cluster"),
            self.by_label(pod_load, "pod"),
            self.by_label(pod_hit_ratio, "pod"),
        )
        rates: dict[int, float] = {}
        for label, rate in clusters.items():
            try:
                rates[int(label)] = rate
            except ValueError:
                continue  # not one of ours: cluster ids are integers
        return Heat(rates, load, hits)
