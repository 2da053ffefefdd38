"""The layer loop: selective recompute through every layer, and reading the candidates' scores.

Why its own module: the loop is the engine's arithmetic and nothing else — given a KV buffer, the
running rows and a :class:`~kvshard_sidecar.engine.selectors.Plan` it runs the layers, narrowing the
running set at each check layer. Every path goes through it: batched block prefill
(:meth:`~kvshard_sidecar.engine.blocks.BlockPrefill.prefill_segments`), ``full``, ``prefix`` and
``blend`` (:mod:`~kvshard_sidecar.engine.blend`); that one loop serves all of them is what makes
"r = 1 equals full" a real check. It knows nothing about segments, keys or the block store.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshard_sidecar.engine.calibration import calibrated_attention, stale_rows
from kvshard_sidecar.engine.executor import Executor
from kvshard_sidecar.engine.kvbuffer import KVBuffer
from kvshard_sidecar.engine.selectors import Plan, attention_received, deviation_scores, select_top


@dataclass(frozen=True)
class Geometry:
    """Where each KV row stands and what it may see, when that is not "row ``p`` is position ``p``,
    causal": batched segment prefill (every segment from one position, blind to the others) and the
    isolated scorer's candidates (:mod:`kvshard_sidecar.engine.isolated_scorer`)."""

    positions: torch.Tensor
    """long ``[N]``: the RoPE position of every row."""
    allowed: torch.Tensor
    """bool ``[N, N]``: row ``i`` may attend to row ``j``."""


def run_layers(
    ex: Executor, kv: KVBuffer, ids: torch.Tensor, steps: Plan, causal: bool, need_hidden: bool,
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
                scores = scores * suffix_attention(ex, layer, kv, q, running, steps.pinned, visible(running))
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


def suffix_attention(
    ex: Executor, layer: int, kv: KVBuffer, q: torch.Tensor, running: torch.Tensor, pinned: torch.Tensor,
    visible: torch.Tensor,
) -> torch.Tensor:
    """Attention the pinned (suffix) queries among ``running`` pay each running token at ``layer``
    (``visible``: ``[n, N]``, what each running query may see)."""
    asking = torch.nonzero(pinned[running]).reshape(-1)
    if asking.numel() == 0:
        return torch.ones(running.numel(), device=running.device)
    keys, _ = kv.layer(layer)
    received = attention_received(q[0][:, asking], keys[0], visible[asking], ex.scaling)
    return received[running]


def readout_scores(ex: Executor, hidden: torch.Tensor, running: torch.Tensor, rows: torch.Tensor, readout: int
                   ) -> torch.Tensor:
    """``log P(readout)`` at ``rows`` (each among the ``running`` rows ``hidden`` holds), [K] float32.
    The head runs in float32, as the scorer was evaluated: near-ties must not break by rounding."""
    at = torch.searchsorted(running, rows)
    if not bool((running[at.clamp(max=running.numel() - 1)] == rows).all()):
        raise AssertionError("a label opening was not recomputed")  # forced rows always are
    normed = ex.norm(hidden[0, at]).float()
    logits = normed @ ex.lm_head.weight.float().T
    scores: torch.Tensor = torch.log_softmax(logits, dim=-1)[:, readout]
    return scores
