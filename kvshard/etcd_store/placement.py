"""The placement key space: ``gen/<G>/assignment``, ``gen/<G>/items/<chunk>`` and ``current``.

Why its own module: placement is the one key space with a multi-key invariant. Publishing writes
the whole generation first and only then compare-and-swaps ``current``, so a reader that follows
``current`` never sees a half-written generation, and two writers cannot both win. When everything
fits in one request the writes and the swap are a single transaction; a bigger generation is
claimed and written in steps (:meth:`PlacementStore._publish_in_steps`). Readers read a generation
at the revision ``current`` named it, so a prune never pulls it from under them.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import etcd3aio
import grpc

from kvshard import placement_schema as ps
from kvshard.etcd_keys import assignment_key, current_key, generation_prefix, items_key, shard_prefix
from kvshard.etcd_store.client import (
    ETCD_ERRORS,
    EtcdClient,
    EtcdStoreError,
    EtcdUnavailableError,
    GenerationConflictError,
)

KEEP_GENERATIONS = 2
_TXN_LIMIT = ps.MAX_VALUE_BYTES


class PlacementStore(EtcdClient):
    """Publish, read and follow placement generations."""

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
        return ps.decode_assignment(bytes(got.kvs[0].value))[0]

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
        assignment, chunks = ps.encode(placement)
        kv = self._kv
        gen_prefix = generation_prefix(namespace, name, generation)
        ckey = current_key(namespace, name)
        compare = (
            kv.txn_compare_create_revision(ckey, 0)
            if expected == 0
            else kv.txn_compare_value(ckey, str(expected))
        )
        writes = [kv.txn_op_put(assignment_key(namespace, name, generation), assignment)]
        writes += [kv.txn_op_put(items_key(namespace, name, generation, i), c) for i, c in enumerate(chunks)]
        swap = kv.txn_op_put(ckey, str(generation))
        clear = kv.txn_op_delete(gen_prefix, range_end=etcd3aio.prefix_range_end(gen_prefix))
        # Leftovers of an earlier failed attempt at this generation go first (only while current is
        # still ``expected``, so another writer's generation is never touched).
        await self._call("publish", kv.txn([compare], [clear], timeout=self.timeout))
        if len(assignment) + sum(map(len, chunks)) <= _TXN_LIMIT:
            resp = await self._call("publish", kv.txn([compare], [*writes, swap], timeout=self.timeout))
        else:
            resp = await self._publish_in_steps(kv, gen_prefix + "writer", compare, writes, swap)
        if not resp.succeeded:
            raise GenerationConflictError(
                f"{namespace}/{name}: current is no longer generation {expected}; re-read and retry"
            )
        await self._prune(namespace, name, generation)
        return generation

    async def _publish_in_steps(self, kv: Any, writer_key: str, compare: Any, writes: list[Any], swap: Any) -> Any:
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
        return await self._call("publish", kv.txn([compare, mine], [swap, kv.txn_op_delete(writer_key)],
                                                  timeout=self.timeout))

    async def _prune(self, namespace: str, name: str, newest: int) -> None:
        """Drop generations older than the last :data:`KEEP_GENERATIONS` (readers may still be
        reading the previous one)."""
        oldest_kept = newest - KEEP_GENERATIONS + 1
        base = shard_prefix(namespace, name) + "gen/"
        resp = await self._range("list", base, keys_only=True)
        stale = {int(kv.key.decode()[len(base):].split("/", 1)[0]) for kv in resp.kvs}
        for g in sorted(x for x in stale if x < oldest_kept):
            prefix = generation_prefix(namespace, name, g)
            await self._delete_range("prune", prefix)

    async def read_generation(self, namespace: str, name: str, generation: int, *, revision: int = 0) -> ps.Placement:
        """One stored generation, whole (raises :class:`ps.PlacementFormatError` if incomplete).

        ``revision`` reads it as etcd held it then (0: now). :meth:`read_current` and
        :meth:`watch_current` pass the revision at which ``current`` named the generation, so a reader
        never loses it to a prune by writers publishing two more generations in between. Should etcd
        have compacted that revision away, the generation is read as it is now.
        """
        prefix = generation_prefix(namespace, name, generation)
        try:
            resp = await self._range("read", prefix, revision)
        except EtcdStoreError as exc:
            cause = exc.__cause__
            if not (revision and isinstance(cause, grpc.aio.AioRpcError)
                    and cause.code() == grpc.StatusCode.OUT_OF_RANGE):
                raise
            resp = await self._range("read", prefix, 0)
        values = {kv.key.decode()[len(prefix):]: bytes(kv.value) for kv in resp.kvs}
        if "assignment" not in values:
            raise ps.PlacementFormatError(f"{namespace}/{name} has no generation {generation}")
        chunks = [values[k] for k in sorted(k for k in values if k.startswith("items/"))]
        return ps.decode(values["assignment"], chunks)


    async def read_current(self, namespace: str, name: str) -> ps.Placement | None:
        """The current placement, or None before the first publish; one consistent snapshot (the
        generation is read at the revision ``current`` was read at)."""
        resp = await self._call("read", self._kv.get(current_key(namespace, name), timeout=self.timeout))
        if not resp.kvs:
            return None
        return await self.read_generation(namespace, name, int(resp.kvs[0].value), revision=resp.header.revision)

    async def watch_current(self, namespace: str, name: str) -> AsyncIterator[ps.Placement]:
        """Yield the current placement (if any) and then every newly published one; the router and
        sidecars follow placement with this. Reconnects are handled by the etcd client."""
        ckey = current_key(namespace, name)
        resp = await self._call("read", self._kv.get(ckey, timeout=self.timeout))
        last = int(resp.kvs[0].value) if resp.kvs else 0
        if last:
            yield await self.read_generation(namespace, name, last, revision=resp.header.revision)
        watch = self._client.watch
        assert watch is not None
        try:
            async for event_batch in watch.watch(ckey, start_revision=resp.header.revision + 1):
                for event in event_batch.events:
                    if event.type != 0 or not event.kv.value:  # 0 == PUT
                        continue
                    generation = int(event.kv.value)
                    if generation > last:
                        last = generation
                        yield await self.read_generation(namespace, name, generation, revision=event.kv.mod_revision)
        except ETCD_ERRORS as exc:
            raise EtcdUnavailableError(f"etcd watch failed: {exc}") from exc
