"""The catalog key space: ``catalog/<version>/manifest`` and ``catalog/<version>/chunks/<n>``.

Why its own module: catalog versions are content-addressed and large (a million items is many
chunks), so they follow their own rules: chunks are written first and the manifest last (a version is
complete once its manifest exists), a stored version is never written again, each chunk is read in a
request of its own so no gRPC message outgrows a chunk, and a version is pruned only once no kept
placement generation names it (:mod:`kvshard.catalog_schema` holds the format).
"""

from __future__ import annotations

from typing import Any

from kvshard import catalog_schema as cs
from kvshard.etcd_keys import catalog_chunk_key, catalog_manifest_key, catalog_prefix
from kvshard.etcd_store.client import EtcdClient


class CatalogStore(EtcdClient):
    """Store, read and prune catalog versions."""

    async def put_catalog(self, namespace: str, name: str, catalog: cs.Catalog) -> int:
        """Store one catalog version (chunks first, the manifest last: a version is complete once its
        manifest exists). A version already stored is not written again (its key is its content).
        Returns the bytes written (0 when it was there)."""
        version = catalog.version
        manifest_key = catalog_manifest_key(namespace, name, version)
        got = await self._call("read", self._kv.get(manifest_key, timeout=self.timeout))
        if got.kvs:
            return 0
        manifest, chunks = cs.encode(catalog)
        for i, chunk in enumerate(chunks):
            await self._call("put", self._kv.put(catalog_chunk_key(namespace, name, version, i), chunk,
                                                 timeout=self.timeout))
        await self._call("put", self._kv.put(manifest_key, manifest, timeout=self.timeout))
        return len(manifest) + sum(map(len, chunks))

    async def read_catalog_manifest(self, namespace: str, name: str, version: str) -> dict[str, Any] | None:
        """A stored version's manifest (items, chunks, bytes), None when it is not (completely) stored."""
        got = await self._call("read", self._kv.get(catalog_manifest_key(namespace, name, version),
                                                    timeout=self.timeout))
        return cs.decode_manifest(bytes(got.kvs[0].value)) if got.kvs else None

    async def read_catalog(self, namespace: str, name: str, version: str) -> cs.Catalog:
        """One stored version, whole and checked against its hash (:class:`cs.CatalogError` when it is
        missing or damaged). Chunks are read one request each, so a 1 M-item catalog never needs one
        gRPC message larger than a chunk."""
        got = await self._call("read", self._kv.get(catalog_manifest_key(namespace, name, version),
                                                    timeout=self.timeout))
        if not got.kvs:
            raise cs.CatalogError("CatalogNotFound", f"{namespace}/{name} has no catalog version {version}")
        manifest = bytes(got.kvs[0].value)
        chunks: list[bytes] = []
        for i in range(int(cs.decode_manifest(manifest)["chunks"])):
            key = catalog_chunk_key(namespace, name, version, i)
            resp = await self._call("read", self._kv.get(key, timeout=self.timeout))
            if not resp.kvs:
                raise cs.CatalogError("CatalogCorrupt", f"catalog version {version} lacks chunk {i}")
            chunks.append(bytes(resp.kvs[0].value))
        return cs.decode(manifest, chunks)

    async def prune_catalogs(self, namespace: str, name: str, keep: set[str]) -> int:
        """Drop every catalog version not in ``keep`` (those the kept generations name); returns how many."""
        prefix = catalog_prefix(namespace, name)
        resp = await self._range("list", prefix, keys_only=True)
        stored = {kv.key.decode()[len(prefix):].split("/", 1)[0] for kv in resp.kvs}
        stale = sorted(stored - keep)
        for version in stale:
            vprefix = prefix + version + "/"
            await self._delete_range("prune", vprefix)
        return len(stale)
