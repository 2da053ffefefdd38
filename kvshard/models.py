"""Which model a component serves, named the same way everywhere, and how that model must be asked.

Every component (sidecar, local cluster, demo, benchmarks) takes ``--model base|finetuned|scorer|late|PATH``.
The defaults are recommenders ``kvshard model prepare`` merges from the adapters the repository ships
(:data:`DEFAULT_MODEL` for the servers, :data:`MEASURED_MODEL` for the demo and the benchmarks): the
base SmolLM2 answers "A" whatever the items (issue 20), so fidelity and hit ratios measured on it say
little. The base stays one word away.

A fine-tuned model also fixes part of its prompt: it was trained with one label position, and asked
another way its ranking is noise. The merge writes those fields into ``kvshard-adapter.json``;
:func:`model_prompt` reads them, so the local cluster writes them into the CacheShard it generates
and a sidecar fills them into a CacheShard that leaves them unset. This module is pure file reading
(no torch), so the core, the local cluster and the sidecar share it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from kvshard.paths import models_dir
from kvshard.prompt_template import PromptTemplate

BASE_NAME = "SmolLM2-135M-Instruct"
FINETUNED_NAME = "SmolLM2-135M-MovieLens-Rec"
SCORER_NAME = "SmolLM2-135M-MovieLens-Scorer"
LATE_NAME = "SmolLM2-135M-MovieLens-Late"
MERGED_NAMES = {"finetuned": FINETUNED_NAME, "scorer": SCORER_NAME, "late": LATE_NAME}
"""``--model`` word → the folder ``kvshard model prepare`` merges from a shipped adapter."""
DEFAULT_MODEL = "finetuned"
"""What a server serves unless told otherwise (the sidecar, ``kvshard up``): the answer-position
recommender, which answers both ``rank`` and ``generate`` requests (a scorer only ranks)."""
MEASURED_MODEL = "late"
"""What ``kvshard demo`` (``make demo``) and the benchmarks (``bench fidelity``, ``bench vllm``,
``bench recommender`` among others) measure unless told otherwise: the late-interaction scorer, the
recommender that meets issue 20's targets on held-out users (README, "Models") and whose blended
answers are full prefill's. ``--model finetuned`` measures the answer-position model, whose blended
cache is not exact — the model a blend method's frontier is drawn on."""
IDENTITY_FILE = "kvshard-identity.json"
MERGE_RECORD = "kvshard-adapter.json"
SCORERS = ("answer", "isolated", "late")
"""How a model ranks the candidates: by their label tokens at the answer position, or each one scored
alone (:mod:`kvshard_sidecar.engine.isolated_scorer`) — its item tokens reading the prefix (``isolated``) or
only their item but for the last few (``late`` interaction: those readers and the label opening read the
prefix and are recomputed when blended, the rest is what a cached item block holds). A merged model
records the one it was trained for (and, for ``late``, how many readers: :func:`model_interaction`)."""
MODEL_HELP = ("'finetuned' (the MovieLens recommender `kvshard model prepare` merges from the shipped adapter), "
              "'base' (SmolLM2-135M-Instruct), 'scorer' (the MovieLens scorer: each candidate scored alone, so the "
              "ranking is the same under every candidate order; served in rank mode only), 'late' (the same, each "
              "item's tokens but its last 4 reading only the item: served exactly from cached item blocks, those 4 "
              "recomputed) or a model folder")


def base_model_path() -> Path:
    """Where ``kvshard model prepare`` puts SmolLM2 (inside the user cache folder)."""
    return models_dir() / BASE_NAME


def finetuned_model_path() -> Path:
    """Where ``kvshard model prepare`` puts the merged fine-tuned model (inside the user cache folder)."""
    return models_dir() / FINETUNED_NAME


def resolve_model(spec: str | Path | None, default: str = DEFAULT_MODEL) -> Path:
    """A ``--model`` value as a folder: ``base``, a word of :data:`MERGED_NAMES` or a path (``None``: ``default``)."""
    chosen = default if spec is None else spec
    if chosen == "base":
        return base_model_path()
    merged = MERGED_NAMES.get(str(chosen))
    if merged is not None:
        path = models_dir() / merged
        if not (path / IDENTITY_FILE).exists():
            raise FileNotFoundError(f"the merged model {chosen!r} is not prepared at {path}: run `kvshard model "
                                    "prepare` (it merges the shipped adapters), or choose --model base")
        return path
    return Path(chosen).expanduser()


def model_prompt(model: Path) -> dict[str, str]:
    """The ``spec.prompt`` fields a merged model was trained with (``{}``: the default template, also
    for the base model and for folders merged before this was recorded)."""
    prompt = _merge_record(model).get("prompt")
    return {str(k): str(v) for k, v in prompt.items()} if isinstance(prompt, dict) else {}


def model_scorer(model: Path) -> str:
    """How ``model`` was trained to rank (``"answer"`` for the base model, for folders merged before this
    was recorded and where the merge record is unreadable; an unknown scorer name is an error)."""
    scorer = _merge_record(model).get("scorer", "answer")
    if scorer not in SCORERS:
        raise ValueError(f"{model / MERGE_RECORD}: unknown scorer {scorer!r} (known: {', '.join(SCORERS)})")
    return str(scorer)


def model_interaction(model: Path) -> int:
    """How many of each item's last tokens a ``late`` scorer trained to read the prefix (0 where none
    was recorded: the label opening alone)."""
    interaction = _merge_record(model).get("interaction", 0)
    if not isinstance(interaction, int) or interaction < 0:
        raise ValueError(f"{model / MERGE_RECORD}: interaction must be a count, got {interaction!r}")
    return interaction


DEFAULT_RETRIEVAL_WEIGHT = 1.0
"""The retrieval stage's weight in the fused ranking for a model that records none (the base model, a folder
merged before the weight was recorded): 1 : 1, fixed before any measurement."""


def model_retrieval_weight(model: Path) -> float:
    """The retrieval stage's weight in ``model``'s fused ranking (:func:`kvshard.ranking.fuse_scores`): the one
    chosen on validation prompts when the model was trained or later (``kvshard model fusion-weight``) and
    merged into ``kvshard-adapter.json``; :data:`DEFAULT_RETRIEVAL_WEIGHT` where none is recorded."""
    weight = _merge_record(model).get("retrieval_weight", DEFAULT_RETRIEVAL_WEIGHT)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < float("inf"):
        raise ValueError(f"{model / MERGE_RECORD}: retrieval_weight must be a finite number at least 0, got {weight!r}")
    return float(weight)


def model_blend(model: Path) -> dict[str, object]:
    """The ``spec.blend`` fields ``model`` calls for (``{}``: kvshard's defaults).

    A ``late`` scorer's item tokens, but for its last ``interaction`` ones, read only their item: a cached
    item block prefilled behind an exact history *is* full prefill for them, and every blend recomputes
    the interaction tokens and the labels anyway (the readers). So ``none`` at ratio 0 is exact, and each
    row a ratio adds is time spent for nothing (``kvshard bench fidelity --model late``: ``none`` 2.76×
    full prefill's speed with top-1 agreement 1.00, ``tail`` at .3 2.18× with the same answers)."""
    return {"method": "none", "ratioPercent": 0} if model_scorer(model) == "late" else {}


def _merge_record(model: Path) -> dict[str, object]:
    try:
        record = json.loads((model / MERGE_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def prompt_for_model(spec_prompt: Mapping[str, str] | None, trained: Mapping[str, str]) -> tuple[dict[str, str],
                                                                                               list[str]]:
    """``spec.prompt`` with the fields the model was trained with filled in where the CacheShard leaves
    them unset, and the names of fields the CacheShard sets to something else (the caller warns: an
    explicit choice is kept, but the model was not trained to be asked that way)."""
    merged = dict(spec_prompt or {})
    conflicts: list[str] = []
    for name, value in trained.items():
        if name not in merged:
            merged[name] = value
        elif merged[name] != value:
            conflicts.append(name)
    return merged, conflicts


def model_template(model: Path) -> PromptTemplate:
    """The prompt template to ask ``model`` with when no CacheShard says: the default, with the fields the
    model was fine-tuned with."""
    return PromptTemplate.from_spec(model_prompt(model))
