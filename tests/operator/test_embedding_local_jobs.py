"""The local cluster's Job controller runs the operator's embedding Job (issue 19): the real operator
creates the Indexed Job, :class:`kvshard_local.job_controller.JobController` runs each chunk as a real
``embed_worker`` process with the pod's environment, a failed pod is retried (``backoffLimit``) and
the CacheShard's status says so, the operator places once every chunk is in, and a rerun embeds
nothing."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from kvshard_local.job_controller import EMBEDDING_CLAIM, JobController
from kvshard_local.kubeapi import KubeApi
from kvshard_operator.embed_chunks import ChunkStore
from kvshard_operator.embed_worker import FINGERPRINT

JOBS = "/apis/batch/v1/namespaces/default/jobs"
PODS = "/api/v1/namespaces/default/pods"


def job_pods(cluster: Any) -> list[dict[str, Any]]:
    return [p for p in cluster.get(PODS)["items"] if "batch.kubernetes.io/job-name" in p["metadata"]["labels"]]


def shard_spec(catalog_file: Path, labels: dict[str, str], etcd: Any) -> dict[str, Any]:
    from emulated import etcd_spec

    return {"model": {"name": "HuggingFaceTB/SmolLM2-135M-Instruct"}, "clusters": 4,
            "catalog": {"file": {"path": str(catalog_file)}, "embeddings": {"from": "Model", "parallelism": 2}},
            "podSelector": {"matchLabels": labels}, "capacityPerPod": "8Gi", "etcd": etcd_spec(etcd)}


@pytest.mark.slow
def test_the_local_job_controller_runs_the_chunks_as_processes_and_the_operator_places(
        cluster: Any, catalog_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from emulated import condition, read_current
    from kopf.testing import KopfRunner
    from polling import wait_until

    from kvshard_local.testing_servers import EtcdServer
    from kvshard_operator import handlers

    root = tmp_path / "volume"
    monkeypatch.setattr(handlers, "SETTINGS", dataclasses.replace(
        handlers.SETTINGS, embedding_volume_claim=EMBEDDING_CLAIM, embedding_root=str(root),
        embedding_image="kvshard", embedding_chunk_items=16, embedding_poll_seconds=0.5))
    labels = {"app.kubernetes.io/name": "kvshard-engine"}
    with EtcdServer() as etcd:
        cluster.trust_etcd(etcd)
        for i in range(2):
            cluster.create_pod(f"engine-{i}", labels)
        with KopfRunner(["run", "--standalone", "--all-namespaces", "-m", "kvshard_operator.handlers"],
                        timeout=60) as runner:
            cluster.create_shard({"apiVersion": "kvshard.io/v1alpha1", "kind": "CacheShard",
                                  "metadata": {"name": "hobbies"}, "spec": shard_spec(catalog_file, labels, etcd)})
            job = wait_until(lambda: (cluster.get(JOBS).get("items") or [None])[0], what="the embedding Job")
            name, plan = job["metadata"]["name"], job["metadata"]["labels"]["kvshard.io/embedding-plan"]
            container = job["spec"]["template"]["spec"]["containers"][0]
            assert {"name": "OMP_NUM_THREADS", "value": "1"} in container["env"]  # a 1-CPU pod, 1 thread

            # chunk 1's input made unreadable before any pod runs: its pod fails until it is restored
            store = ChunkStore(root, FINGERPRINT)
            addresses = json.loads((store.folder / "plans" / f"{plan}.json").read_text())["chunks"]
            assert len(addresses) == 3
            work = store.folder / "inputs" / f"{addresses[1]}.json"
            intact = work.read_bytes()
            work.write_text("not json")
            controller = JobController(KubeApi(cluster.url), "default", tmp_path / "logs", period=0.2, backoff=2.0)
            controller.start()
            try:
                degraded = wait_until(lambda: condition(cluster.shard("hobbies"), "Degraded").get("reason")
                                      == "EmbeddingPodFailed" and condition(cluster.shard("hobbies"), "Degraded"),
                                      timeout=60, what="Degraded=EmbeddingPodFailed")
                assert "pod(s) failed, the Job retries them" in degraded["message"]
                failed = [p for p in job_pods(cluster) if p["status"]["phase"] == "Failed"]
                assert failed and all(p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"] == "1"
                                      for p in failed)
                assert read_current(etcd, "hobbies") is None  # nothing placed before every chunk is in
                work.write_bytes(intact)

                placed = wait_until(lambda: read_current(etcd, "hobbies"), timeout=120, what="generation 1")
                assert len(placed.item_clusters) == 40 and set(placed.pods) == {"engine-0", "engine-1"}
                # the last chunk's file is in before its process exits: the Job completes just after
                status = wait_until(lambda: (j := cluster.get(f"{JOBS}/{name}")["status"]).get("conditions")
                                    and j, timeout=60, what="the Job's Complete condition")
                assert (status["succeeded"], status["active"], status["completedIndexes"]) == (3, 0, "0-2")
                assert status["failed"] >= 1 and status["conditions"][0]["type"] == "Complete"
                shard = wait_until(lambda: (s := cluster.shard("hobbies"))["status"].get("embedding", {}).get(
                    "state") == "Complete" and s, what="embedding Complete")
                assert condition(shard, "Ready")["status"] == "True"
                assert condition(shard, "Degraded")["status"] == "False"
                pods = job_pods(cluster)
                assert sorted(int(p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"])
                              for p in pods if p["status"]["phase"] == "Succeeded") == [0, 1, 2]
                assert len(list((tmp_path / "logs").glob(f"{name}-*.log"))) == len(pods)  # a log per pod

                # a rerun embeds nothing: the same catalog in another CacheShard is placed from the
                # volume's chunks, without a Job
                other = {"app.kubernetes.io/name": "kvshard-engine-b"}
                cluster.create_pod("engine-b-0", other)
                cluster.create_shard({"apiVersion": "kvshard.io/v1alpha1", "kind": "CacheShard",
                                      "metadata": {"name": "again"}, "spec": shard_spec(catalog_file, other, etcd)})
                again = wait_until(lambda: read_current(etcd, "again"), timeout=60, what="the rerun placed")
                assert len(again.item_clusters) == 40
                assert [j["metadata"]["name"] for j in cluster.get(JOBS)["items"]] == [name]
                assert "embedding" not in cluster.shard("again")["status"]
            finally:
                controller.stop()
        assert runner.exception is None, runner.output
    assert all(not p.process.running for j in controller.jobs.values() for p in j.pods)
