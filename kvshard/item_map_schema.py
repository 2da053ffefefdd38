"""Item maps (placement schema 2): the item → cluster map of a generation, stored once per content.

Why its own module: a generation (:mod:`kvshard.placement_schema`) only names its map by digest; the map is
written once, chunked by cluster with a per-cluster index, and may be a *delta* on the previous map, so a
rebalance writes kilobytes and a catalog change bytes in proportion to what changed
(docs/architecture.md#etcd-layout). Pure functions over bytes; :mod:`kvshard.etcd_store.placement` stores them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from kvshard.placement_schema import _CHUNK_TARGET, MAX_VALUE_BYTES, SCHEMA, PlacementFormatError, _load

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
