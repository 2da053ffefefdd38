"""Datasets: the items users see and the order in which they saw them.

A dataset is a folder users bring, with two JSON Lines files::

    items.jsonl          {"id": "42", "text": "Toy Story (1995), Animation, Comedy"}
    interactions.jsonl   {"user": "7", "item": "42", "timestamp": 881250949}

``text`` is what the prompt shows for the item, so keep it short and uniform: every prompt that
contains the item reuses its KV block, and a long description costs cache bytes on every pod that
holds it. The built-in ``movielens-100k`` is read from the ``recbole`` package's example data
(located with ``importlib``, never imported: recbole's own dependencies are not wanted here).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

BUILTIN_DATASETS = ("movielens-100k",)


class DatasetError(ValueError):
    """A dataset that cannot be found or parsed; the message names the file and line."""


@dataclass(frozen=True)
class Item:
    """A catalog entry; ``text`` is its prompt text (one line)."""

    id: str
    text: str
    fields: Mapping[str, str] = field(default_factory=dict)
    """Other fields of the catalog line (strings), for a prompt's ``itemFormat`` such as ``{text} ({brand})``."""


@dataclass(frozen=True)
class Interaction:
    user: str
    item: str
    timestamp: int


@dataclass
class Dataset:
    """Items by id and each user's time-ordered history of item ids."""

    name: str
    items: dict[str, Item]
    histories: dict[str, list[str]] = field(default_factory=dict)

    @property
    def num_interactions(self) -> int:
        return sum(len(h) for h in self.histories.values())


def load_dataset(name_or_path: str = "movielens-100k") -> Dataset:
    """Load a built-in dataset by name, or a folder with ``items.jsonl``/``interactions.jsonl``.

    A path to a single ``.jsonl`` file is read as a catalog of items with no interactions.
    """
    if name_or_path in BUILTIN_DATASETS:
        return load_movielens_100k()
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return Dataset(name=path.stem, items=_read_items(path))
    if path.is_dir():
        items = _read_items(path / "items.jsonl")
        interactions_file = path / "interactions.jsonl"
        interactions = list(_read_interactions(interactions_file, items)) if interactions_file.exists() else []
        return Dataset(name=path.name, items=items, histories=_histories(interactions))
    raise DatasetError(
        f"dataset {name_or_path!r} is neither a built-in ({', '.join(BUILTIN_DATASETS)}) "
        "nor an existing folder with items.jsonl / interactions.jsonl"
    )


def _jsonl(path: Path) -> Iterator[tuple[int, dict[str, object]]]:
    if not path.exists():
        raise DatasetError(f"{path} does not exist")
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DatasetError(f"{path}:{number}: not JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise DatasetError(f"{path}:{number}: expected a JSON object")
            yield number, record


def _read_items(path: Path) -> dict[str, Item]:
    items: dict[str, Item] = {}
    for number, record in _jsonl(path):
        item_id, text = record.get("id"), record.get("text")
        if not isinstance(item_id, (str, int)) or isinstance(item_id, bool):
            raise DatasetError(f"{path}:{number}: field 'id' must be a string or integer")
        if not isinstance(text, str) or not text.strip():
            raise DatasetError(f"{path}:{number}: field 'text' must be a non-empty string")
        if str(item_id) in items:
            raise DatasetError(f"{path}:{number}: duplicate item id {item_id!r}")
        fields = {str(k): " ".join(str(v).split()) for k, v in record.items()
                  if k not in ("id", "text") and isinstance(v, (str, int, float, bool)) and str(v).strip()}
        items[str(item_id)] = Item(id=str(item_id), text=" ".join(text.split()), fields=fields)
    if not items:
        raise DatasetError(f"{path}: no items")
    return items


def _read_interactions(path: Path, items: dict[str, Item]) -> Iterator[Interaction]:
    for number, record in _jsonl(path):
        user, item, timestamp = record.get("user"), record.get("item"), record.get("timestamp")
        if not isinstance(user, (str, int)) or not isinstance(item, (str, int)):
            raise DatasetError(f"{path}:{number}: fields 'user' and 'item' must be strings or integers")
        if not isinstance(timestamp, (int, float)) or isinstance(timestamp, bool):
            raise DatasetError(f"{path}:{number}: field 'timestamp' must be a number")
        if str(item) not in items:
            raise DatasetError(f"{path}:{number}: item {item!r} is not in items.jsonl")
        yield Interaction(user=str(user), item=str(item), timestamp=int(timestamp))


def _histories(interactions: list[Interaction]) -> dict[str, list[str]]:
    by_user: dict[str, list[Interaction]] = {}
    for interaction in interactions:
        by_user.setdefault(interaction.user, []).append(interaction)
    # Stable sort: equal timestamps keep file order, so histories are reproducible.
    return {
        user: [i.item for i in sorted(rows, key=lambda i: i.timestamp)]
        for user, rows in sorted(by_user.items(), key=lambda kv: _natural(kv[0]))
    }


def _natural(text: str) -> tuple[int, str]:
    return (int(text), "") if text.isdigit() else (2**63, text)


def movielens_folder() -> Path:
    """``recbole/dataset_example/ml-100k`` inside the installed recbole package."""
    spec = importlib.util.find_spec("recbole")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError("movielens-100k needs the recbole package: pip install --no-deps recbole==1.2.1")
    folder = Path(next(iter(spec.submodule_search_locations))) / "dataset_example" / "ml-100k"
    if not (folder / "ml-100k.item").exists():
        raise DatasetError(f"MovieLens files not found in {folder}")
    return folder


def movielens_item_text(title: str, year: str, genres: list[str]) -> str:
    """``Toy Story (1995), Animation, Children's, Comedy``: short and uniform across items."""
    head = f"{title} ({year})" if year else title
    return ", ".join([head, *genres]) if genres else head


def load_movielens_100k() -> Dataset:
    """MovieLens-100k: 1,682 movies with title, year and genres; 943 users' rating histories."""
    folder = movielens_folder()
    items: dict[str, Item] = {}
    with (folder / "ml-100k.item").open(encoding="utf-8", errors="replace") as handle:
        next(handle)  # header: item_id:token movie_title:token_seq release_year:token class:token_seq
        for line in handle:
            fields = line.rstrip("\n").split("\t")
            if len(fields) < 4:
                continue
            item_id, title, year, genres = fields[:4]
            items[item_id] = Item(id=item_id, text=movielens_item_text(title.strip(), year.strip(), genres.split()))
    interactions: list[Interaction] = []
    with (folder / "ml-100k.inter").open(encoding="utf-8") as handle:
        next(handle)  # header: user_id:token item_id:token rating:float timestamp:float
        for line in handle:
            user, item, _rating, timestamp = line.split("\t")[:4]
            if item in items:
                interactions.append(Interaction(user=user, item=item, timestamp=int(float(timestamp))))
    return Dataset(name="movielens-100k", items=items, histories=_histories(interactions))
