"""APE-style attention calibration of blended rows, and the once-per-model calibration that sets it.

Why. A block prefilled on its own never competed for attention with the blocks now around it, so a
query that attends over many stale rows spreads its attention differently than over full prefill's
rows. APE (ICLR 2025) corrects this without training: a shared prefix (kvshard's ``system`` prefill
context gives one) plus a *temperature* ``T`` and a *scale* ``S`` on the attention paid to the
parallel-encoded rows: ``weight ∝ S · exp(q·k / (T·√d))`` for those rows, unchanged for the rest.
Here the calibrated rows are the blended rows that were not recomputed (stale), after the exact
prefix; at r = 1 there are none, so a calibrated blend is still a full prefill.

How it is applied. Dividing a key by ``T`` divides its logits by ``T``; ``log S`` added to the
attention mask multiplies its weight by ``S`` — one SDPA call, the stored KV untouched.

How it is calibrated (:func:`calibrate`): a grid of ``(T, S)``, each scored by the mean KL between
full prefill's and the calibrated blend's candidate-label distributions on a few prompts, the first
minimum wins (grid order, so the result is deterministic). The prompts must not be the benchmark's:
``kvshard bench fidelity`` draws them from training-side users (``kvshard.splits``) at targets before
their second-to-last interaction, with their own seed, and records users and seed in the file. The
result is stored beside the model's identity (``kvshard-calibration.json`` in the model folder) and
:func:`load_calibration` refuses a file made for another model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvshard.segments import ModelIdentity, Prompt
from kvshard_sidecar.engine.settings import BlendSettings

if TYPE_CHECKING:
    from kvshard_sidecar.engine.blend import BlendEngine

CALIBRATION_FILE = "kvshard-calibration.json"
TEMPERATURES = (0.9, 1.0, 1.1, 1.25, 1.5, 1.75)
SCALES = (0.15, 0.25, 0.35, 0.5, 0.7, 1.0, 1.4)


class CalibrationError(ValueError):
    """A calibration file is missing, malformed, or made for another model."""


def stale_rows(n_rows: int, running: torch.Tensor, exact_prefix: int) -> torch.Tensor:
    """Bool ``[n_rows]``: rows after the exact prefix that are not in the running (recomputed) set."""
    stale = torch.ones(n_rows, dtype=torch.bool, device=running.device)
    stale[:exact_prefix] = False
    stale[running] = False
    return stale


def calibrated_attention(keys: torch.Tensor, mask: torch.Tensor, stale: torch.Tensor, temperature: float,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[1, KV, N, d]`` with stale rows divided by ``temperature``, and a float ``[n, N]`` mask:
    ``-inf`` where ``mask`` forbids, ``log(scale)`` on allowed stale columns, 0 elsewhere."""
    divisor = torch.where(stale, torch.tensor(1.0 / temperature, device=keys.device),
                          torch.tensor(1.0, device=keys.device)).to(keys.dtype)
    scaled = keys * divisor[None, None, :, None]
    bias = torch.zeros(mask.shape, dtype=keys.dtype, device=keys.device)
    bias[:, stale] = math.log(scale)
    return scaled, bias.masked_fill(~mask, float("-inf"))


@dataclass(frozen=True)
class Calibration:
    """One model's calibrated ``(temperature, scale)`` and how they were obtained."""

    model: dict[str, str]
    temperature: float
    scale: float
    objective: str = "mean KL(full ‖ blend) over the candidate labels, selector none"
    provenance: dict[str, Any] = field(default_factory=dict)

    def matches(self, identity: ModelIdentity) -> bool:
        return all(self.model.get(k) == getattr(identity, k) for k in ("name", "revision", "tokenizer"))


def model_record(identity: ModelIdentity) -> dict[str, str]:
    return {"name": identity.name, "revision": identity.revision, "tokenizer": identity.tokenizer,
            "dtype": identity.dtype}


def save_calibration(calibration: Calibration, folder: Path) -> Path:
    path = Path(folder) / CALIBRATION_FILE
    path.write_text(json.dumps(asdict(calibration), indent=2, sort_keys=True) + "\n")
    return path


def load_calibration(folder: Path, identity: ModelIdentity) -> Calibration:
    """The calibration stored beside the model; refuses one made for another model's weights."""
    path = Path(folder) / CALIBRATION_FILE
    if not path.exists():
        raise CalibrationError(f"no calibration at {path}")
    try:
        record = json.loads(path.read_text())
        calibration = Calibration(model=dict(record["model"]), temperature=float(record["temperature"]),
                                  scale=float(record["scale"]), objective=str(record.get("objective", "")),
                                  provenance=dict(record.get("provenance", {})))
    except (ValueError, KeyError, TypeError) as error:
        raise CalibrationError(f"malformed calibration {path}: {error}") from None
    if not calibration.matches(identity):
        raise CalibrationError(
            f"{path} calibrates {calibration.model.get('name')} revision {calibration.model.get('revision')}, "
            f"not the loaded {identity.name} revision {identity.revision}: calibrate this model first"
        )
    return calibration


def label_kl(reference: torch.Tensor, other: torch.Tensor, labels: Sequence[int]) -> float:
    """KL(reference ‖ other) over the softmax of the label logits only."""
    index = torch.tensor(list(labels))
    p, q = reference[index].double().log_softmax(-1), other[index].double().log_softmax(-1)
    return max(0.0, float((p.exp() * (p - q)).sum()))


def grid_search(score: Callable[[float, float], float], temperatures: Sequence[float] = TEMPERATURES,
                scales: Sequence[float] = SCALES) -> tuple[float, float, list[dict[str, float]]]:
    """The ``(T, S)`` with the lowest ``score`` (the first in grid order on ties) and every point scored."""
    points = [{"temperature": t, "scale": s, "score": score(t, s)} for t in temperatures for s in scales]
    best = min(points, key=lambda p: p["score"])
    return best["temperature"], best["scale"], points


def calibrate(engine: BlendEngine, prompts: Sequence[tuple[Prompt, Sequence[int]]], base: BlendSettings,
              provenance: dict[str, Any] | None = None, temperatures: Sequence[float] = TEMPERATURES,
              scales: Sequence[float] = SCALES) -> Calibration:
    """Grid-search ``(T, S)`` for ``engine``'s model on ``prompts`` (each with its candidates' label token
    ids): the blend is ``base`` with selector ``none`` (every blended row stale, where calibration acts
    most), scored by the mean label KL to full prefill. Deterministic for given prompts and grid."""
    if not prompts:
        raise CalibrationError("calibration needs at least one prompt")
    plain = base.with_(selector="none", ratio=0.0, schedule=(), tail_weight=0.0, structure=False,
                       granularity="token", attention_temperature=1.0, attention_scale=1.0)
    references = [engine.full(prompt).logits for prompt, _ in prompts]

    def score(temperature: float, scale: float) -> float:
        settings = plain.with_(attention_temperature=temperature, attention_scale=scale)
        kls = [label_kl(ref, engine.blend(prompt, settings).logits, labels)
               for ref, (prompt, labels) in zip(references, prompts, strict=True)]
        return round(sum(kls) / len(kls), 9)  # rounded so float noise cannot reorder near-equal points

    temperature, scale, points = grid_search(score, temperatures, scales)
    record = dict(provenance or {})
    record.update(prompts=len(prompts), prefill_context=plain.prefill_context, selector="none",
                  grid=[{k: round(v, 9) for k, v in point.items()} for point in points])
    return Calibration(model=model_record(engine.identity), temperature=temperature, scale=scale,
                       provenance=record)
