"""The router's HTTP API (aiohttp) and its lifecycle: thin handlers over :class:`Router`.

On startup one shared ``ClientSession`` is opened (connection reuse to the pods matters more than
anything else for the router's own latency), the health checker and the etcd follower start; on
cleanup they stop in reverse. Nothing is persisted: a restarted router rebuilds everything from etcd.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvshard.etcd_store import EtcdStore
from kvshard.tasks import cancel_and_wait
from kvshard_router.backlog import Backlog
from kvshard_router.corequest import CoRequestSketch
from kvshard_router.corequest_publisher import CoRequestPublisher
from kvshard_router.follower import PlacementFollower
from kvshard_router.health import HealthChecker
from kvshard_router.metrics import NO_POD, RouterMetrics
from kvshard_router.picker import Picker
from kvshard_router.policies import AffinityPolicy, RoutingPolicy, make_policy
from kvshard_router.service import Router, error_response
from kvshard_router.settings import RouterSettings
from kvshard_router.state import RouterState

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class RouterApp:
    """What the handlers share: settings, state, and (once started) the router and its tasks."""

    def __init__(self, settings: RouterSettings, store: EtcdStore | None) -> None:
        self.settings = settings
        self.store = store
        self.state = RouterState(default_item_tokens=settings.item_tokens)
        self.load = Backlog(cached_cost=settings.cached_token_cost, overhead_tokens=settings.request_overhead_tokens)
        self.policy = build_policy(settings)
        self.metrics = RouterMetrics(self.state, self.load, cacheshard=settings.cacheshard)
        self.session: aiohttp.ClientSession | None = None
        self.picker: Picker | None = None
        """The policy core both front ends share (HTTP forwarding here, ext_proc in kvshard_router.epp)."""
        self.router: Router | None = None
        self.health: HealthChecker | None = None
        self.follower: PlacementFollower | None = None
        self.corequest: CoRequestSketch | None = None
        self.publisher: CoRequestPublisher | None = None
        self.publisher_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        s = self.settings
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024), raise_for_status=False)
        self.picker = Picker(self.state, self.policy, self.load, self.metrics, history_tokens=s.history_tokens,
                             corequest=self._corequest())
        self.router = Router(self.picker, self.session, request_timeout=s.request_timeout_seconds,
                             connect_timeout=s.connect_timeout_seconds)
        self.health = HealthChecker(self.state, self.session, interval=s.health_interval_seconds,
                                    timeout=s.connect_timeout_seconds)
        self.health.start()
        if self.store is not None:
            namespace, name = s.shard()
            self.follower = PlacementFollower(self.store, namespace, name, self.state)
            self.follower.start()
            if self.corequest is not None:
                self.publisher = CoRequestPublisher(
                    self.store, namespace, name, s.router_name or socket.gethostname(), self.corequest,
                    interval_seconds=s.corequest_interval_seconds, top=s.corequest_top_pairs)
                self.publisher_task = asyncio.create_task(self.publisher.run(), name="corequest-publisher")
        log.info("router serving policy %s for %s", s.policy, s.cacheshard or "-")

    def _corequest(self) -> CoRequestSketch | None:
        """A co-request sketch when there is an etcd to publish it to and counting is on."""
        if self.store is not None and self.settings.corequest_interval_seconds > 0:
            self.corequest = CoRequestSketch(capacity=4 * self.settings.corequest_top_pairs)
        return self.corequest

    async def stop(self) -> None:
        await cancel_and_wait(self.publisher_task)
        if self.follower is not None:
            await self.follower.stop()
        if self.health is not None:
            await self.health.stop()
        if self.session is not None:
            await self.session.close()


ROUTER_APP = web.AppKey("router", RouterApp)


def build_policy(settings: RouterSettings) -> RoutingPolicy:
    if settings.policy == "affinity":
        # weighs cached tokens against the Backlog (kvshard_router.backlog)
        return AffinityPolicy(recent_blocks_per_pod=settings.recent_blocks_per_pod)
    return make_policy(settings.policy)


@web.middleware
async def errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own errors (404, 405, 413) as the same JSON error body the API uses."""
    try:
        return await handler(request)
    except web.HTTPException as error:
        if error.status >= 400 and error.content_type != "application/json":
            return error_response(error.status, "request", error.reason)
        raise


async def recommend(request: web.Request) -> web.StreamResponse:
    app = request.app[ROUTER_APP]
    assert app.router is not None
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        app.metrics.requests.labels(NO_POD, "4xx").inc()
        return error_response(413, "body", f"larger than {MAX_BODY_BYTES} bytes")
    return await app.router.recommend(raw, request.content_type)


async def placement(request: web.Request) -> web.StreamResponse:
    app = request.app[ROUTER_APP]
    assert app.router is not None
    view = app.router.placement_view()
    view["cacheshard"] = app.settings.cacheshard
    view["etcd"] = {"endpoints": list(app.settings.etcd_endpoints),
                    "errors": {k: v for k, v in (app.follower.errors if app.follower else {}).items() if v}}
    return web.json_response(view)


async def metrics(request: web.Request) -> web.StreamResponse:
    body = generate_latest(request.app[ROUTER_APP].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def healthz(request: web.Request) -> web.StreamResponse:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.StreamResponse:
    """Ready when a placement is loaded and at least one of its pods can take requests."""
    router_app = request.app[ROUTER_APP]
    state, follower = router_app.state, router_app.follower
    snapshot = state.snapshot
    if snapshot is None:
        # say why when etcd refuses us (a wrong CA, a missing client certificate), not only that
        reason = follower.errors.get("placement", "") if follower is not None else ""
        return error_response(503, "placement", "no placement loaded yet" + (f": {reason}" if reason else ""))
    healthy = [pod for pod in state.pods() if state.routable(pod)]
    if not healthy:
        return error_response(503, "pods", f"none of the {len(snapshot.pods)} pods of generation "
                              f"{snapshot.generation} is healthy")
    return web.json_response({"status": "ready", "generation": snapshot.generation, "healthy_pods": healthy})


def add_status_routes(app: web.Application,
                      ready: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> None:
    """What both front ends serve besides their requests: ``/v1/placement``, ``/metrics``, ``/healthz``
    and ``ready`` as ``/readyz`` (each front end says itself when it is ready)."""
    app.router.add_get("/v1/placement", placement)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", ready)


def build_app(settings: RouterSettings, store: EtcdStore | None) -> web.Application:
    """The aiohttp application; ``store`` (not yet connected) is followed for placement."""
    app = web.Application(middlewares=[errors_as_json], client_max_size=MAX_BODY_BYTES)
    router_app = RouterApp(settings, store)
    app[ROUTER_APP] = router_app
    app.router.add_post("/v1/recommend", recommend)
    add_status_routes(app, readyz)

    async def start(_: web.Application) -> None:
        await router_app.start()

    async def stop(_: web.Application) -> None:
        await router_app.stop()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app
