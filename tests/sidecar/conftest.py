"""Real sidecar processes for the API tests: ``kvshard sidecar serve`` on free loopback ports."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sidecar_process import PEER_TOKEN, Sidecar, SidecarFactory

from kvshard.processes import ManagedProcess
from kvshard_local.testing_servers import free_port


@pytest.fixture(scope="module")
def start_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarFactory]:
    """Start sidecars with extra flags; every one is stopped at the end of the module."""
    started: list[ManagedProcess] = []

    def start(*flags: str, name: str = "pod", wait_ready: bool = True) -> Sidecar:
        folder: Path = tmp_path_factory.mktemp(name)
        port = free_port()
        command = [sys.executable, "-m", "kvshard.cli", "--log-level", "WARNING", "sidecar", "serve",
                   "--port", str(port), "--pod-name", name, "--disk-dir", str(folder / "blocks"), *flags]
        env = {**os.environ, "KVSHARD_SIDECAR_PEER_TOKEN": PEER_TOKEN}
        process = ManagedProcess(command, folder / "sidecar.log", f"http://127.0.0.1:{port}/readyz", env=env)
        started.append(process)
        process.start(wait=wait_ready)
        return Sidecar(process, f"http://127.0.0.1:{port}")

    yield start
    for process in started:
        process.stop()
