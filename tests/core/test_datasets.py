"""Datasets: the user folder format and the built-in MovieLens-100k."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvshard.datasets import DatasetError, load_dataset


def test_user_folder_loads_items_and_time_ordered_histories(tiny_dataset_dir: Path) -> None:
    dataset = load_dataset(str(tiny_dataset_dir))
    assert sorted(dataset.items) == ["3", "a", "b"]
    assert dataset.items["3"].text == "Gamma (2003), Horror"  # whitespace folded to one line
    assert dataset.histories == {"u1": ["a", "b"], "u2": ["3"]}


def test_a_single_jsonl_file_is_a_catalog(tiny_dataset_dir: Path) -> None:
    dataset = load_dataset(str(tiny_dataset_dir / "items.jsonl"))
    assert len(dataset.items) == 3 and dataset.histories == {}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        ('{"id": "x"}', "field 'text'"),
        ('{"id": true, "text": "t"}', "field 'id'"),
        ('{"id": "a", "text": "dup"}', "duplicate item id"),
    ],
)
def test_bad_item_lines_are_reported_with_file_and_line(tiny_dataset_dir: Path, line: str, message: str) -> None:
    items = tiny_dataset_dir / "items.jsonl"
    items.write_text(items.read_text() + line + "\n")
    with pytest.raises(DatasetError, match=message) as error:
        load_dataset(str(tiny_dataset_dir))
    assert "items.jsonl:4" in str(error.value)


def test_interactions_must_name_known_items(tiny_dataset_dir: Path) -> None:
    (tiny_dataset_dir / "interactions.jsonl").write_text('{"user": "u", "item": "zzz", "timestamp": 1}\n')
    with pytest.raises(DatasetError, match="not in items.jsonl"):
        load_dataset(str(tiny_dataset_dir))


def test_unknown_dataset_names_the_builtins() -> None:
    with pytest.raises(DatasetError, match="movielens-100k"):
        load_dataset("no-such-dataset")


def test_movielens_100k_has_every_movie_and_user(movielens: Any) -> None:
    assert len(movielens.items) == 1682
    assert len(movielens.histories) == 943
    assert movielens.num_interactions == 100_000
    assert movielens.items["1"].text == "Toy Story (1995), Animation, Children's, Comedy"
    assert min(len(h) for h in movielens.histories.values()) >= 20
