"""The benchmark's fidelity metrics and settings: small pure functions whose mistakes would mislead."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvshard.prompts import RecommendationPrompt, RecommendationRequest
from kvshard.segments import Prompt, Segment, SegmentKind
from kvshard_bench.fidelity import add_arguments, kl_divergence, method_settings, schedule, score
from kvshard_sidecar.engine import BlendResult


def test_kl_is_zero_for_identical_logits_and_positive_otherwise() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0])
    assert kl_divergence(logits, logits) == pytest.approx(0.0, abs=1e-12)
    assert kl_divergence(logits, logits + 5.0) == pytest.approx(0.0, abs=1e-9)  # shift-invariant
    p = torch.tensor([0.5, 0.25, 0.25])
    q = torch.tensor([0.25, 0.5, 0.25])
    expected = float((p * (p / q).log()).sum())
    assert kl_divergence(p.log(), q.log()) == pytest.approx(expected)


def _result(logits: list[float]) -> BlendResult:
    return BlendResult(method="x", logits=torch.tensor(logits), ttft_s=0.0, timings={}, num_tokens=3,
                       exact_prefix_tokens=0, recomputed_tokens=3, token_layers=3, num_layers=1, query_tokens={},
                       hit_tokens={}, computed_tokens={}, selected=torch.arange(3), kv=None)  # type: ignore[arg-type]


def test_agreement_is_on_the_chosen_candidate_not_the_free_first_token() -> None:
    """Token 0 plays "The" (no label); tokens 1-3 are the labels A-C of candidates x, y, z (target y)."""
    request = RecommendationPrompt(RecommendationRequest("u", (), ("x", "y", "z"), target="y"),
                                   Prompt.of([Segment(SegmentKind.FREE, (5, 6, 7))]), ("A", "B", "C"), (1, 2, 3))
    full = _result([3.0, 2.9, 1.0, 0.5])  # free token "The", candidate A
    blended = _result([2.0, 2.5, 1.0, 0.4])  # free token flips to "A"; the ranking A > B > C stays
    got = score(full, blended, request)
    assert (got["top1_agreement"], got["token_top1_agreement"], got["tau"]) == (1.0, 0.0, 1.0)
    assert (got["hr1"], got["hr5"]) == (0.0, 1.0) and got["ndcg10"] == pytest.approx(1 / 1.584962500721156)
    swapped = score(full, _result([3.0, 1.0, 2.9, 0.5]), request)  # same free token, candidate B chosen
    assert (swapped["top1_agreement"], swapped["token_top1_agreement"], swapped["hr1"]) == (0.0, 1.0, 1.0)


def test_gradual_schedule_narrows_to_the_ratio() -> None:
    assert schedule(0.3, 0.15, 2) == (0.3, 0.15)
    assert schedule(0.3, 0.05, 3) == pytest.approx((0.3, 0.175, 0.05))
    assert schedule(0.3, 0.5, 2) == (0.5, 0.5)  # never widens below r
    assert schedule(0.0, 0.15, 2) == ()
    assert schedule(0.3, 0.15, 1) == ()


def test_benchmark_runs_every_method_at_every_ratio() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--ratios", "0.1", "0.3"])
    methods = method_settings(args)
    names = [(name, ratio) for name, ratio, _ in methods]
    assert names[0] == ("none", 0.0)
    for selector in ("boundary", "deviation", "hybrid"):
        assert (selector, 0.1) in names and (selector, 0.3) in names
    for _, ratio, settings in methods:
        settings.validate(num_layers=30)
        assert settings.ratio == ratio
