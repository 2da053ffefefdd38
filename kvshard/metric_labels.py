"""Constant labels on every series of a prometheus_client registry, added at scrape time.

prometheus_client has no constant labels, and a label passed at each ``labels()`` call is one a
future metric can forget. The router and the sidecar put ``cacheshard="<namespace>/<name>"`` on
every series this way: cluster ids and pod names are only unique within one CacheShard, so when one
Prometheus scrapes several shards the rebalancer and the dashboards select one by it. (Only those
two import this module; their extras bring prometheus-client, the core's dependencies do not.)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector


class ConstantLabels(Collector):
    """The families of ``source`` with ``labels`` added to every sample."""

    def __init__(self, source: CollectorRegistry, labels: Mapping[str, str]) -> None:
        self._source = source
        self._labels = dict(labels)

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [s._replace(labels={**s.labels, **self._labels}) for s in family.samples]
            yield labelled


def labelled_registry(source: CollectorRegistry, **labels: str) -> CollectorRegistry:
    """A registry serving every family of ``source`` with ``labels`` added (``/metrics`` serves it)."""
    registry = CollectorRegistry()
    registry.register(ConstantLabels(source, labels))
    return registry
