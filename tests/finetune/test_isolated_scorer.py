"""The isolated scorer: each candidate scored from the prefix and its own item alone, so order cannot matter;
`kvshard model finetune --scorer isolated|late` trains it, the merge records it, the benchmarks and the
sidecar rank with it."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from kvshard.models import model_scorer
from kvshard.prompt_template import PromptTemplate
from kvshard.prompts import PromptBuilder, RecommendationRequest, candidate_orders
from kvshard.settings import SettingsError
from kvshard_sidecar.engine.isolated_scorer import IsolatedInputs, isolated_scores, readout_id
from kvshard_sidecar.vllm.scorer import candidate_rows
from kvshard_training.settings import FinetuneSettings

AFTER = PromptTemplate(label_position="after")


def _request(movielens: Any, candidates: int = 6) -> RecommendationRequest:
    user, history = next((u, h) for u, h in sorted(movielens.histories.items()) if len(h) > 12)
    unseen = [item for item in sorted(movielens.items) if item not in set(history)][:candidates - 1]
    return RecommendationRequest(user, list(history[:5]), [history[5], *unseen])


@pytest.mark.model
def test_every_item_scores_the_same_under_every_candidate_order(smollm2: Any, movielens: Any) -> None:
    builder = PromptBuilder(smollm2.tokenizer, movielens, template=AFTER)
    readout = readout_id(smollm2.tokenizer)
    by_item: dict[str, list[float]] = {}
    with torch.inference_mode():
        for order in candidate_orders(_request(movielens), 3, random.Random(0)):
            built = builder.build(order)
            for item, score in zip(order.candidates, isolated_scores(smollm2.model, IsolatedInputs.of(built),
                                                                     readout).tolist(), strict=True):
                by_item.setdefault(item, []).append(score)
    assert len(by_item) == 6
    for scores in by_item.values():
        assert max(scores) - min(scores) < 1e-4, scores


@pytest.mark.model
def test_a_score_is_log_p_yes_of_a_causal_prompt_of_the_prefix_and_that_item_alone(smollm2: Any,
                                                                                   movielens: Any) -> None:
    """The block-masked pass equals K plain causal prompts ``prefix + item + " ["`` — what vLLM or a
    cache of item blocks behind a history block would compute."""
    built = PromptBuilder(smollm2.tokenizer, movielens, template=AFTER).build(_request(movielens))
    inputs = IsolatedInputs.of(built)
    readout = readout_id(smollm2.tokenizer)
    with torch.inference_mode():
        scores = isolated_scores(smollm2.model, inputs, readout)
        for rows, score in zip(candidate_rows(inputs), scores.tolist(), strict=True):  # what the sidecar asks vLLM
            alone = [inputs.token_ids[row] for row in rows]
            logits = smollm2.model(input_ids=torch.tensor([alone])).logits[0, -1]
            assert abs(float(torch.log_softmax(logits.float(), -1)[readout]) - score) < 1e-4


@pytest.mark.model
def test_the_isolated_scorer_needs_each_label_after_its_item(smollm2: Any, movielens: Any) -> None:
    built = PromptBuilder(smollm2.tokenizer, movielens).build(_request(movielens))  # the default: "A. <item>"
    with pytest.raises(ValueError, match="labelPosition: after"):
        IsolatedInputs.of(built)


@pytest.mark.parametrize("wrong", [{"label_position": "before"}, {"consistency": 1.0}, {"pointwise": 1.0}])
@pytest.mark.parametrize("scorer", ["isolated", "late"])
def test_finetune_refuses_what_the_isolated_scorer_cannot_train(wrong: dict[str, Any], scorer: str) -> None:
    with pytest.raises(SettingsError, match=f"--scorer {scorer}"):
        FinetuneSettings(**{"scorer": scorer, **wrong}).validate()
    with pytest.raises(SettingsError, match="--scorer must be one of"):
        FinetuneSettings(scorer="letters").validate()


@pytest.fixture(scope="module", params=["isolated", "late"])
def tiny_scorer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two steps of `kvshard model finetune --scorer isolated|late` on a tiny split, merged."""
    from kvshard.cli import main
    from kvshard_sidecar.engine.model import default_model_path
    from kvshard_training.merge import merge_adapter

    scorer = str(request.param)
    out = tmp_path_factory.mktemp(f"{scorer}-adapter")
    settings = FinetuneSettings(out=out, history=3, candidates=4, steps=2, accumulation=1, users=5, val_users=2,
                                rank=2, alpha=4, layers=2, targets=("q_proj", "v_proj"), warmup=1, minutes=5.0,
                                scorer=scorer)
    assert main(settings.command().split()[1:]) == 0
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["settings"]["scorer"] == scorer and f"--scorer {scorer}" in provenance["command"]
    assert provenance["evaluation"]["validation"]["position_consistency"] == 1.0
    return merge_adapter(default_model_path(), out, tmp_path_factory.mktemp("merged") / "Scorer", "Scorer")


@pytest.mark.model
def test_the_merge_records_the_scorer_and_the_bench_ranks_with_it(tiny_scorer: Path, tmp_path: Path) -> None:
    from kvshard.cli import build_parser
    from kvshard_bench.recommender import run
    from kvshard_sidecar.engine.model import default_model_path

    scorer = model_scorer(tiny_scorer)
    assert scorer in ("isolated", "late") and model_scorer(default_model_path()) == "answer"
    argv = ["bench", "recommender", "--models", str(tiny_scorer), "--users", "3", "--history", "3",
            "--candidates", "4", "--permutations", "3"]
    row, fused = run(build_parser(argv).parse_args(argv))
    assert row["scorer"] == scorer and row["position_consistency"] == 1.0
    assert fused["fused_with_retrieval"] and fused["position_consistency"] == 1.0  # an order-free stage, too


@pytest.mark.model
def test_the_sidecar_serves_a_scorer_in_rank_mode(tiny_scorer: Path, tmp_path: Path) -> None:
    from kvshard_sidecar.serving.calls import RecommendCall
    from kvshard_sidecar.serving.service import SidecarService
    from kvshard_sidecar.settings import SidecarSettings

    service = SidecarService(SidecarSettings(model=str(tiny_scorer), disk_dir=tmp_path / "blocks"))
    service.load()
    call = RecommendCall(user_id="1", history=("1", "2", "3"), candidates=("50", "172", "181", "7"),
                         blend=service.blend_defaults)
    answer = service.recommend(call)
    assert answer["mode"] == "rank" and sorted(r["candidate"] for r in answer["ranking"]) == sorted(call.candidates)
    expected = "history" if model_scorer(tiny_scorer) == "late" else "system"
    assert service.blend_defaults.prefill_context == expected


@pytest.mark.model
def test_the_fidelity_bench_measures_a_scorer_against_its_full_prefill(tiny_scorer: Path) -> None:
    from kvshard.cli import build_parser
    from kvshard_bench.fidelity import run

    late = model_scorer(tiny_scorer) == "late"
    argv = ["bench", "fidelity", "--model", str(tiny_scorer), "--users", "2", "--history", "4", "--candidates", "4",
            "--methods", "none", "--ratios", "0.1", *(["--prefill-context", "history"] if late else [])]
    rows = {row["method"]: row for row in run(build_parser(argv).parse_args(argv))}
    assert rows["full"]["top1_agreement"] == 1.0 and rows["prefix"]["label_kl"] < 1e-6
    if late:  # items read only themselves: labels recomputed over exact blocks is full prefill
        assert rows["none"]["top1_agreement"] == 1.0 and rows["none"]["label_kl"] < 1e-6


@pytest.mark.model
def test_the_fidelity_bench_says_which_modes_a_scorer_cannot_take(tiny_scorer: Path) -> None:
    from kvshard.cli import build_parser
    from kvshard_bench.fidelity import run

    for mode in (["--attribution"], ["--methods", "tail+ape"]):
        argv = ["bench", "fidelity", "--model", str(tiny_scorer), "--users", "1", "--history", "4", "--candidates",
                "4", *mode]
        with pytest.raises(SystemExit, match="--model finetuned"):
            run(build_parser(argv).parse_args(argv))
