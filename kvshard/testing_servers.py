"""Real servers for tests and the local cluster: start them on free loopback ports, stop them after.

Tests of anything that talks to etcd run against a real etcd (Debian's ``etcd-server``, or any
``etcd`` binary on ``$KVSHARD_ETCD_BINARY``/``PATH``) rather than a fake, because compare-and-swap,
leases and watches are exactly what fakes get wrong. Each :class:`EtcdServer` has its own temporary
data directory and ports, so parallel tests never share state.

    with EtcdServer() as etcd:
        client = Etcd3Client([etcd.endpoint])
        ...
        etcd.stop()      # simulate an outage (the data directory survives)
        etcd.start()     # back on the same port with the same data

:class:`PrometheusServer` does the same for Prometheus (Debian's ``prometheus``): the rebalancer reads
rates from a real one, and ``kvshard up`` runs one scraping every process it started.
"""

from __future__ import annotations

import abc
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from kvshard.processes import http_ok


class EtcdNotInstalledError(FileNotFoundError):
    """No etcd binary: install Debian's ``etcd-server`` or set ``KVSHARD_ETCD_BINARY``."""


class ServerStartError(RuntimeError):
    """A server did not become ready in time; the message carries the end of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _binary(name: str, variable: str, missing: type[FileNotFoundError], package: str) -> str:
    """``$variable``, else ``name`` on ``PATH``, else ``/usr/bin/<name>``; or ``missing``."""
    found = os.environ.get(variable) or shutil.which(name) or (
        f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if not found:
        raise missing(f"{name} not found: apt-get install {package}, or set {variable}")
    return found


def etcd_binary() -> str:
    """The etcd executable to run, or :class:`EtcdNotInstalledError`."""
    return _binary("etcd", "KVSHARD_ETCD_BINARY", EtcdNotInstalledError, "etcd-server")


class _LocalServer(abc.ABC):
    """What both servers share: one child process, stopped politely then firmly, used with ``with``."""

    _process: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @abc.abstractmethod
    def start(self) -> None:
        """Start the server and wait until it answers."""

    def _spawn(self, cmd: list[str], log_path: Path, ready: Callable[[], bool], timeout: float, what: str,
               **popen: Any) -> None:
        """Run ``cmd`` logging to ``log_path`` and poll ``ready`` until ``timeout``; if it exits or times
        out first, stop it and raise :class:`ServerStartError` with the end of its log."""
        log = open(log_path, "ab")  # noqa: SIM115 - owned by the child process
        self._process = subprocess.Popen(cmd, stdout=log, stderr=log, **popen)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._process.poll() is None:
            if ready():
                return
            time.sleep(0.05)
        self.stop()
        tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
        raise ServerStartError(f"{what} did not become ready:\n{tail}")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s); its data folder stays for a restart."""
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=10)
        self._process = None

    def close(self) -> None:
        self.stop()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class EtcdServer(_LocalServer):
    """A single-member etcd on loopback with a private data directory."""

    def __init__(self, *, data_dir: Path | None = None, start_timeout: float = 20.0) -> None:
        self.binary = etcd_binary()
        self.host = "127.0.0.1"
        self.client_port = free_port()
        self.peer_port = free_port()
        self._own_dir = data_dir is None
        self.data_dir = data_dir or Path(tempfile.mkdtemp(prefix="kvshard-etcd-"))
        self.start_timeout = start_timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._log = self.data_dir.parent / f"{self.data_dir.name}.log"

    @property
    def endpoint(self) -> str:
        """``host:port`` as etcd clients (and ``CacheShard.spec.etcd.endpoints``) expect it."""
        return f"{self.host}:{self.client_port}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    def start(self) -> None:
        """Start (or restart) etcd and wait until ``/health`` says it serves requests."""
        if self.running:
            return
        peer = f"http://{self.host}:{self.peer_port}"
        cmd = [
            self.binary,
            "--name", "kvshard-test",
            "--data-dir", str(self.data_dir / "data"),
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"kvshard-test={peer}",
            "--initial-cluster-state", "new",
            "--logger", "zap",
            "--log-outputs", "stderr",
        ]
        env = dict(os.environ, ETCD_UNSUPPORTED_ARCH=os.environ.get("ETCD_UNSUPPORTED_ARCH", ""))
        self._spawn(cmd, self._log, self._healthy, self.start_timeout, f"etcd on {self.endpoint}", env=env)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=0.5) as resp:
                return b'"health":"true"' in resp.read()
        except (urllib.error.URLError, OSError):
            return False

    def close(self) -> None:
        """Stop etcd and remove the data directory if we created it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self._log.unlink(missing_ok=True)



class PrometheusNotInstalledError(FileNotFoundError):
    """No Prometheus binary: install Debian's ``prometheus`` or set ``KVSHARD_PROMETHEUS_BINARY``."""


def prometheus_binary() -> str:
    """The Prometheus executable to run, or :class:`PrometheusNotInstalledError`."""
    return _binary("prometheus", "KVSHARD_PROMETHEUS_BINARY", PrometheusNotInstalledError, "prometheus")


class PrometheusServer(_LocalServer):
    """One Prometheus on loopback with the given config file and a private TSDB folder.

        with PrometheusServer(config_path) as prom:
            urllib.request.urlopen(prom.url + "/api/v1/query?query=up")

    ``reload()`` re-reads the config (the lifecycle API is enabled), so targets can be added live.
    """

    def __init__(self, config_path: Path, *, data_dir: Path | None = None, port: int | None = None,
                 start_timeout: float = 30.0) -> None:
        self.binary = prometheus_binary()
        self.config_path = config_path
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self._own_dir = data_dir is None
        self.data_dir = data_dir or Path(tempfile.mkdtemp(prefix="kvshard-prometheus-"))
        self.start_timeout = start_timeout
        self.log_path = self.data_dir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        """Start Prometheus and wait until ``/-/ready`` answers."""
        if self.running:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            self.binary,
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.data_dir / 'tsdb'}",
            f"--web.listen-address={self.host}:{self.port}",
            "--web.enable-lifecycle",
            "--storage.tsdb.retention.time=1d",
        ]
        self._spawn(cmd, self.log_path, lambda: http_ok(f"{self.url}/-/ready", timeout=0.5), self.start_timeout,
                    f"prometheus on {self.url}", start_new_session=True)

    def reload(self) -> None:
        """Ask Prometheus to re-read its config file."""
        request = urllib.request.Request(f"{self.url}/-/reload", method="POST")
        with urllib.request.urlopen(request, timeout=5):
            pass

    def close(self) -> None:
        """Stop Prometheus and remove the data folder if we created it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
