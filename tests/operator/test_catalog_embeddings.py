"""The operator places by the vectors a catalog carries (spec.catalog.embeddings, issue 19): the model
is skipped, large catalogs go through the sampled placement, catalog changes join the same centroids,
and bad vectors end in the CacheShard's conditions naming their lines."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from typing import Any

import numpy as np
import pytest

GROUPS = 3
DIM = 8


def line(item_id: str, group: int, rng: np.random.Generator, *, vector: bool = True) -> str:
    """One item whose vector points along axis ``group`` (plus noise); every text is the same, so only
    the given vectors can tell the groups apart (the model would see one item, 126 times)."""
    row: dict[str, Any] = {"id": item_id, "text": "a product"}
    if vector:
        v = rng.normal(0, 0.05, DIM)
        v[group] += 1.0
        row["embedding"] = np.round(v, 4).tolist()
    return json.dumps(row)


@pytest.mark.slow
def test_given_vectors_are_placed_by_the_sampled_placement_and_changes_reuse_its_centroids(
        cluster: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real operator (KopfRunner) on the emulated API and a TLS etcd, with the large-catalog
    threshold at 60 items: a 120-item ConfigMap catalog whose lines carry vectors is placed one group
    per cluster; added items join their group's cluster and nothing unchanged moves; a line without a
    vector sets Degraded=CatalogInvalid naming it while the last good catalog stays in force."""
    from emulated import condition, edit_configmap, etcd_spec, read_current
    from kopf.testing import KopfRunner
    from polling import wait_until

    from kvshard_local.testing_servers import EtcdServer
    from kvshard_operator import embedding, handlers

    monkeypatch.setattr(handlers, "SETTINGS", dataclasses.replace(handlers.SETTINGS, large_placement_items=60))

    def no_model(*_: object, **__: object) -> None:
        raise AssertionError("the model was used although the catalog carries vectors")

    monkeypatch.setattr(embedding, "embed_catalog", no_model)
    monkeypatch.setattr(embedding, "embed_texts", no_model)
    rng = np.random.default_rng(7)
    lines = [line(f"g{g}-{i}", g, rng) for i in range(40) for g in range(GROUPS)]
    labels = {"app.kubernetes.io/name": "kvshard-engine"}
    with EtcdServer() as etcd:
        def current() -> Any:
            return read_current(etcd, "shop")

        cluster.trust_etcd(etcd)
        for i in range(2):
            cluster.create_pod(f"engine-{i}", labels)
        cluster.create_configmap("shop", {"items.jsonl": "\n".join(lines)})
        spec = {"model": {"name": "HuggingFaceTB/SmolLM2-135M-Instruct"}, "clusters": GROUPS,
                "catalog": {"configMap": {"name": "shop", "key": "items.jsonl"}, "refreshSeconds": 5,
                            "embeddings": {"from": "Field", "dimension": DIM}},
                "podSelector": {"matchLabels": labels}, "capacityPerPod": "8Gi", "etcd": etcd_spec(etcd)}
        with KopfRunner(["run", "--standalone", "--all-namespaces", "-m", "kvshard_operator.handlers"],
                        timeout=60) as runner:
            cluster.create_shard({"apiVersion": "kvshard.io/v1alpha1", "kind": "CacheShard",
                                  "metadata": {"name": "shop"}, "spec": spec})
            first = wait_until(current, what="generation 1")
            by_group = {g: {c for item, c in first.item_clusters.items() if item.startswith(f"g{g}-")}
                        for g in range(GROUPS)}
            assert all(len(c) == 1 for c in by_group.values()), by_group  # one cluster per group ...
            assert len(set.union(*by_group.values())) == GROUPS  # ... and a different one each
            assert Counter(first.item_clusters.values()) == Counter({c: 40 for c in range(GROUPS)})

            added = [line(f"new-{i}", 1, rng) for i in range(3)]
            edit_configmap(cluster, "shop", {"items.jsonl": "\n".join([*lines, *added])})
            second = wait_until(lambda: (found := current()).generation == 2 and found, what="generation 2")
            assert all(second.item_clusters[i] == c for i, c in first.item_clusters.items())
            group_one = next(iter(by_group[1]))
            assert [second.item_clusters[f"new-{i}"] for i in range(3)] == [group_one] * 3

            mixed = [*lines, *added, line("bare", 0, rng, vector=False)]
            edit_configmap(cluster, "shop", {"items.jsonl": "\n".join(mixed)})
            degraded = wait_until(lambda: condition(cluster.shard("shop"), "Degraded").get("reason")
                                  == "CatalogInvalid" and condition(cluster.shard("shop"), "Degraded"),
                                  what="Degraded=CatalogInvalid", timeout=30)
            assert degraded["status"] == "True" and "line 124: no 'embedding' vector" in degraded["message"]
            assert condition(cluster.shard("shop"), "Ready")["status"] == "True"
            assert current().generation == 2  # the last good catalog stays in force
        assert runner.exception is None, runner.output
