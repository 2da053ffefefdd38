"""Catalog changes as diffs (no existing item moves; new items join the nearest cluster) and the URL
source against a real HTTP server."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvshard.catalog_schema import Catalog, CatalogError
from kvshard.prompt_template import PromptTemplate
from kvshard_operator import catalog
from kvshard_operator import catalog_update as updates

AXES = {"red": 0, "green": 1, "blue": 2}


def embed(texts: Sequence[str]) -> updates.FloatArray:
    """Deterministic unit vectors: a text's colour word picks its axis, its length adds a small tilt."""
    out = np.zeros((len(texts), 4), dtype=np.float32)
    for row, text in enumerate(texts):
        out[row, AXES[text.split()[0]]] = 1.0
        out[row, 3] = 0.01 * len(text)
    norms: updates.FloatArray = np.linalg.norm(out, axis=1, keepdims=True)
    return out / norms


def catalog_of(items: dict[str, str]) -> Catalog:
    return Catalog(tuple(items), tuple(items.values()))


def test_unchanged_items_never_move_and_new_ones_join_their_nearest_cluster() -> None:
    old = catalog_of({f"{colour}-{i}": f"{colour} thing {i}" for colour in AXES for i in range(10)})
    labels = {item: AXES[item.split("-")[0]] for item in old.ids}
    centroids = updates.Centroids.from_vectors(embed(old.texts), [labels[i] for i in old.ids], 3)
    new_items = {k: v for k, v in zip(old.ids, old.texts, strict=True) if k != "red-3"}
    new_items["blue-0"] = "green thing, formerly blue"  # edited: its nearest cluster is now green's
    new_items["red-1"] = "red thing 1, reworded"  # edited: stays red
    new_items["new-g"] = "green newcomer"
    new_items["new-r"] = "red newcomer"
    update = updates.apply_change(old, catalog_of(new_items), labels, centroids, embed, slack_percent=50)
    assert update.moved_unchanged == 0
    assert all(update.labels[i] == labels[i] for i in new_items if i in labels and i not in ("blue-0", "red-1"))
    assert (update.labels["new-g"], update.labels["new-r"]) == (1, 0)
    assert (update.labels["blue-0"], update.labels["red-1"]) == (1, 0)
    assert update.reassigned == ("blue-0",)
    assert "red-3" not in update.labels
    assert update.diff.summary() == "+2 ~2 \u22121"
    assert list(update.labels) == list(new_items)  # in catalog order


def test_a_full_cluster_sends_newcomers_to_the_next_nearest_one() -> None:
    old = catalog_of({f"{colour}-{i}": f"{colour} thing {i}" for colour in AXES for i in range(4)})
    labels = {item: AXES[item.split("-")[0]] for item in old.ids}
    centroids = updates.Centroids.from_vectors(embed(old.texts), [labels[i] for i in old.ids], 3)
    grown = dict(zip(old.ids, old.texts, strict=True)) | {f"red-new-{i}": f"red newcomer {i}" for i in range(6)}
    update = updates.apply_change(old, catalog_of(grown), labels, centroids, embed, slack_percent=0)
    sizes = np.bincount(list(update.labels.values()), minlength=3)
    assert sizes.max() <= 6 and update.moved_unchanged == 0  # cap = ceil(18 / 3)
    assert updates.imbalance(update.labels) == pytest.approx(1.0)


def test_centroids_rebuilt_from_a_sample_place_like_the_full_ones() -> None:
    old = catalog_of({f"{colour}-{i}": f"{colour} thing {i}" for colour in AXES for i in range(50)})
    labels = {item: AXES[item.split("-")[0]] for item in old.ids}
    sampled = updates.sample_centroids(old, labels, 3, embed, sample=5)
    assert sampled.counts.tolist() == [5, 5, 5]
    new = catalog_of(dict(zip(old.ids, old.texts, strict=True)) | {"x": "blue newcomer"})
    assert updates.apply_change(old, new, labels, sampled, embed).labels["x"] == 2


class _CatalogHandler(http.server.BaseHTTPRequestHandler):
    body = b""
    token = "s3cret"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.headers.get("Authorization") != f"Bearer {self.token}":
            self.send_response(401)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def catalog_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _CatalogHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/items.jsonl"
    server.shutdown()


def test_a_url_catalog_is_fetched_with_the_secrets_bearer_token(catalog_server: str) -> None:
    _CatalogHandler.body = b'{"id": "b1", "text": "A book", "author": "Someone"}\n'
    secrets = {("shop", "catalog-token", "token"): "s3cret"}

    def read_key(namespace: str, name: str, key: str) -> str:
        if (namespace, name, key) not in secrets:
            raise ValueError(f"Secret {namespace}/{name} has no key {key!r}")
        return secrets[(namespace, name, key)]

    source = {"url": {"url": catalog_server, "secretRef": {"name": "catalog-token"}}}
    cat = catalog.load_catalog(source, "shop", read_secret_key=read_key)
    assert cat.ids == ("b1",) and dict(cat.fields_of(0)) == {"author": "Someone"}

    with pytest.raises(CatalogError) as info:
        catalog.load_catalog({"url": {"url": catalog_server}}, "shop")
    assert info.value.reason == "CatalogUnreachable" and "HTTP 401" in str(info.value)
    with pytest.raises(CatalogError, match="no key 'token'"):
        catalog.load_catalog(source, "other-namespace", read_secret_key=read_key)


def test_an_unreachable_url_and_a_bad_body_are_catalog_errors(catalog_server: str) -> None:
    with pytest.raises(CatalogError) as info:
        catalog.load_catalog({"url": {"url": "http://127.0.0.1:9/items.jsonl"}}, "ns")
    assert info.value.reason == "CatalogUnreachable" and "catalog URL http://127.0.0.1:9/items.jsonl" in str(info.value)
    _CatalogHandler.body = b'{"id": "1", "text": "ok"}\n{"id": "1", "text": "dup"}\n'
    with pytest.raises(CatalogError) as bad:
        catalog.load_catalog({"url": {"url": catalog_server}}, "ns", read_secret_key=lambda *a: "s3cret")
    assert bad.value.reason == "CatalogUnreachable"  # no token given in the spec: 401
    source = {"url": {"url": catalog_server, "secretRef": {"name": "t"}}}
    with pytest.raises(CatalogError) as dup:
        catalog.load_catalog(source, "ns", read_secret_key=lambda *a: "s3cret")
    assert dup.value.reason == "CatalogInvalid" and "line 2: duplicate id '1'" in str(dup.value)


def test_a_configmap_over_one_mib_is_refused_with_the_limit_named() -> None:
    line = json.dumps({"id": "x", "text": "y" * 1000}) + "\n"
    data = {"items.jsonl": "".join(line.replace('"x"', f'"{i}"') for i in range(1100))}
    with pytest.raises(CatalogError) as info:
        catalog.load_catalog({"configMap": {"name": "cm", "key": "items.jsonl"}}, "ns", lambda ns, name: data)
    assert info.value.reason == "CatalogTooLarge" and "at most 1 MiB" in str(info.value)


@pytest.mark.slow
def test_configmap_edits_flow_as_diffs_and_a_broken_edit_keeps_the_last_good_catalog(
        cluster: Any, catalog_file: Path) -> None:
    """The real operator (KopfRunner) on the emulated API and a real etcd: a ConfigMap catalog with
    its own prompt is placed; an edit publishes one new generation in which no unchanged item moved
    and the status says ``+2 ~1 −1``; a broken edit sets Degraded naming the bad lines and publishes
    nothing; fixing it clears Degraded."""
    from emulated import condition, edit_configmap, etcd_spec
    from kopf.testing import KopfRunner
    from polling import wait_until

    from kvshard.catalog_schema import parse_jsonl
    from kvshard_local.testing_servers import EtcdServer

    lines = catalog_file.read_text().splitlines()
    labels = {"app.kubernetes.io/name": "kvshard-engine"}
    prompt = {"systemText": "You pick what a hobbyist reads about next.", "itemFormat": "{text} [{topic}]"}
    with_topic = [json.dumps({**json.loads(line), "topic": json.loads(line)["id"].split("-")[0]}) for line in lines]
    with EtcdServer() as etcd:
        def current() -> Any:
            async def read() -> Any:
                async with etcd.store(timeout=2, attempts=1) as store:
                    found = await store.read_current("default", "hobbies")
                    return found, (await store.read_catalog("default", "hobbies", found.catalog)) if found else None
            return asyncio.run(read())

        cluster.trust_etcd(etcd)
        for i in range(2):
            cluster.create_pod(f"engine-{i}", labels)
        cluster.create_configmap("hobbies", {"items.jsonl": "\n".join(with_topic)})
        spec = {"model": {"name": "HuggingFaceTB/SmolLM2-135M-Instruct"}, "clusters": 4,
                "catalog": {"configMap": {"name": "hobbies", "key": "items.jsonl"}, "refreshSeconds": 5},
                "prompt": prompt, "podSelector": {"matchLabels": labels}, "capacityPerPod": "8Gi",
                "etcd": etcd_spec(etcd)}
        with KopfRunner(["run", "--standalone", "--all-namespaces", "-m", "kvshard_operator.handlers"],
                        timeout=60) as runner:
            cluster.create_shard({"apiVersion": "kvshard.io/v1alpha1", "kind": "CacheShard",
                                  "metadata": {"name": "hobbies"}, "spec": spec})
            first, first_catalog = wait_until(lambda: current()[0] is not None and current(), what="generation 1")
            assert first_catalog == parse_jsonl("\n".join(with_topic), "x")
            assert PromptTemplate.from_spec(first.prompt) == PromptTemplate.from_spec(prompt)
            assert first.prompt["itemFormat"] == "{text} [{topic}]" and first.catalog == first_catalog.version

            edited = [line for line in with_topic if '"space-3"' not in line]
            edited[0] = json.dumps({"id": "space-0", "text": "rocket launch, rescheduled", "topic": "space"})
            edited += [json.dumps({"id": "space-new", "text": "lunar rover", "topic": "space"}),
                       json.dumps({"id": "music-new", "text": "string quartet", "topic": "music"})]
            edit_configmap(cluster, "hobbies", {"items.jsonl": "\n".join(edited)})
            second, _ = wait_until(lambda: current()[0].generation == 2 and current(), what="generation 2",
                                   timeout=60)
            unchanged = set(first.item_clusters) - {"space-0", "space-3"}
            assert all(second.item_clusters[i] == first.item_clusters[i] for i in unchanged)
            assert {"space-new", "music-new"} <= set(second.item_clusters) and "space-3" not in second.item_clusters
            status = wait_until(lambda: (cluster.shard("hobbies")["status"].get("catalog") or {}).get(
                "lastChange") == "+2 ~1 \u22121" and cluster.shard("hobbies")["status"], what="status.catalog")
            assert status["catalog"]["items"] == 41 and status["catalog"]["version"] == second.catalog

            edit_configmap(cluster, "hobbies", {"items.jsonl": "\n".join([*edited, "{broken", edited[1]])})
            degraded = wait_until(lambda: condition(cluster.shard("hobbies"), "Degraded").get("reason")
                                  == "CatalogInvalid" and condition(cluster.shard("hobbies"), "Degraded"),
                                  what="Degraded=CatalogInvalid", timeout=60)
            assert degraded["status"] == "True"
            assert "ConfigMap default/hobbies key items.jsonl" in degraded["message"]
            assert "line 42: not JSON" in degraded["message"] and "line 43: duplicate id" in degraded["message"]
            assert condition(cluster.shard("hobbies"), "Ready")["status"] == "True"
            assert current()[0].generation == 2  # the last good catalog stays in force

            edit_configmap(cluster, "hobbies", {"items.jsonl": "\n".join(edited)})
            wait_until(lambda: condition(cluster.shard("hobbies"), "Degraded").get("status") == "False",
                       what="Degraded cleared", timeout=60)
            assert current()[0].generation == 2
        assert runner.exception is None, runner.output
