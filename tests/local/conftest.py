"""A small catalog for the local-cluster tests: the 48 most-watched MovieLens items and the
histories of 60 users over them, so two sidecars warm their clusters in seconds on two cores."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvshard.datasets import load_dataset

    movielens = load_dataset("movielens-100k")
    popular = Counter(item for history in movielens.histories.values() for item in history)
    keep = [item for item, _ in popular.most_common(48)]
    folder = tmp_path_factory.mktemp("small-movielens")
    (folder / "items.jsonl").write_text(
        "".join(json.dumps({"id": i, "text": movielens.items[i].text}) + "\n" for i in keep))
    kept = set(keep)
    rows = []
    for user, history in list(movielens.histories.items())[:60]:
        for t, item in enumerate([i for i in history if i in kept][:20]):
            rows.append(json.dumps({"user": user, "item": item, "timestamp": t}) + "\n")
    (folder / "interactions.jsonl").write_text("".join(rows))
    return folder
