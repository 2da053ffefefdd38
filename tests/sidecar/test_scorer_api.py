"""A sidecar serving a shipped scorer (``--model scorer``, the isolated one, and ``--model late``): it ranks every
candidate, each scored alone, the same ranking under every candidate order; it refuses to generate; a blended
answer is full prefill's where the scorer is served exactly from cache (``late``); and the shadow checks
measure that in production."""

from __future__ import annotations

from typing import Any

import pytest
from sidecar_process import Sidecar, SidecarFactory

from kvshard.models import MERGED_NAMES, model_retrieval_weight, model_scorer, resolve_model

pytestmark = [pytest.mark.slow, pytest.mark.model]

REQUEST = {"user_id": "1", "history": ["1", "2", "3", "4", "5", "6"], "candidates": ["50", "172", "181", "7", "98"]}


@pytest.fixture(scope="module", params=["scorer", "late"])
def model(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def sidecar(start_sidecar: SidecarFactory, model: str) -> Sidecar:
    return start_sidecar("--model", model, "--shadow-sample-rate", "1", "--shadow-budget-percent", "100",
                         name=model)


def _scores(body: dict[str, Any]) -> dict[str, float]:
    return {r["candidate"]: r["logprob"] for r in body["ranking"]}


def test_the_scorer_ranks_every_candidate_the_same_under_every_order(sidecar: Sidecar, model: str) -> None:
    status, body = sidecar.json("POST", "/v1/recommend", REQUEST)
    assert status == 200, body
    assert body["model"] == MERGED_NAMES[model] and body["mode"] == "rank"
    assert sorted(_scores(body)) == sorted(REQUEST["candidates"])
    status, reversed_body = sidecar.json("POST", "/v1/recommend",
                                         {**REQUEST, "candidates": REQUEST["candidates"][::-1]})
    assert status == 200, reversed_body
    forward, backward = _scores(body), _scores(reversed_body)
    assert all(abs(forward[c] - backward[c]) < 1e-3 for c in forward)
    assert reversed_body["candidate"] == body["candidate"]


def test_the_blended_ranking_is_full_prefills_where_the_scorer_is_served_exactly(sidecar: Sidecar, model: str
                                                                                  ) -> None:
    _, blended = sidecar.json("POST", "/v1/recommend", REQUEST)
    status, full = sidecar.json("POST", "/v1/recommend", {**REQUEST, "blend": {"method": "full"}})
    assert status == 200, full
    assert full["tokens"]["recompute_ratio"] > blended["tokens"]["recompute_ratio"]
    if model_scorer(resolve_model(model)) == "late":  # items read only themselves: exact from cache
        assert blended["tokens"]["recompute_ratio"] < 0.3
        assert all(abs(_scores(blended)[c] - _scores(full)[c]) < 1e-3 for c in REQUEST["candidates"])


def test_a_scorer_does_not_generate(sidecar: Sidecar) -> None:
    status, body = sidecar.json("POST", "/v1/recommend", {**REQUEST, "mode": "generate", "max_tokens": 2})
    assert (status, body["error"]["field"]) == (422, "mode"), body
    assert "ranks the candidates" in body["error"]["message"]
    assert sidecar.json("POST", "/v1/recommend", REQUEST)[0] == 200


def test_shadow_checks_compare_the_scores_with_full_prefill(sidecar: Sidecar, model: str) -> None:
    import time

    sidecar.json("POST", "/v1/recommend", REQUEST)
    deadline = time.monotonic() + 60
    checked = ""
    while time.monotonic() < deadline:
        checked = "\n".join(line for line in sidecar.metrics().splitlines()
                            if line.startswith("kvshard_sidecar_fidelity_checks_total{")
                            and 'result="skipped"' not in line and not line.endswith(" 0.0"))
        if checked:
            break
        time.sleep(0.5)
    assert checked, "no shadow check ran"
    if model_scorer(resolve_model(model)) == "late":
        assert 'result="agree"' in checked and 'result="disagree"' not in checked


def test_with_its_vllm_gone_a_scorer_sidecar_answers_503_and_keeps_serving(start_sidecar: SidecarFactory) -> None:
    """A sidecar whose vLLM computes (``--engine vllm``) loads only the tokenizer, so it is ready without vLLM;
    while vLLM is down (not started yet, restarting) a request gets a JSON 503 naming vLLM, not a 500."""
    from kvshard_local.testing_servers import free_port

    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    sidecar = start_sidecar("--model", "late", "--engine", "vllm", "--vllm-url", gone, name="vllm-gone")
    for _ in range(2):
        status, body = sidecar.json("POST", "/v1/recommend", REQUEST)
        assert status == 503, body
        message = body["error"]["message"]
        assert body["error"]["field"] == "engine" and gone in message and "did not answer" in message
    assert sidecar.json("GET", "/healthz")[0] == 200


def test_the_retrieval_stages_scores_fuse_into_the_ranking(sidecar: Sidecar, model: str) -> None:
    _, alone = sidecar.json("POST", "/v1/recommend", REQUEST)
    alone_scores = _scores(alone)
    worst = min(alone_scores, key=alone_scores.__getitem__)
    stage = [10.0 if c == worst else 0.0 for c in REQUEST["candidates"]]  # the stage is sure of the model's last
    status, fused = sidecar.json("POST", "/v1/recommend", {**REQUEST, "retrieval_scores": stage,
                                                           "retrieval_weight": 10})
    assert status == 200, fused
    assert fused["candidate"] == worst and _scores(fused) == alone_scores  # reordered, the model's numbers kept
    assert all("fused_score" in r for r in fused["ranking"]) and fused["retrieval_weight"] == 10
    assert "retrieval_weight" not in alone
    status, ignored = sidecar.json("POST", "/v1/recommend", {**REQUEST, "retrieval_scores": stage,
                                                             "retrieval_weight": 0})
    assert status == 200 and ignored["candidate"] == alone["candidate"]
    status, default = sidecar.json("POST", "/v1/recommend", {**REQUEST, "retrieval_scores": stage})
    assert status == 200 and default["retrieval_weight"] == model_retrieval_weight(resolve_model(model))
    status, error = sidecar.json("POST", "/v1/recommend", {**REQUEST, "retrieval_scores": stage[:-1]})
    assert status == 400 and error["error"]["field"] == "retrieval_scores", error
