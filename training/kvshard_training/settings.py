"""Settings of ``kvshard model finetune``, light enough for ``kvshard --help`` (no torch, no peft).

One dataclass, every field documented; :mod:`kvshard.settings` turns it into flags and
``KVSHARD_FINETUNE_*`` variables. The defaults are sized for this project's 2-core CPU machine: a
short history (the candidates, not the history, carry most of the signal against random negatives),
20 candidates (the benchmarks' count, so every label the benchmark uses is trained), LoRA on the
upper layers only (backward stops where the adapters stop) and a wall-clock budget that leaves room
for the final validation inside the hour.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvshard import settings as settings_lib
from kvshard.models import SCORERS
from kvshard.prompt_template import LABEL_POSITIONS
from kvshard.settings import setting
from kvshard.splits import DEFAULT_HELDOUT_FRACTION, DEFAULT_SALT

ENV_PREFIX = "KVSHARD_FINETUNE_"
PRECISIONS = ("auto", "bfloat16", "float32")
DEVICES = ("auto", "cpu", "cuda")
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class FinetuneSettings:
    dataset: str = setting("movielens-100k", "built-in dataset name or folder with items/interactions JSONL")
    model: Path | None = setting(None, "base model folder (default: the prepared SmolLM2-135M-Instruct)")
    out: Path | None = setting(None, "output folder for the adapter, provenance and loss curve "
                                     "(default: <user cache>/finetune/movielens-rec)")
    history: int = setting(10, "history items per training prompt")
    candidates: int = setting(20, "candidates per prompt (the target and sampled unseen negatives): training's, "
                                  "unless --training-candidates says otherwise, and validation's")
    training_candidates: int = setting(0, "--scorer isolated|late only: candidates per training prompt when it "
                                          "differs from --candidates (0 = the same). These scorers read each "
                                          "candidate apart, so a prompt's candidate count changes only how many "
                                          "negatives share its softmax, not a candidate's score, and a prompt of "
                                          "fewer candidates is a cheaper example (its tokens are mostly candidate "
                                          "blocks); validation and serving keep --candidates. 0 (the "
                                          "default: at 10 in a 56-minute run on 2026-12-06, 2,010 examples, "
                                          "alone HR@1 .297 on 300 validation prompts against .350 for 2,166 "
                                          "examples at 20) = --candidates")
    label_position: str = setting("after", "where a candidate's label stands: 'after' ('<item> [A]': the label token "
                                           "has read its item, so a short run learns to point; the merge records it "
                                           "and the sidecar asks the model that way) or 'before' ('A. <item>', the "
                                           "default template, which a CPU-sized run does not learn to point from)")
    steps: int = setting(150, "optimizer steps (each over --accumulation examples)")
    accumulation: int = setting(4, "examples per optimizer step (gradient accumulation)")
    minutes: float = setting(50.0, "wall-clock budget for the training steps (intermediate validations "
                                   "included); stops when spent, the final validation and saving come after")
    lr: float = setting(1e-3, "peak AdamW learning rate (linear warmup, then cosine decay to 10% by --steps or by "
                              "the end of --minutes, whichever comes first)")
    warmup: int = setting(10, "warmup steps")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    rank: int = setting(8, "LoRA rank (at most 16: the adapter ships in the repository); 8 (the default: at 16, "
                           "alpha 32, the late recipe's 2,872 examples in the hour gave the same loss curve and "
                           "held-out HR@1 .346 against .354, paired −.008, −.030 … +.014, on 2026-12-07)")
    alpha: int = setting(16, "LoRA alpha (scale = alpha / rank)")
    targets: tuple[str, ...] = setting(ALL_PROJECTIONS, "projections that get LoRA (comma-separated)")
    layers: int = setting(15, "LoRA on the top N decoder layers only (0 = all); fewer layers, faster backward")
    hard_negatives: float = setting(0.0, "share of each training prompt's negatives the retrieval stage picks "
                                         "(kvshard.retrieval: item-kNN of the shown history over the training "
                                         "users, topped up with popular items; never an item the user saw) instead "
                                         "of drawing them uniformly, the target kept in every prompt; 0 (the "
                                         "default: at 0.5 in the 56-minute recipe shipped until 2026-12-06 "
                                         "held-out HR@1 fell .309 → .152: beside the stage's favourites the "
                                         "target mostly scores lower by the stage, so its signal points away "
                                         "from the answer) = uniform "
                                         "negatives only; validation stays uniform")
    window: int = setting(30, "training targets come from the N interactions before each user's "
                              "second-to-last (0 = all)")
    positives: int = setting(1, "count the next N interactions of the user (up to the validation target, never "
                                "it) as positives: each is among the prompt's candidates and the target's "
                                "one-hot is spread evenly over them (users rate in sessions, so which "
                                "session item comes next is close to arbitrary); 1 (the default: at 5 in the "
                                "56-minute recipe shipped until 2026-12-06 held-out HR@1 stayed .309, "
                                "NDCG@10 .581 → .598, within noise) = the next item only; validation keeps one target")
    retrieval_weight: float = setting(0.0, "--scorer isolated|late only: train the ranking as it is served behind a "
                                           "retrieval stage, z(model) + W · z(stage score) (the sidecar's "
                                           "retrieval_weight; kvshard.ranking.fuse_scores), one learned scale on the "
                                           "sum: the model learns what the stage's item-kNN score misses instead "
                                           "of re-learning it (the stage's score for a training prompt leaves its "
                                           "user out; validation reports the fused ranking and the model alone; "
                                           "alone such a model ranks near chance, so serve it with "
                                           "retrieval_scores); 0 (the default: at 1 with --teacher none in the "
                                           "56-minute recipe shipped until 2026-12-06 the served held-out HR@1 "
                                           "went .372 → .408, NDCG@10 .650 → .654, paired intervals holding 0) = the "
                                           "model ranks alone")
    users: int = setting(0, "training users drawn from (0 = every training user)")
    val_users: int = setting(48, "validation prompts (training users' second-to-last interactions)")
    val_every: int = setting(0, "validate every N steps as well as at the end (0 = only at the end)")
    heldout_fraction: float = setting(DEFAULT_HELDOUT_FRACTION, "share of users held out for the benchmarks "
                                                                 "(never trained or validated on)")
    split_salt: str = setting(DEFAULT_SALT, "salt of the user split's hash")
    teacher: str = setting("item-knn", "soft targets from a teacher over every candidate: 'item-knn' (co-occurrence "
                                       "over training users' interactions) or 'none' (the target's label only)")
    teacher_weight: float = setting(0.5, "share of the teacher's distribution in the training target "
                                         "(the rest is the held-out item's one-hot)")
    teacher_temperature: float = setting(1.0, "softmax temperature over the teacher's z-scored candidate scores")
    teacher_model: Path | None = setting(None, "--scorer isolated|late only: a merged scorer model folder, or "
                                               "'scorer' (the prepared isolated scorer), whose order-free candidate "
                                               "scores join the teacher: z(item-kNN) + --teacher-model-weight · "
                                               "z(scorer), computed in the training loop (inside --minutes)")
    teacher_model_weight: float = setting(1.0, "weight of --teacher-model's z-scores beside item-kNN's (weight 1)")
    consistency: float = setting(0.0, "weight of the order-agreement term: > 0 trains every request under two "
                                      "candidate orders at once (twice the compute per request) and adds this "
                                      "weight × the symmetric KL between their per-item distributions; 0 (the "
                                      "default: in a 54-minute budget it bought consistency .45 vs .40 for "
                                      "HR@1 .21 vs .28) = one order, cross-entropy only")
    pointwise: float = setting(0.0, "weight of the pointwise term: the ' yes' logit at each candidate's own label "
                                    "token ranks the candidates against the same target as the answer (K graded "
                                    "signals per forward pass instead of one; no extra compute; needs "
                                    "--label-position after, where the label has read its item); 0 (the default: "
                                    "at 1.0 in a 50-minute budget, on all 191 held-out users, HR@1 .260 vs .267 "
                                    "and consistency .41 vs .41 without it) = off")
    scorer: str = setting("answer", "how the model ranks: 'answer' (the candidates' label tokens at the answer "
                                    "position, after reading them all as a list) or 'isolated' (each candidate's "
                                    "log P(' yes') where its label opens, having read only the prefix and its own "
                                    "item, every candidate at the same positions: the same ranking under every "
                                    "candidate order; needs --label-position after; the merge records it) or "
                                    "'late' (the same, but an item's tokens read only themselves — as its cached "
                                    "block holds them — and its label opening reads the prefix and the item: "
                                    "served exactly from cached item blocks, recomputing the labels only)")
    interaction: int = setting(0, "--scorer late only: how many of each item's last tokens read the prefix as well "
                                  "(late interaction; 0 = the label opening alone): more reading, more "
                                  "recomputed per candidate when served from cache")
    init_adapter: Path | None = setting(None, "start the LoRA from this trained adapter folder instead of zero (a "
                                              "warm start: same --rank, --alpha, --targets and --layers, trained "
                                              "on the same base), e.g. a late scorer from the isolated scorer's "
                                              "adapter; provenance records its hash")
    seed: int = setting(0, "seed of the data sampling, candidate shuffles and LoRA initialisation")
    threads: int = setting(2, "torch threads")
    device: str = setting("auto", "where to train: 'auto' (cuda when torch sees a GPU, else cpu), 'cpu', or 'cuda' "
                                  "(refused without one); the base, the adapters and the examples' tensors go there")
    batch: int = setting(1, "examples per forward pass within each optimizer step's --accumulation (--scorer "
                            "isolated or late: the examples' block masks padded into one batched mask); 1 (the "
                            "default) = one example at a time, what a CPU does best; a GPU wants --accumulation "
                            "and --batch 16 or more")
    body_cache_mib: int = setting(2048, "--scorer late on the CPU: MiB of item bodies kept through the frozen "
                                        "layers below --layers (each body computed once, then only the rows "
                                        "that read the history run there: the same scores; measured 2.61 -> "
                                        "2.55 s per training example one per pass, 2.39 with --batch 2: "
                                        "bench/experiments/training_step_rows.py); least recently used out "
                                        "beyond it (~0.25 MiB per MovieLens item); 0 = off")
    precision: str = setting("auto", "'bfloat16': the frozen base weights in bfloat16 and its matmuls under "
                                     "autocast, the adapters and optimizer in float32 (1.8x faster than float32 "
                                     "on CPUs with AMX or AVX512-BF16, and the GPUs' choice; on a CPU without "
                                     "them bfloat16 is emulated, ~20x slower); 'float32': everything in float32; "
                                     "'auto' (the default): bfloat16 on CUDA and on CPUs that compute it, else "
                                     "float32 (provenance records the one used)")
    clip: float = setting(1.0, "gradient-norm clipping (0 = off)")

    def validate(self) -> None:
        if not 1 <= self.rank <= 16:
            raise settings_lib.SettingsError("--rank must be in 1..16 (the adapter ships in the repository)")
        for name in ("history", "steps", "accumulation", "threads", "batch"):
            if getattr(self, name) < 1:
                raise settings_lib.SettingsError(f"--{name} must be at least 1")
        if self.body_cache_mib < 0:
            raise settings_lib.SettingsError("--body-cache-mib must be 0 (off) or more")
        if self.candidates < 2:
            raise settings_lib.SettingsError("--candidates must be at least 2")
        if not self.targets or set(self.targets) - set(ALL_PROJECTIONS):
            raise settings_lib.SettingsError(f"--targets must be among {', '.join(ALL_PROJECTIONS)}")
        if self.label_position not in LABEL_POSITIONS:
            raise settings_lib.SettingsError(f"--label-position must be one of {', '.join(LABEL_POSITIONS)}")
        if self.teacher not in ("item-knn", "none"):
            raise settings_lib.SettingsError("--teacher must be 'item-knn' or 'none'")
        if not 0.0 <= self.teacher_weight <= 1.0 or self.teacher_temperature <= 0:
            raise settings_lib.SettingsError("--teacher-weight must be in [0, 1] and --teacher-temperature positive")
        if self.precision not in PRECISIONS:
            raise settings_lib.SettingsError(f"--precision must be one of {', '.join(PRECISIONS)}")
        if self.consistency < 0 or self.pointwise < 0:
            raise settings_lib.SettingsError("--consistency and --pointwise must be at least 0")
        if self.pointwise > 0 and self.label_position != "after":
            raise settings_lib.SettingsError("--pointwise needs --label-position after: a label before its item "
                                             "has not read it, so its score says nothing about the item")
        if self.scorer not in SCORERS:
            raise settings_lib.SettingsError(f"--scorer must be one of {', '.join(SCORERS)}")
        if self.scorer != "answer" and (self.label_position != "after" or self.consistency or self.pointwise):
            raise settings_lib.SettingsError(f"--scorer {self.scorer} needs --label-position after (it reads where "
                                             "each label opens, after its item) and no --consistency or --pointwise "
                                             "(its ranking does not depend on the order; it has no answer position)")
        if self.interaction < 0 or (self.interaction and self.scorer != "late"):
            raise settings_lib.SettingsError("--interaction must be at least 0, and above 0 only with --scorer late")
        if self.device not in DEVICES:
            raise settings_lib.SettingsError(f"--device must be one of {', '.join(DEVICES)}")
        if self.batch > self.accumulation:
            raise settings_lib.SettingsError(f"--batch {self.batch} is more than --accumulation {self.accumulation}: "
                                             "a forward pass holds at most one optimizer step's examples")
        if self.batch > 1 and self.scorer == "answer":
            raise settings_lib.SettingsError("--batch above 1 needs --scorer isolated or late (the answer scorer "
                                             "reads the last position of prompts of different lengths)")
        if self.teacher_model is not None and (self.scorer == "answer" or self.teacher_model_weight <= 0):
            raise settings_lib.SettingsError("--teacher-model needs --scorer isolated or late (its scores are per "
                                             "candidate) and a positive --teacher-model-weight")
        if self.retrieval_weight < 0 or (self.retrieval_weight > 0 and self.scorer == "answer"):
            raise settings_lib.SettingsError("--retrieval-weight must be at least 0, and above 0 only with --scorer "
                                             "isolated or late (the stage's score is fused per candidate)")
        if not 0.0 <= self.hard_negatives <= 1.0:
            raise settings_lib.SettingsError("--hard-negatives must be a share in [0, 1]")
        if self.training_candidates and (self.training_candidates < 2 or self.scorer == "answer"):
            raise settings_lib.SettingsError("--training-candidates must be 0 or at least 2, and set only with "
                                             "--scorer isolated or late (the answer scorer learns one label per "
                                             "candidate position: fewer candidates would leave labels untrained)")
        if not 1 <= self.positives < self.prompt_candidates():
            raise settings_lib.SettingsError("--positives must be at least 1 and below a training prompt's "
                                             "candidates (a prompt keeps a negative)")
        if self.minutes <= 0 or self.lr <= 0:
            raise settings_lib.SettingsError("--minutes and --lr must be positive")

    def resolved_device(self) -> str:
        """The device to train on: :func:`resolve_device` of ``--device`` on this machine (imports torch)."""
        import torch

        return resolve_device(self.device, torch.cuda.is_available())

    def prompt_candidates(self) -> int:
        """Candidates per training prompt: ``--training-candidates``, or ``--candidates`` where it is 0."""
        return self.training_candidates or self.candidates

    def resolved_precision(self, device: str) -> str:
        """``--precision`` for ``device`` on this machine: :func:`resolve_precision` (imports torch)."""
        return resolve_precision(self.precision, device, self.precision == "auto" and cpu_has_bfloat16())

    def interaction_of_scorer(self) -> int | None:
        """:attr:`IsolatedInputs.interaction` for this scorer (``None``: every item token reads the prefix)."""
        return self.interaction if self.scorer == "late" else None

    @classmethod
    def from_record(cls, recorded: Mapping[str, Any], exclude: Iterable[str] = ()) -> FinetuneSettings:
        """The settings a provenance's ``settings`` record holds, but for the fields named in ``exclude``
        (they keep their defaults, as do fields the record lacks); fields this version does not know are
        ignored, and lists (the LoRA targets) come back as tuples."""
        known = {f.name for f in fields(cls)} - set(exclude)
        values: dict[str, Any] = {name: tuple(value) if isinstance(value, list) else value
                                  for name, value in recorded.items() if name in known}
        return cls(**values)

    def command(self) -> str:
        """The ``kvshard model finetune`` command line that reproduces these settings."""
        words = ["kvshard", "model", "finetune"]
        for name, value in vars(self).items():
            if name in ("out", "model", "init_adapter", "teacher_model") and value is None:
                continue
            shown = ",".join(value) if isinstance(value, tuple) else str(value)
            words += [f"--{name.replace('_', '-')}", shown]
        return " ".join(words)


def resolve_device(requested: str, cuda_available: bool) -> str:
    """``auto`` → ``cuda`` where CUDA is available, else ``cpu``; ``cuda`` without CUDA is refused here, with
    the reason, rather than later as a torch error from deep inside the model's ``.to()``."""
    if requested == "auto":
        return "cuda" if cuda_available else "cpu"
    if requested == "cuda" and not cuda_available:
        raise settings_lib.SettingsError("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() "
                                         "is False: no GPU, no driver, or a CPU-only torch build); use --device "
                                         "auto or cpu")
    return requested


def resolve_precision(requested: str, device: str, cpu_computes_bfloat16: bool) -> str:
    """``auto`` → ``bfloat16`` on CUDA and on CPUs with bfloat16 instructions (AVX512-BF16 or AMX), else
    ``float32``: without them every bfloat16 matmul is emulated — measured on an AVX2-only AMD EPYC
    (2026-12-06), a late-scorer training step took 67 s in bfloat16 against 3.1 s in float32."""
    if requested != "auto":
        return requested
    return "bfloat16" if device.startswith("cuda") or cpu_computes_bfloat16 else "float32"


def cpu_has_bfloat16() -> bool:
    """Whether this CPU computes bfloat16 matmuls in hardware (imports torch)."""
    import torch

    capabilities = torch.cpu.get_capabilities()
    return bool(capabilities.get("avx512_bf16") or capabilities.get("amx_bf16"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvshard model finetune`` (each also read from ``KVSHARD_FINETUNE_*``)."""
    settings_lib.add_arguments(parser, FinetuneSettings, ENV_PREFIX)


def from_args(args: argparse.Namespace | None) -> FinetuneSettings:
    settings = settings_lib.from_sources(FinetuneSettings, args, ENV_PREFIX)
    settings.validate()
    return settings
