"""Merge a shipped LoRA adapter into a prepared base model: a second model folder, loaded like the first.

Why it exists. vLLM, the blend engine and the block keys all want one plain Hugging Face folder
with one weights hash; a LoRA adapter applied at run time would need every one of them to know
about adapters. So ``kvshard model prepare`` merges the adapter the repository ships
(``training/kvshard_training/adapters/movielens-rec/``) into the prepared base once, beside it
(``<user cache>/models/SmolLM2-135M-MovieLens-Rec``), and writes ``kvshard-identity.json`` the same
way — the merged weights hash differently, so their blocks never mix with the base's.

The merge is pure tensor arithmetic over safetensors files (no model object): for every adapted
projection ``W' = W + scale · B·A``, computed in float64 and rounded once to the base dtype, every
other tensor copied unchanged and the files written with sorted keys — so two merges give
byte-identical files whatever the thread count. An adapter records the weights hash of the base it
was trained on (``provenance.json``); merging into any other base is refused.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvshard.models import FINETUNED_NAME, IDENTITY_FILE, LATE_NAME, MERGE_RECORD, SCORER_NAME
from kvshard_sidecar.engine.model import read_identity, write_identity
from kvshard_training.report import PROVENANCE_FILE, sha256_file

log = logging.getLogger(__name__)

SHIPPED_ADAPTERS = Path(__file__).parent / "adapters"
MOVIELENS_ADAPTER = SHIPPED_ADAPTERS / "movielens-rec"
MOVIELENS_SCORER_ADAPTER = SHIPPED_ADAPTERS / "movielens-scorer"
MOVIELENS_LATE_ADAPTER = SHIPPED_ADAPTERS / "movielens-late"
SHIPPED = ((MOVIELENS_ADAPTER, FINETUNED_NAME), (MOVIELENS_SCORER_ADAPTER, SCORER_NAME),
           (MOVIELENS_LATE_ADAPTER, LATE_NAME))
"""Each shipped adapter and the name of the prepared folder it is merged into."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."
_COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
           "model.safetensors.index.json")


class AdapterError(ValueError):
    """An adapter folder that cannot be merged: missing files, or LoRA features the merge does not do."""


class BaseMismatchError(AdapterError):
    """The adapter was trained on other base weights (or another tokenizer) than the prepared base."""


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter folder as peft writes it, plus kvshard's provenance."""

    folder: Path
    config: dict[str, Any]
    provenance: dict[str, Any]
    sha256: str

    @classmethod
    def read(cls, folder: Path) -> Adapter:
        for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG, PROVENANCE_FILE):
            if not (folder / name).is_file():
                raise AdapterError(f"{folder} has no {name}: not a kvshard adapter folder")
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
        provenance = json.loads((folder / PROVENANCE_FILE).read_text())
        base = provenance.get("base")
        if not isinstance(base, dict) or not base.get("revision"):
            raise AdapterError(f"{folder / PROVENANCE_FILE} does not record the base weights hash (base.revision)")
        return cls(folder, config, provenance, sha256_file(folder / ADAPTER_WEIGHTS))

    @property
    def scale(self) -> float:
        """``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA), as peft applies it."""
        self.check_supported()
        rank, alpha = int(self.config["r"]), float(self.config["lora_alpha"])
        return alpha / math.sqrt(rank) if self.config.get("use_rslora") else alpha / rank

    def check_supported(self) -> None:
        config = self.config
        problems = []
        if config.get("peft_type", "LORA") != "LORA":
            problems.append(f"peft_type {config.get('peft_type')!r} (only LORA)")
        for flag in ("use_dora", "fan_in_fan_out", "lora_bias"):
            if config.get(flag):
                problems.append(flag)
        if config.get("bias", "none") != "none":
            problems.append(f"bias={config.get('bias')!r}")
        for field in ("rank_pattern", "alpha_pattern"):
            if config.get(field):
                problems.append(field)
        if config.get("modules_to_save"):
            problems.append("modules_to_save")
        if problems:
            raise AdapterError(f"{self.folder}: the merge does not support {', '.join(problems)}")

    def check_base(self, base: Path) -> None:
        """Refuse a base whose weights (or tokenizer) differ from those the adapter was trained on."""
        recorded = self.provenance["base"]
        actual = read_identity(base, "float32")
        if actual.revision != recorded["revision"]:
            raise BaseMismatchError(
                f"adapter {self.folder.name} was trained on base weights {recorded['revision']} "
                f"({recorded.get('name', '?')}), but {base} has {actual.revision} ({actual.name}); "
                "prepare the matching base model or retrain the adapter")
        if recorded.get("tokenizer") and actual.tokenizer != recorded["tokenizer"]:
            raise BaseMismatchError(f"adapter {self.folder.name} was trained with tokenizer {recorded['tokenizer']}, "
                                    f"but {base} has {actual.tokenizer}")

    def lora_pairs(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Base weight name → (A [r, in], B [out, r]) for every adapted projection."""
        from safetensors.torch import load_file

        tensors = load_file(str(self.folder / ADAPTER_WEIGHTS))
        pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, a in tensors.items():
            if not key.endswith(".lora_A.weight"):
                if not key.endswith(".lora_B.weight"):
                    raise AdapterError(f"{self.folder}: unexpected tensor {key!r} (only lora_A/lora_B weights)")
                continue
            module = key.removesuffix(".lora_A.weight")
            b = tensors.get(f"{module}.lora_B.weight")
            if b is None:
                raise AdapterError(f"{self.folder}: {key} has no matching lora_B")
            pairs[module.removeprefix(_PEFT_PREFIX) + ".weight"] = (a, b)
        if not pairs:
            raise AdapterError(f"{self.folder}: no LoRA weights")
        return pairs


def merge_weights(base: dict[str, torch.Tensor], pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
                  scale: float) -> dict[str, torch.Tensor]:
    """``W + scale · B·A`` for the adapted weights (float64, rounded once); everything else as is."""
    merged = dict(base)
    for name, (a, b) in pairs.items():
        weight = merged[name]
        delta = b.double() @ a.double()
        if delta.shape != weight.shape:
            raise AdapterError(f"{name}: LoRA delta {tuple(delta.shape)} does not match {tuple(weight.shape)}")
        merged[name] = (weight.double() + scale * delta).to(weight.dtype).contiguous()
    return merged


def merge_adapter(base: Path, adapter_folder: Path, target: Path, name: str = FINETUNED_NAME) -> Path:
    """Write ``base`` + ``adapter`` as a new prepared folder ``target`` (replaced atomically)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    adapter = Adapter.read(adapter_folder)
    adapter.check_base(base)
    pairs = adapter.lora_pairs()
    scale = adapter.scale
    files = sorted(base.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no weights (*.safetensors) in {base}")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)
    try:
        remaining = dict(pairs)
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                metadata = handle.metadata() or {"format": "pt"}
                tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
            mine = {k: v for k, v in remaining.items() if k in tensors}
            for key in mine:
                del remaining[key]
            save_file(merge_weights(tensors, mine, scale), str(staging / file.name), metadata=metadata)
        if remaining:
            raise AdapterError(f"adapted weights not in the base: {', '.join(sorted(remaining)[:3])}…")
        for copied in _COPIED:
            if (base / copied).exists():
                shutil.copyfile(base / copied, staging / copied)
        write_identity(staging, name)
        record = {"adapter": adapter_folder.name, "adapter_sha256": adapter.sha256, "scale": scale,
                  "base": adapter.provenance["base"], "command": adapter.provenance.get("command"),
                  **serving_fields(adapter.provenance)}
        (staging / MERGE_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    log.info("merged adapter %s into %s at %s", adapter_folder.name, base.name, target)
    return target


def serving_fields(provenance: dict[str, Any]) -> dict[str, object]:
    """What the merge record tells every server about how to ask and rank with the model
    (:mod:`kvshard.models` reads each): the prompt it was trained with, its scorer and interaction tokens,
    and — where chosen (``served_fusion``: at the end of fine-tuning, or by ``kvshard model fusion-weight``)
    — the retrieval stage's weight in its fused ranking."""
    settings = provenance.get("settings") or {}
    fields: dict[str, object] = {"prompt": trained_prompt(provenance), "scorer": settings.get("scorer", "answer"),
                                 "interaction": settings.get("interaction", 0)}
    fusion = provenance.get("served_fusion")
    if isinstance(fusion, dict) and "retrieval_weight" in fusion:
        fields["retrieval_weight"] = fusion["retrieval_weight"]
    return fields


def trained_prompt(provenance: dict[str, Any]) -> dict[str, str]:
    """The ``spec.prompt`` fields an adapter was trained with that differ from the default template
    (today the label position): the model must be asked that way."""
    position = (provenance.get("settings") or {}).get("label_position", "before")
    return {} if position == "before" else {"labelPosition": str(position)}


def is_current(target: Path, adapter_folder: Path) -> bool:
    """True when ``target`` is a complete merge of exactly this adapter's weights, recording what its provenance
    says today about serving it (a weight chosen after the merge makes the merge stale)."""
    record = target / MERGE_RECORD
    if not (target / IDENTITY_FILE).exists() or not record.exists():
        return False
    merged, adapter = json.loads(record.read_text()), Adapter.read(adapter_folder)
    fields = serving_fields(adapter.provenance)
    return bool(merged.get("adapter_sha256") == adapter.sha256
                and all(merged.get(k) == fields.get(k) for k in {*fields, "retrieval_weight"}))


def prepare_finetuned(base: Path, target: Path | None = None, adapter_folder: Path = MOVIELENS_ADAPTER,
                      force: bool = False, name: str = FINETUNED_NAME) -> Path | None:
    """Merge the shipped adapter into ``base`` unless that merge is already there; ``None`` (and a log
    line) when the repository ships no adapter yet."""
    if not (adapter_folder / ADAPTER_WEIGHTS).exists():
        log.info("no fine-tuned adapter shipped at %s: only the base model is prepared", adapter_folder)
        return None
    target = target or base.parent / name
    if not force and is_current(target, adapter_folder):
        log.info("fine-tuned model already prepared at %s", target)
        return target
    return merge_adapter(base, adapter_folder, target, name)
