"""Child processes that serve HTTP: start them, wait until ready, and leave nothing behind.

Used by tests (real sidecars, real vLLM) and by the local cluster. Each child runs in its own
process group, so stopping it also stops anything it spawned (vLLM's engine core, for instance);
its output goes to a log file whose tail is shown when it fails to come up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType


class ProcessStartError(RuntimeError):
    """The child exited or did not become ready in time; the message carries its log's tail."""


class ManagedProcess:
    """One HTTP-serving child process with a readiness URL."""

    def __init__(self, command: Sequence[str], log_path: Path, ready_url: str,
                 env: Mapping[str, str] | None = None, start_timeout: float = 120.0) -> None:
        self.command = list(command)
        self.log_path = log_path
        self.ready_url = ready_url
        self.env = dict(os.environ if env is None else env)
        self.start_timeout = start_timeout
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, wait: bool = True) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            env=self.env, start_new_session=True)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if not self.running:
                raise ProcessStartError(f"{self.command[0]} exited early:\n{self.log_tail()}")
            if http_ok(self.ready_url):
                return
            time.sleep(0.2)
        self.stop()
        raise ProcessStartError(f"{self.ready_url} not ready after {self.start_timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL the whole group at once (a crash, as fault tests need it)."""
        self._signal(signal.SIGKILL)
        if self.process is not None:
            self.process.wait(timeout=10)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the group, then SIGKILL what is left after ``grace`` seconds."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        self._signal(signal.SIGKILL)  # stragglers in the group, even if the leader exited
        if self.process.poll() is None:
            self.process.wait(timeout=10)
        self.process = None

    def _signal(self, sig: signal.Signals) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> ManagedProcess:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def http_ok(url: str, timeout: float = 1.0) -> bool:
    """True if ``GET url`` answers 2xx."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return bool(200 <= response.status < 300)
    except (urllib.error.URLError, OSError, ValueError):
        return False
