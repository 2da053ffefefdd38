"""The fidelity guard's adapter against a real etcd and a real Prometheus scraping a real exporter of
``kvshard_sidecar_fidelity_checks_total``: spec → blend in etcd (compare-and-swap), counts → a step,
Prometheus down → hold and say so."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server
from traffic import running_prometheus, wait_scraped

from kvshard import blend_policy as bp
from kvshard_local.testing_servers import EtcdServer, PrometheusServer, free_port
from kvshard_operator.guard import FIDELITY_MET, GuardState, guard_shard
from kvshard_operator.settings import Settings

NS = "default"
SETTINGS = Settings(etcd_timeout_seconds=2, prometheus_timeout_seconds=2, fidelity_check_seconds=1)
LOG = logging.getLogger("test_fidelity_guard")
ETCD_TLS_SECRET = "etcd-client-tls"


def etcd_spec(etcd: EtcdServer) -> dict[str, Any]:
    return {"endpoints": [etcd.endpoint], "tls": {"secretRef": {"name": ETCD_TLS_SECRET}}}


def spec(etcd: EtcdServer, prometheus_url: str, **fidelity: Any) -> dict[str, Any]:
    return {
        "model": {"name": "HuggingFaceTB/SmolLM2-135M-Instruct"},
        "catalog": {"builtin": "movielens-100k"},
        "clusters": 4,
        "podSelector": {"matchLabels": {"app": "engine"}},
        "capacityPerPod": "8Gi",
        "etcd": etcd_spec(etcd),
        "prometheus": {"url": prometheus_url},
        "blend": {"method": "tail", "ratioPercent": 15},
        "fidelity": {"targetAgreementPercent": 95, "intervalSeconds": 10, "windowSeconds": 30, "minSamples": 20,
                     "sampleRatePercent": 5, **fidelity},
    }


def secrets(etcd: EtcdServer) -> Any:
    def read(namespace: str, name: str) -> dict[str, bytes]:
        assert (namespace, name) == (NS, ETCD_TLS_SECRET)
        return etcd.tls_secret_data()
    return read


@pytest.fixture(scope="module")
def checks() -> Iterator[tuple[Counter, str]]:
    """A sidecar-shaped exporter: 40 agree + 20 disagree checks of tail at 0.15 for shard ``strict``."""
    registry = CollectorRegistry()
    counter = Counter("kvshard_sidecar_fidelity_checks", "checks", ["cacheshard", "result", "method", "ratio"],
                      registry=registry)
    for result in ("agree", "disagree", "skipped"):
        counter.labels(f"{NS}/strict", result, "tail", "0.15")  # present at 0 before the first check
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    yield counter, f"127.0.0.1:{port}"
    server.shutdown()
    thread.join(timeout=5)


@pytest.fixture(scope="module")
def prometheus(checks: tuple[Counter, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    config = ("global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\nscrape_configs:\n"
              f"  - job_name: sidecar\n    static_configs:\n      - targets: ['{checks[1]}']\n")
    with running_prometheus(config, tmp_path_factory.mktemp("prometheus")) as server:
        wait_scraped(server.url, 3, targets=1)
        yield server


async def tick(etcd: EtcdServer, name: str, url: str, state: GuardState, now: float, **fidelity: Any) -> Any:
    return await guard_shard(namespace=NS, name=name, spec=spec(etcd, url, **fidelity), status={}, generation=1,
                             settings=SETTINGS, state=state, logger=LOG, now=now, read_secret=secrets(etcd))


async def in_force(etcd: EtcdServer, name: str) -> tuple[bp.BlendPolicy | None, int]:
    async with etcd.store() as store:
        return await store.read_blend(NS, name)


def test_below_target_the_ratio_steps_up_once_and_is_published_with_cas(
        etcd: EtcdServer, prometheus: PrometheusServer, checks: tuple[Counter, str]) -> None:
    counter, _ = checks

    async def run() -> None:
        state = GuardState()
        first = await tick(etcd, "strict", prometheus.url, state, now=1000.0)
        assert first.published == bp.BlendPolicy("tail", 0.15, 0.05)
        assert (await in_force(etcd, "strict"))[0] == first.published
        assert first.status["blend"] == {"method": "tail", "ratioPercent": 15, "reason": "Spec"}
        # a (new) spec has measured nothing yet: no agreement left over from a previous spec's ratio
        assert first.status["fidelity"]["samples"] == 0 and "agreementPercent" not in first.status["fidelity"]
        assert [c["reason"] for c in first.status["conditions"] if c["type"] == FIDELITY_MET] == [
            "InsufficientSamples"]
        # not due yet: nothing decided, nothing published
        early = await tick(etcd, "strict", prometheus.url, state, now=1003.0)
        assert early.decision is None and early.published is None
        counter.labels(f"{NS}/strict", "agree", "tail", "0.15").inc(40)
        counter.labels(f"{NS}/strict", "disagree", "tail", "0.15").inc(20)
        await asyncio.sleep(4)  # scraped a few times
        due = await tick(etcd, "strict", prometheus.url, state, now=1011.0)
        assert due.decision is not None and due.decision.reason == "BelowTarget", due.decision
        assert 50 <= due.decision.samples <= 70  # increase() extrapolates a little
        assert due.published is not None and due.published.ratio == 0.2
        policy, version = await in_force(etcd, "strict")
        assert policy is not None and (policy.ratio, policy.reason) == (0.2, "BelowTarget") and version == 2
        assert due.status["fidelity"]["samples"] == due.decision.samples
        met = [c for c in due.status["conditions"] if c["type"] == FIDELITY_MET][0]
        assert (met["status"], met["reason"]) == ("False", "BelowTarget")
        # at 0.2 there are no checks yet: hold, however bad 0.15 looked
        held = await tick(etcd, "strict", prometheus.url, state, now=1022.0)
        assert held.decision is not None and held.decision.reason == "InsufficientSamples"
        assert (await in_force(etcd, "strict"))[0].ratio == 0.2  # type: ignore[union-attr]
        # a restarted operator resumes from the published ratio instead of resetting to the spec's
        resumed = await tick(etcd, "strict", prometheus.url, GuardState(), now=1030.0)
        assert resumed.published is None and resumed.status["blend"]["ratioPercent"] == 20

    asyncio.run(run())


def test_prometheus_down_holds_and_says_so(etcd: EtcdServer) -> None:
    down = f"http://127.0.0.1:{free_port()}"

    async def run() -> None:
        state = GuardState()
        await tick(etcd, "dark", down, state, now=0.0)
        outcome = await tick(etcd, "dark", down, state, now=20.0)
        assert outcome.decision is not None and outcome.decision.reason == "PrometheusUnavailable"
        met = [c for c in outcome.status["conditions"] if c["type"] == FIDELITY_MET][0]
        assert met["status"] == "Unknown" and "unreachable" in met["message"]
        policy, version = await in_force(etcd, "dark")
        assert policy is not None and policy.ratio == 0.15 and version == 1

    asyncio.run(run())


def test_a_spec_change_is_published_and_a_lost_swap_publishes_nothing(etcd: EtcdServer) -> None:
    down = f"http://127.0.0.1:{free_port()}"

    async def run() -> None:
        state = GuardState()
        await tick(etcd, "edit", down, state, now=0.0)
        changed = await tick(etcd, "edit", down, state, now=1.0, sampleRatePercent=10)
        assert changed.published is not None and changed.published.sample_rate == 0.1
        async with etcd.store() as store:
            _, version = await store.read_blend(NS, "edit")
            await store.publish_blend(NS, "edit", bp.BlendPolicy("none", 0.0), expected=version)
            with pytest.raises(Exception, match="no longer at version"):
                await store.publish_blend(NS, "edit", bp.BlendPolicy("tail", 0.3), expected=version)

    asyncio.run(run())
