"""`kvshard bench placement --publish`: what publishing placement generations costs etcd, per
generation and for the readers, with content-addressed item maps (schema 2) next to the old
per-generation layout (schema 1).

A real etcd is started with the chart's flags for this many items (:func:`chart_etcd_flags`:
periodic compaction every 5 minutes and the quota ``kvshard.etcdQuotaBytes`` in
charts/kvshard/templates/_helpers.tpl computes from ``etcd.sizing.catalogItems``).
``--items`` synthetic items (ids ``item-00000000``…) are labelled with
``--clusters`` clusters (uniformly at random: the clustering itself is what plain ``bench
placement`` measures; here only the map's size and shape matter) and the clusters placed on
``--pods`` pods by the operator's :func:`kvshard_operator.placement.assign_clusters`. Then:

* generation 1 is published;
* ``--rebalances`` rebalance-only generations follow, each moving ``--moves`` clusters to another
  pod and keeping the very ``item_clusters`` object (as the operator's rebalancer and learned
  placement do with ``dataclasses.replace``);
* ``--catalog-changes`` generations follow, each re-labelling ~1 % of the items (a new item map),
  published as the operator publishes one: a new ``item_clusters`` dict, ``expected`` the generation
  the writer published last (whose map it holds), so the writer stores the new map as a *delta* on
  that one (:meth:`kvshard.etcd_store.placement.PlacementStore._store_item_map`) — and every
  :data:`~kvshard.item_maps.MAX_DELTA_DEPTH` + 1-th change whole, bounding the chain.
  ``bytes_per_catalog_change_full_map`` is what each would write as a whole map (computed: the
  encoded map's keys and values), the cost before deltas.

After every publish a *sidecar* reader reads ``current`` as the sidecar follows it (the whole map:
the sidecar's peer lookups need every item's cluster — only when its digest changed), and an
*own-clusters* reader reads only the items of one pod's clusters. Bytes are the stores' counters
(``len(key) + len(value)`` of every put or key-value read). ``etcd_db_bytes_after`` is etcd's
``dbSize`` at the end (a run shorter than the 5-minute retention compacts nothing).

The ``per-generation`` row is computed, not published: what a schema-1 generation of the same
placement writes (assignment + every item chunk + ``current``) and what a reader reads (the same,
less ``current``) — every generation, rebalance or not; its ``etcd_db_bytes_after`` is left empty
and ``etcd_db_bytes_estimate`` is the sum of what its generations would write (a lower bound of the
DB's growth within the retention window).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import time
from typing import Any

import numpy as np

import kvshard_operator.placement as op_placement
from kvshard import etcd_keys
from kvshard import item_map_schema as item_maps
from kvshard import placement_schema as ps
from kvshard_local.testing_servers import EtcdServer

NAMESPACE, NAME = "bench", "publish"
GIB = 1 << 30


def chart_etcd_quota(items: int, *, history: int = 2) -> int:
    """The quota the chart gives its etcd for ``items`` catalog items with its default sizing values —
    the arithmetic of ``kvshard.etcdQuotaBytes`` (tests/chart checks the two agree): 14 B per item-map
    entry × 3 maps and 80 B per catalog entry × 2 versions, times the compaction history, plus 256 MiB,
    rounded up to GiB, at least 2 GiB."""
    live = items * (14 * 3 + 80 * 2)
    return max(2 * GIB, math.ceil((live * history + 256 * 2**20) / GIB) * GIB)


def chart_etcd_flags(items: int) -> tuple[str, ...]:
    return ("--auto-compaction-mode=periodic", "--auto-compaction-retention=5m",
            f"--quota-backend-bytes={chart_etcd_quota(items)}")


def synthetic_placement(items: int, pods: int, clusters: int, seed: int) -> ps.Placement:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, clusters, size=items)
    item_clusters = {f"item-{i:08d}": c for i, c in enumerate(labels.tolist())}
    capacity = {f"pod-{i:04d}": 1 << 40 for i in range(pods)}
    assignment = op_placement.assign_clusters(sorted(set(labels.tolist())), capacity)
    return ps.Placement(generation=1, assignment={c: tuple(h) for c, h in assignment.items()},
                        item_clusters=item_clusters, pods=tuple(sorted(capacity)), model="bench")


def rebalanced(placement: ps.Placement, moves: int, rng: np.random.Generator) -> ps.Placement:
    """The next generation with ``moves`` clusters moved to another pod (same item_clusters object)."""
    assignment = dict(placement.assignment)
    clusters = sorted(assignment)
    for c in rng.choice(clusters, size=min(moves, len(clusters)), replace=False).tolist():
        others = [p for p in placement.pods if p not in assignment[c]]
        if others:
            assignment[c] = (others[int(rng.integers(len(others)))],)
    return dataclasses.replace(placement, generation=placement.generation + 1, assignment=assignment)


def catalog_changed(placement: ps.Placement, fraction: float, rng: np.random.Generator) -> ps.Placement:
    """The next generation with ``fraction`` of the items in another cluster (a new item map)."""
    items = dict(placement.item_clusters)
    keys = list(items)
    clusters = sorted(placement.assignment)
    for i in rng.choice(len(keys), size=max(1, int(len(keys) * fraction)), replace=False).tolist():
        items[keys[i]] = clusters[int(rng.integers(len(clusters)))]
    return dataclasses.replace(placement, generation=placement.generation + 1, item_clusters=items)


def per_generation_bytes(placement: ps.Placement) -> tuple[int, int]:
    """(bytes written, bytes a reader reads) for one schema-1 generation of ``placement``."""
    assignment, chunks = ps.encode(placement)
    g = placement.generation
    stored = len(etcd_keys.assignment_key(NAMESPACE, NAME, g)) + len(assignment) + sum(
        len(etcd_keys.items_key(NAMESPACE, NAME, g, i)) + len(c) for i, c in enumerate(chunks))
    current = len(etcd_keys.current_key(NAMESPACE, NAME)) + len(str(g))
    return stored + current, stored + current


def full_map_bytes(placement: ps.Placement) -> int:
    """Bytes (keys and values) the item map of ``placement`` takes stored whole."""
    encoded = item_maps.encode_item_map(placement.item_clusters)
    d = encoded.digest
    return (len(etcd_keys.item_map_manifest_key(NAMESPACE, NAME, d)) + encoded.size
            + sum(len(etcd_keys.item_map_chunk_key(NAMESPACE, NAME, d, i)) for i in range(len(encoded.chunks))))


def _mean(values: list[int]) -> int:
    return int(round(sum(values) / len(values))) if values else 0


async def measure(server: EtcdServer, args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = np.random.default_rng(args.seed + 1)
    placement = synthetic_placement(args.items, args.pods, args.clusters, args.seed)
    own_pod = placement.pods[0]
    written: dict[str, list[int]] = {"rebalance": [], "catalog": []}
    read: dict[str, list[int]] = {"rebalance": [], "catalog": []}
    own_read: dict[str, list[int]] = {"rebalance": [], "catalog": []}
    seconds: dict[str, list[float]] = {"rebalance": [], "catalog": []}
    full_map: list[int] = []
    async with server.store(timeout=120) as writer, server.store(timeout=120) as sidecar, \
            server.store(timeout=120) as own:
        first_write = writer.bytes_written
        await writer.publish(NAMESPACE, NAME, placement, expected=0)
        first_bytes = writer.bytes_written - first_write
        current = await sidecar.read_current(NAMESPACE, NAME)
        await own.read_current(NAMESPACE, NAME, clusters_of=own_pod)
        assert current is not None
        steps = ["rebalance"] * args.rebalances + ["catalog"] * args.catalog_changes
        for kind in steps:
            new = (rebalanced(placement, args.moves, rng) if kind == "rebalance"
                   else catalog_changed(placement, args.change_fraction, rng))
            if kind == "catalog":
                full_map.append(full_map_bytes(new))
            w0, r0, o0 = writer.bytes_written, sidecar.bytes_read, own.bytes_read
            t0 = time.perf_counter()
            await writer.publish(NAMESPACE, NAME, new, expected=placement.generation)
            seconds[kind].append(time.perf_counter() - t0)
            written[kind].append(writer.bytes_written - w0)
            await sidecar.read_current(NAMESPACE, NAME)
            read[kind].append(sidecar.bytes_read - r0)
            await own.read_current(NAMESPACE, NAME, clusters_of=own_pod)
            own_read[kind].append(own.bytes_read - o0)
            placement = new
        db = await writer.db_size()
    old_write, old_read = per_generation_bytes(placement)
    generations = 1 + args.rebalances + args.catalog_changes
    common = {"items": args.items, "pods": args.pods, "clusters": len(placement.assignment),
              "rebalances": args.rebalances, "catalog_changes": args.catalog_changes,
              "quota_bytes": chart_etcd_quota(args.items)}
    return [
        {**common, "layout": "per-generation",
         "bytes_first_generation": old_write,
         "bytes_per_rebalance_generation": old_write,
         "bytes_per_catalog_change": old_write,
         "bytes_per_catalog_change_median": old_write,
         "bytes_per_catalog_change_full_map": None,
         "sidecar_read_bytes_per_rebalance": old_read,
         "sidecar_read_bytes_per_catalog_change": old_read,
         "own_clusters_read_bytes_per_rebalance": old_read,
         "seconds_per_rebalance": None,
         "seconds_per_catalog_change": None,
         "etcd_db_bytes_after": None,
         "etcd_db_bytes_estimate": old_write * generations},
        {**common, "layout": "content-addressed",
         "bytes_first_generation": first_bytes,
         "bytes_per_rebalance_generation": _mean(written["rebalance"]),
         "bytes_per_catalog_change": _mean(written["catalog"]),
         "bytes_per_catalog_change_median": int(np.median(written["catalog"])) if written["catalog"] else 0,
         "bytes_per_catalog_change_full_map": _mean(full_map),
         "sidecar_read_bytes_per_rebalance": _mean(read["rebalance"]),
         "sidecar_read_bytes_per_catalog_change": _mean(read["catalog"]),
         "own_clusters_read_bytes_per_rebalance": _mean(own_read["rebalance"]),
         "seconds_per_rebalance": round(sum(seconds["rebalance"]) / max(1, len(seconds["rebalance"])), 4),
         "seconds_per_catalog_change": round(sum(seconds["catalog"]) / max(1, len(seconds["catalog"])), 4),
         "etcd_db_bytes_after": db,
         "etcd_db_bytes_estimate": None},
    ]


def run_publish(args: argparse.Namespace, server: EtcdServer | None = None) -> list[dict[str, Any]]:
    """Run the publish benchmark (on ``server``, else a fresh etcd with the chart's flags)."""
    if server is not None:
        return asyncio.run(measure(server, args))
    with EtcdServer(tls=False, extra_args=chart_etcd_flags(args.items), start_timeout=60) as fresh:
        return asyncio.run(measure(fresh, args))


def print_rows(rows: list[dict[str, Any]]) -> None:
    def mib(v: int | None) -> str:
        return "-" if v is None else f"{v / (1 << 20):.3f}"

    print(f"{'layout':<19}{'items':>10}{'pods':>6}{'MiB/rebal':>11}{'MiB/catalog':>13}{'(median)':>10}"
          f"{'(full map)':>12}{'MiB read/rebal':>16}{'read/catalog':>14}"
          f"{'own MiB/rebal':>15}{'etcd DB MiB':>13}{'(estimate)':>12}{'quota MiB':>11}")
    for r in rows:
        print(f"{r['layout']:<19}{r['items']:>10}{r['pods']:>6}{mib(r['bytes_per_rebalance_generation']):>11}"
              f"{mib(r['bytes_per_catalog_change']):>13}{mib(r['bytes_per_catalog_change_median']):>10}"
              f"{mib(r['bytes_per_catalog_change_full_map']):>12}"
              f"{mib(r['sidecar_read_bytes_per_rebalance']):>16}{mib(r['sidecar_read_bytes_per_catalog_change']):>14}"
              f"{mib(r['own_clusters_read_bytes_per_rebalance']):>15}{mib(r['etcd_db_bytes_after']):>13}"
              f"{mib(r['etcd_db_bytes_estimate']):>12}{mib(r['quota_bytes']):>11}")
