"""The two front ends choose alike: for the same requests over the same snapshot, ``kvshard router serve``
(HTTP, forwarding to real loopback pods) and ``kvshard router epp`` (Envoy ext_proc messages) pick the
same pod, or refuse with the same status — whatever the placement, warm reports, drains, health and
policy. Each front end has its own policy and backlog (as two processes would), on one shared clock.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import aiohttp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router_helpers import FakePod

from kvshard.placement_schema import Placement, WarmReport
from kvshard_router.app import build_policy
from kvshard_router.backlog import Backlog
from kvshard_router.epp import (
    Endpoints,
    ExtProcStream,
    destination,
    endpoint_of,
    request_messages,
    response_headers,
)
from kvshard_router.metrics import RouterMetrics
from kvshard_router.picker import Picker
from kvshard_router.service import Router
from kvshard_router.settings import RouterSettings
from kvshard_router.state import RouterState

ITEM_IDS = [f"i{k}" for k in range(12)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class Pod:
    clusters: frozenset[int]
    warm: frozenset[int]
    reported: bool
    healthy: bool


@st.composite
def worlds(draw: st.DrawFn) -> tuple[dict[str, int], list[Pod], list[tuple[str, list[str]]], str]:
    clusters = draw(st.integers(1, 4))
    items = {i: draw(st.integers(0, clusters - 1)) for i in ITEM_IDS}
    n = draw(st.integers(1, 4))
    pods = []
    for _ in range(n):
        held = draw(st.frozensets(st.integers(0, clusters - 1), max_size=clusters))
        pods.append(Pod(held, draw(st.frozensets(st.sampled_from(sorted(held)), max_size=len(held)))
                        if held else frozenset(), draw(st.booleans()), draw(st.booleans())))
    requests = draw(st.lists(st.tuples(st.sampled_from(["u1", "u2", "u3"]),
                                       st.lists(st.sampled_from([*ITEM_IDS, "unknown"]), min_size=1, max_size=6)),
                             min_size=1, max_size=8))
    policy = draw(st.sampled_from(["affinity", "round-robin", "least-loaded", "prefix-aware"]))
    return items, pods, requests, policy


def state_of(items: dict[str, int], pods: list[Pod], urls: list[str]) -> RouterState:
    names = [f"p{k}" for k in range(len(pods))]
    assignment: dict[int, tuple[str, ...]] = {}
    for name, pod in zip(names, pods, strict=True):
        for c in sorted(pod.clusters):
            assignment[c] = (*assignment.get(c, ()), name)
    state = RouterState()
    state.set_placement(Placement(1, assignment, items, pods=tuple(names)))
    state.set_reports({name: WarmReport(1, tuple(sorted(pod.warm)), url, warming=len(pod.clusters - pod.warm))
                       for name, pod, url in zip(names, pods, urls, strict=True) if pod.reported})
    for name, pod in zip(names, pods, strict=True):
        state.set_health(name, pod.healthy, "" if pod.healthy else "refused")
    return state


def picker_for(state: RouterState, policy: str, clock: Clock) -> Picker:
    load = Backlog(clock=clock)
    return Picker(state, build_policy(RouterSettings(policy=policy)),  # type: ignore[arg-type]
                  load, RouterMetrics(state, load, cacheshard=""))


async def both(items: dict[str, int], pods: list[Pod], requests: list[tuple[str, list[str]]], policy: str) -> None:
    fakes = [FakePod(f"p{k}") for k in range(len(pods))]
    for fake in fakes:
        await fake.start()
    try:
        urls = [fake.url for fake in fakes]
        clock = Clock()
        http_state, epp_state = state_of(items, pods, urls), state_of(items, pods, urls)
        http_picker, epp_picker = picker_for(http_state, policy, clock), picker_for(epp_state, policy, clock)
        endpoints = Endpoints(epp_state)
        pod_at = {endpoint_of(url): f"p{k}" for k, url in enumerate(urls)}
        async with aiohttp.ClientSession() as session:
            router = Router(http_picker, session, request_timeout=10, connect_timeout=2)
            for user, candidates in requests:
                clock.now += 1.0
                raw = json.dumps({"user_id": user, "candidates": candidates}).encode()
                response = await router.recommend(raw, "application/json")
                http = (response.status, response.headers.get("X-Kvshard-Pod"))

                stream = ExtProcStream(epp_picker, endpoints)
                answers = [a for m in request_messages(raw) for a in stream.handle(m)]
                epp: tuple[int, str | None]
                if answers[0].HasField("immediate_response"):
                    epp = (int(answers[0].immediate_response.status.code), None)
                else:
                    epp = (200, pod_at[destination(answers)])
                    stream.handle(response_headers(200))
                stream.close()
                assert epp == http, (user, candidates)
    finally:
        for fake in fakes:
            await fake.stop()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds())
def test_the_epp_and_the_http_router_choose_the_same_pod(world: tuple[dict[str, int], list[Pod],
                                                                       list[tuple[str, list[str]]], str]) -> None:
    asyncio.run(both(*world))
