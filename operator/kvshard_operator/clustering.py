"""Which cluster each catalog item belongs to, for one reconciliation: clustered afresh, or carried over
from the previous generation with a catalog change applied as a diff.

Why a module of its own. Clustering is the reconciler's one expensive step, and its policy — cache the
labels per (catalog, vectors, k, settings), apply a change as a diff so unchanged items keep their
clusters, re-cluster only past the drift threshold, cluster large catalogs in bounded memory — is a
unit a reader wants to see whole; :mod:`reconcile` keeps the order of the steps and the status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvshard import etcd_store
from kvshard import placement_schema as ps
from kvshard_operator import catalog as catalogs
from kvshard_operator import catalog_update as updates
from kvshard_operator import catalog_vectors as given
from kvshard_operator import embedding, placement, placement_large
from kvshard_operator.settings import Settings
from kvshard_operator.vectors import ArrayVectors

if TYPE_CHECKING:  # the reconciler imports this module and owns the per-CacheShard memory
    from kvshard_operator.reconcile import ShardState


def cluster(loaded: given.Loaded, k: int, settings: Settings, state: ShardState) -> dict[str, int]:
    """item → cluster, recomputed only when the catalog, its vectors, k or the clustering settings
    change. Given vectors skip the model; catalogs of ``settings.large_placement_items`` or more are
    clustered in bounded memory (:mod:`placement_large`), and its centroids are the ones later
    catalog changes are placed against."""
    cat = loaded.catalog
    large = len(cat) >= settings.large_placement_items
    key = (cat.content_hash, loaded.digest, k, settings.seed, settings.slack_percent, settings.cooccurrence_percent,
           large)
    if state.labels_key == key:
        return state.labels
    raw: npt.NDArray[np.floating] = (embedding.embed_catalog(cat.ids, cat.texts) if loaded.vectors is None
                                     else loaded.vectors)
    if large:
        result = placement_large.cluster_large(ArrayVectors(raw), k, seed=settings.seed,
                                               slack_percent=settings.slack_percent)
        labels = result.labels.tolist()
        state.centroids = result.update_centroids()
    else:
        vectors = np.asarray(raw, dtype=np.float32)
        if settings.cooccurrence_percent and cat.histories:
            row = {item: i for i, item in enumerate(cat.ids)}
            histories = [[row[i] for i in h if i in row] for h in cat.histories]
            vectors = placement.pull_cooccurring(vectors, histories, settings.cooccurrence_percent)
        labels = [int(c) for c in placement.cluster_items(vectors, k, seed=settings.seed,
                                                          slack_percent=settings.slack_percent)]
        state.centroids = updates.Centroids.from_vectors(np.asarray(raw, dtype=np.float32), labels, k)
    state.labels_key, state.labels = key, dict(zip(cat.ids, labels, strict=True))
    state.centroids_key = (cat.content_hash, k)
    return state.labels


async def catalog_labels(loaded: given.Loaded, k: int, previous: ps.Placement | None, store: etcd_store.EtcdStore,
                  namespace: str, name: str, settings: Settings, state: ShardState,
                  logger: logging.Logger | logging.LoggerAdapter[logging.Logger],
                  ) -> tuple[dict[str, int], updates.Update | None]:
    """item → cluster: the previous generation's when the catalog did not change, the previous ones
    plus a diff when it did (no re-clustering) unless the diff drifted past
    ``settings.recluster_imbalance_percent`` (then a full clustering matched to the old ids), a full
    clustering when there is no catalog-aware previous generation or ``spec.clusters`` changed.
    Given vectors are read, never embedded."""
    cat = loaded.catalog
    source = None if loaded.vectors is None else ArrayVectors(loaded.vectors)
    if previous is not None and previous.catalog and len(previous.assignment) == k:
        if previous.catalog == cat.version:
            return dict(previous.item_clusters), None
        old = state.catalog if state.catalog is not None and state.catalog.version == previous.catalog else None
        if old is None:
            try:
                old = await store.read_catalog(namespace, name, previous.catalog)
            except catalogs.CatalogError as exc:
                logger.warning("previous catalog unreadable (%s); clustering from scratch", exc)
        if old is not None:
            centroids = state.centroids if state.centroids_key == (old.version, k) else None
            if centroids is None:  # after a restart; given vectors exist for the new catalog's rows only
                centroids = await asyncio.to_thread(updates.sample_centroids, old if source is None else cat,
                                                    previous.item_clusters, k, embedding.embed_texts,
                                                    seed=settings.seed, source=source)
            update = await asyncio.to_thread(updates.apply_change, old, cat, previous.item_clusters, centroids,
                                             embedding.embed_texts, slack_percent=settings.slack_percent,
                                             source=source)
            drift = updates.imbalance(update.labels)
            update = dataclasses.replace(update, drift=drift)
            if updates.drifted(update.labels, settings.recluster_imbalance_percent):
                # the same clustering as the first placement, computed afresh (not from the cache, so
                # its centroids are in its own ids), then matched to the old ids
                state.labels_key = None
                fresh = await asyncio.to_thread(cluster, loaded, k, settings, state)
                update, mapping = updates.recluster(update, previous.item_clusters, fresh, k)
                fresh_centroids = state.centroids  # set by cluster, in the fresh ids
                if fresh_centroids is None:
                    raise RuntimeError("clustering left no centroids")
                centroids = fresh_centroids.relabel(mapping)
                state.labels = dict(update.labels)
                logger.info("catalog drifted to %d %% imbalance (> %d %%): re-clustered, %d unchanged items moved "
                            "(%d forced by the balance cap)", round(drift * 100), settings.recluster_imbalance_percent,
                            update.moved_unchanged,
                            updates.forced_moves({i: previous.item_clusters[i] for i in update.labels
                                                  if i in previous.item_clusters}, k, settings.slack_percent))
            state.centroids, state.centroids_key = centroids, (cat.version, k)
            return update.labels, update
    return await asyncio.to_thread(cluster, loaded, k, settings, state), None


def cluster_bytes(cat: catalogs.Catalog, labels: Mapping[str, int], bytes_per_token: int) -> dict[int, int]:
    """Estimated KV bytes per cluster: ~4 characters per token, plus one token per item."""
    sizes = np.zeros(max(labels.values(), default=-1) + 1, dtype=np.int64)
    for item, text in zip(cat.ids, cat.texts, strict=True):
        sizes[labels[item]] += (len(text) // 4 + 1) * bytes_per_token
    return {c: int(b) for c, b in enumerate(sizes)}
