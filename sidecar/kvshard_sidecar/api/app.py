"""The sidecar's HTTP API (aiohttp): thin handlers over :class:`~kvshard_sidecar.serving.service.SidecarService`.

Handlers validate, admit, and hand the blocking model work to a small thread pool, so the event
loop keeps answering health checks, metrics and peers while a prefill runs. Admission is bounded:
``max_concurrency`` requests compute (``vllm_concurrency`` when vLLM computes), ``max_queue`` wait, and
the next one gets 429 with ``Retry-After`` at once — never an unbounded queue. Every client mistake
is a 4xx with a JSON body naming the field; the process keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import http.client
import json
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvshard.request_errors import RequestError, error_body
from kvshard.segments import is_block_key
from kvshard.tasks import cancel_and_wait
from kvshard_sidecar.api.drain import Drain
from kvshard_sidecar.api.validation import parse_prefill, parse_recommend
from kvshard_sidecar.blockstore.peers import TOKEN_HEADER, bearer
from kvshard_sidecar.follow.placement import PlacementFollower
from kvshard_sidecar.serving.prefill_queue import WarmUnit
from kvshard_sidecar.serving.service import SidecarService

log = logging.getLogger(__name__)

SERVICE = web.AppKey("service", SidecarService)
FOLLOWER = web.AppKey("follower", PlacementFollower)
DRAIN = web.AppKey("drain", Drain)
LOOPBACK = frozenset({"127.0.0.1", "::1"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MAX_BODY_BYTES = 1 << 20


class Admission:
    """Counts requests in the building; refuses the one past ``compute + queue``."""

    def __init__(self, compute: int, queue: int) -> None:
        self.limit = compute + queue
        self.inside = 0

    def try_enter(self) -> bool:
        if self.inside >= self.limit:
            return False
        self.inside += 1
        return True

    def leave(self) -> None:
        self.inside -= 1


def _error(status: int, field: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(field, message), status=status, headers=headers)


@web.middleware
async def errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Client mistakes become JSON 4xx; aiohttp's own HTTP errors keep their status."""
    service = request.app[SERVICE]
    endpoint = request.match_info.route.resource.canonical if request.match_info.route.resource else "other"
    try:
        response = await handler(request)
    except RequestError as error:
        response = web.json_response(error.body(), status=error.status)
    except web.HTTPException as error:
        if error.status >= 400 and error.content_type != "application/json":
            response = _error(error.status, "request", error.reason)
        else:
            raise
    service.metrics.count_request(endpoint, response.status)
    return response


async def _json_body(request: web.Request) -> Any:
    if request.content_type != "application/json":
        raise RequestError("body", "Content-Type must be application/json", status=415)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise RequestError("body", f"larger than {MAX_BODY_BYTES} bytes", status=413) from None
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RequestError("body", f"not valid JSON: {error}") from None
    except RecursionError:
        raise RequestError("body", "JSON nested too deeply") from None


async def recommend(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    if not service.ready:
        return _error(503, "service", "the model is still loading", {"Retry-After": "5"})
    request.app[DRAIN].arrived()
    call = parse_recommend(await _json_body(request), service.items, service.limits, service.blend_defaults)
    admission: Admission = request.app["admission"]
    if not admission.try_enter():
        return _error(429, "service", "at capacity, retry shortly", {"Retry-After": "1"})
    pressure = service.metrics.pressure
    pressure.arrived()
    started = False
    try:
        async with request.app["compute"]:
            pressure.started()
            started = True
            result = await asyncio.get_running_loop().run_in_executor(
                request.app["pool"], service.recommend, call)
    finally:
        pressure.left(started=started)
        admission.leave()
    return web.json_response(result)


async def prefill(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    if not service.ready:
        return _error(503, "service", "the model is still loading", {"Retry-After": "5"})
    call = parse_prefill(await _json_body(request), service.items, service.users)
    queued = service.prefill_queue.submit(call.items, call.users)
    return web.json_response({"queued_items": len(call.items), "queued_users": len(call.users),
                              "pending": queued}, status=202)


def _authorised(request: web.Request, token: str) -> bool:
    given = request.headers.get(TOKEN_HEADER, "")
    return bool(token) and hmac.compare_digest(given.encode(), bearer(token).encode())


async def get_block(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    if not _authorised(request, service.peer_token):
        return _error(401, TOKEN_HEADER, "a valid peer token is required",
                      {"WWW-Authenticate": 'Bearer realm="kvshard-peers"'})
    key = request.match_info["key"]
    if not is_block_key(key):
        return _error(400, "key", "not a block key (64 lowercase hex characters)")
    found = await asyncio.get_running_loop().run_in_executor(None, service.block_for_peer, key)
    if found is None:
        return _error(404, "key", "this pod does not hold the block")
    if isinstance(found, Path):
        # sendfile: the kernel streams the verified file to the socket without copying it through Python.
        return web.FileResponse(found, headers={"Content-Type": "application/octet-stream"})
    if request.method == "HEAD":
        return web.Response(status=200, headers={"Content-Type": "application/octet-stream",
                                                 "Content-Length": str(len(found))})
    return web.Response(status=200, body=found, content_type="application/octet-stream")


async def metrics(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    body = generate_latest(service.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def healthz(request: web.Request) -> web.StreamResponse:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    if request.app[DRAIN].draining:
        return _error(503, "service", "draining: this pod is leaving")
    if service.load_error:
        return _error(503, "model", f"failed to load: {service.load_error}")
    if not service.ready:
        return _error(503, "model", "loading")
    if service.awaiting_blend(time.monotonic()):
        return _error(503, "blend", "waiting for the CacheShard's blend settings from etcd")
    return web.json_response({"status": "ready", "model": service.model_name, "pod": service.settings.name})


async def drain(request: web.Request) -> web.StreamResponse:
    """Leave routing and wait for the requests inside (:mod:`kvshard_sidecar.api.drain`); for the
    ``preStop`` hook, so loopback only and a GET (what an ``httpGet`` hook can send)."""
    if request.remote not in LOOPBACK:
        return _error(403, "client", "drain is only accepted from loopback (the pod's own preStop hook)")
    try:
        timeout = float(request.query.get("timeout", "60"))
    except ValueError:
        return _error(400, "timeout", "not a number of seconds")
    follower = request.app.get(FOLLOWER)

    async def withdraw() -> None:
        if follower is not None:
            await follower.stop()

    answer = await request.app[DRAIN].run(withdraw, timeout=max(0.0, timeout))
    return web.json_response(answer, status=200 if answer["drained"] else 504)


async def warm_state(request: web.Request) -> web.StreamResponse:
    """What this pod follows, holds and is still warming (debugging placement)."""
    follower = request.app.get(FOLLOWER)
    if follower is None:
        service = request.app[SERVICE]
        if service.settings.etcd_endpoints and not service.ready:
            return _error(503, "service", "the model is still loading", {"Retry-After": "5"})
        return _error(404, "etcd_endpoints", "this sidecar does not follow placement (no --etcd-endpoints)")
    return web.json_response(follower.state())


def build_app(service: SidecarService) -> web.Application:
    """The aiohttp application; the model loads in the background after startup."""
    app = web.Application(middlewares=[errors_as_json], client_max_size=MAX_BODY_BYTES)
    app[SERVICE] = service
    app["admission"] = Admission(service.concurrency, service.settings.max_queue)
    app["compute"] = asyncio.Semaphore(service.concurrency)
    app[DRAIN] = Drain(lambda: app["admission"].inside, settle_seconds=service.settings.drain_settle_seconds)
    app["pool"] = ThreadPoolExecutor(max_workers=service.concurrency, thread_name_prefix="engine")
    app.router.add_post("/v1/recommend", recommend)
    app.router.add_post("/v1/blocks/prefill", prefill)
    app.router.add_get("/v1/blocks/{key}", get_block)  # aiohttp adds HEAD for GET routes
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/v1/warm", warm_state)
    app.router.add_get("/v1/drain", drain)
    app.on_startup.append(_start)
    app.on_cleanup.append(_stop)
    return app


async def _start(app: web.Application) -> None:
    service = app[SERVICE]
    loop = asyncio.get_running_loop()
    started = time.perf_counter()

    async def load() -> None:
        try:
            await loop.run_in_executor(app["pool"], service.load)
        except Exception as error:  # reported by /readyz; the process stays up for diagnosis
            log.exception("model failed to load")
            service.load_error = str(error)
            return
        log.info("sidecar %s ready in %.1f s (model %s)", service.settings.name,
                 time.perf_counter() - started, service.model_name)
        service.prefill_queue.start(loop, app["pool"], app["compute"])
        if service.vllm_computes:
            app["vllm_queue"] = asyncio.create_task(_follow_vllm_queue(service))
        admission: Admission = app["admission"]
        service.shadow.start(app["pool"], app["compute"], busy=lambda: admission.inside > 0)
        history = service.history_users(service.settings.warm_history_users)
        if service.settings.etcd_endpoints and not app[DRAIN].draining:  # history queues behind clusters
            follower = PlacementFollower(service, history)
            app[FOLLOWER] = follower
            follower.start()
            # logs the wait's end even when nobody asks /readyz (which logs it first when asked first)
            waited = time.monotonic() - (service.loaded_at or time.monotonic())
            loop.call_later(max(0.0, service.settings.blend_wait_seconds - waited),
                            lambda: service.awaiting_blend(time.monotonic()))
        elif history:
            service.prefill_queue.submit_units((WarmUnit("user", (u,)) for u in history), priority=1)

    app["loader"] = asyncio.create_task(load())


async def _follow_vllm_queue(service: SidecarService, every_seconds: float = 1.0) -> None:
    """Read vLLM's scheduler queue into the pressure gauge once a second (vLLM computes, so its queue is the
    pod's); a failed read keeps the last one and is logged once until a read succeeds."""
    client, capacity = service.vllm_client, service.settings.vllm_max_num_seqs
    assert client is not None
    failing = False
    while True:
        try:
            running, waiting = await asyncio.get_running_loop().run_in_executor(None, client.scheduler_queue)
        except (OSError, http.client.HTTPException, ValueError, IndexError) as error:
            if not failing:
                log.warning("cannot read vLLM's queue for the pressure gauge: %s", error)
            failing = True
        else:
            service.metrics.pressure.engine_queue(running, waiting, capacity)
            failing = False
        await asyncio.sleep(every_seconds)


async def _stop(app: web.Application) -> None:
    service = app[SERVICE]
    app["loader"].cancel()
    if "vllm_queue" in app:
        await cancel_and_wait(app["vllm_queue"])
    follower = app.get(FOLLOWER)
    if follower is not None:
        await follower.stop()
    await service.prefill_queue.stop()
    await service.shadow.stop()
    app["pool"].shutdown(wait=True, cancel_futures=True)
    service.close()
