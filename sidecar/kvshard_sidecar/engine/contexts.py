"""What precedes a block when it is prefilled (``BlendSettings.prefill_context``), as pure functions.

Why a module of its own. A cached block is only as good as the context it was computed in: an item
prefilled alone at position 0 has never seen a list, one prefilled behind the system segment has
seen the prompt's start but not the ``Candidates:`` header or its label. The engine supports four
contexts, and every decision about them — which segment goes behind which text, which leading
segments are an exact prefix, which key names the result — lives here so it is decided the same way
when a block is warmed (``[system, item]``) and when a request looks it up:

* ``standalone`` — each block at position 0 (CacheBlend, EPIC);
* ``system`` — every block behind the prompt's system segment (chat prefix, system text and the
  history header), so the history right after it is exact;
* ``neutral`` — the history behind the system segment (exact); every later block behind the system
  segment plus a short fixed text shaped like what precedes an item in a prompt (default
  ``"\\nCandidates:\\nA. "``: the list header and a label);
* ``averaged`` — like ``neutral`` with the first of ``averaged_contexts`` as its text, except item
  blocks: an item's block is the mean of its position-free KV (keys rotated back to ``0..T-1``, the
  store's convention, so averaging never mixes rotations) over one prefill behind *each* context —
  short seeded lists of other items (:func:`averaging_contexts`). One appearance is exactly
  ``neutral`` with that text; several average out what any one neighbour list imprints on the item;
* ``history`` — the history behind the system segment (exact), every later block alone at position 0
  (``standalone``'s blocks, under the same keys): the late-interaction scorer's items read only
  themselves (:mod:`kvshard_sidecar.engine.isolated_scorer`), so this serves it exactly.

The context is part of every block key (:func:`context_tag`): blocks computed behind different texts,
or averaged over different lists, never collide.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from kvshard.segments import ModelIdentity, Prompt, Segment, SegmentKind, block_key
from kvshard_sidecar.blockstore.block import KVBlock
from kvshard_sidecar.engine.settings import BlendSettings

AVERAGED_TAG = "averaged:"
"""Prefix of an averaged item block's key context, so one appearance never shares ``neutral``'s key."""


def system_context(prompt: Prompt, mode: str) -> Segment | None:
    """The segment other blocks are prefilled behind: the leading SYSTEM segment (all modes but standalone)."""
    if (mode in ("system", "neutral", "averaged", "history") and len(prompt.segments) > 1
            and prompt.segments[0].kind is SegmentKind.SYSTEM):
        return prompt.segments[0]
    return None


def later_text(settings: BlendSettings) -> Segment | None:
    """The text behind the system segment that later (not exact) blocks are prefilled behind, if any."""
    if settings.prefill_context == "neutral":
        return Segment(SegmentKind.FREE, settings.neutral_context)
    if settings.prefill_context == "averaged":
        return Segment(SegmentKind.FREE, settings.averaged_contexts[0])
    return None


def appearance_texts(settings: BlendSettings) -> list[Segment]:
    """The texts an averaged item block is prefilled behind, one per appearance (empty otherwise)."""
    if settings.prefill_context != "averaged":
        return []
    return [Segment(SegmentKind.FREE, ids) for ids in settings.averaged_contexts]


def behind_system_only(prompt: Prompt, index: int, settings: BlendSettings) -> bool:
    """Whether segment ``index`` is prefilled behind the system segment alone (so exact at index 1).

    In ``system`` mode every segment is. In ``neutral``/``averaged``/``history`` mode only a HISTORY segment right
    after the system segment is (it is an exact prefix there); everything else goes behind system +
    text — decided by kind, so warming ``[system, item]`` stores the key a request will look up.
    """
    if settings.prefill_context == "system":
        return True
    return index == 1 and prompt.segments[index].kind is SegmentKind.HISTORY


def is_averaged(prompt: Prompt, index: int, settings: BlendSettings) -> bool:
    """Whether segment ``index``'s block is averaged over appearances (``averaged`` mode, item blocks)."""
    return (settings.prefill_context == "averaged" and index > 0
            and prompt.segments[index].kind is SegmentKind.ITEM and not behind_system_only(prompt, index, settings))


def exact_segments(prompt: Prompt, settings: BlendSettings, cached: int) -> int:
    """How many leading segments (of the ``cached`` fetched ones) have exactly full-prefill KV.

    The first is computed at offset 0 with nothing before it, like in the prompt. Behind a system
    context, the segment right after it also saw exactly what precedes it in the prompt.
    """
    exact = min(1, cached)
    if (exact and cached >= 2 and system_context(prompt, settings.prefill_context) is not None
            and behind_system_only(prompt, 1, settings)):
        exact = 2
    return exact


def context_tag(appearance_keys: Sequence[str]) -> str:
    """The key context of an averaged block: every appearance's context key, in order, tagged."""
    return AVERAGED_TAG + ",".join(appearance_keys)


def average_blocks(per_appearance: Sequence[Sequence[KVBlock]]) -> list[KVBlock]:
    """Segment-wise mean of position-free blocks over appearances (``per_appearance[a][s]``).

    Keys must already be rotated back to ``0..T-1`` (what :meth:`BlendEngine.prefill_segments`
    returns behind any context), so the mean is taken in one rotation frame and the engine
    re-rotates it to where it lands. One appearance returns its blocks unchanged.
    """
    if not per_appearance:
        raise ValueError("averaging needs at least one appearance")
    if len(per_appearance) == 1:
        return list(per_appearance[0])
    averaged = []
    for blocks in zip(*per_appearance, strict=True):
        keys = torch.stack([b.keys.float() for b in blocks]).mean(0).to(blocks[0].keys.dtype)
        values = torch.stack([b.values.float() for b in blocks]).mean(0).to(blocks[0].values.dtype)
        averaged.append(KVBlock(keys.contiguous(), values.contiguous()))
    return averaged


def averaging_contexts(header: Sequence[int], labels: Sequence[Sequence[int]], fillers: Sequence[Sequence[int]],
                       appearances: int, seed: int, label_after: bool = False) -> tuple[tuple[int, ...], ...]:
    """Seeded in-list contexts for averaged item blocks, as token ids (one tuple per appearance).

    Appearance ``a`` is ``header + label₀ + filler + label₁ + filler + … + label_{a+1}``: the list
    header, ``a + 1`` other items drawn without replacement from ``fillers`` (seeded), each behind
    its label, and the label the averaged item then sits behind — so the item is seen at different
    list positions, behind different neighbours and labels. With ``label_after`` (``labelPosition:
    after``, ``<item> [A]``) each neighbour comes before its label and the averaged item directly follows
    the last label: ``header + filler + label₀ + … + filler + label_a``. Segments are joined as token
    ids, exactly as a prompt joins them. The same arguments always give the same contexts.
    """
    if appearances < 1:
        raise ValueError(f"appearances must be >= 1, got {appearances}")
    if len(labels) < appearances + 1:
        raise ValueError(f"{appearances} appearances need {appearances + 1} labels, got {len(labels)}")
    needed = appearances * (appearances + 1) // 2
    if len(fillers) < needed:
        raise ValueError(f"{appearances} appearances need {needed} filler items, got {len(fillers)}")
    drawn = random.Random(seed).sample(range(len(fillers)), needed)
    contexts = []
    for a in range(appearances):
        ids = list(header)
        for slot in range(a + 1):
            filler = fillers[drawn.pop()]
            ids += [*filler, *labels[slot]] if label_after else [*labels[slot], *filler]
        if not label_after:
            ids += labels[a + 1]
        contexts.append(tuple(ids))
    return tuple(contexts)


def segment_keys(identity: ModelIdentity, prompt: Prompt, settings: BlendSettings) -> list[str]:
    """The key of every segment's block of ``prompt`` as a model of ``identity`` stores it under
    ``settings`` (the suffix's too, unused). Pure: a sidecar that holds no weights (vLLM computes) names
    blocks exactly as the engine does."""
    context_segment = system_context(prompt, settings.prefill_context)
    context_key = block_key(identity, context_segment) if context_segment else ""
    neutral = later_text(settings) if context_segment is not None else None
    later_key = f"{context_key}+{block_key(identity, neutral, context_key)}" if neutral else context_key
    if settings.prefill_context == "history":
        later_key = ""  # alone at position 0: standalone's blocks
    averaged_key = context_tag([f"{context_key}+{block_key(identity, text, context_key)}"
                                for text in appearance_texts(settings)])
    keys = []
    for index, segment in enumerate(prompt.segments):
        if context_segment is None or index == 0:
            context = ""
        elif behind_system_only(prompt, index, settings):
            context = context_key
        else:
            context = averaged_key if is_averaged(prompt, index, settings) else later_key
        keys.append(block_key(identity, segment, context))
    return keys
