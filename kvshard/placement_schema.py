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
import hashlib
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


# --------------------------------------------------------------------------- item maps (schema 2)

DIGEST_BYTES = 16
"""blake2b digest size: 32 hex characters in a key, collisions out of reach."""


@dataclasses.dataclass(frozen=True)
class ItemMapManifest:
    """``itemmap/<digest>/manifest``: counts and the per-cluster index of the chunks."""

    digest: str
    items: int
    chunks: int
    clusters: Mapping[int, tuple[int, int, int]]
    """Cluster → (first chunk, last chunk, items): a cluster's items lie in chunks first..last."""

    def chunks_for(self, clusters: Iterable[int]) -> list[int]:
        """The chunk numbers holding the items of ``clusters`` (unknown clusters hold none)."""
        wanted: set[int] = set()
        for c in clusters:
            span = self.clusters.get(int(c))
            if span is not None:
                wanted.update(range(span[0], span[1] + 1))
        return sorted(wanted)

    def encode(self) -> bytes:
        doc = {"schema": SCHEMA, "digest": self.digest, "items": self.items, "chunks": self.chunks,
               "clusters": {str(c): list(v) for c, v in sorted(self.clusters.items())}}
        data = json.dumps(doc, separators=(",", ":")).encode()
        if len(data) > MAX_VALUE_BYTES:
            raise PlacementFormatError(
                f"item map index of {len(self.clusters)} clusters is {len(data)} bytes (> 1 MiB)")
        return data


@dataclasses.dataclass(frozen=True)
class EncodedItemMap:
    manifest: ItemMapManifest
    chunks: list[bytes]

    @property
    def digest(self) -> str:
        return self.manifest.digest

    @property
    def size(self) -> int:
        """Bytes of the values (manifest and chunks)."""
        return len(self.manifest.encode()) + sum(map(len, self.chunks))


def encode_item_map(item_clusters: Mapping[str, int]) -> EncodedItemMap:
    """The item map of ``item_clusters``: chunks (each ≤ 1 MiB) grouping items by cluster — clusters in
    id order, items sorted, so equal content encodes (and hashes) the same — and its manifest. The
    digest is blake2b over the chunks; it is remembered for this mapping object (:func:`known_digest`)."""
    by_cluster: dict[int, list[str]] = {}
    for item, cluster in item_clusters.items():
        by_cluster.setdefault(int(cluster), []).append(item)
    quote = json.encoder.encode_basestring_ascii
    chunks: list[bytes] = []
    spans: dict[int, tuple[int, int, int]] = {}
    current: dict[str, list[str]] = {}
    size = 0
    for cluster in sorted(by_cluster):
        items = sorted(by_cluster[cluster])
        first = -1
        part: list[str] = []
        head = len(str(cluster)) + 6  # "c":[...],
        for item in items:
            entry = len(quote(item)) + 1
            if size + head + entry > _CHUNK_TARGET and (part or current):
                if part:
                    current[str(cluster)] = part
                chunks.append(_dump_map_chunk(current))
                current, part, size = {}, [], 0
            if first < 0:
                first = len(chunks)
            part.append(item)
            size += entry
        current[str(cluster)] = part
        size += head
        spans[cluster] = (first, len(chunks), len(items))
    if current or not chunks:
        chunks.append(_dump_map_chunk(current))
    digest = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for chunk in chunks:
        digest.update(len(chunk).to_bytes(4, "big"))
        digest.update(chunk)
    manifest = ItemMapManifest(digest.hexdigest(), len(item_clusters), len(chunks), spans)
    remember_digest(item_clusters, manifest.digest)
    return EncodedItemMap(manifest, chunks)


def _dump_map_chunk(clusters: Mapping[str, list[str]]) -> bytes:
    data = json.dumps({"schema": SCHEMA, "clusters": clusters}, separators=(",", ":")).encode()
    if len(data) > MAX_VALUE_BYTES:
        raise PlacementFormatError("a single item id is larger than 1 MiB")
    return data


def decode_item_map_manifest(data: bytes) -> ItemMapManifest:
    doc = _load(data, (SCHEMA,))
    try:
        return ItemMapManifest(str(doc["digest"]), int(doc["items"]), int(doc["chunks"]),
                               {int(c): (int(v[0]), int(v[1]), int(v[2])) for c, v in doc["clusters"].items()})
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise PlacementFormatError(f"not an item map manifest: {exc}") from exc


def decode_item_map_chunk(data: bytes) -> dict[int, list[str]]:
    """One chunk: cluster → its items in this chunk."""
    doc = _load(data, (SCHEMA,))
    return {int(c): list(items) for c, items in doc["clusters"].items()}


def item_clusters_of(chunks: Iterable[Mapping[int, Sequence[str]]], clusters: Collection[int] | None = None
                     ) -> dict[str, int]:
    """item → cluster from decoded chunks (only the items of ``clusters`` when given)."""
    out: dict[str, int] = {}
    for chunk in chunks:
        for cluster, items in chunk.items():
            if clusters is None or cluster in clusters:
                out.update(dict.fromkeys(items, cluster))
    return out


# Digests of recent item_clusters mappings, by identity. A rebalance publishes
# ``dataclasses.replace(current, assignment=...)``, which keeps the very mapping object the reader
# returned, so its digest is known without encoding 10 M items again. Mappings in a Placement are
# never mutated (they are shared between generations); the length is checked as a cheap guard.
_DIGEST_MEMO_SIZE = 2  # the mapping read last and the one being published; each may be 10 M items
_digests: list[tuple[Mapping[str, int], int, str]] = []


def remember_digest(item_clusters: Mapping[str, int], digest: str) -> None:
    """Record that ``item_clusters`` (this object) has item map ``digest``."""
    _digests[:] = [e for e in _digests if e[0] is not item_clusters][-(_DIGEST_MEMO_SIZE - 1):]
    _digests.append((item_clusters, len(item_clusters), digest))


def known_digest(item_clusters: Mapping[str, int]) -> str | None:
    """The item map digest of this very mapping object, if it was encoded or read recently."""
    for mapping, size, digest in _digests:
        if mapping is item_clusters and size == len(item_clusters):
            return digest
    return None


def item_map_digest(item_clusters: Mapping[str, int]) -> str:
    """The digest of ``item_clusters``' item map (remembered per mapping object; else encoded)."""
    return known_digest(item_clusters) or encode_item_map(item_clusters).digest
