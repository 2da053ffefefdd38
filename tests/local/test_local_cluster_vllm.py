"""The local cluster with ``engine: vllm``: each pod runs its own vLLM, and the answers are full prefill's.

One pod serving the ``late`` scorer: its sidecar holds no weights and sends each recommendation's
candidates to the pod's vLLM, whose KV connector loads item bodies from the pod's block store. Requests
through the router must all succeed, come from vLLM, rank as an in-process full prefill of the same
requests does (scores within float error), and stopping the cluster must leave no vLLM process behind.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvshard.settings import SettingsError
from kvshard_local import LocalCluster
from kvshard_local.kubelet import PodContainers

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.model]

# vLLM and the blend engine compute in float32 from the same weights, summing in another order: measured
# ~2e-5 (tests/connector/test_sidecar_vllm_scorer.py); a wrongly computed item body moves scores by > 1.
TOLERANCE = 1e-4


def _recommend(router_url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(router_url + "/v1/recommend", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        assert response.status == 200
        return dict(json.load(response))


def _process_group_alive(pgid: int) -> bool:
    """Any process of group ``pgid`` (vLLM's API server and its engine core) still exists."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def test_vllm_engine_is_refused_for_an_answer_position_model(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="scorer models only"):
        LocalCluster(pods=1, dir=tmp_path / "run", model="finetuned", engine="vllm")


def test_vllm_pods_answer_as_full_prefill_and_leave_nothing_behind(small_dataset: Path, tmp_path: Path) -> None:
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1",
                        reason="vLLM is not installed in this environment (the vllm extra)")
    from kvshard.datasets import load_dataset
    from kvshard.prompts import sample_requests
    from kvshard_bench.demo_reference import FullPrefillReference

    cluster = LocalCluster(pods=1, dir=tmp_path / "run", dataset=str(small_dataset), model="late", engine="vllm",
                           clusters_per_pod=2, scrape_interval_seconds=5.0, embedding_jobs=False)
    started = time.monotonic()
    with cluster:
        cluster.wait_ready(timeout=cluster.settings.start_timeout_seconds, progress=lambda line: None)
        print(f"1 pod with its vLLM ready in {time.monotonic() - started:.0f} s")
        pod = cluster._kubelet.pods["engine-0"].process if cluster._kubelet else None
        assert isinstance(pod, PodContainers)
        vllm_pids = [c.pid for c in pod.companions]
        assert all(vllm_pids)
        assert "engine-0/vllm" in {info.name for info in cluster.processes()}

        dataset = load_dataset(str(small_dataset))
        requests = sample_requests(dataset, users=3, history=10, candidates=8, seed=5)
        bodies = [{"user_id": r.user_id, "history": list(r.history), "candidates": list(r.candidates)}
                  for r in requests]
        answers = [_recommend(cluster.router_url, body) for body in bodies]

    for pid in vllm_pids:  # stopped with the cluster, engine core included
        assert pid is not None and not _process_group_alive(pid)

    reference = FullPrefillReference(cluster.model_path, dataset)
    worst = 0.0
    for body, answer in zip(bodies, answers, strict=True):
        assert answer["engine"] == "vllm", answer
        full = reference.answer(body)
        assert [r["candidate"] for r in answer["ranking"]] == [r["candidate"] for r in full["ranking"]]
        expected = {r["candidate"]: r["logprob"] for r in full["ranking"]}
        worst = max(worst, *(abs(r["logprob"] - expected[r["candidate"]]) for r in answer["ranking"]))
    print(f"largest score difference, vLLM pod vs in-process full prefill: {worst:.2e}")
    assert worst <= TOLERANCE
