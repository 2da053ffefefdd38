"""The blocks a sidecar holds ahead of requests: computed between requests, dropped when placement moves, sent to peers.

Why a module of its own: warming is the other work the model does — placement's clusters, histories warmed
ahead and ``POST /v1/blocks/prefill`` become units of the prefill queue (:mod:`.prefill_queue`), and each
unit lands here, in the worker thread, to be computed by the embedded engine or by vLLM. What is stored
is then this pod's to evict and to serve to its peers, verified before it leaves.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from kvshard.segments import Prompt
from kvshard_sidecar.blockstore import BlockStore, encode_block
from kvshard_sidecar.serving.catalog_state import CatalogState
from kvshard_sidecar.serving.model_host import ModelHost
from kvshard_sidecar.serving.prefill_queue import WarmUnit


class BlockWarmer:
    """Computes, checks, evicts and hands out this pod's stored blocks."""

    def __init__(self, store: BlockStore, host: ModelHost, catalog: CatalogState, max_history: int) -> None:
        self.store = store
        self.host = host
        self.catalog = catalog
        self.max_history = max_history

    def warm_unit(self, unit: WarmUnit) -> int:
        """Make sure the blocks of some items or of one user's history are stored (worker thread);
        returns tokens computed. Items go through one batched prefill: their keys are the same as
        one by one (a key depends on the segment and its context, never the position)."""
        builder = self.catalog.builder
        if self.host.vllm_scorer is not None:
            return self._warm_through_vllm(unit)
        engine = self.host.engine
        assert engine is not None, "load() first"
        segments = [builder.system_segment]
        if unit.kind == "item":
            segments += [builder.item_segment(ident) for ident in unit.idents]
        else:
            users = self.catalog.users
            segments += [builder.history_segment(users[ident][-self.max_history:]) for ident in unit.idents]
        computed = engine.ensure_blocks(Prompt.of(segments))
        return sum(computed.values())

    def _warm_through_vllm(self, unit: WarmUnit) -> int:
        """Warming when vLLM computes: item bodies a late scorer loads are prefilled alone by vLLM and saved
        by its connector; an isolated scorer's items read the history, so nothing of theirs is stored
        ahead, and history prefixes are stored on a user's first request (vLLM computes them then)."""
        scorer = self.host.vllm_scorer
        assert scorer is not None
        if unit.kind != "item":
            return 0
        segments = [self.catalog.builder.item_segment(ident) for ident in unit.idents]
        wanted = {self.catalog.item_key(ident): list(segment.token_ids)
                  for ident, segment in zip(unit.idents, segments, strict=True)
                  if scorer.body_tokens(len(segment)) > 0}
        computed = scorer.ensure(wanted)
        return sum(len(wanted[key]) for key in computed)

    def history_users(self, count: int) -> list[str]:
        """The ``count`` most active users (longest histories first, then by id) to warm ahead."""
        users = self.catalog.users
        ranked = sorted(users, key=lambda user: (-len(users[user]), user))
        return ranked[:count]

    def evict(self, keys: Iterable[str]) -> int:
        """Drop blocks from memory and disk (blocking: disk I/O); returns how many were held."""
        return sum(self.store.evict(key) for key in keys)

    def stored(self, keys: Iterable[str]) -> bool:
        """Whether every key is held by a local tier (memory or disk)."""
        return all(self.store.contains(key) is not None for key in keys)

    def block_for_peer(self, key: str) -> Path | bytes | None:
        """A stored block for a peer: the verified file (sent with sendfile), else encoded bytes.

        A disk file is checked before it is offered, so a corrupt one is counted, removed and never
        sent; a memory-only block is encoded (with its checksum) on the fly.
        """
        if self.store.disk is not None:
            path = self.store.disk.verified_path(key)
            if path is not None:
                return path
        block = self.store.memory.get(key)
        return encode_block(key, block) if block is not None else None
