"""Learned placement has two halves that must tick together: the routers publish their co-request
sketch every ``KVSHARD_ROUTER_COREQUEST_INTERVAL_SECONDS`` and the operator co-locates once per
``spec.colocation.intervalSeconds`` (a router's report is leased for a few of *its* intervals, so a
router publishing far less often than the operator reads leaves intervals with nothing to learn from).
The chart sets both from ``colocation.*``; these tests read both back from one render, through the
router's own settings loader and the operator's own reading of the spec.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from chart_helpers import HelmError, Manifest, container, find, pod_spec, render, resolved_env


def _router_settings(objects: list[Manifest]) -> Any:
    from kvshard import settings as settings_lib
    from kvshard_router.settings import ENV_PREFIX, RouterSettings

    environ = resolved_env(container(pod_spec(objects, "Deployment", "-router"), "router"), field_refs={})
    return settings_lib.from_sources(RouterSettings, None, ENV_PREFIX, environ)


@pytest.mark.parametrize("interval", [60, 900])
def test_one_value_sets_the_routers_publish_interval_and_the_operators(helm_bin: Path, interval: int) -> None:
    from kvshard_operator import learned, validation

    objects = render(helm_bin, sets=["exampleCacheShard.enabled=true", "colocation.enabled=true",
                                     f"colocation.intervalSeconds={interval}",
                                     "colocation.maxMovesPerInterval=4", "colocation.maxLoadPercent=125"])
    shard = find(objects, "CacheShard")
    spec = shard["spec"]["colocation"]
    router = _router_settings(objects)
    assert spec["enabled"] is True
    assert router.corequest_interval_seconds == spec["intervalSeconds"] == interval
    operator = learned.settings_of(spec)
    assert (operator.max_moves, operator.max_load) == (4, 1.25)
    assert validation.violations(shard) == [], "the CRD accepts what the chart renders"


def test_off_the_routers_count_nothing_and_the_example_does_not_colocate(helm_bin: Path) -> None:
    objects = render(helm_bin, sets=["exampleCacheShard.enabled=true", "colocation.intervalSeconds=60"])
    assert "colocation" not in find(objects, "CacheShard")["spec"]
    assert _router_settings(objects).corequest_interval_seconds == 0


def test_the_router_interval_cannot_be_set_apart_from_the_operators(helm_bin: Path) -> None:
    with pytest.raises(HelmError, match="colocation.intervalSeconds"):
        render(helm_bin, sets=["colocation.enabled=true",
                               "router.extraEnv.KVSHARD_ROUTER_COREQUEST_INTERVAL_SECONDS=thirty"])


@pytest.mark.parametrize("bad", ["colocation.intervalSeconds=5", "colocation.maxLoadPercent=90",
                                 "colocation.maxMovesPerInterval=-1", "colocation.every=30"])
def test_the_schema_holds_the_crds_bounds(helm_bin: Path, bad: str) -> None:
    with pytest.raises(HelmError, match="colocation"):
        render(helm_bin, sets=[bad])


def test_the_router_needs_no_new_access_for_it(helm_bin: Path) -> None:
    """The sketch goes to etcd, which the router already reaches: no API token, and its egress is
    the engine pods, etcd and DNS whether colocation is on or off."""
    on = render(helm_bin, sets=["colocation.enabled=true"])
    off = render(helm_bin)
    assert find(on, "NetworkPolicy", "-router")["spec"] == find(off, "NetworkPolicy", "-router")["spec"]
    assert pod_spec(on, "Deployment", "-router")["automountServiceAccountToken"] is False
    assert not [o for o in on if o["kind"] in ("Role", "RoleBinding") and o["metadata"]["name"].endswith("-router")]
