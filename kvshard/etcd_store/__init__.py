"""The etcd side of placement: the only package that imports ``etcd3aio`` (import-linter checks it).

So the operator, the router and the sidecars share one key layout (:mod:`kvshard.etcd_keys`,
docs/architecture.md#etcd-layout) and one set of semantics. :class:`EtcdStore` is every key space on one
connection; each key space
is a module of its own because each has its own rules:

* :mod:`.client` — the connection (TLS, login, host names) and the translation of every failure:
  callers see :class:`EtcdUnavailableError`, :class:`EtcdTLSError` naming the TLS mistake
  (:mod:`kvshard.etcd_tls`) or :class:`EtcdAuthError`, never gRPC or etcd3aio exceptions;
* :mod:`.placement` — generations, their content-addressed item maps and ``current``: the whole
  generation (and the item map it names) is written before ``current`` is compare-and-swapped, so a
  reader never sees half of one and two writers cannot both win;
* :mod:`.warm` — heat snapshots (leased) and each pod's warm report;
* :mod:`.corequest` — each router's co-requested pairs (leased);
* :mod:`.catalog` — content-addressed, chunked catalog versions;
* :mod:`.blend` — the blend settings in force (compare-and-swap).

Callers import from here (``from kvshard import etcd_store``; ``etcd_store.EtcdStore``), never from
the modules.
"""

from __future__ import annotations

from kvshard.etcd_keys import shard_prefix
from kvshard.etcd_store.blend import BlendStore
from kvshard.etcd_store.catalog import CatalogStore
from kvshard.etcd_store.client import (
    EtcdAuthError,
    EtcdStoreError,
    EtcdTLSError,
    EtcdUnavailableError,
    GenerationConflictError,
    wait_for,
)
from kvshard.etcd_store.corequest import CoRequestStore
from kvshard.etcd_store.placement import KEEP_GENERATIONS, PlacementStore
from kvshard.etcd_store.warm import WarmStore

__all__ = [
    "KEEP_GENERATIONS", "EtcdAuthError", "EtcdStore", "EtcdStoreError", "EtcdTLSError", "EtcdUnavailableError",
    "GenerationConflictError", "wait_for",
]


class EtcdStore(PlacementStore, WarmStore, CoRequestStore, CatalogStore, BlendStore):
    """An async connection to etcd speaking the kvshard key layout.

        tls = EtcdTLS.from_files(Path("ca.crt"), Path("tls.crt"), Path("tls.key"))
        async with EtcdStore(["127.0.0.1:2379"], tls=tls) as store:
            generation = await store.publish("default", "movielens", placement, expected=0)

    Endpoints are ``host:port``; a host name is resolved by gRPC (one endpoint) or when connecting
    (several), so a Service name works as well as an address.
    """

    # The whole CacheShard's keys (``shard_prefix``), across every key space.

    async def delete_all(self, namespace: str, name: str) -> int:
        """Remove every key of one CacheShard (its finalizer calls this): generations, item maps,
        catalogs, reports — everything under its prefix. Returns how many."""
        self._item_maps.pop((namespace, name), None)
        prefix = shard_prefix(namespace, name)
        resp = await self._delete_range("delete", prefix)
        return int(resp.deleted)

    async def keys(self, namespace: str, name: str) -> list[str]:
        """Every key of one CacheShard, sorted (for inspection and tests)."""
        prefix = shard_prefix(namespace, name)
        resp = await self._range("list", prefix, keys_only=True)
        return sorted(kv.key.decode() for kv in resp.kvs)
