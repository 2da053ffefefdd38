"""The LoRA adapter a finetune run trains: created fresh, warm-started from a trained one, saved.

Why its own module: the adapter is what outlives a run — it is shipped, merged and started from again —
so where it comes from (:func:`warm_start` and the :func:`lineage_record` of every stage before it) and
how it is written (peft's format, the base named by kvshard's model name) are one concern, apart from
the training loop in :mod:`kvshard_training.finetune`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from kvshard_training.merge import ADAPTER_CONFIG, ADAPTER_WEIGHTS, Adapter, AdapterError
from kvshard_training.report import PROVENANCE_FILE, write_json_atomic
from kvshard_training.settings import FinetuneSettings

log = logging.getLogger(__name__)


def lora_model(model: Any, settings: FinetuneSettings) -> Any:
    """Wrap ``model`` with fresh LoRA adapters (seeded initialisation; B starts at zero, so the wrapped
    model starts exactly as the base)."""
    from peft import LoraConfig, get_peft_model

    layers = model.config.num_hidden_layers
    top = settings.layers if 0 < settings.layers < layers else layers
    config = LoraConfig(
        r=settings.rank, lora_alpha=settings.alpha, lora_dropout=0.0, bias="none",
        target_modules=list(settings.targets), layers_to_transform=list(range(layers - top, layers)),
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(settings.seed)
    return get_peft_model(model, config)


def warm_start(peft_model: Any, folder: Path, base: Path) -> dict[str, object]:
    """Load a trained adapter's LoRA weights into the fresh adapters, so training continues from it.

    Why: a late scorer differs from the isolated scorer only in what item tokens may read; starting from
    the isolated scorer's weights spends the CPU budget on adapting to the tighter mask instead of learning
    the task again; and a run stopped by its wall-clock budget continues from its own adapter on new
    examples (another ``--seed``). Refuses an adapter of another shape (rank, alpha, projections,
    layers) or trained on other base weights: its numbers would not mean the same here."""
    from peft import set_peft_model_state_dict
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    adapter = Adapter.read(folder)
    adapter.check_base(base)
    ours = peft_model.peft_config["default"]
    tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    expected = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(peft_model).items()}
    if ((int(adapter.config["r"]), float(adapter.config["lora_alpha"])) != (ours.r, float(ours.lora_alpha))
            or {k: tuple(v.shape) for k, v in tensors.items()} != expected):
        raise AdapterError(f"{folder}: its LoRA (rank {adapter.config['r']}, alpha {adapter.config['lora_alpha']}, "
                           f"{len(tensors)} tensors) does not match this run's (rank {ours.r}, alpha "
                           f"{ours.lora_alpha}, {len(expected)} tensors): give the same --rank, --alpha, "
                           "--targets and --layers it was trained with")
    set_peft_model_state_dict(peft_model, tensors)
    log.info("warm start from %s (sha256 %s…)", folder, adapter.sha256[:12])
    return lineage_record(folder, adapter.sha256, adapter.provenance)


def lineage_record(folder: Path, sha256: str, provenance: Mapping[str, object]) -> dict[str, object]:
    """What a warm start started from, all the way down: each adapter's command, seconds and hash, and
    the adapter *it* started from. Why: the training cost of an adapter trained in stages is the sum of
    its stages, and a later run may overwrite the starting folder; the chain keeps the recipe whole. A
    stage recorded before stages carried their seconds is completed from its sibling folder when that
    folder still holds the same adapter (same sha256)."""
    record: dict[str, object] = {"folder": folder.name, "sha256": sha256, "command": str(provenance.get("command", "")),
                                 "training_seconds": provenance.get("training_seconds")}
    parent = provenance.get("init_adapter")
    if isinstance(parent, Mapping):
        record["init_adapter"] = dict(parent)
        sibling = folder.parent / str(parent.get("folder", ""))
        if "training_seconds" not in parent and (sibling / PROVENANCE_FILE).exists():
            stage = Adapter.read(sibling)
            if stage.sha256 == parent.get("sha256"):
                record["init_adapter"] = lineage_record(sibling, stage.sha256, stage.provenance)
    return record


def lineage_seconds(seconds: float, init_adapter: Mapping[str, object] | None) -> float:
    """Training seconds of this run plus every stage it warm-started from (stages that did not record
    their time count as zero, so the sum never overstates)."""
    total, stage = seconds, init_adapter
    while isinstance(stage, Mapping):
        spent = stage.get("training_seconds")
        total += float(spent) if isinstance(spent, (int, float)) else 0.0
        parent = stage.get("init_adapter")
        stage = parent if isinstance(parent, Mapping) else None
    return total


def save_adapter(peft_model: Any, folder: Path, base_name: str) -> None:
    """``adapter_model.safetensors`` + ``adapter_config.json`` (peft's format; the base named by its
    kvshard model name, not by this machine's path)."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    # .cpu(): a run on a GPU saves the same file as one on the CPU (a no-op there)
    state = {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(peft_model).items()}
    save_file(state, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = peft_model.peft_config["default"].to_dict()
    config["base_model_name_or_path"] = base_name
    config["target_modules"] = sorted(config["target_modules"])
    config["task_type"] = str(config.get("task_type") or "CAUSAL_LM")
    config["peft_type"] = str(getattr(config.get("peft_type"), "value", config.get("peft_type")))
    write_json_atomic(folder / ADAPTER_CONFIG, config)
