"""Deleting a CacheShard removes every series it had, of every operator metric labelled by CacheShard.

Issue 41: the delete handler looked for ``kvshard_operator_placement_generation`` series labelled
``{namespace, cacheshard: name}`` (the gauge has one label, ``cacheshard="<namespace>/<name>"``), so it
never found one, and would have called ``remove()`` with two label values for one label had it found
one: every deleted CacheShard left its series behind. Checked here on the process's default registry
(what ``/metrics`` serves), with the metrics found by their label, not by a list the fix keeps.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import kopf
import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from kvshard import etcd_store
from kvshard_operator import metrics

LOG = logging.getLogger("test_operator_metrics")


def per_shard_metrics() -> list[MetricWrapperBase]:
    """Every operator metric that carries a CacheShard label, found in the module (so a gauge added later
    without being forgotten on delete fails the test)."""
    return [m for m in vars(metrics).values()
            if isinstance(m, MetricWrapperBase) and "cacheshard" in getattr(m, "_labelnames", ())]


def record(metric: MetricWrapperBase, shard: str) -> None:
    child: Any = metric.labels(shard)
    for method, value in (("set", 3.0), ("inc", 1.0), ("observe", 0.5)):
        if hasattr(child, method):
            getattr(child, method)(value)
            return
    raise AssertionError(f"cannot record a sample of {metric}")


def series_of(shard: str) -> list[tuple[str, dict[str, str]]]:
    """Every sample in the default registry labelled with ``shard``."""
    return [(sample.name, dict(sample.labels)) for family in REGISTRY.collect() for sample in family.samples
            if sample.labels.get("cacheshard") == shard]


@pytest.fixture
def shard_series() -> Iterator[list[MetricWrapperBase]]:
    """Series of ``gone-ns/gone`` (to delete) and ``gone-ns/kept`` (another shard) in every such metric."""
    found = per_shard_metrics()
    for metric in found:
        record(metric, "gone-ns/gone")
        record(metric, "gone-ns/kept")
    yield found
    for shard in ("gone-ns/gone", "gone-ns/kept"):
        for metric in found:
            metric.remove(shard)


def test_the_per_shard_metrics_are_the_ones_the_operator_sets() -> None:
    names = {m._name for m in per_shard_metrics()}  # type: ignore[attr-defined]
    assert {"kvshard_operator_placement_generation", "kvshard_operator_blend_ratio",
            "kvshard_operator_fidelity_target", "kvshard_operator_fidelity_max_ratio"} <= names
    assert set(per_shard_metrics()) == set(metrics.PER_SHARD)


def test_forgetting_a_deleted_cacheshard_removes_every_series_it_had(shard_series: list[MetricWrapperBase]) -> None:
    assert len(series_of("gone-ns/gone")) == len(shard_series) >= 4
    assert 'cacheshard="gone-ns/gone"' in generate_latest(REGISTRY).decode()
    metrics.forget_shard("gone-ns", "gone")
    assert series_of("gone-ns/gone") == []
    assert 'cacheshard="gone-ns/gone"' not in generate_latest(REGISTRY).decode()
    assert len(series_of("gone-ns/kept")) == len(shard_series), "another shard's series must stay"
    metrics.forget_shard("gone-ns", "gone")  # a retried delete, or a shard that never published: no error


class FakeStore:
    """What the delete handler needs of :class:`kvshard.etcd_store.EtcdStore`, with etcd up or down."""

    up = True

    def __init__(self, endpoints: Any, **_: Any) -> None:
        self.endpoints = endpoints

    async def __aenter__(self) -> FakeStore:
        if not FakeStore.up:
            raise etcd_store.EtcdUnavailableError("etcd down (test)")
        return self

    async def __aexit__(self, *_: Any) -> None:
        return None

    async def delete_all(self, namespace: str, name: str) -> int:
        return 7


def delete(spec: dict[str, Any], retry: int = 0) -> None:
    from kvshard_operator import handlers

    asyncio.run(handlers.delete_shard(namespace="gone-ns", name="gone", spec=kopf.Body({"spec": spec}).spec, logger=LOG,
                                      retry=retry))


def test_the_delete_handler_removes_the_series_once_the_etcd_keys_are_gone(
        shard_series: list[MetricWrapperBase], monkeypatch: pytest.MonkeyPatch) -> None:
    """The finalizer (``delete_shard``): while etcd is down the keys and the series stay (retried);
    once the keys are deleted, so is every series of the shard, and no other shard's."""
    monkeypatch.setattr(etcd_store, "EtcdStore", FakeStore)
    monkeypatch.setattr(FakeStore, "up", False)
    with pytest.raises(kopf.TemporaryError):
        delete({"etcd": {"endpoints": ["127.0.0.1:2379"]}})
    assert len(series_of("gone-ns/gone")) == len(shard_series)
    monkeypatch.setattr(FakeStore, "up", True)
    delete({"etcd": {"endpoints": ["127.0.0.1:2379"]}})
    assert series_of("gone-ns/gone") == []
    assert len(series_of("gone-ns/kept")) == len(shard_series)


def test_a_cacheshard_without_etcd_endpoints_is_forgotten_too(shard_series: list[MetricWrapperBase]) -> None:
    delete({})
    assert series_of("gone-ns/gone") == []
