"""The HPA's replica rule and behaviour as the local autoscaler applies them (kvshard.autoscaling)."""

from __future__ import annotations

import pytest

from kvshard.autoscaling import Autoscaler, DirectionRule, ScalingRules, pressure_query, raw_recommendation


def rules(*, up_window: float = 0, up_pods: int = 1, up_period: float = 60, down_window: float = 300,
          down_pods: int = 1, down_period: float = 60, lo: int = 2, hi: int = 6) -> ScalingRules:
    return ScalingRules(lo, hi, 1.0, "1m", DirectionRule(up_window, up_pods, up_period),
                        DirectionRule(down_window, down_pods, down_period))


def test_replicas_are_the_sum_over_the_target_with_the_hpa_tolerance() -> None:
    assert raw_recommendation(5.0, 2, 1.0) == 5
    assert raw_recommendation(2.15, 2, 1.0) == 2  # within 10 %: no change
    assert raw_recommendation(2.5, 2, 1.0) == 3
    assert raw_recommendation(0.0, 3, 0.8) == 0


def test_scale_up_is_immediate_but_rate_limited_to_one_pod_per_period() -> None:
    scaler = Autoscaler(rules())
    assert scaler.decide(0.0, 2, 10.0) == 3
    assert scaler.decide(10.0, 3, 10.0) == 3  # one pod already added within the 60 s period
    assert scaler.decide(61.0, 3, 10.0) == 4


def test_scale_down_waits_for_the_whole_window_of_lower_recommendations() -> None:
    scaler = Autoscaler(rules(down_window=30, down_period=30))
    assert scaler.decide(0.0, 4, 4.0) == 4
    assert scaler.decide(10.0, 4, 0.0) == 4  # the window still holds the recommendation 4
    assert scaler.decide(29.0, 4, 0.0) == 4
    assert scaler.decide(41.0, 4, 0.0) == 3  # 4 left the window; one pod per period
    assert scaler.decide(50.0, 3, 0.0) == 3
    assert scaler.decide(72.0, 3, 0.0) == 2  # never below min


def test_bounds_and_missing_data_keep_the_count_inside_min_max() -> None:
    scaler = Autoscaler(rules(up_pods=10))
    assert scaler.decide(0.0, 5, 100.0) == 6
    assert scaler.decide(1.0, 1, None) == 2
    assert scaler.decide(2.0, 4, None) == 4


def test_invalid_rules_and_windows_are_refused() -> None:
    with pytest.raises(ValueError):
        rules(lo=3, hi=2)
    with pytest.raises(ValueError, match="duration"):
        pressure_query("ns", "engine", "1 minute")


def test_query_selects_the_statefulsets_pods_of_the_namespace() -> None:
    assert pressure_query("recommend", "kvs-kvshard-engine", "1m") == (
        'sum(avg_over_time(kvshard_sidecar_pressure{namespace="recommend",pod=~"kvs-kvshard-engine-[0-9]+"}[1m]))')
