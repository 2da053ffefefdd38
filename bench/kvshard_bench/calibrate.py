"""The prompts the attention calibration is fitted on, and load-or-calibrate for the fidelity benchmark.

Why a module of its own: "never tune on the data you report". The benchmark's prompts are users'
*last* interactions (``kvshard.prompts.sample_requests``); calibration prompts come from training-side
users of the shared split (``kvshard.splits``) at targets *before* their second-to-last interaction,
with a seed of their own — so no calibration prompt is a benchmark prompt, and the file records
which users and seed were used. Calibrated once per model, stored beside its identity
(:mod:`kvshard_sidecar.engine.calibration`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvshard.datasets import Dataset
from kvshard.prompts import PromptBuilder, RecommendationRequest
from kvshard_sidecar.engine import BlendEngine, BlendSettings
from kvshard_sidecar.engine.calibration import (
    CALIBRATION_FILE,
    Calibration,
    calibrate,
    load_calibration,
    save_calibration,
)

CALIBRATION_SEED = 20261201
CALIBRATION_PROMPTS = 4


def calibration_requests(dataset: Dataset, history: int, candidates: int, count: int = CALIBRATION_PROMPTS,
                         seed: int = CALIBRATION_SEED) -> list[RecommendationRequest]:
    """``count`` training-side requests (never a user's last two interactions)."""
    from kvshard.splits import UserSplit, training_requests

    users = UserSplit().training_users(dataset)
    return training_requests(dataset, users, history, candidates, count, seed=seed)


def load_or_calibrate(engine: BlendEngine, model_folder: Path, builder: PromptBuilder, dataset: Dataset,
                      history: int, candidates: int, base: BlendSettings, force: bool = False) -> Calibration:
    """The model's stored calibration, or a fresh one (computed, saved beside the model) if none/forced."""
    if not force and (Path(model_folder) / CALIBRATION_FILE).exists():
        return load_calibration(model_folder, engine.identity)  # refuses another model's file
    requests = calibration_requests(dataset, history, candidates)
    prompts = [builder.build(r) for r in requests]
    provenance = {"dataset": dataset.name, "seed": CALIBRATION_SEED, "history": history, "candidates": candidates,
                  "users": [r.user_id for r in requests],
                  "source": "kvshard.splits training users, targets before the second-to-last interaction"}
    calibration = calibrate(engine, [(p.prompt, p.label_token_ids) for p in prompts], base, provenance)
    path = save_calibration(calibration, model_folder)
    print(f"calibrated attention on {len(prompts)} training-side prompts: temperature {calibration.temperature}, "
          f"scale {calibration.scale} -> {path}")
    return calibration


def overlap(calibration: Calibration, users: Sequence[str]) -> list[str]:
    """Benchmark users that the calibration was fitted on (should be none)."""
    fitted = set(calibration.provenance.get("users", []))
    return sorted(set(users) & fitted)
