"""The training examples of ``kvshard model finetune``: requests drawn by :mod:`kvshard.splits`, built into
kvshard's prompt and turned into tensors, with the teacher's soft targets beside them.

Why a module of its own. What the model is shown — which users and positions, which candidates, which
targets (one item, or ``--positives`` of them), the teacher's distribution — is the part of a recipe a
team changes for its own catalog, and it is pure data preparation; :mod:`kvshard_training.finetune` keeps
the loss and the loop. Nothing here runs the model.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvshard.datasets import Dataset, load_dataset
from kvshard.prompts import (
    PromptBuilder,
    PromptTemplate,
    RecommendationPrompt,
    RecommendationRequest,
    candidate_orders,
)
from kvshard.ranking import standardized
from kvshard.retrieval import RetrievalIndex
from kvshard.segments import SegmentKind
from kvshard.splits import UserSplit, training_requests, validation_requests
from kvshard_sidecar.engine.isolated_scorer import IsolatedInputs
from kvshard_training.settings import FinetuneSettings
from kvshard_training.teacher import ItemKnnTeacher, teacher_quality

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Example:
    """One request as tensors, under one or more candidate orders of the same length: token ids [P, T],
    the label token ids [K] (labels are positional, so every order shares them), the target's index in
    each order [P], and ``alignment`` [P, K]: where order ``p`` puts order 0's ``i``-th candidate."""

    input_ids: torch.Tensor
    label_ids: torch.Tensor
    targets: torch.Tensor
    alignment: torch.Tensor
    soft: torch.Tensor | None = None
    """The teacher's distribution over each order's K labels [P, K] (:mod:`kvshard_training.teacher`)."""
    label_positions: torch.Tensor | None = None
    """Where each order's K label tokens stand in its prompt [P, K] (read by the pointwise term)."""
    isolated: tuple[IsolatedInputs, ...] = ()
    """Each order's candidate blocks, for ``--scorer isolated`` or ``late``
    (:mod:`kvshard_sidecar.engine.isolated_scorer`), each ending at its label opening (the rows after it are read
    by nothing: :meth:`~kvshard_sidecar.engine.isolated_scorer.IsolatedInputs.ending_at_openings`)."""
    positives: torch.Tensor | None = None
    """With later targets (``--positives``): each order's hard target [P, K], spread evenly over the target
    and the later targets; ``None``: the one-hot of ``targets``."""
    stage: torch.Tensor | None = None
    """With ``--retrieval-weight W``: what the retrieval stage adds to each order's served ranking [P, K],
    ``W · z(stage score)`` (:func:`kvshard.ranking.fuse_scores`), the prompt's own user left out of the score."""

    @classmethod
    def of(cls, *orders: RecommendationPrompt, soft: Sequence[Sequence[float]] | None = None,
           isolated: bool = False, interaction: int | None = None,
           stage: Sequence[Sequence[float]] | None = None) -> Example:
        """The same request built under each candidate order (the first is the reference)."""
        first = orders[0]
        if any(o.target_index is None for o in orders):
            raise ValueError("a training example needs its target among the candidates")
        if len({len(o.prompt) for o in orders}) != 1 or any(o.label_token_ids != first.label_token_ids for o in orders):
            raise ValueError("candidate orders of one example must tokenize to the same length and labels")
        reference = first.request.candidates
        alignment = [[o.request.candidates.index(c) for c in reference] for o in orders]
        positives = None
        if first.request.later_targets:
            wanted = (first.request.target, *first.request.later_targets)
            positives = torch.tensor([[1.0 / len(wanted) if c in wanted else 0.0 for c in o.request.candidates]
                                      for o in orders])
        return cls(torch.tensor([o.prompt.token_ids for o in orders], dtype=torch.long),
                   torch.tensor(first.label_token_ids, dtype=torch.long),
                   torch.tensor([o.target_index for o in orders], dtype=torch.long),
                   torch.tensor(alignment, dtype=torch.long),
                   None if soft is None else torch.tensor(soft, dtype=torch.float32),
                   torch.tensor([label_positions(o) for o in orders], dtype=torch.long),
                   tuple(IsolatedInputs.of(o, interaction).ending_at_openings() for o in orders) if isolated else (),
                   positives,
                   None if stage is None else torch.tensor(stage, dtype=torch.float32))

    @property
    def orders(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def tokens(self) -> int:
        """Tokens a training forward computes per order: the scored rows of an isolated or late example (its
        blocks cut at their openings), else the whole prompt."""
        return len(self.isolated[0].token_ids) if self.isolated else int(self.input_ids.shape[1])

    def to(self, device: str | torch.device) -> Example:
        """The same example with its tensors on ``device`` (itself when they are there already)."""
        def move(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.to(device)

        if self.input_ids.device == torch.device(device):
            return self
        return Example(self.input_ids.to(device), self.label_ids.to(device), self.targets.to(device),
                       self.alignment.to(device), move(self.soft), move(self.label_positions), self.isolated,
                       move(self.positives), move(self.stage))


def stage_terms(teacher: ItemKnnTeacher, orders: Sequence[RecommendationRequest],
                weight: float) -> list[list[float]] | None:
    """``weight · z(stage score)`` of each order's candidates (``None`` when ``weight`` is 0): the stage's part
    of the ranking it serves (:func:`kvshard.ranking.fuse_scores`). The score is the stage's co-occurrence sum
    with the request's own user left out, so on a training user it behaves as the stage does on a user it
    never counted (the benchmarks' and a live request's)."""
    if weight <= 0:
        return None
    return [[weight * z for z in standardized(teacher.stage_scores(o.history, o.candidates, o.user_id))]
            for o in orders]


def label_positions(built: RecommendationPrompt) -> list[int]:
    """The position of each candidate's label token in ``built``'s prompt, in label order (the label
    token inside each label segment, whichever side of its item the template puts it)."""
    positions: list[int] = []
    wanted = built.label_token_ids
    for span in built.prompt.spans:
        if len(positions) < len(wanted) and span.segment.kind is SegmentKind.FREE \
                and wanted[len(positions)] in span.segment.token_ids:
            positions.append(span.start + span.segment.token_ids.index(wanted[len(positions)]))
    if len(positions) != len(wanted):
        raise ValueError("every candidate's label token must stand in its own label segment")
    return positions


@dataclass
class TrainingData:
    """The split's examples as tensors, and what provenance says about them."""

    dataset: str
    split: dict[str, object]
    examples: list[Example]
    validation: list[Example]
    teacher: dict[str, object]
    init_adapter: dict[str, object] | None = None
    validation_stage: list[list[float]] = field(default_factory=list)
    """The retrieval stage's score of each validation prompt's candidates, in its first order."""


def split_users(settings: FinetuneSettings, dataset: Dataset) -> tuple[UserSplit, list[str], list[str]]:
    """The split ``settings`` name, its training users, and those a run draws prompts from (``--users``: a
    seeded sample of them; 0: all)."""
    split = UserSplit(settings.heldout_fraction, settings.split_salt)
    training_users = split.training_users(dataset)
    users = training_users
    if settings.users:
        users = sorted(random.Random(settings.seed).sample(users, min(settings.users, len(users))))
    return split, training_users, users


def training_data(settings: FinetuneSettings, tokenizer: Any) -> TrainingData:
    """Training examples (seeded, shuffled candidates; two orders each when the agreement term is on)
    and validation prompts from the training users (always two orders: validation reports position
    consistency)."""
    dataset = load_dataset(settings.dataset)
    split, training_users, users = split_users(settings, dataset)
    builder = PromptBuilder(tokenizer, dataset, template=PromptTemplate(label_position=settings.label_position))
    stage = RetrievalIndex.fit(dataset, split) if settings.hard_negatives > 0 else None
    requests = training_requests(dataset, users, settings.history, settings.prompt_candidates(),
                                 settings.steps * settings.accumulation, settings.seed, settings.window,
                                 stage.hard_negatives if stage is not None else None, settings.hard_negatives,
                                 settings.positives)
    if not requests:
        raise SystemExit(f"no training positions: users need more than {settings.history + 2} interactions")
    validation = validation_requests(dataset, users, settings.history, settings.candidates, settings.val_users,
                                     settings.seed + 1)
    rng = random.Random(f"{settings.seed}-orders")
    training_orders = [candidate_orders(r, 2 if settings.consistency > 0 else 1, rng) for r in requests]
    teacher_record: dict[str, object] = {"kind": settings.teacher}
    soft: list[list[list[float]] | None] = [None] * len(requests)
    # Every training user feeds the teacher, not only the sampled ones: more co-occurrence, no leak.
    teacher = ItemKnnTeacher(dataset.histories, training_users)
    if settings.teacher == "item-knn":
        soft = [[teacher.distribution(o.history, o.candidates, settings.teacher_temperature, o.user_id) for o in orders]
                for orders in training_orders]
        teacher_record |= {"weight": settings.teacher_weight, "temperature": settings.teacher_temperature,
                           "validation": teacher_quality(teacher, ((r.user_id, r.history, r.candidates,
                                                                    r.candidates.index(str(r.target)))
                                                                   for r in validation))}
        log.info("item-kNN teacher on the validation prompts: %s", teacher_record["validation"])
    isolated, interaction = settings.scorer != "answer", settings.interaction_of_scorer()
    examples = [Example.of(*(builder.build(o) for o in orders), soft=s, isolated=isolated,
                           interaction=interaction, stage=stage_terms(teacher, orders, settings.retrieval_weight))
                for orders, s in zip(training_orders, soft, strict=True)]
    described = {**split.describe(dataset), "training_users_used": len(users)}
    if settings.positives > 1:
        described["positives"] = {"next_items": settings.positives,
                                  "mean_per_prompt": sum(1 + len(r.later_targets) for r in requests) / len(requests)}
    if settings.retrieval_weight > 0:
        described["retrieval_fusion"] = {
            "weight": settings.retrieval_weight,
            "stage_score": "item-kNN co-occurrence summed over the history (kvshard.retrieval's score), over the "
                           "training users before their second-to-last interaction, the prompt's own user left out"}
    if stage is not None:
        described["hard_negatives"] = {"share": settings.hard_negatives, **stage.describe()}
    validation_examples, validation_stage = validation_set(settings, validation, builder, teacher, rng)
    return TrainingData(dataset.name, described, examples, validation_examples, teacher_record,
                        validation_stage=validation_stage)


def validation_set(settings: FinetuneSettings, requests: Sequence[RecommendationRequest], builder: PromptBuilder,
                   teacher: ItemKnnTeacher, rng: random.Random, orders: int = 2) -> tuple[list[Example],
                                                                                     list[list[float]]]:
    """The validation ``requests`` (:func:`kvshard.splits.validation_requests`) as examples, each under
    ``orders`` candidate orders (two in training: validation reports position consistency), and the
    retrieval stage's score of each prompt's candidates in its first order, the prompt's own user left out
    (what :func:`kvshard.ranking.choose_fusion_weight` fuses with the model's)."""
    ordered = [candidate_orders(r, orders, rng) for r in requests]
    examples = [Example.of(*(builder.build(o) for o in each), isolated=settings.scorer != "answer",
                           interaction=settings.interaction_of_scorer(),
                           stage=stage_terms(teacher, each, settings.retrieval_weight)) for each in ordered]
    return examples, [teacher.stage_scores(each[0].history, each[0].candidates, each[0].user_id) for each in ordered]
