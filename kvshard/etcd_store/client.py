"""The connection to etcd: channel, TLS, login, and the one place etcd's errors are translated.

Why its own module: every key space (:mod:`.placement`, :mod:`.warm`, :mod:`.corequest`,
:mod:`.catalog`, :mod:`.blend`) talks to etcd through :meth:`EtcdClient._call`, so a failure reads
the same whichever key it touched — :class:`EtcdUnavailableError` for an outage,
:class:`EtcdTLSError` naming the TLS mistake (:mod:`kvshard.etcd_tls`), :class:`EtcdAuthError` for
refused credentials — and no caller ever sees gRPC or etcd3aio exceptions. The channel's own quirks
(one gRPC subchannel pool per store, host names resolved here) live here too.
"""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self

import etcd3aio
import grpc

from kvshard.etcd_tls import EtcdTLS, diagnose, endpoint_host, is_ip

# What etcd3aio and gRPC raise; :meth:`EtcdClient._call` and every key space's watch map these.
ETCD_ERRORS = (etcd3aio.EtcdError, grpc.aio.AioRpcError, TimeoutError, OSError)
# etcd 3.4 reports missing or wrong credentials as INVALID_ARGUMENT with these details.
_AUTH_DETAILS = re.compile(r"user name is empty|authentication failed|invalid auth token|permission denied")
_UNAVAILABLE = (etcd3aio.EtcdConnectionError, etcd3aio.EtcdTransientError, TimeoutError, OSError)

# gRPC shares one subchannel per address across all channels of a process and, after a refused
# connection, backs off reconnecting for up to 120 s. So a store opened right after etcd came back
# could inherit a sibling's backoff and fail at once with "connections to all backends failing", and a
# long-lived store could take minutes to notice etcd is back. Each store keeps its own subchannels and
# retries a refused connection within 2 s. (Not ``grpc.min_reconnect_backoff_ms``: gRPC reads it as the
# connect timeout, and 200 ms would fail handshakes with a slow or briefly frozen etcd.)
_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class EtcdStoreError(Exception):
    """Base of every error this package raises."""


class EtcdUnavailableError(EtcdStoreError, ConnectionError):
    """etcd could not be reached or did not answer in time (transient: retry later)."""


class EtcdAuthError(EtcdStoreError):
    """etcd refused the username/password (or the user lacks permission on our keys)."""


class EtcdTLSError(EtcdStoreError):
    """TLS with etcd failed: its certificate is not signed by our CA or does not name the host, or it
    refused our client certificate. A configuration mistake, not an outage: retrying will not help."""


class GenerationConflictError(EtcdStoreError):
    """``current`` was not the generation the writer expected: someone else published first."""


class EtcdClient:
    """An async connection to etcd: connect, authenticate, translate errors. The key spaces build on
    it; :class:`kvshard.etcd_store.EtcdStore` is all of them on one connection."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        username: str | None = None,
        password: str | None = None,
        tls: EtcdTLS | None = None,
        timeout: float = 5.0,
        attempts: int = 2,
    ) -> None:
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.tls = tls
        self._username = username
        self._password = password
        conn_args: dict[str, Any] = tls.channel_args(self.endpoints) if tls is not None else {}
        self._client = etcd3aio.Etcd3Client(self.endpoints, rpc_max_attempts=attempts, **conn_args)
        self._client._manager.grpc_options.extend(_CHANNEL_OPTIONS)  # etcd3aio has no channel-options argument
        self._connected = False
        self.bytes_written = 0
        """Cumulative ``len(key) + len(value)`` of every put this store made (puts in transactions
        included, counted only for the branch etcd ran)."""
        self.bytes_read = 0
        """Cumulative ``len(key) + len(value)`` of every key-value this store read (gets, ranges,
        ranges in transactions, and the values its watches delivered)."""

    async def _target(self) -> str:
        """The gRPC target: etcd3aio's ``ipv4:`` list takes addresses only, so one host name goes to
        gRPC's DNS resolver (which follows the Service's addresses) and several are resolved here."""
        hosts = [endpoint_host(e) for e in self.endpoints]
        if all(is_ip(h) for h in hosts):
            return str(self._client._manager.target)
        if len(self.endpoints) == 1:
            return f"dns:///{self.endpoints[0]}"
        loop = asyncio.get_running_loop()
        addresses: list[str] = []
        for endpoint, host in zip(self.endpoints, hosts, strict=True):
            port = endpoint.rsplit(":", 1)[1]
            if is_ip(host):
                addresses.append(f"{host}:{port}")
                continue
            try:
                infos = await loop.getaddrinfo(host, int(port), family=socket.AF_INET, type=socket.SOCK_STREAM)
            except OSError as exc:
                raise EtcdUnavailableError(f"etcd endpoint {endpoint}: cannot resolve {host}: {exc}") from exc
            addresses += sorted({f"{info[4][0]}:{port}" for info in infos})
        return "ipv4:" + ",".join(dict.fromkeys(addresses))

    async def connect(self) -> None:
        """Open the channel (and authenticate when a username is given)."""
        if self._connected:
            return
        self._client._manager.target = await self._target()
        await self._client.connect()
        self._count_traffic()
        self._connected = True  # _call needs the channel; undone below if the login fails
        if self._username:
            auth = self._client.auth
            assert auth is not None
            try:
                resp = await self._call("authenticate",
                                        auth.authenticate(self._username, self._password or "", timeout=self.timeout))
            except EtcdStoreError as exc:
                await self.close()
                if isinstance(exc, EtcdUnavailableError | EtcdTLSError):
                    raise
                raise EtcdAuthError(f"etcd refused user {self._username!r}: {exc.__cause__ or exc}") from exc
            self._client.set_token(resp.token)

    async def close(self) -> None:
        if self._connected:
            await self._client.close()
            self._connected = False

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @property
    def _kv(self) -> Any:
        if not self._connected or self._client.kv is None:
            raise EtcdStoreError("EtcdStore is not connected; use `async with` or connect()")
        return self._client.kv

    async def _call(self, what: str, coro: Any) -> Any:
        try:
            return await coro
        except ETCD_ERRORS as exc:
            transient = isinstance(exc, _UNAVAILABLE) or (
                isinstance(exc, grpc.aio.AioRpcError)
                and exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            )
            denied = isinstance(exc, etcd3aio.EtcdUnauthenticatedError | etcd3aio.EtcdPermissionDeniedError) or (
                isinstance(exc, grpc.aio.AioRpcError) and _AUTH_DETAILS.search(exc.details() or "") is not None
            )
            tls_problem = diagnose(str(exc), self.tls, self.endpoints) if transient else None
            if tls_problem and self.tls is not None:
                raise EtcdTLSError(tls_problem) from exc
            error = EtcdUnavailableError if transient else EtcdAuthError if denied else EtcdStoreError
            hint = f" ({tls_problem})" if tls_problem else ""
            raise error(f"etcd {what} failed on {','.join(self.endpoints)}: {exc}{hint}") from exc

    def _count_traffic(self) -> None:
        """Route every KV request of this store through :meth:`_account`, which keeps
        :attr:`bytes_written` and :attr:`bytes_read` (etcd3aio sends each unary KV request through its
        service's ``_rpc``; it has no hook of its own)."""
        kv = self._client.kv
        assert kv is not None
        rpc = kv._rpc

        async def counted(call: Any, request: Any, **kwargs: Any) -> Any:
            response = await rpc(call, request, **kwargs)
            self._account(request, response)
            return response

        setattr(kv, "_rpc", counted)  # noqa: B010 (mypy refuses assigning to a method)

    def _account(self, request: Any, response: Any) -> None:
        kind = request.DESCRIPTOR.name
        if kind == "PutRequest":
            self.bytes_written += len(request.key) + len(request.value)
        elif kind == "TxnRequest":
            ops = request.success if response.succeeded else request.failure
            for op, result in zip(ops, response.responses, strict=False):
                if op.HasField("request_put"):
                    self.bytes_written += len(op.request_put.key) + len(op.request_put.value)
                elif op.HasField("request_range"):
                    self.count_read(result.response_range.kvs)
        elif kind == "RangeRequest":
            self.count_read(response.kvs)

    def count_read(self, kvs: Any) -> None:
        """Add key-values read outside a KV request (a watch's events) to :attr:`bytes_read`."""
        self.bytes_read += sum(len(kv.key) + len(kv.value) for kv in kvs)

    async def db_size(self) -> int:
        """etcd's backend database size in bytes (``db_size`` of the maintenance Status call: the
        physical file (``dbSize``), which grows towards ``--quota-backend-bytes`` until compacted and defragmented)."""
        maintenance = self._client.maintenance
        if not self._connected or maintenance is None:
            raise EtcdStoreError("EtcdStore is not connected; use `async with` or connect()")
        resp = await self._call("status", maintenance.status(timeout=self.timeout))
        return int(resp.dbSize)

    async def ping(self) -> None:
        """Raise :class:`EtcdUnavailableError` unless etcd answers a read."""
        await self._call("ping", self._kv.get("/kvshard/ping", timeout=self.timeout))

    async def _range(self, what: str, prefix: str, revision: int = 0, *, keys_only: bool = False) -> Any:
        """Every key under ``prefix`` (at ``revision``; 0: now)."""
        return await self._call(what, self._kv.get(prefix, range_end=etcd3aio.prefix_range_end(prefix),
                                                   revision=revision, keys_only=keys_only, timeout=self.timeout))

    async def _delete_range(self, what: str, prefix: str) -> Any:
        """Delete every key under ``prefix``."""
        return await self._call(what, self._kv.delete(prefix, range_end=etcd3aio.prefix_range_end(prefix),
                                                      timeout=self.timeout))


async def wait_for(store: EtcdClient, *, timeout: float) -> None:
    """Ping until etcd answers or ``timeout`` passes (then :class:`EtcdUnavailableError`)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            await store.ping()
            return
        except EtcdUnavailableError:
            if asyncio.get_running_loop().time() >= deadline:
                raise
            await asyncio.sleep(0.2)
