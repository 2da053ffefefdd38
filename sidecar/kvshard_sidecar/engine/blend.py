"""The blend engine: segment blocks in, first-token logits and a decodable KV out (DESIGN §4).

One request goes through four steps, each timed:

1. **fetch** every cached segment's block from the :class:`~kvshard_sidecar.engine.source.BlockSource`
   (the uncached suffix — the last segment — is never fetched);
2. **compute** the missing ones (the cold path) and put them back, so the next request hits;
3. **assemble**: copy blocks into one :class:`~kvshard_sidecar.engine.kvbuffer.KVBuffer` at their
   prompt positions and re-rotate their keys from ``0..T-1`` to ``start..start+T-1``
   (:mod:`~kvshard_sidecar.engine.rope`);
4. **layers**: selective recompute. The selector's :class:`~kvshard_sidecar.engine.selectors.Plan`
   says which positions run from layer 0; at a check layer their fresh K/V are scored against the
   cached rows and the set narrows. At every layer the running set's fresh K/V overwrite their rows
   *before* attention, and its queries attend over all rows with a causal mask by position — so
   unselected tokens contribute their cached KV, selected ones their fresh KV, and ``r = 1`` is a full
   prefill. The last position (always selected: it is in the suffix) gives the first-token logits.

Blocks are prefilled standalone at position 0, behind the prompt's system segment, behind the
system segment plus a short neutral text, or (item blocks) averaged over several such in-list
contexts (``BlendSettings.prefill_context``, :mod:`.contexts`); the block key's ``context`` records
which, so they never collide. Leading segments whose block is an exact prefix
of the prompt (the first segment; behind a system context also the one right after it) are never
recomputed — a prefix cache would not recompute them either.

``full`` (whole-prompt prefill) and ``prefix`` (a prefix cache's best: reuse the exact prefix, prefill
the rest) run through the same layer loop, which is what makes "r = 1 equals full" a real check.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kvshard.segments import ModelIdentity, Prompt, Segment, SegmentKind, block_key
from kvshard_sidecar.blockstore.block import KVBlock
from kvshard_sidecar.engine.calibration import calibrated_attention, stale_rows
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
from kvshard_sidecar.engine.decoding import decode
from kvshard_sidecar.engine.executor import Executor
from kvshard_sidecar.engine.isolated_scorer import IsolatedInputs, Readout
from kvshard_sidecar.engine.kvbuffer import KVBuffer
from kvshard_sidecar.engine.oracle import Oracle
from kvshard_sidecar.engine.results import BlendResult, Generation, Sampling
from kvshard_sidecar.engine.rope import apply_rotary, rotate_keys, rotation_tables
from kvshard_sidecar.engine.selectors import (
    Layout,
    Plan,
    attention_received,
    deviation_scores,
    plan,
    select_top,
)
from kvshard_sidecar.engine.settings import BlendSettings
from kvshard_sidecar.engine.source import BlockSource, MemoryBlockSource, tier_name


@dataclass(frozen=True)
class Geometry:
    """Where each KV row stands and what it may see, when that is not "row ``p`` is position ``p``,
    causal": batched segment prefill (every segment from one position, blind to the others) and the
    isolated scorer's candidates (:mod:`kvshard_sidecar.engine.isolated_scorer`)."""

    positions: torch.Tensor
    """long ``[N]``: the RoPE position of every row."""
    allowed: torch.Tensor
    """bool ``[N, N]``: row ``i`` may attend to row ``j``."""


@dataclass(frozen=True)
class _Scoring:
    """How a scorer prompt is run and read (:meth:`BlendEngine._scoring`)."""

    geometry: Geometry
    rows: torch.Tensor
    """long ``[K]``: each candidate's label opening, where its score is read."""
    token: int
    readers: torch.Tensor
    """long: item rows that read the prefix although their cached block did not (``late`` interaction)."""


@dataclass
class _Assembly:
    kv: KVBuffer
    exact_prefix: int
    timings: dict[str, float]
    query_tokens: dict[str, int]
    hit_tokens: dict[str, dict[str, int]]
    computed_tokens: dict[str, int]


class BlendEngine:
    """Blends cached segment KV for one model; thread-compatible, not thread-safe (one request at a time)."""

    def __init__(self, model: Any, identity: ModelIdentity, store: BlockSource | None = None,
                 settings: BlendSettings | None = None) -> None:
        self.executor = Executor(model)
        self.identity = identity
        self.store: BlockSource = store if store is not None else MemoryBlockSource()
        self.settings = settings or BlendSettings()
        self.settings.validate(self.executor.shape.num_layers)
        if self.settings.threads:
            torch.set_num_threads(self.settings.threads)

    @classmethod
    def load(
        cls, path: Path | str | None = None, store: BlockSource | None = None, settings: BlendSettings | None = None
    ) -> BlendEngine:
        """Load a Llama-family folder (default: the prepared SmolLM2) on the settings' device/dtype."""
        from kvshard_sidecar.engine.model import load_model

        settings = settings or BlendSettings()
        loaded = load_model(path, dtype=settings.dtype, device=settings.device)
        return cls(loaded.model, loaded.identity, store, settings)

    # ----------------------------------------------------------------- blocks

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
        self._run(kv, ids, steps, causal=False, need_hidden=False, geometry=Geometry(positions, allowed))
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
        self, segments: Sequence[Segment], keys: Sequence[str], context: KVBlock | None, stats: _Assembly,
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
                  geometry: Geometry | None = None) -> _Assembly:
        """Fetch/compute blocks of segments ``[0, upto)`` (never the suffix) into a KV buffer, each at its
        rows and rotated to its position (its first row's, or ``geometry``'s)."""
        ex, shape = self.executor, self.executor.shape
        segments = prompt.segments
        cached = len(segments) - 1 if upto is None else min(upto, len(segments) - 1)
        n = len(prompt)
        kv = KVBuffer.empty(shape.num_layers, shape.num_kv_heads, n, shape.head_dim, ex.dtype, ex.device)
        stats = _Assembly(kv, 0, {"fetch": 0.0, "compute": 0.0, "assemble": 0.0}, {}, {}, {})
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

    def _blocks(self, prompt: Prompt, settings: BlendSettings, count: int, stats: _Assembly) -> list[KVBlock]:
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
        stats = _Assembly(empty, 0, {"fetch": 0.0, "compute": 0.0, "assemble": 0.0}, {}, {}, {})
        self._blocks(prompt, settings, len(prompt.segments), stats)
        return stats.computed_tokens

    def _neutral_context(self, system: KVBlock, neutral: Segment, system_key: str, stats: _Assembly) -> KVBlock:
        """System block followed by the neutral text's block (itself cached behind the system)."""
        scratch = _Assembly(stats.kv, 0, stats.timings, {}, {}, {})  # its tokens are not the prompt's
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

    # ----------------------------------------------------------------- prefill paths

    @torch.inference_mode()
    def full(self, prompt: Prompt, readout: Readout | None = None) -> BlendResult:
        """Reference: an ordinary causal prefill of the whole prompt through the same executor (with
        ``readout``, the isolated scorer's full prefill: see :meth:`blend`)."""
        ex, shape = self.executor, self.executor.shape
        start = time.perf_counter()
        n = len(prompt)
        scoring = self._scoring(prompt, readout)
        kv = KVBuffer.empty(shape.num_layers, shape.num_kv_heads, n, shape.head_dim, ex.dtype, ex.device)
        ids = torch.tensor(prompt.token_ids, dtype=torch.long, device=ex.device)
        everything = torch.arange(n, device=ex.device)
        steps = Plan(everything, torch.zeros(n, dtype=torch.bool), (), "kv")
        timings = {"fetch": 0.0, "compute": 0.0, "assemble": 0.0}
        kinds = {k.value: v for k, v in prompt.tokens_by_kind().items()}
        stats = _Assembly(kv, 0, timings, kinds, {}, {})
        return self._finish("full", prompt, ids, steps, stats, start, causal=scoring is None, scoring=scoring)

    @torch.inference_mode()
    def prefix(self, prompt: Prompt, settings: BlendSettings | None = None, readout: Readout | None = None
               ) -> BlendResult:
        """Baseline: what a prefix cache does at best — reuse the exact-prefix blocks, prefill the rest."""
        settings = settings or self.settings.with_(prefill_context="system", neutral_context=(),
                                                       averaged_contexts=())
        start = time.perf_counter()
        scoring = self._scoring(prompt, readout)
        exact = exact_segments(prompt, settings, len(prompt.segments) - 1)
        stats = self._assemble(prompt, settings, upto=exact)
        ids = torch.tensor(prompt.token_ids, dtype=torch.long, device=self.executor.device)
        rest = torch.arange(stats.exact_prefix, len(prompt), device=self.executor.device)
        steps = Plan(rest, torch.zeros(len(prompt), dtype=torch.bool), (), "kv")
        return self._finish("prefix", prompt, ids, steps, stats, start, causal=False, scoring=scoring)

    @torch.inference_mode()
    def blend(self, prompt: Prompt, settings: BlendSettings | None = None, oracle: Oracle | None = None,
              readout: Readout | None = None) -> BlendResult:
        """Serve a prompt from cached blocks with the selector in ``settings`` (default: the engine's).

        ``oracle`` (measurement only, see :mod:`.oracle`) overwrites some assembled rows with full
        prefill's exact KV before the layer loop — how the fidelity benchmark attributes error.

        With ``readout`` the prompt is an isolated scorer's
        (:func:`~kvshard_sidecar.engine.isolated_scorer.scoring_prompt`: it ends at the last candidate's label)
        and ``result.scores`` holds each candidate's ``log P(readout.token)`` at its label opening. Every
        candidate's item block is placed at the prefix's end (all at the same positions) and sees the
        prefix (or, for a ``late`` scorer, not even that) and itself, never another candidate. FREE
        segments (the list header, every label) are always recomputed; item tokens are selected like
        any blended row — recomputed ones read the history afresh, the others keep the cached block's
        KV. A ``late`` scorer's items read only themselves, so their cached blocks prefilled alone
        (``prefill_context`` ``history`` or ``standalone``) are already exact.
        """
        settings = settings or self.settings
        settings.validate(self.executor.shape.num_layers)
        start = time.perf_counter()
        scoring = self._scoring(prompt, readout)
        stats = self._assemble(prompt, settings, upto=None, geometry=scoring.geometry if scoring else None)
        if oracle is not None:
            oracle.apply(stats.kv)
        free = [i for i, s in enumerate(prompt.segments) if s.kind is SegmentKind.FREE] if scoring else []
        layout = self.layout(prompt, stats.exact_prefix, settings, free)
        if scoring:  # the answers are read at each candidate's label: tail means each item's tail
            spans = prompt.spans
            items = tuple((span.start, span.end) for span in spans if span.segment.kind is SegmentKind.ITEM)
            layout = replace(layout, answer_blocks=items)
            layout.forced[scoring.readers[scoring.readers >= stats.exact_prefix].cpu()] = True
        steps = plan(layout, settings)
        device = self.executor.device
        steps = replace(steps, initial=steps.initial.to(device), pinned=steps.pinned.to(device))
        ids = torch.tensor(prompt.token_ids, dtype=torch.long, device=device)
        calibration = None
        if settings.calibrates_attention:
            calibration = (settings.attention_temperature, settings.attention_scale, stats.exact_prefix)
        return self._finish(settings.selector, prompt, ids, steps, stats, start, causal=False,
                            calibration=calibration, scoring=scoring)

    def _scoring(self, prompt: Prompt, readout: Readout | None) -> _Scoring | None:
        """For a scorer prompt: its geometry, the label-opening rows read, the readout token and the item
        rows that must be recomputed for the blend to be exact (a ``late`` scorer's interaction tokens)."""
        if readout is None:
            return None
        inputs = IsolatedInputs.of_prompt(prompt, readout.interaction)
        allowed, positions = inputs.mask_and_positions()
        device = self.executor.device
        geometry = Geometry(positions[0].to(device), allowed[0, 0].to(device))
        return _Scoring(geometry, torch.tensor(inputs.readouts, device=device), readout.token,
                        torch.tensor(inputs.readers(), dtype=torch.long))

    @staticmethod
    def layout(prompt: Prompt, exact_prefix: int, settings: BlendSettings, forced: Sequence[int] = ()) -> Layout:
        """The selectors' view of a prompt: the suffix, the segments in ``forced`` and (if configured)
        FREE segments are always recomputed."""
        last = len(prompt.segments) - 1
        always = sorted({last, *forced})
        if settings.recompute_free:
            always += [i for i, s in enumerate(prompt.segments) if s.kind is SegmentKind.FREE and i not in always]
        bounds = [(span.start, span.end) for span in prompt.spans]
        return Layout.build(bounds, exact_prefix, always, [s.kind.value for s in prompt.segments])

    def _finish(
        self, method: str, prompt: Prompt, ids: torch.Tensor, steps: Plan, stats: _Assembly,
        start: float, causal: bool, calibration: tuple[float, float, int] | None = None,
        scoring: _Scoring | None = None,
    ) -> BlendResult:
        t0 = time.perf_counter()
        hidden, token_layers, selected = self._run(stats.kv, ids, steps, causal=causal, need_hidden=True,
                                                   calibration=calibration,
                                                   geometry=scoring.geometry if scoring else None)
        self._sync()
        t1 = time.perf_counter()
        assert hidden is not None
        logits = self.executor.logits(hidden[:, -1:])[0]
        logits = logits.cpu()
        scores = None
        if scoring is not None:
            scores = self._readout_scores(hidden, selected, scoring.rows, scoring.token).cpu()
        t2 = time.perf_counter()
        timings = dict(stats.timings, layers=t1 - t0, head=t2 - t1)
        return BlendResult(
            method=method, logits=logits, ttft_s=t2 - start, timings=timings, num_tokens=len(prompt),
            exact_prefix_tokens=stats.exact_prefix, recomputed_tokens=int(selected.numel()),
            token_layers=token_layers, num_layers=self.executor.shape.num_layers,
            query_tokens=stats.query_tokens, hit_tokens=stats.hit_tokens, computed_tokens=stats.computed_tokens,
            selected=selected.cpu(), kv=stats.kv, scores=scores,
        )

    def _readout_scores(self, hidden: torch.Tensor, running: torch.Tensor, rows: torch.Tensor, readout: int
                        ) -> torch.Tensor:
        """``log P(readout)`` at ``rows`` (each among the ``running`` rows ``hidden`` holds), [K] float32.
        The head runs in float32, as the scorer was evaluated: near-ties must not break by rounding."""
        at = torch.searchsorted(running, rows)
        if not bool((running[at.clamp(max=running.numel() - 1)] == rows).all()):
            raise AssertionError("a label opening was not recomputed")  # forced rows always are
        normed = self.executor.norm(hidden[0, at]).float()
        logits = normed @ self.executor.lm_head.weight.float().T
        scores: torch.Tensor = torch.log_softmax(logits, dim=-1)[:, readout]
        return scores

    def _run(
        self, kv: KVBuffer, ids: torch.Tensor, steps: Plan, causal: bool, need_hidden: bool,
        geometry: Geometry | None = None, calibration: tuple[float, float, int] | None = None,
    ) -> tuple[torch.Tensor | None, int, torch.Tensor]:
        """The layer loop: run ``steps.initial`` from layer 0, narrowing at each check layer.

        By default row ``p`` of ``kv`` is position ``p``. ``causal=True`` is only for a running set equal
        to all rows ``0..N-1`` (full prefill); otherwise a boolean ``[n, N]`` mask lets each running
        query see every position up to its own, or what ``geometry`` allows (its positions then give
        RoPE's).
        ``calibration`` ``(temperature, scale, exact_prefix)`` rescales attention to the stale rows
        (blended, not running, after the exact prefix) — see :func:`calibrated_attention`.
        """
        ex = self.executor
        n_rows = kv.length
        running = steps.initial
        all_rows = torch.arange(n_rows, device=running.device)

        def visible(rows: torch.Tensor) -> torch.Tensor:
            return all_rows[None, :] <= rows[:, None] if geometry is None else geometry.allowed[rows]

        hidden = ex.embed(ids[running])
        cos, sin = ex.rope(running if geometry is None else geometry.positions[running])
        checks = {step.layer: step for step in steps.checks}
        mask = None if causal and geometry is None else visible(running)
        causal = mask is None
        token_layers = 0
        last_layer = ex.shape.num_layers - 1
        stale: torch.Tensor | None = None
        for layer in range(ex.shape.num_layers):
            q, k, v = ex.project(layer, hidden, (cos, sin))
            token_layers += int(running.numel())
            step = checks.get(layer)
            if step is not None:
                cached_k, cached_v = kv.rows(layer, running)
                scores = deviation_scores(k[0], cached_k, v[0], cached_v, steps.deviation_on)
                kv.write(layer, running, k, v)
                if steps.deviation_weight == "attention":
                    scores = scores * self._suffix_attention(layer, kv, q, running, steps.pinned, visible(running))
                if steps.picker is not None:
                    keep = steps.picker(scores, step.keep, steps.pinned[running], running)
                else:
                    keep = select_top(scores, step.keep, steps.pinned[running])
                running = running[keep]
                hidden, q = hidden[:, keep], q[:, :, keep]
                cos, sin = cos[:, :, keep], sin[:, :, keep]
                mask = visible(running)
                causal = False
                stale = None
            else:
                kv.write(layer, running, k, v)
            if layer == last_layer and not need_hidden:
                break
            keys, values = kv.layer(layer)
            if calibration is not None and mask is not None:
                if stale is None:
                    stale = stale_rows(n_rows, running, calibration[2])
                keys, bias = calibrated_attention(keys, mask, stale, calibration[0], calibration[1])
                hidden = ex.finish(layer, hidden, q, keys, values, bias)
                continue
            hidden = ex.finish(layer, hidden, q, keys, values, mask, causal=causal)
        return (hidden if need_hidden else None), token_layers, running

    def _suffix_attention(
        self, layer: int, kv: KVBuffer, q: torch.Tensor, running: torch.Tensor, pinned: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """Attention the pinned (suffix) queries among ``running`` pay each running token at ``layer``
        (``visible``: ``[n, N]``, what each running query may see)."""
        asking = torch.nonzero(pinned[running]).reshape(-1)
        if asking.numel() == 0:
            return torch.ones(running.numel(), device=running.device)
        keys, _ = kv.layer(layer)
        received = attention_received(q[0][:, asking], keys[0], visible[asking], self.executor.scaling)
        return received[running]

    # ----------------------------------------------------------------- decoding

    def decode(
        self,
        result: BlendResult,
        max_new_tokens: int,
        sampling: Sampling | None = None,
        stop_token_ids: Iterable[int] = (),
        keep_logits: bool = False,
    ) -> Generation:
        """Continue from a prefill (:func:`~kvshard_sidecar.engine.decoding.decode`)."""
        return decode(self.executor, result, max_new_tokens, sampling, stop_token_ids, keep_logits)

    def generate(
        self,
        prompt: Prompt,
        max_new_tokens: int,
        settings: BlendSettings | None = None,
        sampling: Sampling | None = None,
        stop_token_ids: Iterable[int] = (),
    ) -> tuple[BlendResult, Generation]:
        """Blend then decode: what the embedded engine serves for one request."""
        result = self.blend(prompt, settings)
        return result, self.decode(result, max_new_tokens, sampling, stop_token_ids)

    def _sync(self) -> None:
        if self.executor.device.type == "cuda":
            torch.cuda.synchronize(self.executor.device)

