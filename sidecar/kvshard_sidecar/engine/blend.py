"""The blend engine: segment blocks in, first-token logits and a decodable KV out.

How a blend works: docs/blending-and-fidelity.md#how-a-blend-works.

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

This module is the request paths (``full``, ``prefix``, ``blend``) and decoding; steps 1–3 are
:mod:`.blocks` (where blocks come from) and step 4 is :mod:`.layers` (the layer loop), each a module
of its own because each is complete without the others' concerns.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kvshard.segments import ModelIdentity, Prompt, SegmentKind
from kvshard_sidecar.engine.blocks import Assembly, BlockPrefill
from kvshard_sidecar.engine.contexts import exact_segments
from kvshard_sidecar.engine.decoding import decode
from kvshard_sidecar.engine.executor import Executor
from kvshard_sidecar.engine.isolated_scorer import IsolatedInputs, Readout
from kvshard_sidecar.engine.kvbuffer import KVBuffer
from kvshard_sidecar.engine.layers import Geometry, readout_scores, run_layers
from kvshard_sidecar.engine.oracle import Oracle
from kvshard_sidecar.engine.results import BlendResult, Generation, Sampling
from kvshard_sidecar.engine.selectors import Layout, Plan, plan
from kvshard_sidecar.engine.settings import BlendSettings
from kvshard_sidecar.engine.source import BlockSource, MemoryBlockSource


@dataclass(frozen=True)
class _Scoring:
    """How a scorer prompt is run and read (:meth:`BlendEngine._scoring`)."""

    geometry: Geometry
    rows: torch.Tensor
    """long ``[K]``: each candidate's label opening, where its score is read."""
    token: int
    readers: torch.Tensor
    """long: item rows that read the prefix although their cached block did not (``late`` interaction)."""


class BlendEngine(BlockPrefill):
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
        stats = Assembly(kv, 0, timings, kinds, {}, {})
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
        self, method: str, prompt: Prompt, ids: torch.Tensor, steps: Plan, stats: Assembly,
        start: float, causal: bool, calibration: tuple[float, float, int] | None = None,
        scoring: _Scoring | None = None,
    ) -> BlendResult:
        t0 = time.perf_counter()
        hidden, token_layers, selected = run_layers(self.executor, stats.kv, ids, steps, causal=causal,
                                                    need_hidden=True, calibration=calibration,
                                                    geometry=scoring.geometry if scoring else None)
        self._sync()
        t1 = time.perf_counter()
        assert hidden is not None
        logits = self.executor.logits(hidden[:, -1:])[0]
        logits = logits.cpu()
        scores = None
        if scoring is not None:
            scores = readout_scores(self.executor, hidden, selected, scoring.rows, scoring.token).cpu()
        t2 = time.perf_counter()
        timings = dict(stats.timings, layers=t1 - t0, head=t2 - t1)
        return BlendResult(
            method=method, logits=logits, ttft_s=t2 - start, timings=timings, num_tokens=len(prompt),
            exact_prefix_tokens=stats.exact_prefix, recomputed_tokens=int(selected.numel()),
            token_layers=token_layers, num_layers=self.executor.shape.num_layers,
            query_tokens=stats.query_tokens, hit_tokens=stats.hit_tokens, computed_tokens=stats.computed_tokens,
            selected=selected.cpu(), kv=stats.kv, scores=scores,
        )

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
