"""The placement key space: ``gen/<G>/assignment``, ``itemmap/<digest>/…`` and ``current``
(``gen/<G>/items/<chunk>`` of schema-1 generations is still read).

Why its own module: placement is the one key space with a multi-key invariant. Publishing writes
the item map the generation names (only when it is not stored yet: chunks first, the manifest last,
so a present manifest means a complete map), then the generation, and only then compare-and-swaps
``current`` — in the same transaction that checks the map's manifest still exists — so a reader
that follows ``current`` never sees a half-written generation or a missing map, and two writers
cannot both win. When everything fits in one request the writes and the swap are a single
transaction; a bigger generation is claimed and written in steps
(:meth:`PlacementStore._publish_in_steps`). Readers read a generation (and its map) at the revision
``current`` named it, so a prune never pulls it from under them; the last map read per CacheShard is
kept in memory, so a generation that names the same map again reads no chunk.

A catalog change that moves a few items is stored as a *delta* on the map the current generation
names (its changes only, under the new map's digest; at most :data:`item_maps.MAX_DELTA_DEPTH` deep): a
reader that holds the base reads only the changes, one that does not reads the chain. Pruning keeps
every map a kept generation's chain needs.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator, Collection, Mapping
from typing import Any

import etcd3aio
import grpc

from kvshard import item_map_schema as item_maps
from kvshard import placement_schema as ps
from kvshard.etcd_keys import (
    assignment_key,
    current_key,
    generation_prefix,
    item_map_base_key,
    item_map_chunk_key,
    item_map_manifest_key,
    item_map_prefix,
    shard_prefix,
)
from kvshard.etcd_store.client import (
    ETCD_ERRORS,
    EtcdClient,
    EtcdStoreError,
    EtcdUnavailableError,
    GenerationConflictError,
)

KEEP_GENERATIONS = 2
_TXN_LIMIT = ps.MAX_VALUE_BYTES
_GREATER = 1  # etcd's Compare.GREATER


@dataclasses.dataclass
class _CachedMap:
    """The last item map read (or published) for one CacheShard: its manifest, the decoded chunks
    read so far (a partial reader's), and the whole mapping once read whole (handed out again, same
    object). A delta map not yet read whole also holds its base's entry and its decoded changes."""

    manifest: item_maps.ItemMapManifest
    chunks: dict[int, dict[int, list[str]]]
    whole: Mapping[str, int] | None = None
    base: _CachedMap | None = None
    changes: dict[str, int | None] | None = None

    def find(self, digest: str) -> _CachedMap | None:
        """This entry or the entry of a map in its chain with ``digest``."""
        entry: _CachedMap | None = self
        while entry is not None and entry.manifest.digest != digest:
            entry = entry.base
        return entry


class PlacementStore(EtcdClient):
    """Publish, read and follow placement generations."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._item_maps: dict[tuple[str, str], _CachedMap] = {}
        self.item_map_bytes_written = 0
        """Bytes of item map values (manifests and chunks) this store wrote."""

    async def read_assignment(self, namespace: str, name: str) -> ps.Placement | None:
        """The current generation without its items (cluster → pods only), None before the first
        publish: the cheap read for whoever follows which pod should warm what."""
        resp = await self._call("read", self._kv.get(current_key(namespace, name), timeout=self.timeout))
        if not resp.kvs:
            return None
        generation = int(resp.kvs[0].value)
        got = await self._call("read", self._kv.get(assignment_key(namespace, name, generation), timeout=self.timeout))
        if not got.kvs:
            raise ps.PlacementFormatError(f"{namespace}/{name} has no generation {generation}")
        return ps.decode_header(bytes(got.kvs[0].value)).placement

    async def current_generation(self, namespace: str, name: str) -> int:
        """The published generation, 0 when none has been published."""
        resp = await self._call("read", self._kv.get(current_key(namespace, name), timeout=self.timeout))
        return int(resp.kvs[0].value) if resp.kvs else 0

    async def publish(self, namespace: str, name: str, placement: ps.Placement, *, expected: int) -> int:
        """Write ``placement`` as generation ``placement.generation`` and make it current, provided
        ``current`` is still ``expected`` (0: nothing published yet). Returns the generation.

        Raises :class:`GenerationConflictError` when ``current`` moved, :class:`EtcdUnavailableError`
        when etcd fails; in both cases ``current`` still names a complete generation.
        """
        generation = placement.generation
        if generation <= expected:
            raise ValueError(f"generation {generation} must be newer than {expected}")
        digest, base = await self._store_item_map(namespace, name, placement.item_clusters, expected)
        assignment = ps.encode_assignment(placement, 0, item_map=digest)
        kv = self._kv
        gen_prefix = generation_prefix(namespace, name, generation)
        ckey = current_key(namespace, name)
        compare = (
            kv.txn_compare_create_revision(ckey, 0)
            if expected == 0
            else kv.txn_compare_value(ckey, str(expected))
        )
        # The map must still be there when current moves (a concurrent writer's prune may have
        # dropped it since it was stored): a conflict then, and the retry stores it again.
        map_present = kv.txn_compare_create_revision(item_map_manifest_key(namespace, name, digest), 0,
                                                     result=_GREATER)
        if base:  # a delta's base too (named by generation ``expected``, so kept while it is current)
            map_present = [map_present, kv.txn_compare_create_revision(
                item_map_manifest_key(namespace, name, base), 0, result=_GREATER)]
        else:
            map_present = [map_present]
        writes = [kv.txn_op_put(assignment_key(namespace, name, generation), assignment)]
        swap = kv.txn_op_put(ckey, str(generation))
        clear = kv.txn_op_delete(gen_prefix, range_end=etcd3aio.prefix_range_end(gen_prefix))
        # Leftovers of an earlier failed attempt at this generation go first (only while current is
        # still ``expected``, so another writer's generation is never touched).
        await self._call("publish", kv.txn([compare], [clear], timeout=self.timeout))
        if len(assignment) <= _TXN_LIMIT:
            resp = await self._call("publish", kv.txn([compare, *map_present], [*writes, swap], timeout=self.timeout))
        else:
            resp = await self._publish_in_steps(kv, gen_prefix + "writer", compare, writes, swap, *map_present)
        if not resp.succeeded:
            raise GenerationConflictError(
                f"{namespace}/{name}: current is no longer generation {expected} (or its item map was pruned "
                "meanwhile); re-read and retry"
            )
        await self._prune(namespace, name, generation)
        return generation

    async def _store_item_map(self, namespace: str, name: str, item_clusters: Mapping[str, int], expected: int
                              ) -> tuple[str, str]:
        """Store the item map of ``item_clusters`` unless its manifest is there already (chunks
        first, the manifest last); return its digest and, when it was stored as a delta, its base's
        ("" otherwise). The digest of a mapping object read or published before is remembered
        (:func:`item_maps.known_digest`), so a rebalance encodes (and diffs) nothing.

        A new map is stored as a delta (:func:`item_maps.encode_item_map_delta`) on the map generation
        ``expected`` names when this store holds that map whole (it read or published it last), fewer
        than :data:`item_maps.MAX_DELTA_FRACTION` of the items changed and the chain stays within
        :data:`item_maps.MAX_DELTA_DEPTH`; else whole.
        """
        digest = item_maps.known_digest(item_clusters)
        encoded = None
        if digest is None:
            encoded = item_maps.encode_item_map(item_clusters)
            digest = encoded.digest
        manifest_key = item_map_manifest_key(namespace, name, digest)
        got = await self._call("read", self._kv.get(manifest_key, keys_only=True, timeout=self.timeout))
        if got.kvs:
            return digest, ""
        if encoded is None:
            encoded = item_maps.encode_item_map(item_clusters)
        stored = await self._as_delta(namespace, name, encoded, item_clusters, expected) or encoded
        base = stored.manifest.base
        for i, chunk in enumerate(stored.chunks):
            await self._call("publish", self._kv.put(item_map_chunk_key(namespace, name, digest, i), chunk,
                                                     timeout=self.timeout))
        if base:
            await self._call("publish", self._kv.put(item_map_base_key(namespace, name, digest), base,
                                                     timeout=self.timeout))
        await self._call("publish", self._kv.put(manifest_key, stored.manifest.encode(), timeout=self.timeout))
        self.item_map_bytes_written += stored.size
        # This store now holds the new map whole: the next catalog change can be a delta on it, and
        # reading the generation back reads no chunk.
        self._item_maps[(namespace, name)] = _CachedMap(stored.manifest, {}, item_clusters)
        return digest, base

    async def _as_delta(self, namespace: str, name: str, encoded: item_maps.EncodedItemMap,
                        item_clusters: Mapping[str, int], expected: int) -> item_maps.EncodedItemMap | None:
        """``encoded`` as a delta on the map generation ``expected`` names, None when it should be
        stored whole (see :meth:`_store_item_map`)."""
        cached = self._item_maps.get((namespace, name))
        if expected == 0 or cached is None or cached.whole is None or not item_clusters:
            return None
        if cached.manifest.digest == encoded.digest:  # the map itself went missing: store it whole again
            return None
        if cached.manifest.depth + 1 > item_maps.MAX_DELTA_DEPTH:
            return None
        got = await self._call("read", self._kv.get(assignment_key(namespace, name, expected), timeout=self.timeout))
        if not got.kvs:
            return None
        try:
            header = ps.decode_header(bytes(got.kvs[0].value))
        except ps.PlacementFormatError:
            return None
        if header.item_map != cached.manifest.digest:
            return None
        limit = int(len(item_clusters) * item_maps.MAX_DELTA_FRACTION)
        changes = item_maps.item_map_changes(cached.whole, item_clusters, limit)
        if changes is None:
            return None
        return item_maps.encode_item_map_delta(encoded, cached.manifest, changes)

    async def _publish_in_steps(self, kv: Any, writer_key: str, compare: Any, writes: list[Any], swap: Any,
                                *also: Any) -> Any:
        """Write a generation too big for one request, then swap ``current``.

        Two writers racing for the same generation would otherwise interleave their chunks, and the
        winner's swap could make a mix of both current. So the writer first *claims* the generation
        (``gen/<G>/writer`` = a random token) and every later write, the swap included, is a
        transaction that also checks the claim is still its own: whoever claims last writes the whole
        generation, every other writer fails its next step with a conflict and stops.
        """
        token = uuid.uuid4().hex
        claim = await self._call("publish", kv.txn([compare], [kv.txn_op_put(writer_key, token)],
                                                    timeout=self.timeout))
        if not claim.succeeded:
            return claim
        mine = kv.txn_compare_value(writer_key, token)
        for op in writes:
            step = await self._call("publish", kv.txn([compare, mine], [op], timeout=self.timeout))
            if not step.succeeded:
                return step
        return await self._call("publish", kv.txn([compare, mine, *also], [swap, kv.txn_op_delete(writer_key)],
                                                  timeout=self.timeout))

    async def _prune(self, namespace: str, name: str, newest: int) -> None:
        """Drop generations older than the last :data:`KEEP_GENERATIONS` (readers may still be
        reading the previous one), then every item map no kept generation names."""
        oldest_kept = newest - KEEP_GENERATIONS + 1
        base = shard_prefix(namespace, name) + "gen/"
        resp = await self._range("list", base, keys_only=True)
        stale = {int(kv.key.decode()[len(base):].split("/", 1)[0]) for kv in resp.kvs}
        for g in sorted(x for x in stale if x < oldest_kept):
            prefix = generation_prefix(namespace, name, g)
            await self._delete_range("prune", prefix)
        await self.prune_item_maps(namespace, name)

    async def prune_item_maps(self, namespace: str, name: str) -> int:
        """Delete every stored item map that no stored generation names, directly or through a
        delta's chain of bases; returns how many."""
        base = shard_prefix(namespace, name) + "gen/"
        resp = await self._range("list", base, keys_only=True)
        kept: set[str] = set()
        for key in sorted({kv.key.decode() for kv in resp.kvs if kv.key.decode().endswith("/assignment")}):
            got = await self._call("read", self._kv.get(key, timeout=self.timeout))
            if got.kvs:
                try:
                    kept.add(ps.decode_header(bytes(got.kvs[0].value)).item_map)
                except ps.PlacementFormatError:
                    continue
        prefix = item_map_prefix(namespace, name)
        listed = await self._range("list", prefix, keys_only=True)
        stored = {kv.key.decode()[len(prefix):].split("/", 1)[0] for kv in listed.kvs}
        keys = {kv.key.decode() for kv in listed.kvs}
        deltas = {d for d in stored if item_map_base_key(namespace, name, d) in keys}
        todo = [d for d in kept if d in deltas]
        while todo:
            got = await self._call("read", self._kv.get(item_map_base_key(namespace, name, todo.pop()),
                                                        timeout=self.timeout))
            if got.kvs:
                base = bytes(got.kvs[0].value).decode()
                if base not in kept:
                    kept.add(base)
                    if base in deltas:
                        todo.append(base)
        stale = sorted(stored - kept)
        # A delta goes before the map it is based on, so a prune cut short never leaves a stored
        # manifest whose chain is incomplete (a publish of equal content would reuse it).
        bases: dict[str, str] = {}
        for digest in stale:
            if digest in deltas:
                got = await self._call("read", self._kv.get(item_map_base_key(namespace, name, digest),
                                                            timeout=self.timeout))
                if got.kvs:
                    bases[digest] = bytes(got.kvs[0].value).decode()
        left = set(stale)
        while left:
            needed = {bases[d] for d in left if d in bases}
            ready = sorted(d for d in left if d not in needed) or sorted(left)  # (a cycle: cannot be, but end)
            for digest in ready:
                await self._delete_range("prune", prefix + digest + "/")
            left -= set(ready)
        return len(stale)

    async def read_generation(self, namespace: str, name: str, generation: int, *, revision: int = 0,
                              clusters: Collection[int] | None = None, clusters_of: str | None = None
                              ) -> ps.Placement:
        """One stored generation (raises :class:`ps.PlacementFormatError` if incomplete).

        ``revision`` reads it as etcd held it then (0: now). :meth:`read_current` and
        :meth:`watch_current` pass the revision at which ``current`` named the generation, so a reader
        never loses it to a prune by writers publishing two more generations in between. Should etcd
        have compacted that revision away, the generation is read as it is now.

        Items: the whole item map by default, read from etcd only when its digest differs from the
        last one this store read for the shard. With ``clusters`` (or ``clusters_of``: the clusters
        that pod holds in this generation) ``item_clusters`` holds only those clusters' items, and only
        the chunks holding them are read (a schema-1 generation is read whole and filtered). Such a
        partial placement is for reading only: published, it would name a map of just those items.
        """
        prefix = generation_prefix(namespace, name, generation)
        resp = await self._range_at("read", prefix, revision)
        values = {kv.key.decode()[len(prefix):]: bytes(kv.value) for kv in resp.kvs}
        if "assignment" not in values:
            raise ps.PlacementFormatError(f"{namespace}/{name} has no generation {generation}")
        header = ps.decode_header(values["assignment"])
        wanted = set(header.placement.clusters_of(clusters_of)) if clusters_of is not None else (
            None if clusters is None else {int(c) for c in clusters})
        if header.schema == ps.SCHEMA_V1:
            chunks = [values[k] for k in sorted(k for k in values if k.startswith("items/"))]
            placement = ps.decode(values["assignment"], chunks)
            if wanted is None:
                return placement
            return dataclasses.replace(placement, item_clusters={
                i: c for i, c in placement.item_clusters.items() if c in wanted})
        items = await self._read_item_map(namespace, name, header.item_map, revision, wanted)
        return dataclasses.replace(header.placement, item_clusters=items)

    async def _range_at(self, what: str, key: str, revision: int, *, prefix: bool = True) -> Any:
        """A range (or one key) at ``revision``, now if etcd compacted that revision away."""
        for rev in (revision, 0) if revision else (0,):
            try:
                if prefix:
                    return await self._range(what, key, rev)
                return await self._call(what, self._kv.get(key, revision=rev, timeout=self.timeout))
            except EtcdStoreError as exc:
                cause = exc.__cause__
                if not (rev and isinstance(cause, grpc.aio.AioRpcError)
                        and cause.code() == grpc.StatusCode.OUT_OF_RANGE):
                    raise
        raise AssertionError("unreachable")

    async def _read_item_map(self, namespace: str, name: str, digest: str, revision: int,
                             clusters: set[int] | None) -> Mapping[str, int]:
        """Item → cluster of item map ``digest`` (of ``clusters`` only, when given), reading only the
        chunks the last map read for this shard (and its chain of bases) does not already hold. A
        delta map is its base (read the same way, recursively) with its changes applied."""
        key = (namespace, name)
        cached = self._item_maps.get(key)
        entry = await self._map_entry(namespace, name, digest, revision, cached)
        self._item_maps[key] = entry
        return await self._items_of(namespace, name, entry, revision, clusters)

    async def _map_entry(self, namespace: str, name: str, digest: str, revision: int,
                         cached: _CachedMap | None) -> _CachedMap:
        """The cache entry of map ``digest``: from ``cached``'s chain, else its manifest (and, for a
        delta, its changes and its base's entry) read from etcd."""
        found = cached.find(digest) if cached is not None else None
        if found is not None:
            return found
        got = await self._range_at("read", item_map_manifest_key(namespace, name, digest), revision, prefix=False)
        if not got.kvs:
            raise ps.PlacementFormatError(f"{namespace}/{name} has no item map {digest}")
        manifest = item_maps.decode_item_map_manifest(bytes(got.kvs[0].value))
        if manifest.digest != digest:
            raise ps.PlacementFormatError(f"item map {digest} of {namespace}/{name} names {manifest.digest}")
        entry = _CachedMap(manifest, {})
        if not manifest.is_delta:
            return entry
        if manifest.depth > item_maps.MAX_DELTA_DEPTH:
            raise ps.PlacementFormatError(f"item map {digest} of {namespace}/{name} is {manifest.depth} deltas deep")
        changes: dict[str, int | None] = {}
        for n in range(manifest.chunks):
            got = await self._range_at("read", item_map_chunk_key(namespace, name, digest, n), revision, prefix=False)
            if not got.kvs:
                raise ps.PlacementFormatError(f"item map {digest} of {namespace}/{name} lacks chunk {n}")
            changes.update(item_maps.decode_item_map_delta_chunk(bytes(got.kvs[0].value)))
        if len(changes) != manifest.changes:
            raise ps.PlacementFormatError(f"item map {digest} holds {len(changes)} of {manifest.changes} changes")
        entry.changes = changes
        entry.base = await self._map_entry(namespace, name, manifest.base, revision, cached)
        if entry.base.manifest.depth != manifest.depth - 1:
            raise ps.PlacementFormatError(f"item map {digest} of {namespace}/{name} is {manifest.depth} deltas deep "
                                          f"but its base {manifest.base} is {entry.base.manifest.depth}")
        return entry

    async def _items_of(self, namespace: str, name: str, entry: _CachedMap, revision: int,
                        clusters: set[int] | None) -> Mapping[str, int]:
        manifest = entry.manifest
        digest = manifest.digest
        if entry.whole is not None:
            if clusters is None:
                return entry.whole
            return {i: c for i, c in entry.whole.items() if c in clusters}
        if manifest.is_delta:
            assert entry.base is not None and entry.changes is not None
            based = await self._items_of(namespace, name, entry.base, revision, clusters)
            if clusters is not None:  # the base's items of those clusters: a new dict, ours to change
                return item_maps.apply_item_map_changes(
                    based if isinstance(based, dict) and based is not entry.base.whole else dict(based),
                    entry.changes, clusters)
            whole = item_maps.apply_item_map_changes(dict(based), entry.changes)
            if len(whole) != manifest.items:
                raise ps.PlacementFormatError(f"item map {digest} holds {len(whole)} of {manifest.items} items")
            # Whole now: the chain is no longer needed.
            entry.whole, entry.base, entry.changes = whole, None, None
            item_maps.remember_digest(whole, digest)
            return whole
        needed = range(manifest.chunks) if clusters is None else manifest.chunks_for(clusters)
        for n in needed:
            if n in entry.chunks:
                continue
            got = await self._range_at("read", item_map_chunk_key(namespace, name, digest, n), revision, prefix=False)
            if not got.kvs:
                raise ps.PlacementFormatError(f"item map {digest} of {namespace}/{name} lacks chunk {n}")
            entry.chunks[n] = item_maps.decode_item_map_chunk(bytes(got.kvs[0].value))
        if clusters is None:
            whole = item_maps.item_clusters_of(entry.chunks[n] for n in needed)
            if len(whole) != manifest.items:
                raise ps.PlacementFormatError(f"item map {digest} holds {len(whole)} of {manifest.items} items")
            entry.whole, entry.chunks = whole, {}
            item_maps.remember_digest(whole, digest)
            return whole
        # A partial reader keeps only the chunks it needs now.
        entry.chunks = {n: entry.chunks[n] for n in needed}
        return item_maps.item_clusters_of((entry.chunks[n] for n in needed), clusters)

    async def read_current(self, namespace: str, name: str, *, clusters: Collection[int] | None = None,
                           clusters_of: str | None = None) -> ps.Placement | None:
        """The current placement, or None before the first publish; one consistent snapshot (the
        generation is read at the revision ``current`` was read at). ``clusters``/``clusters_of``:
        only those clusters' items (:meth:`read_generation`)."""
        resp = await self._call("read", self._kv.get(current_key(namespace, name), timeout=self.timeout))
        if not resp.kvs:
            return None
        return await self.read_generation(namespace, name, int(resp.kvs[0].value), revision=resp.header.revision,
                                          clusters=clusters, clusters_of=clusters_of)

    async def watch_current(self, namespace: str, name: str, *, clusters_of: str | None = None
                            ) -> AsyncIterator[ps.Placement]:
        """Yield the current placement (if any) and then every newly published one; the router and
        sidecars follow placement with this. Reconnects are handled by the etcd client. The item map
        is read only when a generation names a different one; with ``clusters_of`` only the items of
        the clusters that pod holds in each generation (:meth:`read_generation`)."""
        ckey = current_key(namespace, name)
        resp = await self._call("read", self._kv.get(ckey, timeout=self.timeout))
        last = int(resp.kvs[0].value) if resp.kvs else 0
        if last:
            yield await self.read_generation(namespace, name, last, revision=resp.header.revision,
                                             clusters_of=clusters_of)
        watch = self._client.watch
        assert watch is not None
        try:
            async for event_batch in watch.watch(ckey, start_revision=resp.header.revision + 1):
                self.count_read([e.kv for e in event_batch.events])
                for event in event_batch.events:
                    if event.type != 0 or not event.kv.value:  # 0 == PUT
                        continue
                    generation = int(event.kv.value)
                    if generation > last:
                        last = generation
                        yield await self.read_generation(namespace, name, generation, revision=event.kv.mod_revision,
                                                         clusters_of=clusters_of)
        except ETCD_ERRORS as exc:
            raise EtcdUnavailableError(f"etcd watch failed: {exc}") from exc
