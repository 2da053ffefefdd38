"""The isolated scorer: each candidate scored from the prefix and its own item alone, so order cannot matter.

Why it exists. A recommender that reads the candidates as one list and answers with a label letter
changes its answer with the candidate order: measured on the shipped answer-position recommender, the
chosen item is the same under three orders for only 41 % of held-out users, and the experiments in
``bench/experiments`` located the cause in the candidates' states (each reads the ones before it, and
its letter), not in the readout. The isolated scorer removes both by construction:

* every candidate (its item tokens and the ``" ["`` that opens its label) attends to the prefix —
  system, history, the ``Candidates:`` header — and to itself, never to another candidate;
* every candidate stands at the same positions, right behind the prefix;
* its score is ``log P(" yes")`` at that ``" ["`` token, before its letter is read.

So a score is a function of (prefix, item) only, and the ranking is the same under every order up to
floating-point ties. All K candidates are scored in one forward pass over the prompt up to the last
candidate, with a block mask (the question after the candidates is not needed). The same numbers come
from K causal prompts ``prefix + item + " ["`` — the shape of kvshard's cache: the prefix is the
history block, each candidate an item block at a fixed position — and the score is a log-probability,
not a raw logit, so an engine that returns log-probabilities (vLLM's ``prompt_logprobs``) reads the
same value as one that returns logits.

Two variants, recorded by the merge as the model's scorer (:data:`kvshard.models.SCORERS`):

* ``isolated`` — a candidate's item tokens read the prefix: the history shapes every item token;
* ``late`` (late interaction) — an item's tokens read only themselves, except its last ``interaction``
  tokens (0: none), which read the prefix too, as its label opening does. Its other item tokens' KV is
  then the item prefilled alone, RoPE-rotated to the prefix's end: exactly a cached item block, so the
  blend engine serves it from cache recomputing only the interaction tokens and the labels, with
  nothing lost (``prefill_context`` ``history``).

The blend engine serves both (``readout``: :class:`Readout`, :meth:`BlendEngine.blend`), the sidecar in
rank mode, and vLLM (:mod:`kvshard_sidecar.vllm.scorer`: the K candidate prompts in one batch, item bodies
loaded from stored blocks, no forward in the sidecar).
Measured at issue 20's training budget (``kvshard model finetune --scorer isolated|late``): README, "Models".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvshard.models import model_interaction, model_scorer
from kvshard.prompts import RecommendationPrompt
from kvshard.segments import Prompt, Segment, SegmentKind

if TYPE_CHECKING:  # the engine imports this module: a runtime import would be circular
    from kvshard_sidecar.engine.settings import PrefillContext

READOUT = " yes"


def readout_id(tokenizer: Any) -> int:
    """The vocabulary row read at each candidate (``" yes"``: one token in SmolLM2's vocabulary; any
    fixed row would do, this one reads as what it is trained to mean)."""
    ids = tokenizer.encode(READOUT, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"the readout {READOUT!r} must be one token, got {ids}")
    return int(ids[0])


@dataclass(frozen=True)
class Readout:
    """How a scorer model's candidates are read: the vocabulary row at each label opening, and how many of
    each item's last tokens read the prefix (``interaction``: ``None`` every one, ``isolated``; a count for
    ``late``, whose other item tokens read only their item)."""

    token: int
    interaction: int | None = None

    @classmethod
    def for_model(cls, tokenizer: Any, model: Path) -> Readout | None:
        """The readout of the model folder ``model``, as its merge recorded the scorer it was trained for
        (``None`` for ``answer``: it answers with a label; ``late`` with its ``interaction`` count)."""
        scorer = model_scorer(model)
        if scorer == "answer":
            return None
        return cls(readout_id(tokenizer), None if scorer == "isolated" else model_interaction(model))


@dataclass(frozen=True)
class IsolatedInputs:
    """Where a prompt's candidates stand: ``blocks`` [start, end) of each candidate (its item and the
    label after it), and ``readouts``, the position of each candidate's label opening (``" ["``)."""

    token_ids: tuple[int, ...]
    blocks: tuple[tuple[int, int], ...]
    readouts: tuple[int, ...]
    interaction: int | None = None
    """How many of each candidate's last item tokens read the prefix: ``None`` all (scorer ``isolated``),
    a count for ``late`` (the others read only their item): see :meth:`mask_and_positions`."""

    @classmethod
    def of(cls, built: RecommendationPrompt, interaction: int | None = None) -> IsolatedInputs:
        """From a prompt whose template puts each label after its item (``labelPosition: after``)."""
        return cls.of_prompt(scoring_prompt(built), interaction)

    @classmethod
    def of_prompt(cls, prompt: Prompt, interaction: int | None = None) -> IsolatedInputs:
        """From a :func:`scoring_prompt`: its ITEM segments are the candidates, each with the label after it."""
        spans = prompt.spans
        items = _candidates(prompt.segments)
        if items[-1] + 2 != len(spans):
            raise ValueError("the isolated scorer needs each label after its item (labelPosition: after), the "
                             "prompt ending at the last label (scoring_prompt)")
        blocks = tuple((spans[i].start, spans[i + 1].end) for i in items)
        return cls(tuple(prompt.token_ids), blocks, tuple(spans[i + 1].start for i in items), interaction)

    def ending_at_openings(self) -> IsolatedInputs:
        """The same scores from fewer rows: every block cut after its label opening.

        A block's rows after its opening (the label's letter, ``"]"``, the newline) are read by nothing —
        blocks never read each other and the score is read at the opening — yet a training forward and
        backward computes them: 3 of a MovieLens block's ~18 rows, a tenth of a late prompt's tokens.
        Positions count from each block's start, so the rows kept stand where they stood. For fine-tuning
        and its validation; the blend engine keeps the prompt's own rows (its geometry indexes them)."""
        ids = list(self.token_ids[:self.prefix])
        blocks, readouts = [], []
        for (start, _), opening in zip(self.blocks, self.readouts, strict=True):
            first = len(ids)
            ids.extend(self.token_ids[start:opening + 1])
            blocks.append((first, len(ids)))
            readouts.append(len(ids) - 1)
        return IsolatedInputs(tuple(ids), tuple(blocks), tuple(readouts), self.interaction)

    @property
    def prefix(self) -> int:
        """Tokens every candidate reads: everything before the first candidate."""
        return self.blocks[0][0]

    def mask_and_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention mask [1, 1, T, T] (True = may attend: causal, minus other candidates) and the
        position ids [1, T] (every candidate from the prefix's end).

        A count ``interaction`` also hides the prefix from each candidate's item tokens but the last
        ``interaction`` (the label reads it): those item tokens' keys and values are then the item
        prefilled alone, RoPE-rotated to the prefix's end — exactly what a cached item block re-rotated
        there holds — so serving from cache recomputes only :meth:`readers` of each candidate."""
        end = len(self.token_ids)
        allowed = torch.ones(end, end, dtype=torch.bool).tril()
        for (start, stop), opening in zip(self.blocks, self.readouts, strict=True):
            allowed[start:stop, self.prefix:start] = False
            if self.interaction is not None:
                allowed[start:max(start, opening - self.interaction), :self.prefix] = False
        return allowed[None, None], self.positions()[None]

    def positions(self) -> torch.Tensor:
        """The position ids [T]: the prefix from 0, every candidate from the prefix's end."""
        positions = torch.arange(len(self.token_ids))
        for start, stop in self.blocks:
            positions[start:stop] = torch.arange(self.prefix, self.prefix + stop - start)
        return positions

    def readers(self) -> list[int]:
        """The item rows that read the prefix when items read only themselves otherwise (``late``): each
        candidate's last ``interaction`` item tokens; empty for ``isolated`` (every item row reads it,
        and a blend chooses which to recompute)."""
        if self.interaction is None:
            return []
        return [row for (start, _), opening in zip(self.blocks, self.readouts, strict=True)
                for row in range(max(start, opening - self.interaction), opening)]


def prefill_context_for(scorer: str) -> PrefillContext:
    """What a model's item blocks are prefilled behind by default (``BlendSettings.prefill_context``): a
    ``late`` scorer's items read only themselves, so blocks prefilled alone behind an exact history serve
    it exactly (``history``); every other model's items read what comes before them (``system``)."""
    return "history" if scorer == "late" else "system"


def scoring_prompt(built: RecommendationPrompt) -> Prompt:
    """The part of a recommendation prompt the scorer reads: up to the last candidate's label (the
    question after the candidates is not needed); refused unless each label follows its item."""
    segments = built.prompt.segments
    return Prompt.of(segments[: _candidates(segments)[-1] + 2])


def _candidates(segments: Sequence[Segment]) -> list[int]:
    """Indices of the candidates' ITEM segments, each followed by its label (a FREE segment)."""
    items = [i for i, s in enumerate(segments) if s.kind is SegmentKind.ITEM]
    if not items:
        raise ValueError("the prompt has no candidates")
    if items[-1] + 1 >= len(segments) or any(segments[i + 1].kind is not SegmentKind.FREE for i in items):
        raise ValueError("the isolated scorer needs each label after its item (labelPosition: after)")
    return items


def isolated_scores(causal_lm: Any, inputs: IsolatedInputs, readout: int) -> torch.Tensor:
    """Each candidate's ``log P(readout)`` at its label opening, [K] in float32, from one forward pass
    (the mask: :meth:`IsolatedInputs.mask_and_positions`).

    A bfloat16 model runs under autocast (training); the head and the log-softmax run in float32: a
    bfloat16 score of ~-20 is rounded to steps of 0.125, and near-ties would then break by place."""
    mask, positions = inputs.mask_and_positions()
    ids = torch.tensor([inputs.token_ids], device=causal_lm.device)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=causal_lm.dtype == torch.bfloat16):
        hidden = causal_lm.model(input_ids=ids, attention_mask=mask.to(ids.device),
                                 position_ids=positions.to(ids.device), use_cache=False).last_hidden_state
    return readout_scores(causal_lm, hidden[0, list(inputs.readouts)], readout)


def readout_scores(causal_lm: Any, at: torch.Tensor, readout: int) -> torch.Tensor:
    """``log P(readout)`` from the last hidden states ``at`` [N, hidden] at the label openings, [N] in
    float32: the head and the log-softmax run in float32 whatever the model's dtype."""
    logits = at.float() @ causal_lm.lm_head.weight.float().T
    scores: torch.Tensor = torch.log_softmax(logits, dim=-1)[:, readout]
    return scores


def batched_isolated_scores(causal_lm: Any, prompts: Sequence[IsolatedInputs], readout: int) -> list[torch.Tensor]:
    """:func:`isolated_scores` of several prompts in one forward pass:
    [K] each, equal to one pass per prompt up to float rounding.

    Why it is exact: each prompt's block mask (:meth:`IsolatedInputs.mask_and_positions`) is copied into a
    [N, 1, T, T] mask padded with ``False``, so no real token reads a pad and every real row's softmax is
    the unpadded one; a pad row reads only itself (an all-``False`` row would make the softmax 0/0, and
    its NaN would reach the gradients through the shared weights). Pads are token 0 at position 0."""
    ids, positions = padded_prompts(prompts)
    length = ids.shape[1]
    mask = torch.zeros(len(prompts), 1, length, length, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        size = len(prompt.token_ids)
        mask[row, :, :size, :size] = prompt.mask_and_positions()[0][0]
        pads = torch.arange(size, length)
        mask[row, 0, pads, pads] = True
    device = causal_lm.device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=causal_lm.dtype == torch.bfloat16):
        hidden = causal_lm.model(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 position_ids=positions.to(device), use_cache=False).last_hidden_state
    return prompts_readout_scores(causal_lm, prompts, hidden, readout)


def padded_prompts(prompts: Sequence[IsolatedInputs]) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts' token ids and position ids [N, T], padded to the longest with token 0 at position 0."""
    length = max(len(p.token_ids) for p in prompts)
    ids = torch.zeros(len(prompts), length, dtype=torch.long)
    positions = torch.zeros(len(prompts), length, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt.token_ids)] = torch.tensor(prompt.token_ids, dtype=torch.long)
        positions[row, :len(prompt.token_ids)] = prompt.positions()
    return ids, positions


def prompts_readout_scores(causal_lm: Any, prompts: Sequence[IsolatedInputs], hidden: torch.Tensor,
                           readout: int) -> list[torch.Tensor]:
    """Each prompt's candidates' :func:`readout_scores` from the padded batch's last hidden states
    ``hidden`` [N, T, hidden]: [K] each."""
    rows = torch.tensor([row for row, p in enumerate(prompts) for _ in p.readouts], device=hidden.device)
    columns = torch.tensor([column for p in prompts for column in p.readouts], device=hidden.device)
    scores = readout_scores(causal_lm, hidden[rows, columns], readout)
    return list(torch.split(scores, [len(p.readouts) for p in prompts]))
