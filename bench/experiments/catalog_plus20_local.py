"""Issue 13 measurement: +20 new items in the 1,682-item MovieLens catalog on the local cluster.

Starts ``kvshard up``'s cluster (3 SmolLM2 pods, the catalog as a file source, refresh 5 s), asks for 20 existing
items, appends 20 new movies to the file, and reports how long until every new item is warm on its cluster's pods
and the per-kind hit ratio (tokens served from cached blocks / tokens asked) of a request naming the new items.
Run: ``.venv/bin/python bench/experiments/catalog_plus20_local.py`` (about 3 minutes).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvshard.datasets import load_dataset
from kvshard_local import LocalCluster

TITLES = [
    "Gattaca (1997), Drama, Sci-Fi, Thriller", "Boogie Nights (1997), Drama", "The Ice Storm (1997), Drama",
    "Jackie Brown (1997), Crime, Drama", "Wag the Dog (1997), Comedy, Drama", "The Sweet Hereafter (1997), Drama",
    "Princess Mononoke (1997), Animation, Adventure, Fantasy", "Cube (1997), Horror, Mystery, Sci-Fi",
    "Lost Highway (1997), Mystery, Thriller", "The Game (1997), Mystery, Thriller",
    "Donnie Brasco (1997), Crime, Drama", "The Fifth Element (1997), Action, Sci-Fi",
    "Grosse Pointe Blank (1997), Comedy, Crime", "Eve's Bayou (1997), Drama", "The Full Monty (1997), Comedy",
    "Good Will Hunting (1997), Drama", "As Good as It Gets (1997), Comedy, Drama", "Amistad (1997), Drama, History",
    "The Rainmaker (1997), Drama, Thriller", "Kundun (1997), Drama, History",
]
NEW = [{"id": f"new-{k:02d}", "text": text} for k, text in enumerate(TITLES)]


def wait(fact: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := fact():
            return found
        time.sleep(0.2)
    raise TimeoutError(f"no {what} after {timeout:.0f} s")


def recommend(cluster: LocalCluster, candidates: list[str]) -> dict[str, Any]:
    body = json.dumps({"user_id": "u1", "history": [], "candidates": candidates}).encode()
    request = urllib.request.Request(cluster.router_url + "/v1/recommend", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def hit_ratios(answer: dict[str, Any]) -> dict[str, str]:
    tokens = answer["tokens"]
    return {kind: f"{sum(tokens['hit'].get(kind, {}).values())}/{asked}" for kind, asked in tokens["query"].items()}


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="kvshard-plus20-"))
    items = work / "items.jsonl"
    dataset = load_dataset("movielens-100k")
    rows = [{"id": i, "text": item.text} for i, item in sorted(dataset.items.items(), key=lambda kv: int(kv[0]))]
    items.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cluster = LocalCluster(pods=3, dir=work / "run", dataset=str(items), catalog_refresh_seconds=5,
                           start_timeout_seconds=600)
    with cluster:
        started = time.monotonic()
        cluster.wait_ready(timeout=900)
        print(f"ready and warm: {time.monotonic() - started:.0f} s", flush=True)
        placement, _ = cluster.warm_reports()
        assert placement is not None
        version = placement.catalog
        print("before, 20 existing items:", hit_ratios(recommend(cluster, [row["id"] for row in rows[:20]])))
        temp = items.with_suffix(".tmp")
        temp.write_text(items.read_text() + "".join(json.dumps(row) + "\n" for row in NEW))
        os.replace(temp, items)
        changed = time.monotonic()

        def all_new_items_warm() -> bool:
            current, reports = cluster.warm_reports()
            if current is None or current.catalog == version:
                return False
            for row in NEW:
                holders = current.pods_for_item(row["id"])
                if not holders or any(h in reports and current.item_clusters[row["id"]] not in reports[h].clusters
                                      for h in holders):
                    return False
            return True

        wait(all_new_items_warm, 300, "warm new items")
        print(f"every new item warm on its cluster's pods {time.monotonic() - changed:.1f} s after the file was "
              f"replaced; status {cluster.cacheshard()['status']['catalog']}")
        answer = recommend(cluster, [row["id"] for row in NEW])
        print("after, the 20 new items:", hit_ratios(answer), "candidate:", answer["candidate"])


if __name__ == "__main__":
    main()
