"""Blocks: the key each segment is stored under, computing missing ones, placing them in one KV buffer.

Why its own module: this is where the engine meets the block store, and everything in it is about
segments, not layers — look each cached segment's block up (the uncached suffix never is), prefill
the misses in one batch behind the context :mod:`.contexts` decides and put them back, then copy the
blocks into a :class:`~kvshard_sidecar.engine.kvbuffer.KVBuffer` at their prompt positions with their
keys re-rotated (:mod:`.rope`). Warming (:meth:`BlockPrefill.ensure_blocks`) and a request's blend go
through the same code, so a warmed block is stored under the key a request looks up. The layer
arithmetic is :mod:`.layers`; what is done with the assembled buffer is :mod:`.blend`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvshard.segments import ModelIdentity, Prompt, Segment, block_key
from kvshard_sidecar.blockstore.block import KVBlock
from kvshard_sidecar.engine.contexts import (
    appearance_texts,
    average_blocks,
    behind_system_only,
    exact_segments,
    is_averaged,
    later_text,
    segment_keys,
    system_context,
)
from kvshard_sidecar.engine.executor import Executor
from kvshard_sidecar.engine.kvbuffer import KVBuffer
from kvshard_sidecar.engine.layers import Geometry, run_layers
from kvshard_sidecar.engine.rope import apply_rotary, rotate_keys, rotation_tables
from kvshard_sidecar.engine.selectors import Plan
from kvshard_sidecar.engine.settings import BlendSettings
from kvshard_sidecar.engine.source import BlockSource, tier_name


@dataclass
class Assembly:
    """The KV buffer blocks were placed in, and what it took: the exact prefix's length, timings and
    tokens per kind (asked, found per tier, computed)."""

    kv: KVBuffer
    exact_prefix: int
    timings: dict[str, float]
    query_tokens: dict[str, int]
    hit_tokens: dict[str, dict[str, int]]
    computed_tokens: dict[str, int]


class BlockPrefill:
    """The block half of :class:`~kvshard_sidecar.engine.blend.BlendEngine` (which sets these attributes)."""

    executor: Executor
    identity: ModelIdentity
    store: BlockSource
    settings: BlendSettings

    def block_keys(self, prompt: Prompt, settings: BlendSettings | None = None) -> list[str]:
        """The key of every segment's block as this engine stores it (the suffix's too, unused)."""
        return segment_keys(self.identity, prompt, settings or self.settings)

    def prefill_segment(self, segment: Segment, context: KVBlock | None = None) -> KVBlock:
        """Compute one segment's block; see :meth:`prefill_segments`."""
        return self.prefill_segments([segment], context)[0]

    @torch.inference_mode()
    def prefill_segments(self, segments: Sequence[Segment], context: KVBlock | None = None) -> list[KVBlock]:
        """Compute segments' blocks, each alone at position 0 or each behind ``context`` (an exact prefix).

        All segments go through the layers in one batch: rows ``[context | seg 1 | seg 2 | ...]`` with a
        block mask (each segment sees the context and its own earlier tokens, never another segment)
        and RoPE positions restarting at ``P`` for every segment — the same arithmetic as one prefill
        per segment, in one pass. Behind a context of P tokens the keys come out rotated for
        ``P..P+T-1``; they are rotated back by ``-P`` so every block follows one convention (keys as at
        positions ``0..T-1``).
        """
        ex = self.executor
        shape = ex.shape
        before = context.num_tokens if context is not None else 0
        lengths = [len(s) for s in segments]
        total = before + sum(lengths)
        kv = KVBuffer.empty(shape.num_layers, shape.num_kv_heads, total, shape.head_dim, ex.dtype, ex.device)
        if context is not None:
            kv.keys[:, :, :before] = context.keys.to(kv.keys)
            kv.values[:, :, :before] = context.values.to(kv.values)
        ids = torch.zeros(total, dtype=torch.long, device=ex.device)
        ids[before:] = torch.tensor([t for s in segments for t in s.token_ids], dtype=torch.long, device=ex.device)
        owner = torch.repeat_interleave(torch.arange(len(segments)), torch.tensor(lengths)).to(ex.device)
        local = torch.cat([torch.arange(n) for n in lengths]).to(ex.device)
        rows = torch.arange(before, total, device=ex.device)
        # query row i (segment a, local t) may see the context and rows of segment a up to t
        same = owner[:, None] == owner[None, :]
        causal = local[None, :] <= local[:, None]
        allowed = torch.ones(total, total, dtype=torch.bool, device=ex.device).tril()
        allowed[before:, before:] = same & causal
        positions = torch.cat((torch.arange(before, device=ex.device), local + before))
        steps = Plan(rows, torch.zeros(total, dtype=torch.bool), (), "kv")
        run_layers(ex, kv, ids, steps, causal=False, need_hidden=False, geometry=Geometry(positions, allowed))
        blocks = []
        offset = before
        for n in lengths:
            keys = kv.keys[:, :, offset : offset + n]
            if before:
                keys = torch.stack([rotate_keys(k, -before, ex.inv_freq) for k in keys.unbind(0)])
            blocks.append(KVBlock(keys.contiguous(), kv.values[:, :, offset : offset + n].contiguous()))
            offset += n
        return blocks

    def _fetch_or_compute(
        self, segments: Sequence[Segment], keys: Sequence[str], context: KVBlock | None, stats: Assembly,
        averaged_over: Sequence[KVBlock] = (),
    ) -> list[KVBlock]:
        """Blocks for ``segments``: store hits as they are, misses computed in one batch and stored.

        With ``averaged_over`` (contexts, one per appearance) a miss is the mean of its position-free
        blocks prefilled behind each of them (:func:`average_blocks`) instead of one behind ``context``.
        """
        found: list[KVBlock | None] = []
        start = time.perf_counter()
        for segment, key in zip(segments, keys, strict=True):
            hit = self.store.get(key)
            if hit is not None:
                tiers = stats.hit_tokens.setdefault(segment.kind.value, {})
                tier = tier_name(hit.tier)
                tiers[tier] = tiers.get(tier, 0) + len(segment)
            found.append(hit.block if hit is not None else None)
        stats.timings["fetch"] += time.perf_counter() - start
        missing = [i for i, block in enumerate(found) if block is None]
        if missing:
            start = time.perf_counter()
            todo = [segments[i] for i in missing]
            if averaged_over:
                computed = average_blocks([self.prefill_segments(todo, c) for c in averaged_over])
            else:
                computed = self.prefill_segments(todo, context)
            for index, block in zip(missing, computed, strict=True):
                self.store.put(keys[index], block)
                found[index] = block
                kind = segments[index].kind.value
                stats.computed_tokens[kind] = stats.computed_tokens.get(kind, 0) + len(segments[index])
            self._sync()
            stats.timings["compute"] += time.perf_counter() - start
        return [block for block in found if block is not None]

    def _assemble(self, prompt: Prompt, settings: BlendSettings, upto: int | None,
                  geometry: Geometry | None = None) -> Assembly:
        """Fetch/compute blocks of segments ``[0, upto)`` (never the suffix) into a KV buffer, each at its
        rows and rotated to its position (its first row's, or ``geometry``'s)."""
        ex, shape = self.executor, self.executor.shape
        segments = prompt.segments
        cached = len(segments) - 1 if upto is None else min(upto, len(segments) - 1)
        n = len(prompt)
        kv = KVBuffer.empty(shape.num_layers, shape.num_kv_heads, n, shape.head_dim, ex.dtype, ex.device)
        stats = Assembly(kv, 0, {"fetch": 0.0, "compute": 0.0, "assemble": 0.0}, {}, {}, {})
        for segment in segments:
            stats.query_tokens[segment.kind.value] = stats.query_tokens.get(segment.kind.value, 0) + len(segment)
        spans = prompt.spans
        fetched = self._blocks(prompt, settings, cached, stats)
        at = (lambda row: row) if geometry is None else (lambda row: int(geometry.positions[row]))
        blocks = [(spans[index].start, at(spans[index].start), block) for index, block in enumerate(fetched)]
        start = time.perf_counter()
        self._place(kv, blocks)
        self._sync()
        stats.timings["assemble"] += time.perf_counter() - start
        stats.exact_prefix = spans[exact_segments(prompt, settings, cached)].start
        return stats

    def _blocks(self, prompt: Prompt, settings: BlendSettings, count: int, stats: Assembly) -> list[KVBlock]:
        """Blocks of the first ``count`` segments, fetched or computed (each batch behind its context)."""
        segments = prompt.segments[:count]
        keys = self.block_keys(prompt, settings)[:count]
        if not segments:
            return []
        if system_context(prompt, settings.prefill_context) is None:
            return self._fetch_or_compute(segments, keys, None, stats)
        system = self._fetch_or_compute(segments[:1], keys[:1], None, stats)[0]
        alone = [i for i in range(1, count) if behind_system_only(prompt, i, settings)]
        averaged = [i for i in range(1, count) if is_averaged(prompt, i, settings)]
        later = [i for i in range(1, count) if i not in alone and i not in averaged]
        found: dict[int, KVBlock] = {0: system}
        for group, kind in ((alone, "alone"), (later, "later"), (averaged, "averaged")):
            if not group:
                continue
            neutral = later_text(settings)
            context: KVBlock | None = system if kind == "alone" or neutral is None else self._neutral_context(
                system, neutral, keys[0], stats)
            if kind == "later" and settings.prefill_context == "history":
                context = None
            over = [self._neutral_context(system, text, keys[0], stats)
                    for text in appearance_texts(settings)] if kind == "averaged" else []
            blocks = self._fetch_or_compute([segments[i] for i in group], [keys[i] for i in group], context, stats,
                                            averaged_over=over)
            found.update(zip(group, blocks, strict=True))
        return [found[i] for i in range(count)]

    @torch.inference_mode()
    def ensure_blocks(self, prompt: Prompt, settings: BlendSettings | None = None) -> dict[str, int]:
        """Make sure every segment of ``prompt`` has its block stored (warming: no segment is treated as
        the suffix); returns the tokens computed per kind (empty when everything was already stored).

        Warm an item with ``Prompt.of([system, item])``: blocks get the keys a request's blend looks up.
        """
        settings = settings or self.settings
        shape = self.executor.shape
        empty = KVBuffer.empty(shape.num_layers, shape.num_kv_heads, 0, shape.head_dim,
                               self.executor.dtype, self.executor.device)
        stats = Assembly(empty, 0, {"fetch": 0.0, "compute": 0.0, "assemble": 0.0}, {}, {}, {})
        self._blocks(prompt, settings, len(prompt.segments), stats)
        return stats.computed_tokens

    def _neutral_context(self, system: KVBlock, neutral: Segment, system_key: str, stats: Assembly) -> KVBlock:
        """System block followed by the neutral text's block (itself cached behind the system)."""
        scratch = Assembly(stats.kv, 0, stats.timings, {}, {}, {})  # its tokens are not the prompt's
        key = block_key(self.identity, neutral, system_key)
        block = self._fetch_or_compute([neutral], [key], system, scratch)[0]
        moved = torch.stack([rotate_keys(k, system.num_tokens, self.executor.inv_freq) for k in block.keys.unbind(0)])
        return KVBlock(torch.cat((system.keys, moved.to(system.keys)), 2),
                       torch.cat((system.values, block.values.to(system.values)), 2))

    def _place(self, kv: KVBuffer, blocks: Sequence[tuple[int, int, KVBlock]]) -> None:
        """Copy each ``(row, position, block)`` to its rows and re-rotate its keys from ``0..T-1`` to
        ``position..position+T-1`` (one pass per layer)."""
        if not blocks:
            return
        device = self.executor.device
        shifts = torch.zeros(kv.capacity, dtype=torch.long)
        for offset, position, block in blocks:
            end = offset + block.num_tokens
            kv.keys[:, :, offset:end] = block.keys.to(device=device, dtype=kv.keys.dtype)
            kv.values[:, :, offset:end] = block.values.to(device=device, dtype=kv.values.dtype)
            shifts[offset:end] = position
        moved = torch.nonzero(shifts).reshape(-1)
        if moved.numel() == 0:
            return
        lo, hi = int(moved[0]), int(moved[-1]) + 1
        cos, sin = rotation_tables(shifts[lo:hi], self.executor.inv_freq, device=device)
        for layer in range(kv.keys.shape[0]):
            rows = kv.keys[layer, :, lo:hi]
            rows.copy_(apply_rotary(rows.float(), cos, sin))

    def _sync(self) -> None:
        if self.executor.device.type == "cuda":
            torch.cuda.synchronize(self.executor.device)
