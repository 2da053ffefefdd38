"""A fine-tuned model is asked as it was trained: its merge record's prompt fields fill in what a
CacheShard leaves unset, and an explicit choice is kept but named; its ranking is fused with a retrieval
stage at the weight chosen for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvshard.models import (
    DEFAULT_RETRIEVAL_WEIGHT,
    MERGE_RECORD,
    model_prompt,
    model_retrieval_weight,
    model_template,
    prompt_for_model,
)


def test_the_trained_fields_fill_only_what_the_cacheshard_leaves_unset() -> None:
    trained = {"labelPosition": "after"}
    assert prompt_for_model(None, trained) == ({"labelPosition": "after"}, [])
    assert prompt_for_model({"itemFormat": "{text}"}, trained) == ({"itemFormat": "{text}", "labelPosition": "after"},
                                                                   [])
    assert prompt_for_model({"labelPosition": "before"}, trained) == ({"labelPosition": "before"}, ["labelPosition"])
    assert prompt_for_model({"labelPosition": "after"}, trained) == ({"labelPosition": "after"}, [])
    assert prompt_for_model({"systemText": "x"}, {}) == ({"systemText": "x"}, [])


def test_a_folder_without_a_readable_merge_record_is_asked_with_the_default_template(tmp_path: Path) -> None:
    assert model_prompt(tmp_path) == {} and model_template(tmp_path).label_position == "before"
    (tmp_path / MERGE_RECORD).write_text("{not json")
    assert model_prompt(tmp_path) == {}
    (tmp_path / MERGE_RECORD).write_text(json.dumps({"prompt": {"labelPosition": "after"}}))
    assert model_template(tmp_path).label_after and model_template(tmp_path).label_text("C") == " [C]\n"


def test_the_cacheshard_kvshard_up_generates_asks_the_served_model_as_it_was_trained(tmp_path: Path) -> None:
    from kvshard_local.cluster import LocalCluster

    model = tmp_path / "Rec"
    model.mkdir()
    (model / MERGE_RECORD).write_text(json.dumps({"prompt": {"labelPosition": "after"}}))
    assert LocalCluster(dir=tmp_path / "run", model=str(model))._prompt == {"labelPosition": "after"}
    prompt = tmp_path / "prompt.yaml"
    prompt.write_text("itemFormat: '{text}!'\n")
    assert LocalCluster(dir=tmp_path / "run", model=str(model), prompt=prompt)._prompt == {
        "itemFormat": "{text}!", "labelPosition": "after"}
    assert LocalCluster(dir=tmp_path / "run", model=str(tmp_path))._prompt is None  # no merge record: the default


def test_a_model_serves_the_fusion_weight_its_merge_recorded_and_1_where_none(tmp_path: Path) -> None:
    assert model_retrieval_weight(tmp_path) == DEFAULT_RETRIEVAL_WEIGHT == 1.0
    (tmp_path / MERGE_RECORD).write_text(json.dumps({"retrieval_weight": 2}))
    assert model_retrieval_weight(tmp_path) == 2.0
    for bad in (-1, "2", True, None, float("inf")):
        (tmp_path / MERGE_RECORD).write_text(json.dumps({"retrieval_weight": bad}))
        with pytest.raises(ValueError, match="retrieval_weight"):
            model_retrieval_weight(tmp_path)
