"""The local Job runner (issue 19): an Indexed Job's pods are real processes, one per completion index,
with the pod's environment, at most ``parallelism`` at once; a failed pod's index is run again until
``backoffLimit`` pods failed, and the Job's status says what the Job controller would."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from kvshard_local.jobs import IndexedJob, index_ranges

# A pod: records its index, its env and how many pods ran at its side; index 1 fails on its first
# attempt, any index listed in $FAIL_ALWAYS always fails.
POD = """
import json, os, pathlib, sys, time
root, i = pathlib.Path(sys.argv[1]), os.environ["JOB_COMPLETION_INDEX"]
if i in os.environ.get("FAIL_ALWAYS", "").split(","):
    sys.exit(5)
if i == "1" and not (root / "failed-once").exists():
    (root / "failed-once").touch()
    sys.exit(3)
(root / f"running-{i}").touch()
time.sleep(0.4)
beside = len(list(root.glob("running-*")))
(root / f"running-{i}").unlink()
(root / f"done-{i}.json").write_text(json.dumps({"threads": os.environ["OMP_NUM_THREADS"], "beside": beside}))
"""


def job(root: Path, completions: int, parallelism: int, backoff_limit: int, fail_always: str = "") -> dict[str, Any]:
    container = {"name": "work", "image": "kvshard", "command": ["python", "-c", POD, str(root)],
                 "env": [{"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "FAIL_ALWAYS", "value": fail_always}]}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "work"},
            "spec": {"completionMode": "Indexed", "completions": completions, "parallelism": parallelism,
                     "backoffLimit": backoff_limit,
                     "template": {"metadata": {"labels": {"app": "work"}},
                                  "spec": {"restartPolicy": "Never", "containers": [container]}}}}


def test_each_index_runs_as_a_process_and_a_failed_pod_is_retried(tmp_path: Path) -> None:
    runner = IndexedJob(job(tmp_path, completions=4, parallelism=2, backoff_limit=2), tmp_path / "logs", backoff=0.1)
    most_active = 0
    while not runner.finished:
        runner.step()
        most_active = max(most_active, len(runner.active))
        time.sleep(0.02)
    assert runner.complete and most_active == 2
    status = runner.status()
    assert (status["succeeded"], status["failed"], status["active"]) == (4, 1, 0)
    assert status["completedIndexes"] == "0-3" and status["conditions"][0]["type"] == "Complete"
    assert "startTime" in status and "completionTime" in status
    done = [json.loads((tmp_path / f"done-{i}.json").read_text()) for i in range(4)]
    assert all(d["threads"] == "1" for d in done)  # the container's env reaches the process
    assert max(d["beside"] for d in done) <= 2  # never more than parallelism at once
    assert sorted(p.index for p in runner.pods if p.phase == "Failed") == [1]
    assert len(list((tmp_path / "logs").glob("work-*.log"))) == 5  # one log per pod, the retried one's too


def test_a_job_past_its_backoff_limit_fails_and_stops_its_pods(tmp_path: Path) -> None:
    runner = IndexedJob(job(tmp_path, completions=3, parallelism=3, backoff_limit=1, fail_always="0"),
                        tmp_path / "logs", backoff=0.1)
    assert not runner.run(timeout=60)
    status = runner.status()
    assert status["failed"] >= 2 and status["active"] == 0
    assert status["conditions"][0]["type"] == "Failed"
    assert status["conditions"][0]["reason"] == "BackoffLimitExceeded"
    assert "0" not in status["completedIndexes"].split(",")
    assert all(not p.process.running for p in runner.pods)


def test_completed_indexes_are_written_as_ranges() -> None:
    assert index_ranges(set()) == ""
    assert index_ranges({0, 1, 2, 4, 6, 7}) == "0-2,4,6-7"


def test_the_local_cluster_makes_its_operator_embed_through_jobs(tmp_path: Path) -> None:
    """``kvshard up`` points the operator at ``<run>/embeddings`` as its shared volume (so it creates
    embedding Jobs, which the cluster's Job controller runs); ``embedding_jobs=False`` embeds in process."""
    from kvshard_local.cluster import LocalCluster
    from kvshard_operator.settings import Settings

    cluster = LocalCluster(dir=tmp_path / "run")
    settings = Settings.from_env(cluster._operator_env())
    assert settings.embedding_volume_claim and settings.embedding_root == str(tmp_path / "run" / "embeddings")
    assert settings.embedding_poll_seconds == 1.0
    off = Settings.from_env(LocalCluster(dir=tmp_path / "run", embedding_jobs=False)._operator_env())
    assert off.embedding_volume_claim == ""
