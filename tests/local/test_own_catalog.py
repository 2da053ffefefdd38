"""A user's own catalog and prompt on the local cluster, end to end: a bookshop (not MovieLens).

``kvshard up --dataset items.jsonl --prompt prompt.yaml`` as a user runs it (through
:class:`LocalCluster` with the same settings): requests through the router name the bookshop's ids; a
replaced catalog file reaches warm blocks on the pods and the answer's prompt; a new system text
gives every block a new key; a broken file leaves the last good catalog serving and sets Degraded.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from polling import wait_until

from kvshard_local import LocalCluster
from kvshard_local.kubeapi import CACHESHARDS, condition

pytestmark = [pytest.mark.slow, pytest.mark.model]
DATA = Path(__file__).with_name("data")
REQUEST = ["b02", "b05", "b06"]
"""A fixed request whose candidates include the book the test edits."""
EDITED = ", reissued with a new afterword in which the author tells how the archipelago was drawn"


def post(url: str, body: Any) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=180) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


def recommend(cluster: LocalCluster, candidates: list[Any], user: str = "reader") -> dict[str, Any]:
    status, answer = post(cluster.router_url + "/v1/recommend", {"user_id": user, "history": [],
                                                                 "candidates": candidates})
    assert status == 200, answer
    assert isinstance(answer, dict)
    return answer


def tokens(answer: dict[str, Any], kind: str) -> tuple[int, int, int]:
    """(prompt tokens, tokens served from a cached block, tokens computed cold) of one segment kind."""
    t = answer["tokens"]
    return t["query"].get(kind, 0), sum(t["hit"].get(kind, {}).values()), t["computed"].get(kind, 0)


def replace_catalog(path: Path, rows: list[dict[str, Any]] | str) -> None:
    """Replace the file atomically, as a deploy would (the operator never reads half a file)."""
    text = rows if isinstance(rows, str) else "".join(json.dumps(row) + "\n" for row in rows)
    temp = path.with_suffix(".tmp")
    temp.write_text(text)
    os.replace(temp, path)


def disk_keys(cluster: LocalCluster) -> set[str]:
    """Every block key in any pod's disk tier."""
    return {file.name.removesuffix(".safetensors") for pod in cluster.pod_names
            for file in cluster.pod_disk_dir(pod).rglob("*.safetensors") if not file.name.startswith(".")}


def wait_for_catalog(cluster: LocalCluster, version: str, timeout: float = 60.0) -> dict[str, Any]:
    """The status once it names a catalog version other than ``version``."""
    found: dict[str, Any] = wait_until(
        lambda: (s := cluster.cacheshard().get("status", {})).get("catalog", {}).get("version") not in (None, version)
        and s, timeout=timeout, what=f"a catalog version other than {version[:12]}")
    return found


def test_a_bookshop_catalog_and_prompt_are_served_edited_reprompted_and_survive_a_bad_edit(tmp_path: Path) -> None:
    items = tmp_path / "items.jsonl"
    shutil.copy(DATA / "books.jsonl", items)
    books = [json.loads(line) for line in items.read_text().splitlines()]
    ids = {book["id"] for book in books}
    cluster = LocalCluster(pods=2, dir=tmp_path / "run", dataset=str(items), prompt=DATA / "books-prompt.yaml",
                           clusters_per_pod=2, catalog_refresh_seconds=5, start_timeout_seconds=240)
    with cluster:
        cluster.wait_ready(timeout=240)

        # the CacheShard carries catalog and prompt; the sidecars were given neither
        shard = cluster.cacheshard()
        assert shard["spec"]["catalog"] == {"file": {"path": str(items)}, "refreshSeconds": 5}
        assert shard["spec"]["prompt"]["itemFormat"] == "{text}, by {author}"
        assert shard["status"]["catalog"]["items"] == len(books)
        placement, reports = cluster.warm_reports()
        assert placement is not None
        assert set(placement.item_clusters) == ids
        assert placement.catalog == shard["status"]["catalog"]["version"]
        assert placement.prompt["systemText"].startswith("You are a bookshop's recommender")
        first_version = placement.catalog

        # requests through the router name the bookshop's ids and are served from warm blocks
        for cluster_id in sorted(placement.assignment):
            candidates = list(placement.items_of(cluster_id))
            answer = recommend(cluster, candidates, user=f"reader-{cluster_id}")
            assert answer["candidate"] in candidates
            asked, hit, computed = tokens(answer, "item")
            assert asked > 0 and hit == asked and computed == 0, answer["tokens"]
            assert tokens(answer, "system")[1] == tokens(answer, "system")[0] > 0, answer["tokens"]
        status, body = post(cluster.router_url + "/v1/recommend", {"user_id": "r", "history": [],
                                                                   "candidates": ["b01", "b99"]})
        assert status == 422 and "b99" in str(body), body
        before = recommend(cluster, REQUEST)
        print("before the edit:", before["tokens"])

        # a replaced file: one edited text, two new books; both reach warm blocks and the answer
        edited = [dict(book, text=book["text"] + EDITED) if book["id"] == "b02" else book for book in books]
        new = [{"id": "n01", "text": "Ottolenghi Simple: weeknight dishes in ten ingredients or fewer",
                "author": "Yotam Ottolenghi"},
               {"id": "n02", "text": "Tehanu: the former archmage and a scarred child on a quiet island of Earthsea",
                "author": "Ursula K. Le Guin"}]
        changed_at = time.monotonic()
        replace_catalog(items, edited + new)
        status_after = wait_for_catalog(cluster, first_version)
        assert status_after["catalog"]["items"] == len(books) + 2
        assert status_after["catalog"]["lastChange"] == "+2 ~1 \u22120"
        cluster.wait_ready(timeout=120)
        warm_after = time.monotonic() - changed_at
        print(f"catalog edit: every pod warm on the new generation {warm_after:.1f} s after the file was replaced")
        assert warm_after < 60
        placement, reports = cluster.warm_reports()
        assert placement is not None and set(placement.item_clusters) == ids | {"n01", "n02"}
        for item in ("n01", "n02"):
            holders = [pod for pod in placement.pods if placement.item_clusters[item] in reports[pod].clusters]
            assert holders, f"{item}'s cluster is warm on no pod"
        answer = recommend(cluster, ["n01", "n02", "b02"])
        asked, hit, computed = tokens(answer, "item")
        assert hit == asked and computed == 0, answer["tokens"]
        after = recommend(cluster, REQUEST)
        print("after the edit:", after["tokens"])
        grown = tokens(after, "item")[0] - tokens(before, "item")[0]
        assert grown > 5, "the edited text should be in the prompt"
        assert tokens(after, "item")[1] == tokens(after, "item")[0] and tokens(after, "item")[2] == 0

        # a new system text: every block gets a new key (none computed under the old text is served)
        keys_before = disk_keys(cluster)
        version = placement.catalog
        cluster.api.patch(CACHESHARDS.format(ns=cluster.namespace) + f"/{cluster.name}", {"spec": {"prompt": {
            "systemText": "You are the recommender of a small independent bookshop in Lisbon. Pick the one "
                          "candidate this reader is most likely to buy next."}}})
        wait_until(lambda: (p := cluster.warm_reports()[0]) is not None
                   and p.prompt.get("systemText", "").endswith("buy next.") and "Lisbon" in p.prompt["systemText"],
                   timeout=60, what="a generation under the new system text")
        cluster.wait_ready(timeout=120)
        fresh = disk_keys(cluster) - keys_before
        assert len(fresh) >= len(ids) + 2 + 1, f"only {len(fresh)} new block keys for 14 items and the system text"
        placement, _ = cluster.warm_reports()
        assert placement is not None and placement.catalog == version  # the catalog did not change
        reprompted = recommend(cluster, REQUEST)
        assert tokens(reprompted, "system")[0] != tokens(after, "system")[0]
        assert tokens(reprompted, "system")[1] == tokens(reprompted, "system")[0]
        assert tokens(reprompted, "item")[1] == tokens(reprompted, "item")[0] == tokens(after, "item")[0]

        # a broken file: the last good catalog keeps serving and Degraded names the bad lines
        generation = placement.generation
        lines = items.read_text().splitlines()
        replace_catalog(items, "\n".join([*lines, lines[0], '{"id": "x", "text": '
                                          '"unterminated', '{"id": "b77", "text": ""}']) + "\n")
        degraded = wait_until(lambda: (d := condition(cluster.cacheshard(), "Degraded")).get("status") == "True"
                              and d, timeout=60, what="Degraded=True")
        print("Degraded:", degraded)
        assert degraded["reason"] == "CatalogInvalid"
        assert str(items) in degraded["message"] and "line 15" in degraded["message"]
        assert "duplicate id 'b01'" in degraded["message"] and "line 17" in degraded["message"]
        shard = cluster.cacheshard()
        assert shard["status"]["catalog"]["version"] == version and shard["status"]["catalog"]["items"] == 14
        assert condition(shard, "Ready")["status"] == "True"
        placement, _ = cluster.warm_reports()
        assert placement is not None and placement.catalog == version and placement.generation >= generation
        still = recommend(cluster, REQUEST)
        assert tokens(still, "item") == tokens(reprompted, "item")

        # fixed again: Degraded clears
        replace_catalog(items, "\n".join(lines) + "\n")
        wait_until(lambda: condition(cluster.cacheshard(), "Degraded").get("status") == "False", timeout=60,
                   what="Degraded=False after the fix")
