"""The placement data model shared by the operator (writer), the router and the sidecars (readers).

A :class:`Placement` is one *generation*: which pods hold each item cluster, which cluster each item
belongs to, and how user-history blocks are kept. Every stored value is ≤ :data:`MAX_VALUE_BYTES`
because etcd refuses larger requests (1.5 MiB default) and big values stall its raft log.

Schema 2 (written today): the generation's ``assignment`` value (cluster → pods, a few kilobytes)
names an *item map* by the digest of its content (``itemMap``). The item map (item → cluster) is
stored once per content under ``itemmap/<digest>/`` (:func:`encode_item_map`): chunks that group
items by cluster, and a manifest carrying the per-cluster index (cluster → chunk numbers) and counts.
So a generation that only moves clusters between pods writes one small value, a reader whose map
digest did not change reads no chunk, and a sidecar can read only its own clusters' chunks.

Schema 1 (read only, through one release): the generation holds its own ``items/<chunk>`` values
(:func:`encode` / :func:`decode`).

The encoding is JSON (readable with ``etcdctl get``) and versioned by ``schema``; readers refuse a
schema they do not know rather than guess.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

SCHEMA = 2
"""The schema of the ``assignment`` values (and item maps) this code writes."""
SCHEMA_V1 = 1
"""Generations holding their own item chunks; still read, no longer written."""
_READABLE = (SCHEMA_V1, SCHEMA)
WARM_SCHEMA = 1
MAX_VALUE_BYTES = 1 << 20  # 1 MiB, docs/architecture.md#etcd-layout
_CHUNK_TARGET = MAX_VALUE_BYTES - 4096  # room for the JSON wrapper


class PlacementFormatError(ValueError):
    """A stored value is not a placement this code understands (or one would exceed 1 MiB)."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """One placement generation of one CacheShard."""

    generation: int
    assignment: Mapping[int, tuple[str, ...]]
    """Cluster id → pods holding it (best first)."""
    item_clusters: Mapping[str, int]
    """Item id → cluster id."""
    pods: tuple[str, ...] = ()
    model: str = ""
    revision: str = ""
    history_policy: str = "ReplicateAll"
    history_bytes_per_pod: int = 0
    catalog: str = ""
    """The catalog version (:mod:`kvshard.catalog_schema`) this generation was computed from; pods
    load exactly this one from etcd ("" before catalogs were published: pods keep their own)."""
    prompt: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """``spec.prompt`` in force ({} = the default template)."""

    @property
    def clusters(self) -> int:
        return len(self.assignment)

    def clusters_of(self, pod: str) -> list[int]:
        """The clusters ``pod`` should warm, in id order."""
        return sorted(c for c, holders in self.assignment.items() if pod in holders)

    def pods_for_item(self, item_id: str) -> tuple[str, ...]:
        """Pods holding ``item_id``'s cluster (empty for an unknown item: a cold-start item)."""
        cluster = self.item_clusters.get(item_id)
        return () if cluster is None else tuple(self.assignment.get(cluster, ()))

    def items_of(self, cluster: int) -> list[str]:
        return sorted(i for i, c in self.item_clusters.items() if c == cluster)


@dataclasses.dataclass(frozen=True)
class WarmReport:
    """What one sidecar says about itself under ``warm/<pod>``: the clusters whose item blocks it
    holds (for ``generation``), where it answers (``url``, so the router and peers can reach it
    without a Kubernetes lookup), and how many assigned clusters it is still warming."""

    generation: int
    clusters: tuple[int, ...]
    url: str = ""
    warming: int = 0

    def encode(self) -> bytes:
        doc = {"schema": WARM_SCHEMA, "generation": self.generation, "clusters": sorted(set(self.clusters)),
               "url": self.url, "warming": self.warming}
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> WarmReport:
        try:
            doc = json.loads(data)
            return cls(int(doc["generation"]), tuple(int(c) for c in doc["clusters"]), str(doc.get("url", "")),
                       int(doc.get("warming", 0)))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise PlacementFormatError(f"not a warm report: {exc}") from exc


def encode_assignment(placement: Placement, chunks: int, *, item_map: str = "") -> bytes:
    """The ``gen/<G>/assignment`` value; pods are listed once and referenced by index. With
    ``item_map`` (a digest) it is schema 2 and names that item map; without, schema 1 with ``chunks``
    item chunks of its own."""
    pods = sorted(set(placement.pods) | {p for h in placement.assignment.values() for p in h})
    index = {p: i for i, p in enumerate(pods)}
    doc: dict[str, Any] = {
        "schema": SCHEMA if item_map else SCHEMA_V1,
        "generation": placement.generation,
        "model": placement.model,
        "revision": placement.revision,
        "pods": pods,
        "clusters": {str(c): [index[p] for p in h] for c, h in sorted(placement.assignment.items())},
        "history": {"policy": placement.history_policy, "bytesPerPod": placement.history_bytes_per_pod},
    }
    if item_map:
        doc["itemMap"] = item_map
        doc["items"] = len(placement.item_clusters)
    else:
        doc["chunks"] = chunks
    if placement.catalog:
        doc["catalog"] = placement.catalog
    if placement.prompt:
        doc["prompt"] = dict(placement.prompt)
    data = json.dumps(doc, separators=(",", ":")).encode()
    if len(data) > MAX_VALUE_BYTES:
        raise PlacementFormatError(
            f"assignment of {len(placement.assignment)} clusters is {len(data)} bytes (> 1 MiB); use fewer clusters"
        )
    return data


def encode_items(item_clusters: Mapping[str, int]) -> list[bytes]:
    """The ``gen/<G>/items/<chunk>`` values: item → cluster, split so each stays under 1 MiB."""
    chunks: list[bytes] = []
    current: dict[str, int] = {}
    size = 0
    quote = json.encoder.encode_basestring_ascii
    for item, cluster in sorted(item_clusters.items()):
        # len(json.dumps({item: cluster})) + 1, without a dumps call per item (100k items: seconds)
        entry = len(quote(item)) + len(str(int(cluster))) + 5
        if current and size + entry > _CHUNK_TARGET:
            chunks.append(_dump_chunk(current))
            current, size = {}, 0
        current[item] = int(cluster)
        size += entry
    if current or not chunks:
        chunks.append(_dump_chunk(current))
    return chunks


def _dump_chunk(items: Mapping[str, int]) -> bytes:
    data = json.dumps({"schema": SCHEMA_V1, "items": items}, separators=(",", ":")).encode()
    if len(data) > MAX_VALUE_BYTES:
        raise PlacementFormatError("a single item id is larger than 1 MiB")
    return data


def encode(placement: Placement) -> tuple[bytes, list[bytes]]:
    """``(assignment value, item chunk values)`` for one schema-1 generation (the old layout, kept
    for tests and for measuring what it cost; :func:`encode_item_map` is what is written now)."""
    items = encode_items(placement.item_clusters)
    return encode_assignment(placement, len(items)), items


def _load(data: bytes, schemas: Collection[int] = _READABLE) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlacementFormatError(f"not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("schema") not in schemas:
        raise PlacementFormatError(
            f"unknown placement schema {doc.get('schema') if isinstance(doc, dict) else doc!r} "
            f"(this reader knows {', '.join(map(str, schemas))}; upgrade it)")
    return doc


@dataclasses.dataclass(frozen=True)
class AssignmentHeader:
    """A decoded ``assignment`` value: the placement without items, and where its items are."""

    placement: Placement
    schema: int
    chunks: int
    """Schema 1: how many ``items/<chunk>`` values the generation holds (0 for schema 2)."""
    item_map: str
    """Schema 2: the digest of the item map the generation names ("" for schema 1)."""
    items: int = -1
    """Schema 2: how many items the map holds (-1: not stated)."""


def decode_header(data: bytes) -> AssignmentHeader:
    """An ``assignment`` value of either schema."""
    doc = _load(data)
    placement = _placement_of(doc)
    if doc["schema"] == SCHEMA_V1:
        return AssignmentHeader(placement, SCHEMA_V1, int(doc["chunks"]), "")
    item_map = str(doc.get("itemMap", ""))
    if not item_map:
        raise PlacementFormatError(f"generation {placement.generation} names no item map")
    return AssignmentHeader(placement, SCHEMA, 0, item_map, int(doc.get("items", -1)))


def decode_assignment(data: bytes) -> tuple[Placement, int]:
    """The placement without items, and how many item chunks of its own belong to it (schema 1;
    0 for schema 2, whose items are in the item map :func:`decode_header` names)."""
    header = decode_header(data)
    return header.placement, header.chunks


def _placement_of(doc: dict[str, Any]) -> Placement:
    pods: list[str] = doc["pods"]
    assignment = {int(c): tuple(pods[i] for i in idx) for c, idx in doc["clusters"].items()}
    placement = Placement(
        generation=int(doc["generation"]),
        assignment=assignment,
        item_clusters={},
        pods=tuple(pods),
        model=doc.get("model", ""),
        revision=doc.get("revision", ""),
        history_policy=doc["history"]["policy"],
        history_bytes_per_pod=int(doc["history"]["bytesPerPod"]),
        catalog=str(doc.get("catalog", "")),
        prompt={str(k): str(v) for k, v in (doc.get("prompt") or {}).items()},
    )
    return placement


def decode(assignment: bytes, chunks: Sequence[bytes] | Iterable[bytes]) -> Placement:
    """A whole schema-1 placement from its stored values (all chunks, in order)."""
    header = decode_header(assignment)
    if header.schema != SCHEMA_V1:
        raise PlacementFormatError(f"generation {header.placement.generation} is schema {header.schema}: "
                                   f"its items are in item map {header.item_map}")
    placement, expected = header.placement, header.chunks
    chunk_list = list(chunks)
    if len(chunk_list) != expected:
        raise PlacementFormatError(f"generation {placement.generation} has {len(chunk_list)} of {expected} chunks")
    items: dict[str, int] = {}
    for chunk in chunk_list:
        items.update({k: int(v) for k, v in _load(chunk, (SCHEMA_V1,))["items"].items()})
    return dataclasses.replace(placement, item_clusters=items)
