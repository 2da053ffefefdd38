"""Catalog sources of a CacheShard: a built-in data set, a JSONL file, or a ConfigMap key.

Every source yields the same :class:`Catalog` — item ids and texts in a stable order, plus user
histories when the source has them (only built-ins do) for the optional co-occurrence pull. Errors
are :class:`CatalogError` with a CamelCase ``reason`` that becomes the status condition's reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvshard.datasets import DatasetError, load_dataset

ConfigMapReader = Callable[[str, str], Mapping[str, str]]
"""``(namespace, name) -> data``; raises :class:`CatalogError` when the ConfigMap is missing."""


class CatalogError(ValueError):
    """The catalog cannot be loaded; ``reason`` names why in one CamelCase word."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Catalog:
    """Items to place: ``ids[i]`` has text ``texts[i]``; ``histories`` hold item ids."""

    ids: tuple[str, ...]
    texts: tuple[str, ...]
    histories: tuple[tuple[str, ...], ...] = ()

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def content_hash(self) -> str:
        digest = hashlib.blake2b(digest_size=16)
        for item_id, text in zip(self.ids, self.texts, strict=True):
            digest.update(item_id.encode() + b"\x00" + text.encode() + b"\x01")
        return digest.hexdigest()


def parse_jsonl(text: str, origin: str) -> Catalog:
    """A catalog from JSONL lines of ``{"id": ..., "text": ...}`` (blank lines skipped)."""
    ids: list[str] = []
    texts: list[str] = []
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CatalogError("CatalogInvalid", f"{origin} line {number}: not JSON ({exc.msg})") from exc
        if not isinstance(row, dict) or not isinstance(row.get("text"), str) or row.get("id") in (None, ""):
            raise CatalogError("CatalogInvalid", f'{origin} line {number}: expected {{"id": ..., "text": "..."}}')
        item_id = str(row["id"])
        if item_id in seen:
            raise CatalogError("CatalogInvalid", f"{origin} line {number}: duplicate id {item_id!r}")
        seen.add(item_id)
        ids.append(item_id)
        texts.append(row["text"])
    if not ids:
        raise CatalogError("CatalogEmpty", f"{origin} holds no items")
    return Catalog(tuple(ids), tuple(texts))


def load_catalog(source: Mapping[str, Any], namespace: str, read_configmap: ConfigMapReader | None = None) -> Catalog:
    """The catalog named by ``spec.catalog`` (exactly one of builtin, file, configMap)."""
    if "builtin" in source:
        try:
            dataset = load_dataset(str(source["builtin"]))
        except (DatasetError, FileNotFoundError) as exc:
            raise CatalogError("CatalogNotFound", f"built-in catalog {source['builtin']}: {exc}") from exc
        ids = tuple(sorted(dataset.items))
        histories = tuple(tuple(h) for h in dataset.histories.values())
        return Catalog(ids, tuple(dataset.items[i].text for i in ids), histories)
    if "file" in source:
        path = Path(source["file"]["path"])
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise CatalogError("CatalogNotFound", f"catalog file {path}: {exc.strerror or exc}") from exc
        return parse_jsonl(text, str(path))
    if "configMap" in source:
        ref = source["configMap"]
        if read_configmap is None:
            raise CatalogError("CatalogNotFound", "ConfigMap catalogs need API access")
        data = read_configmap(namespace, ref["name"])
        if ref["key"] not in data:
            raise CatalogError("CatalogNotFound", f"ConfigMap {namespace}/{ref['name']} has no key {ref['key']!r}")
        return parse_jsonl(data[ref["key"]], f"ConfigMap {namespace}/{ref['name']} key {ref['key']}")
    raise CatalogError("CatalogInvalid", "spec.catalog names no source")
