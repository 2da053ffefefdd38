"""A trained scorer as a second teacher for ``kvshard model finetune``: its scores, mixed with item-kNN's.

Why it exists. The late scorer (``--scorer late``) is the model kvshard caches exactly: its item tokens
read only their item. The isolated scorer (``--scorer isolated``) lets every item token read the
history, which kvshard cannot cache exactly, and it ranks held-out users' last items better (README,
"Models"). Its scores are order-free (each candidate is scored from the prefix and its own item alone),
so they are a clean teacher: the student learns where the history-reading scorer puts every candidate,
not one hit per prompt. Item-kNN (:mod:`kvshard_training.teacher`) and the scorer make different
mistakes — co-occurrence counts against what a language model reads in the titles — so the teacher is
their mix in z-score space:

    teacher logits = z(item-kNN) + weight · z(scorer)    (per request, over its K candidates)

and the training target stays ``(1 - teacher_weight) · one-hot + teacher_weight · softmax(logits / T)``.

The scorer's scores are computed inside the training loop, one forward pass per example in inference
mode, so their cost is inside ``--minutes``: a run with this teacher gets the same wall-clock budget as
one without it, and fewer student steps.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kvshard.models import model_interaction, model_scorer, resolve_model
from kvshard_sidecar.engine.isolated_scorer import IsolatedInputs, isolated_scores, readout_id
from kvshard_sidecar.engine.model import load_model


def zscore(scores: torch.Tensor) -> torch.Tensor:
    """Scores standardised along the last axis (a constant row becomes zeros): scale-free, so the mix's
    weight means the same for every request whatever the scorer's logit range."""
    spread = scores.std(dim=-1, unbiased=False, keepdim=True)
    centred = scores - scores.mean(dim=-1, keepdim=True)
    return torch.where(spread > 0, centred / spread.clamp_min(1e-12), torch.zeros_like(centred))


def mixed_distribution(knn: torch.Tensor | None, scorer: torch.Tensor, weight: float,
                       temperature: float) -> torch.Tensor:
    """The teacher's distribution over each order's K candidates [P, K]: softmax((z(kNN) + weight ·
    z(scorer)) / T). ``knn`` is item-kNN's distribution (softmax of its z-scores / T, as
    :func:`kvshard_training.teacher.soft_distribution` makes it) or ``None`` for the scorer alone;
    its logarithm recovers z(kNN) / T up to a per-row constant, which the softmax ignores."""
    logits = weight * zscore(scorer) / temperature
    if knn is not None:
        logits = logits + knn.clamp_min(1e-30).log()
    return torch.softmax(logits, dim=-1)


class ScorerTeacher:
    """A merged isolated (or late) scorer model, scoring a training example's candidates in each order.

    The student's examples carry their candidates' blocks (:class:`IsolatedInputs`) built for the
    student's mask; the teacher reads the same tokens with its own mask (its merge record says which:
    every item token reads the prefix for an isolated scorer). The tokens are the same because the
    teacher must share the student's base and tokenizer (checked by :meth:`check_base`)."""

    def __init__(self, spec: Path | str, dtype: str = "bfloat16", device: str = "cpu") -> None:
        self.folder = resolve_model(str(spec))
        scorer = model_scorer(self.folder)
        if scorer == "answer":
            raise ValueError(f"--teacher-model {spec}: {self.folder} is not a scorer (merge an adapter trained "
                             "with --scorer isolated or late)")
        self.interaction = model_interaction(self.folder) if scorer == "late" else None
        loaded = load_model(self.folder, dtype=dtype, device=device)
        self.model: Any = loaded.model.eval()
        self.readout = readout_id(loaded.tokenizer)
        self.identity = loaded.identity
        self.scorer = scorer

    def describe(self, weight: float) -> dict[str, object]:
        """What provenance records of this teacher."""
        return {"model": self.identity.name, "revision": self.identity.revision, "path": str(self.folder),
                "scorer": self.scorer, "weight": weight}

    @torch.inference_mode()
    def scores(self, inputs: tuple[IsolatedInputs, ...], alignment: torch.Tensor) -> torch.Tensor:
        """The teacher's scores [P, K] of each order's candidates. The scores are order-free, so one
        forward pass over the first order serves every order: ``alignment`` [P, K] says where order ``p``
        puts the first order's ``i``-th candidate (:class:`kvshard_training.examples.Example`)."""
        first = isolated_scores(self.model, replace(inputs[0], interaction=self.interaction), self.readout)
        return torch.zeros(alignment.shape, dtype=first.dtype).scatter_(1, alignment, first.expand_as(alignment))

    def check_base(self, tokenizer_hash: str) -> None:
        """Refuse a teacher whose tokenizer is not the student's: it would read other tokens than the ones
        the student's example holds."""
        if self.identity.tokenizer != tokenizer_hash:
            raise ValueError(f"--teacher-model {self.folder}: its tokenizer ({self.identity.tokenizer}) is not the "
                             f"student base's ({tokenizer_hash}); a teacher must be merged into the same base")
