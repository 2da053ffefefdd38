"""The peer tier: on a local miss, ask the sidecars that hold a block before computing it.

Runs in the engine's worker thread (the store calls it synchronously on a miss), so it uses a plain
blocking HTTP client with a short timeout. Every payload is decoded with the checksummed codec: a
damaged reply raises :class:`CorruptBlockError`, which the store counts as corrupt and never serves.
Who holds what comes from a callable: a static peer list (``--peers``), or :class:`PlacementHolders`,
which answers from the followed placement and the pods' warm reports in etcd.
"""

from __future__ import annotations

import http.client
import logging
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvshard.placement_schema import Placement, WarmReport
from kvshard_sidecar.blockstore import CorruptBlockError, KVBlock, decode_block

log = logging.getLogger(__name__)

TOKEN_HEADER = "Authorization"
HoldersOf = Callable[[str], Sequence[str]]


def bearer(token: str) -> str:
    return f"Bearer {token}"


class PeerFetcher:
    """A :data:`~kvshard_sidecar.blockstore.BlockFetcher` over HTTP ``GET /v1/blocks/{key}``."""

    def __init__(self, holders: HoldersOf, token: str, timeout_seconds: float = 2.0) -> None:
        self._holders = holders
        self._token = token
        self._timeout = timeout_seconds

    def __call__(self, key: str) -> KVBlock | None:
        corrupt_from: list[str] = []
        for base_url in self._holders(key):
            try:
                data = self._get(base_url, key)
            except (OSError, http.client.HTTPException) as error:
                log.warning("peer %s unreachable for block %s: %s", base_url, key[:12], error)
                continue
            if data is None:
                continue
            try:
                return decode_block(key, data, copy=False)  # ``data`` is a fresh buffer we own
            except CorruptBlockError as error:
                log.warning("peer %s sent a corrupt block %s: %s", base_url, key[:12], error)
                corrupt_from.append(base_url)
        if corrupt_from:
            raise CorruptBlockError(f"block {key[:12]} was corrupt from {', '.join(corrupt_from)}")
        return None

    def _get(self, base_url: str, key: str) -> bytearray | None:
        url = urllib.parse.urlsplit(base_url)
        connection_class = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        connection = connection_class(url.netloc, timeout=self._timeout)
        try:
            connection.request("GET", f"{url.path.rstrip('/')}/v1/blocks/{key}",
                               headers={TOKEN_HEADER: bearer(self._token)})
            response = connection.getresponse()
            if response.status != 200:
                detail = response.read(200)
                if response.status == 404:
                    return None
                raise http.client.HTTPException(f"HTTP {response.status}: {detail!r}")
            length = int(response.getheader("Content-Length") or 0)
            body = bytearray(length)  # read straight into one buffer: no intermediate copies
            view, got = memoryview(body), 0
            while got < length:
                count = response.readinto(view[got:])
                if not count:
                    break
                got += count
            return body[:got] if got < length else body
        finally:
            connection.close()


def static_holders(peers: Sequence[str]) -> HoldersOf:
    """Every listed peer may hold every block (`--peers`, when the sidecar does not follow placement)."""
    frozen = tuple(p.rstrip("/") for p in peers)
    return lambda key: frozen


@dataclass(frozen=True)
class _View:
    """One consistent picture, swapped whole so the engine thread never sees half an update."""

    placement: Placement | None = None
    warm: Mapping[str, WarmReport] = field(default_factory=dict)


class PlacementHolders:
    """``key → peer base URLs`` from placement: pure, updated by the follower, read by the fetcher.

    An item block's key maps to its item (``item_keys``, computed once from the catalog), the item
    to its cluster, the cluster to its holders: pods that report the cluster warm first (they hold
    every block of it — also one that placement just moved away from and that has not evicted yet),
    then the other pods placement assigns it to (they may be warming it). A pod without a warm
    report has no known URL and is skipped. Any other key (a user-history
    block, the system block) may be anywhere — history is replicated — so every other pod that
    reported a URL is asked. This pod is never asked.
    """

    def __init__(self, own_pod: str, item_keys: Mapping[str, str] | None = None) -> None:
        self.own_pod = own_pod
        self._item_of_key: Mapping[str, str] = dict(item_keys or {})
        self._view = _View()

    def set_item_keys(self, item_keys: Mapping[str, str]) -> None:
        """Block key → item id for the catalog (after the model is loaded)."""
        self._item_of_key = dict(item_keys)

    def update_placement(self, placement: Placement) -> None:
        self._view = _View(placement, self._view.warm)

    def update_warm(self, warm: Mapping[str, WarmReport]) -> None:
        self._view = _View(self._view.placement, dict(warm))

    def __call__(self, key: str) -> Sequence[str]:
        view = self._view
        others = {pod: report.url.rstrip("/") for pod, report in sorted(view.warm.items())
                  if pod != self.own_pod and report.url}
        item = self._item_of_key.get(key)
        if item is None:
            return tuple(others.values())
        if view.placement is None:
            return ()
        cluster = view.placement.item_clusters.get(item)
        if cluster is None:  # a cold-start item: no pod was given it
            return ()
        warm = [pod for pod in others if cluster in view.warm[pod].clusters]
        warming = [pod for pod in view.placement.assignment.get(cluster, ()) if pod in others and pod not in warm]
        return tuple(others[pod] for pod in warm + warming)
