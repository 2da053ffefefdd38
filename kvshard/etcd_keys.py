"""The etcd key layout of a CacheShard (docs/architecture.md#etcd-layout): pure functions, shared by every component.

Why its own module: the layout is the contract between the operator, the router and the sidecars,
and tests and tools name keys without talking to etcd; :mod:`kvshard.etcd_store` is the only module
that reads and writes them::

    /kvshard/v1/<namespace>/<name>/gen/<G>/assignment      cluster → pods, and the item map's digest (schema 2)
    /kvshard/v1/<namespace>/<name>/gen/<G>/items/<chunk>   item → cluster (schema 1 only: read, no longer written)
    /kvshard/v1/<namespace>/<name>/itemmap/<digest>/manifest      item map: counts, cluster → chunk numbers
    /kvshard/v1/<namespace>/<name>/itemmap/<digest>/chunks/<n>    item map: items grouped by cluster (each ≤ 1 MiB),
                                                                  or a delta's changes to its base map
    /kvshard/v1/<namespace>/<name>/itemmap/<digest>/base          a delta map's base digest
    /kvshard/v1/<namespace>/<name>/current                 G (changed only by compare-and-swap)
    /kvshard/v1/<namespace>/<name>/heat/<timestamp>        hit-rate snapshot (lease/TTL'd)
    /kvshard/v1/<namespace>/<name>/warm/<pod>              clusters the pod has warmed
    /kvshard/v1/<namespace>/<name>/catalog/<version>/…      catalog versions (content-addressed, chunked)
    /kvshard/v1/<namespace>/<name>/blend                   blend settings in force (compare-and-swap)
    /kvshard/v1/<namespace>/<name>/corequest/<router>      a router's top co-requested pairs (leased)
"""

from __future__ import annotations

PREFIX = "/kvshard/v1"


def shard_prefix(namespace: str, name: str) -> str:
    """``/kvshard/v1/<namespace>/<name>/`` — every key of one CacheShard starts with this."""
    return f"{PREFIX}/{namespace}/{name}/"


def current_key(namespace: str, name: str) -> str:
    return shard_prefix(namespace, name) + "current"


def generation_prefix(namespace: str, name: str, generation: int) -> str:
    return shard_prefix(namespace, name) + f"gen/{generation}/"


def assignment_key(namespace: str, name: str, generation: int) -> str:
    return generation_prefix(namespace, name, generation) + "assignment"


def items_key(namespace: str, name: str, generation: int, chunk: int) -> str:
    return generation_prefix(namespace, name, generation) + f"items/{chunk:06d}"


def item_map_prefix(namespace: str, name: str) -> str:
    """``itemmap/``: item → cluster maps, stored once per content (:func:`kvshard.item_map_schema.encode_item_map`)
    under the digest of that content; generations name theirs, and a map goes when no kept generation does."""
    return shard_prefix(namespace, name) + "itemmap/"


def item_map_manifest_key(namespace: str, name: str, digest: str) -> str:
    return item_map_prefix(namespace, name) + f"{digest}/manifest"


def item_map_chunk_key(namespace: str, name: str, digest: str, chunk: int) -> str:
    return item_map_prefix(namespace, name) + f"{digest}/chunks/{chunk:06d}"


def item_map_base_key(namespace: str, name: str, digest: str) -> str:
    """``itemmap/<digest>/base``: a delta map's base digest (also in its manifest), so pruning finds
    the maps a kept delta needs from a keys-only listing and a few small values."""
    return item_map_prefix(namespace, name) + f"{digest}/base"


def heat_prefix(namespace: str, name: str) -> str:
    return shard_prefix(namespace, name) + "heat/"


def warm_prefix(namespace: str, name: str) -> str:
    return shard_prefix(namespace, name) + "warm/"


def warm_key(namespace: str, name: str, pod: str) -> str:
    return warm_prefix(namespace, name) + pod


def catalog_prefix(namespace: str, name: str) -> str:
    """``catalog/``: the content-addressed catalog versions (:mod:`kvshard.catalog_schema`)."""
    return shard_prefix(namespace, name) + "catalog/"


def catalog_manifest_key(namespace: str, name: str, version: str) -> str:
    return catalog_prefix(namespace, name) + f"{version}/manifest"


def catalog_chunk_key(namespace: str, name: str, version: str, chunk: int) -> str:
    return catalog_prefix(namespace, name) + f"{version}/chunks/{chunk:06d}"


def blend_key(namespace: str, name: str) -> str:
    """``blend``: the blend settings in force (:class:`kvshard.blend_policy.BlendPolicy`), changed only
    by compare-and-swap on the key's version."""
    return shard_prefix(namespace, name) + "blend"


def corequest_prefix(namespace: str, name: str) -> str:
    """``corequest/``: each router's last interval of co-requested cluster pairs
    (:mod:`kvshard.corequest_schema`), under a lease so a router that died stops counting."""
    return shard_prefix(namespace, name) + "corequest/"


def corequest_key(namespace: str, name: str, router: str) -> str:
    return corequest_prefix(namespace, name) + router
