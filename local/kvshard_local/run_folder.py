"""The local cluster's run folder: who holds it, what ran in it, what a new run forgets.

Why a module of its own: ``kvshard up`` and ``kvshard down`` are separate processes that meet only
in this folder. ``up`` holds an flock on :data:`LOCK_FILE` for as long as it lives (the kernel drops
it when the process dies, so a crash never leaves a stale lock) and records every process it started
in :data:`STATE_FILE`; ``down`` reads that file and signals only processes whose kernel start time
still matches, so a recycled pid is never killed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import shutil
from pathlib import Path
from typing import IO

STATE_FILE = "cluster.json"
LOCK_FILE = "up.lock"


class ClusterAlreadyRunningError(RuntimeError):
    """Another local cluster holds the run folder."""


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """One process of the cluster as ``cluster.json`` and ``kvshard up``'s table show it."""

    name: str
    pid: int
    url: str
    log: str
    group: bool
    """True when the process leads its own process group (kill the group, not just the pid)."""
    start_time: int
    """Kernel start time (clock ticks since boot), so a recycled pid is never mistaken for it."""


def process_start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat``; ``None`` when no such process runs (a zombie, which has
    exited and only waits for its parent to read its status, counts as not running)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


class RunFolderLock:
    """The flock that says one ``kvshard up`` runs in a folder."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        """Hold the folder, or raise :class:`ClusterAlreadyRunningError` naming the ``kvshard up``
        that holds it; holding it already is fine."""
        if self._file is not None:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        lock = (self.run_dir / LOCK_FILE).open("a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            owner = ""
            with contextlib.suppress(OSError, ValueError, KeyError):
                owner = f" (kvshard up pid {json.loads((self.run_dir / STATE_FILE).read_text())['up_pid']})"
            raise ClusterAlreadyRunningError(
                f"a local cluster already runs in {self.run_dir}{owner}; stop it with "
                f"`kvshard down --dir {self.run_dir}` or choose another --dir") from None
        self._file = lock

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # releases the flock
            self._file = None


def forget_previous_run(run_dir: Path, logs_dir: Path) -> None:
    """Forget the previous run's state (etcd data, TSDB, logs); keep the sidecars' disk blocks,
    which stay valid across runs and make the next warm-up a disk read."""
    for name in ("logs", "etcd", "prometheus"):
        shutil.rmtree(run_dir / name, ignore_errors=True)
    for name in ("etcd.log", "kubeconfig", "prometheus.yml", "cacheshard.yaml"):
        (run_dir / name).unlink(missing_ok=True)
    logs_dir.mkdir(parents=True)
