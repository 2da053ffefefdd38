"""Shadow checks and the blend in force, on real sidecar processes with SmolLM2 and a real etcd: the
sidecar follows the published blend without a restart, shadow-checks sampled requests against a full
prefill off the request path, labels the metrics with the method and ladder ratio, never samples a
per-call override, and sheds checks (``skipped``) when requests keep it busy."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Iterator

import pytest
from sidecar_process import Sidecar, SidecarFactory
from test_follow_placement import metric, wait_for

from kvshard.blend_policy import BlendPolicy
from kvshard_local.testing_servers import EtcdServer, free_port
from kvshard_sidecar.serving.shadow import Budget

NAMESPACE, SHARD = "recs", "guarded"
CANDIDATES = ["50", "172", "181", "7", "1", "100"]


def publish(server: EtcdServer, policy: BlendPolicy) -> None:
    async def run() -> None:
        async with server.store(timeout=3) as store:
            _, version = await store.read_blend(NAMESPACE, SHARD)
            await store.publish_blend(NAMESPACE, SHARD, policy, expected=version)
    asyncio.run(run())


def ask(sidecar: Sidecar, user: str, blend: dict[str, object] | None = None) -> dict[str, object]:
    body: dict[str, object] = {"user_id": user, "history": ["1", "2", "3"], "candidates": CANDIDATES}
    if blend is not None:
        body["blend"] = blend
    status, answer = sidecar.json("POST", "/v1/recommend", body)
    assert status == 200, answer
    return dict(answer)


def checks(sidecar: Sidecar, result: str, ratio: str, method: str = "tail") -> float:
    try:
        return metric(sidecar, "kvshard_sidecar_fidelity_checks_total", result=result, method=method, ratio=ratio)
    except AssertionError:
        return 0.0


@pytest.fixture(scope="module")
def guarded(etcd_server: EtcdServer, start_sidecar: SidecarFactory) -> Iterator[Sidecar]:
    publish(etcd_server, BlendPolicy("tail", 0.15, sample_rate=1.0, reason="Spec"))
    yield start_sidecar("--etcd-endpoints", etcd_server.endpoint, *etcd_server.client_flags(), "--cacheshard",
                        f"{NAMESPACE}/{SHARD}", "--shadow-budget-percent", "100", "--max-queue", "16",
                        name="guarded")


@pytest.mark.slow
@pytest.mark.model
def test_the_blend_in_force_is_followed_and_sampled_requests_are_shadow_checked(
        guarded: Sidecar, etcd_server: EtcdServer) -> None:
    # ready means the published blend is in force: the first request already runs at its ratio
    assert ask(guarded, "1")["blend"] == {"selector": "tail", "ratio": 0.15}
    for user in ("2", "3"):
        ask(guarded, user)
    done = wait_for("3 shadow checks", lambda: checks(guarded, "agree", "0.15") + checks(guarded, "disagree", "0.15")
                    >= 3)
    assert done
    kl = metric(guarded, "kvshard_sidecar_fidelity_kl_count", method="tail", ratio="0.15")
    tau = metric(guarded, "kvshard_sidecar_fidelity_rank_correlation_count", method="tail", ratio="0.15")
    assert kl == tau == checks(guarded, "agree", "0.15") + checks(guarded, "disagree", "0.15")
    assert metric(guarded, "kvshard_sidecar_shadow_seconds_total") > 0
    # a per-call override is answered as asked and never sampled
    before = kl
    override = ask(guarded, "4", {"method": "none"})
    assert override["blend"] == {"selector": "none", "ratio": 0.0}
    assert metric(guarded, "kvshard_sidecar_fidelity_kl_count", method="tail", ratio="0.15") == before
    assert checks(guarded, "agree", "0", "none") + checks(guarded, "disagree", "0", "none") == 0
    # a new ratio applies to the next request, without a restart, and labels the checks with its rung
    publish(etcd_server, BlendPolicy("tail", 0.3, sample_rate=1.0, reason="BelowTarget"))
    wait_for("ratio 0.3 in force", lambda: ask(guarded, "5")["blend"] == {"selector": "tail", "ratio": 0.3})
    wait_for("a check at 0.3", lambda: checks(guarded, "agree", "0.3") + checks(guarded, "disagree", "0.3") >= 1)


@pytest.mark.slow
@pytest.mark.model
def test_shadow_checks_are_shed_first_under_load(guarded: Sidecar, etcd_server: EtcdServer) -> None:
    publish(etcd_server, BlendPolicy("tail", 0.2, sample_rate=1.0, reason="Spec"))
    wait_for("ratio 0.2 in force", lambda: ask(guarded, "6")["blend"] == {"selector": "tail", "ratio": 0.2})
    with concurrent.futures.ThreadPoolExecutor(max_workers=14) as pool:
        answers = list(pool.map(lambda u: ask(guarded, u), [str(u) for u in range(10, 24)]))
    assert len(answers) == 14  # every request answered; the checks waited
    skipped = wait_for("skipped checks", lambda: checks(guarded, "skipped", "0.2"))
    checked = checks(guarded, "agree", "0.2") + checks(guarded, "disagree", "0.2")
    assert skipped >= 1 and checked + skipped <= 15, (skipped, checked)


@pytest.mark.slow
@pytest.mark.model
def test_readiness_waits_for_the_blend_and_gives_up_on_an_unreachable_etcd(start_sidecar: SidecarFactory) -> None:
    silent = f"127.0.0.1:{free_port()}"  # nothing listens: the follower's first read never completes
    pod = start_sidecar("--etcd-endpoints", silent, "--cacheshard", f"{NAMESPACE}/unreachable",
                        "--blend-wait-seconds", "6", name="unreachable", wait_ready=False)
    answers: list[tuple[int, str]] = []

    def readiness() -> bool:
        try:
            status, body = pod.json("GET", "/readyz")
        except OSError:  # not listening yet
            return False
        answers.append((status, body.get("error", {}).get("field", "") if status != 200 else "ready"))
        return status == 200

    assert wait_for("ready after the blend wait", readiness, timeout=180)
    assert (503, "blend") in answers, answers  # the model was loaded, the blend not known
    assert "no blend settings read from etcd within 6 s" in pod.process.log_path.read_text()
    # ready with the flags' settings
    assert ask(pod, "1")["blend"] == {"selector": "tail", "ratio": 0.3}


def test_the_shadow_budget_fills_at_its_share_and_caps_at_the_burst() -> None:
    now = [0.0]
    budget = Budget(0.1, burst=2.0, clock=lambda: now[0])
    assert not budget.allows(1.0)
    now[0] = 10.0
    assert budget.allows(1.0)
    budget.spend(1.2)
    assert not budget.allows(1.0)
    now[0] = 1000.0
    assert budget.allows(2.0) and not Budget(0.0).allows(0.0)
