"""The blend engine serves the isolated scorers: its full prefill is the scorer's own pass, r = 1 reproduces
it from cached blocks, any ratio keeps every candidate blind to the others, blocks are reused — and the
late-interaction scorer is served exactly from item blocks prefilled alone, recomputing only the labels."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvshard.prompt_template import PromptTemplate
from kvshard.prompts import PromptBuilder, RecommendationRequest
from kvshard_sidecar.engine import BlendEngine, BlendSettings, MemoryBlockSource
from kvshard_sidecar.engine.isolated_scorer import IsolatedInputs, Readout, isolated_scores, readout_id, scoring_prompt
from kvshard_sidecar.engine.methods import method_settings

pytestmark = pytest.mark.model

AFTER = PromptTemplate(label_position="after")


@pytest.fixture(scope="module")
def engine(smollm2: Any) -> BlendEngine:
    return BlendEngine(smollm2.model, smollm2.identity, MemoryBlockSource())


def _built(smollm2: Any, movielens: Any, candidates: list[str] | None = None) -> Any:
    user, history = next((u, h) for u, h in sorted(movielens.histories.items()) if len(h) > 12)
    unseen = [item for item in sorted(movielens.items) if item not in set(history)][:5]
    request = RecommendationRequest(user, list(history[:6]), candidates or [history[6], *unseen])
    return PromptBuilder(smollm2.tokenizer, movielens, template=AFTER).build(request)


def test_full_prefill_scores_are_the_isolated_scorers(engine: BlendEngine, smollm2: Any, movielens: Any) -> None:
    built = _built(smollm2, movielens)
    readout = Readout(readout_id(smollm2.tokenizer))
    with torch.inference_mode():
        expected = isolated_scores(smollm2.model, IsolatedInputs.of(built), readout.token)
    result = engine.full(scoring_prompt(built), readout=readout)
    assert result.scores is not None and result.scores.shape == (6,)
    torch.testing.assert_close(result.scores, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["full", "cacheblend"])
def test_ratio_one_from_cached_blocks_reproduces_full(engine: BlendEngine, smollm2: Any, movielens: Any,
                                                      method: str) -> None:
    prompt = scoring_prompt(_built(smollm2, movielens))
    readout = Readout(readout_id(smollm2.tokenizer))
    full = engine.full(prompt, readout=readout)
    blended = engine.blend(prompt, method_settings(method, 1.0), readout=readout)
    assert blended.scores is not None and full.scores is not None
    torch.testing.assert_close(blended.scores, full.scores, atol=1e-4, rtol=1e-4)
    again = engine.blend(prompt, method_settings(method, 1.0), readout=readout)
    assert again.computed_tokens == {} and again.hit_tokens["item"]  # the second request hits every block


@pytest.mark.parametrize("method", ["none", "cacheblend", "tail"])
def test_a_blended_score_does_not_depend_on_the_other_candidates(engine: BlendEngine, smollm2: Any,
                                                                 movielens: Any, method: str) -> None:
    """Reversing the candidates leaves every candidate's blended score as it was at r = 0.3: no candidate
    reads another, and what is recomputed does not depend on the order."""
    built = _built(smollm2, movielens)
    readout = Readout(readout_id(smollm2.tokenizer))
    candidates = list(built.request.candidates)
    settings = method_settings(method, 0.3) if method != "tail" else BlendSettings(selector="tail", ratio=0.3)
    forward = engine.blend(scoring_prompt(built), settings, readout=readout).scores
    reverse = engine.blend(scoring_prompt(_built(smollm2, movielens, candidates[::-1])), settings,
                           readout=readout).scores
    assert forward is not None and reverse is not None
    # every candidate's rows are its own block, recomputed by content (cacheblend) or by its own length
    # (tail: each item's last rows, not the last candidates') alone
    torch.testing.assert_close(forward, reverse.flip(0), atol=1e-4, rtol=1e-4)


def test_a_prompt_that_is_not_a_scorer_prompt_is_refused(engine: BlendEngine, smollm2: Any, movielens: Any) -> None:
    built = _built(smollm2, movielens)
    with pytest.raises(ValueError, match="labelPosition: after"):
        engine.blend(built.prompt, readout=Readout(readout_id(smollm2.tokenizer)))  # the question is still there


@pytest.mark.parametrize(("method", "interaction"), [("none", 0), ("tail", 0), ("deviation", 0), ("none", 3),
                                                     ("tail", 3)])
def test_the_late_scorer_is_served_exactly_from_item_blocks_prefilled_alone(
        engine: BlendEngine, smollm2: Any, movielens: Any, method: str, interaction: int) -> None:
    """Its items read only themselves but for their last ``interaction`` tokens: the history is an exact
    prefix, item blocks prefilled alone are what a full prefill computes for the other item tokens, so
    every ratio — even none: the labels and the interaction tokens — equals full prefill."""
    built = _built(smollm2, movielens)
    late = Readout(readout_id(smollm2.tokenizer), interaction=interaction)
    inputs = IsolatedInputs.of(built, interaction)
    with torch.inference_mode():
        expected = isolated_scores(smollm2.model, inputs, late.token)
        reading_everything = isolated_scores(smollm2.model, IsolatedInputs.of(built), late.token)
    assert not torch.allclose(expected, reading_everything, atol=1e-3)  # the mask matters
    full = engine.full(scoring_prompt(built), readout=late)
    assert full.scores is not None
    torch.testing.assert_close(full.scores, expected, atol=1e-4, rtol=1e-4)
    settings = method_settings(method, 0.0 if method == "none" else 0.3, BlendSettings(prefill_context="history"))
    blended = engine.blend(scoring_prompt(built), settings, readout=late)
    assert blended.scores is not None and blended.exact_prefix_tokens > len(built.prompt.segments[0])
    torch.testing.assert_close(blended.scores, full.scores, atol=1e-4, rtol=1e-4)
    if method == "none":
        recomputed = set(blended.selected.tolist())
        assert set(inputs.readers()) <= recomputed and len(inputs.readers()) == interaction * len(inputs.blocks)
        assert blended.recomputed_tokens <= len(inputs.readers()) + 0.25 * blended.num_tokens  # + header, labels
