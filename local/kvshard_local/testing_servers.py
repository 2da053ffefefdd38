"""Real servers for tests and the local cluster: start them on free loopback ports, stop them after.

Tests of anything that talks to etcd run against a real etcd (Debian's ``etcd-server``, or any
``etcd`` binary on ``$KVSHARD_ETCD_BINARY``/``PATH``) rather than a fake, because compare-and-swap,
leases and watches are exactly what fakes get wrong. Each :class:`EtcdServer` has its own temporary
data directory and ports, so parallel tests never share state. It serves TLS and demands client
certificates, as the chart's etcd does, from a CA made for it at construction
(:mod:`kvshard_local.certificates`): the TLS path is the one every test takes.

    with EtcdServer() as etcd:
        async with etcd.store() as store:        # EtcdStore with the server's client certificate
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
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from kvshard.etcd_store import EtcdStore
from kvshard.etcd_tls import CA_KEY, CERT_KEY, KEY_KEY, EtcdTLS
from kvshard.processes import http_ok
from kvshard.settings import environment
from kvshard_local.certificates import EtcdCertificates, make_etcd_certificates


class EtcdNotInstalledError(FileNotFoundError):
    """No etcd binary: install Debian's ``etcd-server`` or set ``KVSHARD_ETCD_BINARY``."""


class ServerStartError(RuntimeError):
    """A server did not become ready in time; the message carries the end of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports that nothing listens on right now. Each socket stays bound until all
    are chosen: two ``free_port()`` calls in a row may get the same port back from the kernel (seen: an
    etcd given one port for both its client and its peer listener failed to start)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            s = stack.enter_context(contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)))
            s.bind((host, 0))
            ports.append(int(s.getsockname()[1]))
        return ports


def _binary(name: str, configured: Path | None, variable: str, missing: type[FileNotFoundError],
            package: str) -> str:
    """``configured`` (``$variable``), else ``name`` on ``PATH``, else ``/usr/bin/<name>``; or ``missing``."""
    found = (str(configured) if configured else None) or shutil.which(name) or (
        f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if not found:
        raise missing(f"{name} not found: apt-get install {package}, or set {variable}")
    return found


def etcd_binary() -> str:
    """The etcd executable to run, or :class:`EtcdNotInstalledError`."""
    return _binary("etcd", environment().kvshard_etcd_binary, "KVSHARD_ETCD_BINARY", EtcdNotInstalledError,
                   "etcd-server")


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
    """A single-member etcd on loopback with a private data directory.

    With ``tls`` (the default) it serves clients and its peer port over TLS with certificates made
    for it in ``<data_dir>/tls`` and accepts only clients that present the client certificate
    (``--client-cert-auth``); :attr:`client_tls`, :meth:`client_flags` and :meth:`tls_secret_data`
    hand that certificate to whoever should connect. ``tls=False`` serves plaintext.
    """

    def __init__(self, *, data_dir: Path | None = None, start_timeout: float = 20.0, tls: bool = True,
                 ports: tuple[int, int] | None = None, extra_args: Sequence[str] = ()) -> None:
        self.binary = etcd_binary()
        self.extra_args = list(extra_args)
        """More etcd flags (e.g. the chart's ``--quota-backend-bytes``), appended to the command line."""
        self.host = "127.0.0.1"
        # (client, peer); a caller that picks other ports as well picks these in the same free_ports call
        self.client_port, self.peer_port = ports or free_ports(2)
        self._own_dir = data_dir is None
        self.data_dir = data_dir or Path(tempfile.mkdtemp(prefix="kvshard-etcd-"))
        self.start_timeout = start_timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._log = self.data_dir.parent / f"{self.data_dir.name}.log"
        self.certificates: EtcdCertificates | None = (
            make_etcd_certificates(self.data_dir / "tls") if tls else None)

    @property
    def tls(self) -> bool:
        return self.certificates is not None

    @property
    def client_tls(self) -> EtcdTLS | None:
        """What a client needs to connect (CA, client certificate and key), ``None`` for plaintext."""
        c = self.certificates
        if c is None:
            return None
        return EtcdTLS.from_files(c.ca, c.client_cert, c.client_key, setting="test etcd")

    def store(self, **kwargs: Any) -> EtcdStore:
        """An :class:`EtcdStore` on this server with its client certificate (``kwargs`` go to it)."""
        kwargs.setdefault("tls", self.client_tls)
        return EtcdStore([self.endpoint], **kwargs)

    def client_args(self) -> dict[str, Any]:
        """Keyword arguments of ``etcd3aio.Etcd3Client`` for this server (tests that talk to etcd
        directly, e.g. to enable auth or compact): its CA and client certificate, {} for plaintext."""
        tls = self.client_tls
        return {} if tls is None else tls.channel_args([self.endpoint])

    def client_flags(self) -> list[str]:
        """``--etcd-ca-file/--etcd-cert-file/--etcd-key-file`` for a router or sidecar command line."""
        c = self.certificates
        if c is None:
            return []
        return ["--etcd-ca-file", str(c.ca), "--etcd-cert-file", str(c.client_cert),
                "--etcd-key-file", str(c.client_key)]

    def tls_secret_data(self) -> dict[str, bytes]:
        """The client certificate as a ``kubernetes.io/tls`` Secret holds it (what the operator reads
        from ``spec.etcd.tls.secretRef``)."""
        c = self.certificates
        if c is None:
            raise RuntimeError("this etcd serves plaintext: no TLS Secret")
        return {CA_KEY: c.ca.read_bytes(), CERT_KEY: c.client_cert.read_bytes(), KEY_KEY: c.client_key.read_bytes()}

    @property
    def endpoint(self) -> str:
        """``host:port`` as etcd clients (and ``CacheShard.spec.etcd.endpoints``) expect it."""
        return f"{self.host}:{self.client_port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    def start(self) -> None:
        """Start (or restart) etcd and wait until ``/health`` says it serves requests."""
        if self.running:
            return
        peer = f"{'https' if self.tls else 'http'}://{self.host}:{self.peer_port}"
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
        c = self.certificates
        if c is not None:
            cmd += [
                "--cert-file", str(c.server_cert), "--key-file", str(c.server_key),
                "--client-cert-auth", "--trusted-ca-file", str(c.ca),
                "--peer-cert-file", str(c.server_cert), "--peer-key-file", str(c.server_key),
                "--peer-client-cert-auth", "--peer-trusted-ca-file", str(c.ca),
            ]
        cmd += self.extra_args
        env = {"ETCD_UNSUPPORTED_ARCH": "", **os.environ}
        self._spawn(cmd, self._log, self._healthy, self.start_timeout, f"etcd on {self.endpoint}", env=env)

    def _healthy(self) -> bool:
        context = None
        if self.certificates is not None:
            context = ssl.create_default_context(cafile=str(self.certificates.ca))
            context.load_cert_chain(str(self.certificates.client_cert), str(self.certificates.client_key))
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=0.5, context=context) as resp:
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
    return _binary("prometheus", environment().kvshard_prometheus_binary, "KVSHARD_PROMETHEUS_BINARY",
                   PrometheusNotInstalledError, "prometheus")


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
