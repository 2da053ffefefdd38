"""`kvshard model finetune` end to end on a tiny split: outputs, a finite loss curve, honest provenance."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from kvshard.cli import build_parser
from kvshard_sidecar.engine.model import default_model_path, read_identity
from kvshard_training.settings import FinetuneSettings, from_args


@pytest.mark.model
def test_two_steps_write_adapter_curve_and_provenance(tiny_adapter: Path) -> None:
    names = {p.name for p in tiny_adapter.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "provenance.json", "loss_curve.json",
            "loss_curve.png"} <= names
    curve = json.loads((tiny_adapter / "loss_curve.json").read_text())
    assert [s["step"] for s in curve["steps"]] == [1, 2]
    assert all(math.isfinite(s["loss"]) and s["loss"] > 0 for s in curve["steps"])
    assert len(curve["validation"]) == 1 and math.isfinite(curve["validation"][0]["loss"])


@pytest.mark.model
def test_adapter_is_small_low_rank_and_trained(tiny_adapter: Path) -> None:
    config = json.loads((tiny_adapter / "adapter_config.json").read_text())
    assert config["r"] == 2 and config["base_model_name_or_path"] == "SmolLM2-135M-Instruct"
    assert config["layers_to_transform"] == [28, 29]
    with safe_open(str(tiny_adapter / "adapter_model.safetensors"), framework="pt") as handle:
        keys = list(handle.keys())
        assert len(keys) == 2 * 2 * 3  # 2 layers × 3 projections × (A, B)
        assert any(float(handle.get_tensor(k).abs().max()) > 0 for k in keys if "lora_B" in k)  # B moved off zero


@pytest.mark.model
def test_provenance_records_command_seed_split_and_base_hash(tiny_adapter: Path) -> None:
    record = json.loads((tiny_adapter / "provenance.json").read_text())
    assert record["base"]["revision"] == read_identity(default_model_path(), "float32").revision
    assert record["steps"] == 2 and record["examples"] == 2 and record["seed"] == 0
    assert record["split"]["heldout_users"] > 0 and "last interaction" in record["split"]["never_used"]
    assert record["command"].startswith("kvshard model finetune ") and "--candidates 4" in record["command"]
    validation = record["evaluation"]["validation"]
    assert "hr1" in validation and 0.0 <= validation["position_consistency"] <= 1.0  # two orders per prompt
    assert record["settings"]["consistency"] == 1.0 and "--consistency 1.0" in record["command"]
    assert record["settings"]["pointwise"] == 1.0 and "--pointwise 1.0" in record["command"]
    assert record["teacher"]["kind"] == "item-knn" and 0.0 <= record["teacher"]["validation"]["hr1"] <= 1.0


def test_training_chooses_the_retrieval_stages_weight_on_its_final_validation(tiny_adapter: Path) -> None:
    from kvshard.ranking import FUSION_WEIGHTS

    fusion = json.loads((tiny_adapter / "provenance.json").read_text())["served_fusion"]
    weight = fusion["retrieval_weight"]
    assert fusion["prompts"] == 2 and "log-likelihood" in fusion["chosen_by"]
    assert 0.0 <= weight <= FUSION_WEIGHTS[-1]  # fitted, and reported beside the grid
    assert set(fusion["by_weight"]) == {f"{w:g}" for w in (*FUSION_WEIGHTS, weight)}


def test_the_recorded_command_parses_back_to_the_same_settings(tmp_path: Path) -> None:
    settings = FinetuneSettings(out=tmp_path, history=7, targets=("q_proj", "o_proj"), lr=3e-4, teacher="none",
                                teacher_weight=0.25)
    words = settings.command().split()[1:]
    assert from_args(build_parser(words).parse_args(words)) == settings


def test_finetune_help_lists_the_budget_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser(["model", "finetune", "--help"]).parse_args(["model", "finetune", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--dataset", "--history", "--candidates", "--steps", "--minutes", "--lr", "--rank", "--seed",
                 "--out", "--threads", "--users", "--teacher", "--teacher-weight", "--teacher-temperature"):
        assert flag in text


def test_a_rank_above_16_is_refused() -> None:
    from kvshard.settings import SettingsError

    with pytest.raises(SettingsError, match="rank"):
        FinetuneSettings(rank=32).validate()


def test_the_pointwise_term_is_refused_when_labels_stand_before_their_items() -> None:
    from kvshard.settings import SettingsError

    FinetuneSettings(pointwise=1.0).validate()
    with pytest.raises(SettingsError, match="label-position after"):
        FinetuneSettings(pointwise=1.0, label_position="before").validate()


@pytest.mark.model
def test_an_example_aligns_each_order_with_the_first() -> None:
    from transformers import AutoTokenizer

    from kvshard.datasets import load_dataset
    from kvshard.prompts import PromptBuilder, RecommendationRequest
    from kvshard_training.examples import Example

    dataset = load_dataset("movielens-100k")
    builder = PromptBuilder(AutoTokenizer.from_pretrained(default_model_path()), dataset)
    first = RecommendationRequest("1", ("1", "2"), ("10", "20", "30"), target="20")
    second = RecommendationRequest("1", ("1", "2"), ("30", "10", "20"), target="20")
    example = Example.of(builder.build(first), builder.build(second))
    assert example.orders == 2 and example.targets.tolist() == [1, 2]
    assert example.alignment.tolist() == [[0, 1, 2], [1, 2, 0]]  # "10" stands second in order 1, ...
    with pytest.raises(ValueError, match="target"):
        Example.of(builder.build(RecommendationRequest("1", ("1",), ("10", "20"), target="99")))
    assert example.positives is None  # one target: the one-hot of ``targets``
    later = [RecommendationRequest("1", ("1", "2"), order, target="20", later_targets=("10",))
             for order in (("10", "20", "30"), ("30", "10", "20"))]
    spread = Example.of(*(builder.build(r) for r in later))
    assert spread.positives is not None
    assert spread.positives.tolist() == [[0.5, 0.5, 0.0], [0.0, 0.5, 0.5]]  # "20" and "10", wherever they stand


@pytest.mark.model
def test_training_prompts_may_hold_fewer_candidates_than_validation_prompts() -> None:
    from transformers import AutoTokenizer

    from kvshard_training.examples import training_data

    settings = FinetuneSettings(history=3, candidates=6, training_candidates=3, steps=4, accumulation=1, users=5,
                                val_users=2, label_position="after", scorer="late", interaction=4)
    settings.validate()
    data = training_data(settings, AutoTokenizer.from_pretrained(default_model_path()))
    assert {len(e.label_ids) for e in data.examples} == {3}  # the target and two negatives
    assert {len(e.label_ids) for e in data.validation} == {6}  # validation ranks as the benchmark does
    assert all(len(scores) == 6 for scores in data.validation_stage)


def test_fewer_training_candidates_only_for_a_scorer_that_reads_each_candidate_apart() -> None:
    from kvshard.settings import SettingsError

    with pytest.raises(SettingsError, match="--training-candidates"):
        FinetuneSettings(training_candidates=10).validate()  # the answer scorer: labels K..T never trained
    with pytest.raises(SettingsError, match="--training-candidates"):
        FinetuneSettings(training_candidates=1, scorer="late", label_position="after").validate()
    with pytest.raises(SettingsError, match="--positives"):  # a training prompt keeps a negative
        FinetuneSettings(training_candidates=3, positives=3, scorer="late", label_position="after").validate()
    FinetuneSettings(training_candidates=10, scorer="late", label_position="after").validate()


def test_positives_must_leave_a_negative() -> None:
    from kvshard.settings import SettingsError

    FinetuneSettings(positives=19).validate()
    for bad in (0, 20):
        with pytest.raises(SettingsError, match="--positives"):
            FinetuneSettings(positives=bad).validate()


@pytest.mark.model
@pytest.mark.parametrize("label_position", ["after", "before"])
def test_label_positions_point_at_each_candidates_label_token(label_position: str) -> None:
    from transformers import AutoTokenizer

    from kvshard.datasets import load_dataset
    from kvshard.prompt_template import PromptTemplate
    from kvshard.prompts import PromptBuilder, RecommendationRequest
    from kvshard_training.examples import label_positions

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    builder = PromptBuilder(tokenizer, load_dataset("movielens-100k"),
                            template=PromptTemplate(label_position=label_position))
    built = builder.build(RecommendationRequest("1", ("1", "2"), ("10", "20", "30", "40"), target="20"))
    positions = label_positions(built)
    ids = built.prompt.token_ids
    assert [ids[p] for p in positions] == list(built.label_token_ids)
    assert positions == sorted(positions) and len(set(positions)) == 4
    closing = {tokenizer.decode(ids[p + 1]) for p in positions}
    assert closing == ({"]"} if label_position == "after" else {"."})


@pytest.mark.model
def test_a_warm_start_continues_from_the_adapter_and_refuses_another_shape(tiny_adapter: Path) -> None:
    import dataclasses

    import torch
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    from kvshard_sidecar.engine.model import load_model
    from kvshard_training.lora import lora_model, warm_start
    from kvshard_training.merge import AdapterError

    words = json.loads((tiny_adapter / "provenance.json").read_text())["command"].split()[1:]
    base, settings = default_model_path(), from_args(build_parser(words).parse_args(words))
    fresh = lora_model(load_model(base).model, dataclasses.replace(settings, seed=1))
    record = warm_start(fresh, tiny_adapter, base)
    saved = load_file(str(tiny_adapter / "adapter_model.safetensors"))
    loaded = get_peft_model_state_dict(fresh)
    assert saved.keys() == loaded.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert record["sha256"] == json.loads((tiny_adapter / "provenance.json").read_text())["adapter_sha256"]

    wider = lora_model(load_model(base).model, dataclasses.replace(settings, rank=4, alpha=8))
    with pytest.raises(AdapterError, match="rank 2.*rank 4"):
        warm_start(wider, tiny_adapter, base)


def test_a_warm_start_records_every_stage_it_grew_from_and_their_seconds(tmp_path: Path) -> None:
    from kvshard_training.lora import lineage_record, lineage_seconds
    from kvshard_training.merge import Adapter

    shipped = Path(__file__).resolve().parents[2] / "training" / "kvshard_training" / "adapters"
    first = tmp_path / "first"  # a stage trained from zero, its seconds recorded
    shutil.copytree(shipped / "movielens-scorer", first)
    grown = tmp_path / "grown"  # warm-started from it, by a version that kept only the parent's hash
    shutil.copytree(shipped / "movielens-rec", grown)
    started_from = Adapter.read(first)
    provenance = {**json.loads((grown / "provenance.json").read_text()),
                  "init_adapter": {"folder": "first", "sha256": started_from.sha256,
                                   "command": started_from.provenance["command"]}}
    (grown / "provenance.json").write_text(json.dumps(provenance))
    late = Adapter.read(grown)
    chain = lineage_record(grown, late.sha256, late.provenance)
    stages = []
    stage: object = chain
    while isinstance(stage, dict):
        stages.append(stage)
        stage = stage.get("init_adapter")
    assert [s["folder"] for s in stages] == ["grown", "first"] and stages[0]["sha256"] == late.sha256
    assert all(s["command"].startswith("kvshard model finetune ") for s in stages)
    seconds = [float(s["training_seconds"]) for s in stages]
    assert all(t > 0 for t in seconds)  # a stage recorded before seconds were kept is completed from its folder
    assert lineage_seconds(60.0, chain) == pytest.approx(60.0 + sum(seconds))
    (first / "adapter_model.safetensors").write_bytes(b"another adapter")  # the folder was overwritten since
    parent = lineage_record(grown, late.sha256, late.provenance)["init_adapter"]
    assert isinstance(parent, dict) and "training_seconds" not in parent  # never another adapter's seconds
    assert lineage_seconds(60.0, {"folder": "gone", "sha256": "0", "command": ""}) == 60.0  # unknown: never more
