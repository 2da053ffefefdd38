"""The sidecar HTTP API against a real ``kvshard sidecar serve`` process with SmolLM2."""

from __future__ import annotations

import concurrent.futures
import math
import re
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sidecar_process import PEER_TOKEN, Sidecar, SidecarFactory

from kvshard.models import FINETUNED_NAME
from kvshard_sidecar.blockstore import decode_block

pytestmark = [pytest.mark.slow, pytest.mark.model]

REQUEST = {"user_id": "1", "history": ["1", "2", "3", "4"], "candidates": ["50", "172", "181", "7"]}
AUTH = {"Authorization": f"Bearer {PEER_TOKEN}"}


@pytest.fixture(scope="module")
def sidecar(start_sidecar: SidecarFactory) -> Sidecar:
    # the recommender that answers with a label: it also generates (the scorer only ranks: test_scorer_api)
    return start_sidecar("--model", "finetuned", "--max-concurrency", "1", "--max-queue", "0",
                         "--max-prompt-tokens", "2048", name="api")


def test_health_and_readiness(sidecar: Sidecar) -> None:
    assert sidecar.json("GET", "/healthz") == (200, {"status": "ok"})
    status, body = sidecar.json("GET", "/readyz")
    assert status == 200 and body["model"] == FINETUNED_NAME


def test_recommend_ranks_every_candidate_and_names_the_best(sidecar: Sidecar) -> None:
    status, body = sidecar.json("POST", "/v1/recommend", REQUEST)
    assert status == 200, body
    assert body["mode"] == "rank" and body["engine"] == "embedded"
    ranking = body["ranking"]
    assert sorted(r["candidate"] for r in ranking) == sorted(REQUEST["candidates"])
    assert [r["label"] for r in sorted(ranking, key=lambda r: REQUEST["candidates"].index(r["candidate"]))] == \
        ["A", "B", "C", "D"]
    logprobs = [r["logprob"] for r in ranking]
    assert logprobs == sorted(logprobs, reverse=True) and all(lp <= 0 for lp in logprobs)
    assert abs(sum(math.exp(lp) for lp in logprobs) - 1) < 1e-4  # a distribution over the candidates
    assert (body["candidate"], body["label"]) == (ranking[0]["candidate"], ranking[0]["label"])
    assert body["timings"]["ttft_ms"] > 0


def test_top_k_limits_the_ranking_to_the_best(sidecar: Sidecar) -> None:
    everything = sidecar.json("POST", "/v1/recommend", REQUEST)[1]["ranking"]
    status, body = sidecar.json("POST", "/v1/recommend", {**REQUEST, "top_k": 2})
    assert status == 200, body
    assert [r["candidate"] for r in body["ranking"]] == [r["candidate"] for r in everything[:2]]


def test_generate_mode_decodes_freely(sidecar: Sidecar) -> None:
    status, body = sidecar.json("POST", "/v1/recommend",
                                {**REQUEST, "mode": "generate", "max_tokens": 2, "logprobs": 3})
    assert status == 200, body
    assert body["mode"] == "generate" and body["text"] and "ranking" not in body
    assert body["candidate"] is None or body["candidate"] in REQUEST["candidates"]
    assert len(body["logprobs"]) == 3
    assert body["timings"]["ttft_ms"] > 0
    assert body["tokens"]["prompt"] > 0 and 0 < body["tokens"]["recompute_ratio"] <= 1
    assert set(body["tokens"]["query"]) >= {"system", "history", "item", "instruction"}


def test_a_repeated_request_is_served_from_memory(sidecar: Sidecar) -> None:
    sidecar.json("POST", "/v1/recommend", REQUEST)
    status, body = sidecar.json("POST", "/v1/recommend", REQUEST)
    assert status == 200
    hits = body["tokens"]["hit"]
    assert hits["item"]["memory"] == body["tokens"]["query"]["item"]
    assert hits["history"]["memory"] == body["tokens"]["query"]["history"]
    assert body["tokens"]["computed"] == {}


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        ({**REQUEST, "candidates": ["1", "no-such-item"]}, 422, "candidates[1]"),
        ({**REQUEST, "candidates": []}, 400, "candidates"),
        ({**REQUEST, "candidates": ["50", "50"]}, 400, "candidates[1]"),
        ({**REQUEST, "candidates": [str(i) for i in range(1, 200)]}, 400, "candidates"),
        ({**REQUEST, "max_tokens": "three"}, 400, "max_tokens"),
        ({**REQUEST, "max_tokens": 4}, 400, "max_tokens"),  # rank mode reads one position
        ({**REQUEST, "mode": "beam"}, 400, "mode"),
        ({**REQUEST, "top_k": 0}, 400, "top_k"),
        ({**REQUEST, "mode": "generate", "top_k": 2}, 400, "top_k"),
        ({**REQUEST, "blend": {"selector": "deviation", "check_layers": [1, 30]}}, 400, "blend.check_layers"),
        ({**REQUEST, "blend": {"selector": "magic"}}, 400, "blend.selector"),
        ({"candidates": ["1"]}, 400, "user_id"),
        ({**REQUEST, "history": [str(1 + i % 1600) for i in range(150)]}, 413, "history"),
    ],
)
def test_bad_requests_get_a_4xx_naming_the_field(sidecar: Sidecar, body: Any, status: int, field: str) -> None:
    got, payload = sidecar.json("POST", "/v1/recommend", body)
    assert (got, payload["error"]["field"]) == (status, field), payload
    assert sidecar.json("GET", "/healthz")[0] == 200


def test_malformed_bodies_are_400_or_415(sidecar: Sidecar) -> None:
    assert sidecar.call("POST", "/v1/recommend", raw=b"{not json")[0] == 400
    assert sidecar.call("POST", "/v1/recommend", raw=b'{"a":1}', headers={"Content-Type": "text/plain"})[0] == 415
    assert sidecar.call("POST", "/v1/recommend", raw=b"x" * (2 << 20))[0] == 413
    status, deep = sidecar.json("POST", "/v1/recommend", raw=b"[" * 100_000)
    assert (status, deep["error"]["message"]) == (400, "JSON nested too deeply")
    assert sidecar.json("POST", "/v1/recommend", REQUEST)[0] == 200


def test_over_capacity_is_429_with_retry_after(sidecar: Sidecar) -> None:
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: sidecar.call("POST", "/v1/recommend", REQUEST), range(4)))
    statuses = sorted(r[0] for r in results)
    assert 200 in statuses and 429 in statuses
    assert all(r[1].get("Retry-After") for r in results if r[0] == 429)


def test_block_fetch_needs_the_peer_token(sidecar: Sidecar) -> None:
    key = "0" * 64
    assert sidecar.call("GET", f"/v1/blocks/{key}")[0] == 401
    assert sidecar.call("GET", f"/v1/blocks/{key}", headers={"Authorization": "Bearer wrong"})[0] == 401
    assert sidecar.call("GET", f"/v1/blocks/{key}", headers=AUTH)[0] == 404
    assert sidecar.call("GET", "/v1/blocks/not-a-key", headers=AUTH)[0] == 400


def test_a_stored_block_is_served_to_peers_as_checked_bytes(sidecar: Sidecar, tmp_path: Any) -> None:
    sidecar.json("POST", "/v1/recommend", REQUEST)
    stored = sorted(p.stem for p in (sidecar.process.log_path.parent / "blocks").rglob("*.safetensors"))
    assert stored
    status, headers, data = sidecar.call("GET", f"/v1/blocks/{stored[0]}", headers=AUTH)
    assert status == 200 and int(headers["Content-Length"]) == len(data)
    block = decode_block(stored[0], data)
    assert block.num_layers == 30
    head = sidecar.call("HEAD", f"/v1/blocks/{stored[0]}", headers=AUTH)
    assert head[0] == 200 and head[2] == b""


def test_prefill_warms_blocks_in_the_background(sidecar: Sidecar) -> None:
    status, body = sidecar.json("POST", "/v1/blocks/prefill", {"items": ["300", "301", "302"], "users": ["5"]})
    assert status == 202 and body["queued_items"] == 3 and body["queued_users"] == 1
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = sidecar.metrics()
        done = re.search(r"^kvshard_sidecar_prefill_blocks_total\{[^}]*\} (\S+)", text, re.M)
        if done and float(done.group(1)) >= 4:
            break
        time.sleep(0.5)
    else:
        pytest.fail("prefill did not finish")
    assert re.search(r'^kvshard_sidecar_prefill_pending_blocks\{[^}]*\} 0\.0', sidecar.metrics(), re.M)
    status, body = sidecar.json("POST", "/v1/recommend",
                                {"user_id": "5", "history": [], "candidates": ["300", "301", "302"]})
    assert status == 200 and body["tokens"]["hit"]["item"]["memory"] == body["tokens"]["query"]["item"]


def test_metrics_use_the_design_names(sidecar: Sidecar) -> None:
    sidecar.json("POST", "/v1/recommend", REQUEST)
    text = sidecar.metrics()
    for name in ("kvshard_sidecar_query_tokens_total", "kvshard_sidecar_hit_tokens_total",
                 "kvshard_sidecar_ttft_seconds_bucket", "kvshard_sidecar_recompute_ratio_bucket",
                 "kvshard_sidecar_cache_bytes", "kvshard_sidecar_cache_events_total"):
        assert re.search(rf"^{name}\{{[^}}]*model_name=\"{FINETUNED_NAME}\"", text, re.M), name
    assert 'tier="memory"' in text and 'kind="item"' in text
    # static config: no CacheShard, so an empty `cacheshard` (which Prometheus stores as no label)
    assert cacheshard_labels(text) == {""}


def test_a_sidecar_of_a_cacheshard_names_it_on_every_series(start_sidecar: SidecarFactory) -> None:
    """Pod names are only unique within a CacheShard: the label keeps shards apart in one Prometheus."""
    labelled = start_sidecar("--cacheshard", "team-a/movies", name="labelled")
    assert labelled.json("POST", "/v1/recommend", REQUEST)[0] == 200
    text = labelled.metrics()
    assert re.search(r'^kvshard_sidecar_query_tokens_total\{[^}]*kind="item"', text, re.M)
    assert cacheshard_labels(text) == {"team-a/movies"}


def cacheshard_labels(text: str) -> set[str | None]:
    """The ``cacheshard`` values of every sample on a ``/metrics`` page (None: a sample without it)."""
    return {s.labels.get("cacheshard") for family in text_string_to_metric_families(text) for s in family.samples}
