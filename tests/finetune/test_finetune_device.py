"""`kvshard model finetune` on your catalog and your hardware: `--device` picks CUDA only where it is, `--batch`
scores several examples in one forward pass with the same losses, and any Llama-family folder trains on a
catalog in the generic format (a 2-step run on a tiny random Llama and a synthetic catalog)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kvshard.settings import SettingsError
from kvshard_bench.synthetic_catalog import CatalogShape, generate, write
from kvshard_sidecar.engine.model import UnsupportedModelError, default_model_path
from kvshard_training.settings import FinetuneSettings, resolve_device, resolve_precision

CUDA = torch.cuda.is_available()
LATE = {"scorer": "late", "interaction": 4, "label_position": "after"}


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shape = CatalogShape(items=120, users=60, groups=6, min_history=10, max_history=16)
    return write(generate(shape), shape, tmp_path_factory.mktemp("synthetic") / "catalog")


def tiny(out: Path, dataset: Path, **changes: object) -> FinetuneSettings:
    """A 2-step late-scorer run on a handful of the catalog's users (the shape of conftest's tiny run)."""
    settings = FinetuneSettings(dataset=str(dataset), out=out, history=3, candidates=4, steps=2, accumulation=2,
                                users=5, val_users=2, rank=2, alpha=4, layers=2, targets=("q_proj", "v_proj"),
                                warmup=1, minutes=5.0, **LATE)  # type: ignore[arg-type]
    return replace(settings, **changes)  # type: ignore[arg-type]


def tiny_llama(folder: Path, chat_template: bool = True) -> Path:
    """A 2-layer Llama with random weights, saved as a plain Hugging Face folder with SmolLM2's tokenizer (no
    kvshard identity file: the folder is what a user would bring)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    smollm2 = default_model_path()
    if not (smollm2 / "config.json").exists():
        pytest.fail(f"SmolLM2 is not prepared at {smollm2}: run `kvshard model prepare` (its tokenizer is used)")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    causal_lm: Any = LlamaForCausalLM  # transformers' annotations differ between versions
    causal_lm(config).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    if not chat_template:
        tokenizer.chat_template = None
    tokenizer.save_pretrained(folder)
    return folder


def test_auto_is_cuda_exactly_when_cuda_is_available() -> None:
    assert resolve_device("auto", cuda_available=True) == "cuda"
    assert resolve_device("auto", cuda_available=False) == "cpu"
    assert resolve_device("cpu", cuda_available=True) == "cpu"
    assert resolve_device("cuda", cuda_available=True) == "cuda"


def test_auto_precision_is_bfloat16_only_where_the_hardware_computes_it() -> None:
    assert resolve_precision("auto", "cuda", cpu_computes_bfloat16=False) == "bfloat16"
    assert resolve_precision("auto", "cpu", cpu_computes_bfloat16=True) == "bfloat16"
    assert resolve_precision("auto", "cpu", cpu_computes_bfloat16=False) == "float32"  # emulated: ~20x slower
    assert resolve_precision("bfloat16", "cpu", cpu_computes_bfloat16=False) == "bfloat16"  # asked for: kept
    assert resolve_precision("float32", "cuda", cpu_computes_bfloat16=True) == "float32"


def test_cuda_without_cuda_is_a_settings_error_that_says_why() -> None:
    with pytest.raises(SettingsError, match="no CUDA device"):
        resolve_device("cuda", cuda_available=False)


@pytest.mark.skipif(CUDA, reason="this machine has CUDA: auto picks it")
def test_here_auto_trains_on_the_cpu_and_cuda_is_refused() -> None:
    assert FinetuneSettings().resolved_device() == "cpu"
    with pytest.raises(SettingsError, match="--device cuda"):
        FinetuneSettings(device="cuda").resolved_device()


@pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")
@pytest.mark.model
def test_on_a_gpu_auto_trains_there_in_batches_and_provenance_names_the_gpu(tmp_path: Path, catalog: Path) -> None:
    from kvshard_training.finetune import train

    assert FinetuneSettings().resolved_device() == "cuda"
    result = train(tiny(tmp_path, catalog, batch=2), progress=False)
    device = json.loads((tmp_path / "provenance.json").read_text())["device"]
    assert result.steps == 2 and device["kind"] == "cuda" and device["batch"] == 2
    assert device["name"] == torch.cuda.get_device_name(0)


@pytest.mark.parametrize(("changes", "message"), [
    ({"device": "tpu"}, "--device"),
    ({"batch": 0}, "--batch"),
    ({"batch": 8, "accumulation": 4}, "--batch 8 is more than --accumulation 4"),
    ({"batch": 2, "accumulation": 2, "scorer": "answer", "interaction": 0}, "--scorer isolated or late"),
])
def test_impossible_devices_and_batches_are_refused(changes: dict[str, object], message: str) -> None:
    settings = replace(FinetuneSettings(**LATE), **changes)  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match=message):
        settings.validate()


def test_the_recorded_command_carries_device_and_batch(tmp_path: Path) -> None:
    command = FinetuneSettings(out=tmp_path, device="cpu", batch=4, **LATE).command()  # type: ignore[arg-type]
    assert "--device cpu" in command and "--batch 4" in command


@pytest.mark.model
def test_a_batch_has_the_losses_and_gradients_of_its_examples_one_by_one(tmp_path: Path, catalog: Path) -> None:
    """float32, so the only difference is summation order; pads of a shorter prompt change nothing."""
    from kvshard_sidecar.engine.isolated_scorer import readout_id
    from kvshard_sidecar.engine.model import load_model
    from kvshard_training.examples import training_data
    from kvshard_training.losses import batch_losses, example_loss

    settings = tiny(tmp_path, catalog, precision="float32", steps=3, accumulation=3, batch=3)
    loaded = load_model(dtype="float32")
    readout = readout_id(loaded.tokenizer)
    examples = training_data(settings, loaded.tokenizer).examples[:3]
    assert len({len(e.isolated[0].token_ids) for e in examples}) > 1  # prompts of different lengths: padded
    probe = loaded.model.model.layers[-1].self_attn.q_proj.weight
    for parameter in loaded.model.parameters():
        parameter.requires_grad_(parameter is probe)

    one_by_one = [example_loss(loaded.model, e, settings, readout) for e in examples]
    torch.autograd.backward(torch.stack(one_by_one).sum())
    assert probe.grad is not None
    gradient, probe.grad = probe.grad.clone(), None
    batched = batch_losses(loaded.model, examples, settings, readout)
    torch.autograd.backward(torch.stack(batched).sum())

    assert torch.allclose(torch.stack(batched), torch.stack(one_by_one), atol=1e-5)
    assert probe.grad is not None and torch.isfinite(probe.grad).all()
    assert torch.allclose(probe.grad, gradient, atol=1e-5, rtol=1e-4)


@pytest.mark.model
def test_any_llama_folder_trains_on_a_synthetic_catalog_in_two_steps_and_merges(tmp_path: Path,
                                                                               catalog: Path) -> None:
    from kvshard.cli import main
    from kvshard_sidecar.engine.model import load_model
    from kvshard_training.merge import merge_adapter

    base = tiny_llama(tmp_path / "tiny-llama")
    out = tmp_path / "adapter"
    settings = tiny(out, catalog, model=base, batch=2)
    assert main(settings.command().split()[1:]) == 0

    record = json.loads((out / "provenance.json").read_text())
    curve = json.loads((out / "loss_curve.json").read_text())
    assert record["base"]["name"] == "tiny-llama" and record["dataset"] == "catalog"
    assert record["device"] == {"kind": "cpu", "name": record["device"]["name"], "batch": 2}
    assert record["steps"] == 2 and record["examples"] == 4 and "--batch 2" in record["command"]
    assert [s["step"] for s in curve["steps"]] == [1, 2] and all(s["loss"] > 0 for s in curve["steps"])
    merged = merge_adapter(base, out, tmp_path / "merged", "tiny-llama-rec")
    assert load_model(merged).identity.name == "tiny-llama-rec"


@pytest.mark.model
def test_a_base_whose_tokenizer_has_no_chat_template_is_refused_by_name(tmp_path: Path, catalog: Path) -> None:
    from kvshard_training.finetune import train

    base = tiny_llama(tmp_path / "plain-llama", chat_template=False)
    with pytest.raises(UnsupportedModelError, match="plain-llama: its tokenizer has no chat template"):
        train(tiny(tmp_path / "out", catalog, model=base), progress=False)
