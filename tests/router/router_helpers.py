"""Helpers for the router service tests: stand-in pods, an in-process router, placement writers.

``FakePod`` is a real aiohttp server on a loopback port that answers ``/readyz`` and
``/v1/recommend`` the way a sidecar does (JSON, 503 while "loading"), so the router's forwarding,
failover and health checks run over real HTTP without loading a model. The tests with real
sidecars live in ``test_router_service.py`` (marked slow + model).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvshard.etcd_store import EtcdStore, EtcdUnavailableError
from kvshard.placement_schema import Placement, WarmReport
from kvshard_local.testing_servers import EtcdServer, free_port
from kvshard_router.app import ROUTER_APP, RouterApp, build_app
from kvshard_router.settings import RouterSettings


@dataclass
class FakePod:
    """A loopback HTTP server that answers like a sidecar; flip ``ready``/``status`` to make it fail."""

    name: str
    ready: bool = True
    status: int = 200
    received: list[bytes] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _readyz(self, request: web.Request) -> web.Response:
        if self.ready:
            return web.json_response({"status": "ready", "pod": self.name})
        return web.json_response({"error": {"field": "model", "message": "loading"}}, status=503)

    async def _recommend(self, request: web.Request) -> web.Response:
        self.received.append(await request.read())
        if self.status == 200:
            return web.json_response({"pod": self.name})
        return web.json_response({"error": {"field": "candidates[0]", "message": f"{self.name} says no"}},
                                 status=self.status, headers={"Retry-After": "7"} if self.status == 503 else None)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/readyz", self._readyz)
        app.router.add_post("/v1/recommend", self._recommend)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        """Close the listening socket: connections are refused from now on."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@asynccontextmanager
async def running_router(etcd: EtcdServer, shard: str, **options: Any) -> AsyncIterator[tuple[str, RouterApp]]:
    """The router app on a free port, following ``shard`` in ``etcd`` with its client certificate
    (given as the router's TLS file settings, as in a pod)."""
    certs = etcd.certificates
    tls_files = {} if certs is None else {"etcd_ca_file": certs.ca, "etcd_cert_file": certs.client_cert,
                                          "etcd_key_file": certs.client_key}
    settings = RouterSettings(port=free_port(), etcd_endpoints=(etcd.endpoint,), cacheshard=shard,
                              **{"health_interval_seconds": 0.2, **tls_files, **options})
    app = build_app(settings, EtcdStore([etcd.endpoint], tls=settings.etcd_tls()))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", settings.port).start()
    try:
        yield f"http://127.0.0.1:{settings.port}", app[ROUTER_APP]
    finally:
        await runner.cleanup()


async def publish(etcd: EtcdServer, shard: str, placement: Placement, reports: dict[str, WarmReport],
                  timeout: float = 15.0) -> None:
    """Write ``placement`` as the next generation and put every pod's warm report (retrying while a
    just restarted etcd is still refused: gRPC shares its backed-off connection between clients)."""
    namespace, name = shard.split("/")
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with etcd.store() as store:
                current = await store.current_generation(namespace, name)
                if current < placement.generation:
                    await store.publish(namespace, name, placement, expected=current)
                for pod, report in reports.items():
                    await store.put_warm(namespace, name, pod, report)
            return
        except EtcdUnavailableError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def eventually(check: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0,
                     what: str = "condition") -> None:
    """Poll ``check`` until it is true; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout:g} s")
        await asyncio.sleep(0.05)


async def post(session: aiohttp.ClientSession, url: str, body: Any = None, raw: bytes | None = None,
               content_type: str = "application/json") -> tuple[int, dict[str, str], Any]:
    """POST a JSON body (or raw bytes); returns status, headers and the decoded JSON answer."""
    data = raw if raw is not None else json.dumps(body).encode()
    async with session.post(url, data=data, headers={"Content-Type": content_type}) as resp:
        text = await resp.read()
        return resp.status, dict(resp.headers), json.loads(text) if text else None


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in Prometheus text output, or None if absent."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        sample, _, rest = key.partition("{")
        got = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
        if sample == name and got == wanted:
            return float(value)
    return None
