"""The blend key space: ``blend``, the blend settings in force for the whole CacheShard.

Why its own module: one key, changed only by compare-and-swap on its version (the fidelity guard and
the operator must not overwrite each other's change), and followed by every sidecar. A follower first
gets what is in force — ``None`` when nothing (readable) is — so it knows it has read, and an
unreadable new value is skipped, never applied (:mod:`kvshard.blend_policy` holds the format).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from kvshard import blend_policy as bp
from kvshard.etcd_keys import blend_key
from kvshard.etcd_store.client import ETCD_ERRORS, EtcdClient, EtcdUnavailableError, GenerationConflictError

log = logging.getLogger("kvshard.etcd_store")  # every key space logs under the store's one name


class BlendStore(EtcdClient):
    """Read, publish and follow the blend in force."""

    async def read_blend(self, namespace: str, name: str) -> tuple[bp.BlendPolicy | None, int]:
        """The blend settings in force and the key's version (``(None, 0)`` before the first publish);
        pass the version to :meth:`publish_blend` as ``expected``."""
        resp = await self._call("read", self._kv.get(blend_key(namespace, name), timeout=self.timeout))
        if not resp.kvs:
            return None, 0
        return bp.BlendPolicy.decode(bytes(resp.kvs[0].value)), int(resp.kvs[0].version)

    async def publish_blend(self, namespace: str, name: str, policy: bp.BlendPolicy, *, expected: int) -> int:
        """Make ``policy`` the blend in force provided the key is still at version ``expected`` (0: never
        written); returns the new version. :class:`GenerationConflictError` when someone wrote first."""
        kv, key = self._kv, blend_key(namespace, name)
        resp = await self._call("publish", kv.txn([kv.txn_compare_version(key, expected)],
                                                  [kv.txn_op_put(key, policy.encode())], timeout=self.timeout))
        if not resp.succeeded:
            raise GenerationConflictError(f"{namespace}/{name}: blend is no longer at version {expected}; re-read")
        return expected + 1

    async def watch_blend(self, namespace: str, name: str) -> AsyncIterator[bp.BlendPolicy | None]:
        """Yield the blend in force first — ``None`` when none is published (or it is unreadable), so a
        follower knows it has read — then every new one; unreadable new values are skipped."""
        key = blend_key(namespace, name)
        resp = await self._call("read", self._kv.get(key, timeout=self.timeout))
        yield _blend(resp.kvs[0].value) if resp.kvs else None
        watch = self._client.watch
        assert watch is not None
        try:
            async for batch in watch.watch(key, start_revision=resp.header.revision + 1):
                for event in batch.events:
                    if event.type == 0 and (policy := _blend(event.kv.value)) is not None:  # 0 == PUT
                        yield policy
        except ETCD_ERRORS as exc:
            raise EtcdUnavailableError(f"etcd watch failed: {exc}") from exc


def _blend(value: bytes) -> bp.BlendPolicy | None:
    try:
        return bp.BlendPolicy.decode(bytes(value))
    except bp.BlendPolicyError:
        log.warning("ignoring an unreadable blend value: %r", bytes(value)[:100])
        return None
