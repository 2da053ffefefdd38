"""Embedding scaled out (issue 19): the operator plans content-addressed chunks, runs them as an Indexed
Job, reports the Job in status (a failed pod, the Job's retries), places once every chunk is in, and a
rerun embeds nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvshard_operator import embedding
from kvshard_operator.embed_chunks import ChunkStore
from kvshard_operator.embed_worker import FINGERPRINT

JOBS = "/apis/batch/v1/namespaces/default/jobs"


def test_chunks_are_content_addressed_and_a_rerun_embeds_nothing(tmp_path: Path) -> None:
    model = embedding.MiniLM()
    embedded: list[int] = []

    def encode(texts: Any) -> Any:
        embedded.append(len(texts))
        return model.encode(texts)

    texts = [f"item number {i}" for i in range(10)] + ["item number 3"]  # a duplicate text is embedded once
    store = ChunkStore(tmp_path, FINGERPRINT)
    plan = store.plan(texts, chunk_items=4)
    assert (plan.items, len(plan.addresses)) == (10, 3)
    assert ChunkStore(tmp_path / "other", FINGERPRINT).plan(texts, chunk_items=4).addresses == plan.addresses
    assert [store.run_chunk(plan.id, i, encode) for i in range(3)] == [4, 4, 2]
    assert store.run_chunk(plan.id, 1, encode) == 0  # a retried index finds its chunk written
    vectors = store.assemble(texts)
    assert np.allclose(vectors.astype(np.float32), model.encode(texts), atol=2e-3)

    rerun = store.plan(texts, chunk_items=4)
    assert rerun.addresses == () and rerun.items == 0 and sum(embedded) == 10
    changed = store.plan([*texts[:5], "a brand new item", *texts[5:]], chunk_items=4)
    assert (changed.items, len(changed.addresses)) == (1, 1)
    with pytest.raises(KeyError, match="1 item vectors missing"):
        store.assemble(["a brand new item"])


def test_a_plan_stays_in_force_while_its_job_writes_its_chunks(tmp_path: Path) -> None:
    """Chunks written meanwhile change neither the plan nor its id (the Job's name): re-planning on
    each poll would make a new Job of the remaining chunks beside the one still running them."""
    model = embedding.MiniLM()
    texts = [f"item number {i}" for i in range(10)]
    store = ChunkStore(tmp_path, FINGERPRINT)
    plan = store.plan(texts, chunk_items=4)
    assert store.run_chunk(plan.id, 1, model.encode) == 4
    assert store.plan(texts, chunk_items=4) == plan  # the next poll: the same plan, one chunk in
    assert store.plan([*texts, "a new item"], chunk_items=4).items == 7  # another catalog plans afresh
    for i in (0, 2):
        store.run_chunk(plan.id, i, model.encode)
    assert store.plan(texts, chunk_items=4).addresses == ()  # every chunk in: nothing left to plan


@pytest.mark.slow
def test_the_embedding_job_is_tracked_its_failed_pod_reported_and_placement_follows(
        cluster: Any, catalog_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real operator on the emulated API and a TLS etcd, with the shared volume at ``tmp_path``: a
    40-item catalog becomes an Indexed Job of 3 chunks; a failed pod (the Job's status, as the Job
    controller writes it) sets Degraded=EmbeddingPodFailed saying the Job retries; a Job that gave up
    sets Degraded=EmbeddingFailed and a second attempt is created; once the worker has
    written every chunk (the real ``embed_worker`` process for one index) and the Job completes, the
    catalog is placed and the status says Complete."""
    from emulated import condition, etcd_spec, read_current
    from kopf.testing import KopfRunner
    from polling import wait_until

    from kvshard_local.testing_servers import EtcdServer
    from kvshard_operator import handlers

    root = tmp_path / "volume"
    monkeypatch.setattr(handlers, "SETTINGS", dataclasses.replace(
        handlers.SETTINGS, embedding_volume_claim="kvshard-embeddings", embedding_root=str(root),
        embedding_image="kvshard:test", embedding_chunk_items=16, embedding_poll_seconds=0.5))
    labels = {"app.kubernetes.io/name": "kvshard-engine"}
    texts = [json.loads(line)["text"] for line in catalog_file.read_text().splitlines()]
    with EtcdServer() as etcd:
        def current() -> Any:
            return read_current(etcd, "hobbies")

        cluster.trust_etcd(etcd)
        for i in range(2):
            cluster.create_pod(f"engine-{i}", labels)
        spec = {"model": {"name": "HuggingFaceTB/SmolLM2-135M-Instruct"}, "clusters": 4,
                "catalog": {"file": {"path": str(catalog_file)}, "embeddings": {"from": "Model", "parallelism": 2}},
                "podSelector": {"matchLabels": labels}, "capacityPerPod": "8Gi", "etcd": etcd_spec(etcd)}
        with KopfRunner(["run", "--standalone", "--all-namespaces", "-m", "kvshard_operator.handlers"],
                        timeout=60) as runner:
            cluster.create_shard({"apiVersion": "kvshard.io/v1alpha1", "kind": "CacheShard",
                                  "metadata": {"name": "hobbies"}, "spec": spec})
            job = wait_until(lambda: (cluster.get(JOBS).get("items") or [None])[0], what="the embedding Job")
            name, plan = job["metadata"]["name"], job["metadata"]["labels"]["kvshard.io/embedding-plan"]
            assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 3
            owner = cluster.shard("hobbies")["metadata"]
            assert job["metadata"]["ownerReferences"] == [  # deleting the CacheShard collects its Jobs
                {"apiVersion": "kvshard.io/v1alpha1", "kind": "CacheShard", "name": "hobbies", "uid": owner["uid"],
                 "controller": True, "blockOwnerDeletion": False}]
            assert job["spec"]["parallelism"] == 2
            pod = job["spec"]["template"]["spec"]
            assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "kvshard-embeddings"
            assert pod["containers"][0]["command"][-2:] == ["--plan", plan]
            embedding_status = wait_until(lambda: cluster.shard("hobbies").get("status", {}).get("embedding"),
                                          what="status.embedding")
            assert embedding_status["chunks"] == 3 and embedding_status["chunksDone"] == 0
            assert condition(cluster.shard("hobbies"), "Placed")["reason"] == "Embedding"
            assert current() is None

            cluster.request("PATCH", f"{JOBS}/{name}/status", {"status": {"active": 2, "failed": 1}})
            degraded = wait_until(lambda: condition(cluster.shard("hobbies"), "Degraded").get("reason")
                                  == "EmbeddingPodFailed" and condition(cluster.shard("hobbies"), "Degraded"),
                                  what="Degraded=EmbeddingPodFailed")
            assert "1 pod(s) failed, the Job retries them" in degraded["message"]
            cluster.request("PATCH", f"{JOBS}/{name}/status", {"status": {"active": 0, "failed": 7, "conditions": [
                {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}})
            retry = wait_until(lambda: cluster.get(f"{JOBS}/{name}-r1"), what="a second attempt")
            assert retry["spec"]["completions"] == 3
            failed = wait_until(lambda: condition(cluster.shard("hobbies"), "Degraded").get("reason")
                                == "EmbeddingFailed" and condition(cluster.shard("hobbies"), "Degraded"),
                                what="Degraded=EmbeddingFailed")
            assert "attempt 2 of 4" in failed["message"]

            store = ChunkStore(root, FINGERPRINT)  # the Job's pods: index 0 as the real worker process
            subprocess.run([sys.executable, "-m", "kvshard_operator.embed_worker", "--root", str(root),
                            "--plan", plan], env={**os.environ, "JOB_COMPLETION_INDEX": "0"},
                           check=True, timeout=120)
            model = embedding.MiniLM()
            assert [store.run_chunk(plan, i, model.encode) for i in range(3)] == [0, 16, 8]
            cluster.request("PATCH", f"{JOBS}/{name}-r1/status", {"status": {
                "active": 0, "failed": 0, "succeeded": 3,
                "conditions": [{"type": "Complete", "status": "True"}]}})
            placed = wait_until(current, what="generation 1", timeout=60)
            assert len(placed.item_clusters) == 40
            shard = wait_until(lambda: (s := cluster.shard("hobbies"))["status"].get("embedding", {}).get("state")
                               == "Complete" and s, what="embedding Complete")
            assert condition(shard, "Ready")["status"] == "True" and condition(shard, "Degraded")["status"] == "False"
            assert store.plan(texts, 16).addresses == ()  # a rerun embeds nothing
        assert runner.exception is None, runner.output
