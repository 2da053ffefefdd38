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
    """Cluster → (first chunk, last chunk, items): a cluster's items lie in chunks first..last
    (empty for a delta: its chunks hold changes, not clusters)."""
    base: str = ""
    """A *delta* map (:func:`encode_item_map_delta`): the digest of the map its chunks change ("": a
    full map, its chunks hold every item)."""
    depth: int = 0
    """How many deltas lie between this map and a full one (0: full)."""
    changes: int = 0
    """A delta: how many items it sets or removes."""

    def chunks_for(self, clusters: Iterable[int]) -> list[int]:
        """The chunk numbers holding the items of ``clusters`` (unknown clusters hold none)."""
        wanted: set[int] = set()
        for c in clusters:
            span = self.clusters.get(int(c))
            if span is not None:
                wanted.update(range(span[0], span[1] + 1))
        return sorted(wanted)

    @property
    def is_delta(self) -> bool:
        return bool(self.base)

    def encode(self) -> bytes:
        doc: dict[str, Any]
        if self.base:
            doc = {"schema": DELTA_SCHEMA, "digest": self.digest, "items": self.items, "chunks": self.chunks,
                   "base": self.base, "depth": self.depth, "changes": self.changes}
        else:
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
    """A full map's manifest (schema 2) or a delta's (:data:`DELTA_SCHEMA`)."""
    doc = _load(data, (SCHEMA, DELTA_SCHEMA))
    try:
        if doc["schema"] == DELTA_SCHEMA:
            base = str(doc["base"])
            if not base:
                raise ValueError("a delta names no base")
            return ItemMapManifest(str(doc["digest"]), int(doc["items"]), int(doc["chunks"]), {}, base,
                                   int(doc["depth"]), int(doc.get("changes", 0)))
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


# --------------------------------------------------------------------------- item map deltas

DELTA_SCHEMA = 3
"""The schema of a delta map's manifest and chunks: a reader that knows only full maps refuses it
("upgrade it") rather than read a delta's chunks as a whole map."""
MAX_DELTA_DEPTH = 8
"""At most this many deltas between a map and a full one: past it the next map is written full, so a
reader that has none of the chain reads at most this many maps."""
MAX_DELTA_FRACTION = 0.25
"""A delta is written only when it changes fewer than this fraction of the new map's items."""


def item_map_changes(base: Mapping[str, int], new: Mapping[str, int], limit: int | None = None
                     ) -> dict[str, int | None] | None:
    """What turns ``base`` into ``new``: item → its new cluster (changed or added), item → None
    (removed). None when more than ``limit`` items change (a full map is then cheaper to read)."""
    if base is new:
        return {}
    changes: dict[str, int | None] = {i: c for i, c in new.items() if base.get(i) != c}
    if limit is not None and len(changes) > limit:
        return None
    added = sum(1 for i in changes if i not in base)
    if len(new) - added != len(base):  # some items of base are not in new: find them
        changes.update(dict.fromkeys((i for i in base if i not in new), None))
    if limit is not None and len(changes) > limit:
        return None
    return changes


def apply_item_map_changes(items: dict[str, int], changes: Mapping[str, int | None],
                           clusters: Collection[int] | None = None) -> dict[str, int]:
    """Apply ``changes`` to ``items`` in place and return it. With ``clusters``, ``items`` holds only
    those clusters' items and so does the result (an item that moved to another cluster leaves it)."""
    for item, cluster in changes.items():
        if cluster is None or (clusters is not None and cluster not in clusters):
            items.pop(item, None)
        else:
            items[item] = cluster
    return items


def encode_item_map_delta(full: EncodedItemMap, base: ItemMapManifest, changes: Mapping[str, int | None]
                          ) -> EncodedItemMap:
    """The item map ``full`` stored as ``changes`` to map ``base``: same digest (that of the full
    content, so equal content dedups and readers cache by it), chunks (each ≤ 1 MiB) of the changes
    only — ``{"set": {cluster: [items]}, "removed": [items]}`` — and a manifest naming ``base``."""
    by_cluster: dict[int, list[str]] = {}
    removed: list[str] = []
    for item, cluster in changes.items():
        if cluster is None:
            removed.append(item)
        else:
            by_cluster.setdefault(int(cluster), []).append(item)
    quote = json.encoder.encode_basestring_ascii
    chunks: list[bytes] = []
    sets: dict[str, list[str]] = {}
    gone: list[str] = []
    size = 0
    groups = [(str(c), sorted(by_cluster[c])) for c in sorted(by_cluster)] + [("", sorted(removed))]
    for key, items in groups:
        part: list[str] = []
        head = len(key) + 6
        for item in items:
            entry = len(quote(item)) + 1
            if size + head + entry > _CHUNK_TARGET and (part or sets or gone):
                if part:
                    if key:
                        sets[key] = part
                    else:
                        gone = part
                chunks.append(_dump_delta_chunk(sets, gone))
                sets, gone, part, size = {}, [], [], 0
            part.append(item)
            size += entry
        if part:
            if key:
                sets[key] = part
            else:
                gone = part
            size += head
    if sets or gone or not chunks:
        chunks.append(_dump_delta_chunk(sets, gone))
    manifest = ItemMapManifest(full.digest, full.manifest.items, len(chunks), {}, base.digest, base.depth + 1,
                               len(changes))
    return EncodedItemMap(manifest, chunks)


def _dump_delta_chunk(sets: Mapping[str, list[str]], removed: list[str]) -> bytes:
    data = json.dumps({"schema": DELTA_SCHEMA, "set": sets, "removed": removed}, separators=(",", ":")).encode()
    if len(data) > MAX_VALUE_BYTES:
        raise PlacementFormatError("a single item id is larger than 1 MiB")
    return data


def decode_item_map_delta_chunk(data: bytes) -> dict[str, int | None]:
    """One delta chunk: item → its new cluster, or None for a removed item."""
    doc = _load(data, (DELTA_SCHEMA,))
    try:
        out: dict[str, int | None] = {}
        for c, items in doc["set"].items():
            out.update(dict.fromkeys(items, int(c)))
        out.update(dict.fromkeys(doc["removed"], None))
        return out
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise PlacementFormatError(f"not an item map delta chunk: {exc}") from exc


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
