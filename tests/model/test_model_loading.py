"""Model preparation and loading: SmolLM2 from GGUF, refusals for what the engine cannot drive."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvshard_sidecar.engine.model import IDENTITY_FILE, UnsupportedModelError, check_supported, load_model


@pytest.mark.model
def test_prepared_model_greedy_generates_a_sensible_answer(smollm2: Any) -> None:
    tokenizer, model = smollm2.tokenizer, smollm2.model
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


@pytest.mark.model
def test_prepared_model_records_its_identity(smollm2: Any) -> None:
    record = json.loads((smollm2.path / IDENTITY_FILE).read_text())
    assert smollm2.identity.name == record["name"] == "SmolLM2-135M-Instruct"
    assert len(smollm2.identity.revision) == 32 and smollm2.identity.tokenizer != smollm2.identity.revision
    assert smollm2.config.model_type == "llama" and smollm2.config.num_hidden_layers == 30


@pytest.mark.parametrize("model_type", ["gpt2", "bert", "mixtral", None])
def test_other_architectures_are_refused_with_the_reason(model_type: str | None) -> None:
    with pytest.raises(UnsupportedModelError, match="Llama-family"):
        check_supported(SimpleNamespace(model_type=model_type))


def test_dynamic_ntk_rope_scaling_is_refused() -> None:
    config = SimpleNamespace(model_type="llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match="dynamic NTK"):
        check_supported(config)


@pytest.mark.parametrize("rope", [None, {"rope_type": "default"}, {"rope_type": "llama3", "factor": 8.0}])
def test_llama3_and_default_rope_are_accepted(rope: Any) -> None:
    check_supported(SimpleNamespace(model_type="llama", rope_scaling=rope))


def test_loading_a_gpt2_folder_is_refused_before_weights_load(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported"):
        load_model(tmp_path)


def test_missing_folder_says_what_to_run(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no Hugging Face model folder"):
        load_model(tmp_path / "absent")
