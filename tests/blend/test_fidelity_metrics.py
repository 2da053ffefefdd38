"""The benchmark's fidelity metrics and settings: small pure functions whose mistakes would mislead."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvshard_bench.fidelity import add_arguments, kendall_tau, kl_divergence, method_settings, schedule, task_metrics


def test_kl_is_zero_for_identical_logits_and_positive_otherwise() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0])
    assert kl_divergence(logits, logits) == pytest.approx(0.0, abs=1e-12)
    assert kl_divergence(logits, logits + 5.0) == pytest.approx(0.0, abs=1e-9)  # shift-invariant
    p = torch.tensor([0.5, 0.25, 0.25])
    q = torch.tensor([0.25, 0.5, 0.25])
    expected = float((p * (p / q).log()).sum())
    assert kl_divergence(p.log(), q.log()) == pytest.approx(expected)


def test_kendall_tau_orders_and_ties() -> None:
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    assert -1.0 <= kendall_tau([1, 1, 2], [1, 2, 2]) <= 1.0


def test_task_metrics_rank_the_target_by_its_label_logit() -> None:
    logits = torch.tensor([0.1, 3.0, 2.0])
    assert task_metrics(logits, 1) == (1.0, 1.0)
    ndcg, hit = task_metrics(logits, 2)
    assert hit == 0.0 and ndcg == pytest.approx(1 / 1.584962500721156)
    assert task_metrics(logits, None) == (0.0, 0.0)


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
