"""``kvshard router epp``: the router core as a Gateway API Inference Extension endpoint picker.

The tests play Envoy: a real ``grpc.aio`` client opens ext_proc streams to the real picker server
(:func:`kvshard_router.epp.start_grpc`) and sends what Envoy sends — request headers (with the GIE
subset hint in the filter metadata when given), the body in chunks, the response headers — and check
what comes back against the GIE Endpoint Picker Protocol v1.0.0
(docs/proposals/004-endpoint-picker-protocol): the destination header and the ``envoy.lb`` dynamic
metadata carrying the same ``ip:port``, an ``ImmediateResponse`` 503 when no pod is eligible, 400 for
a body the router cannot route, and a server that keeps serving.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from router_helpers import FakePod, eventually, metric, publish

from kvshard.cli import build_parser, main
from kvshard.etcd_store import EtcdStore
from kvshard.placement_schema import Placement, WarmReport
from kvshard_local.testing_servers import EtcdServer, free_port
from kvshard_router.app import ROUTER_APP, build_policy
from kvshard_router.backlog import Backlog
from kvshard_router.epp import (
    DESTINATION,
    LB_NAMESPACE,
    EnvoyClient,
    build_epp_app,
    destination,
    endpoint_of,
    request_messages,
    response_headers,
    start_grpc,
)
from kvshard_router.metrics import RouterMetrics
from kvshard_router.picker import Picker
from kvshard_router.settings import RouterSettings, from_args
from kvshard_router.state import RouterState

ITEMS = {**{f"a{i}": 0 for i in range(8)}, **{f"b{i}": 1 for i in range(8)}}
URLS = {"a": "http://10.0.0.1:8100", "b": "http://10.0.0.2:8100", "c": "http://10.0.0.3:8100"}
ENDPOINT = {pod: f"10.0.0.{k + 1}:8100" for k, pod in enumerate("abc")}
A_BODY = json.dumps({"user_id": "u1", "candidates": ["a0", "a1", "a2", "a3"]}).encode()
B_BODY = json.dumps({"user_id": "u1", "candidates": ["b0", "b1", "b2", "b3"]}).encode()


def world(*, c_warming: int = 0) -> RouterState:
    """Pods a (cluster 0), b (cluster 1) and c (cluster 0 too, still warming ``c_warming`` clusters),
    every one healthy."""
    state = RouterState()
    state.set_placement(Placement(1, {0: ("a", "c"), 1: ("b",)}, ITEMS, pods=("a", "b", "c")))
    state.set_reports({"a": WarmReport(1, (0,), URLS["a"]), "b": WarmReport(1, (1,), URLS["b"]),
                       "c": WarmReport(1, () if c_warming else (0,), URLS["c"], warming=c_warming)})
    for pod in "abc":
        state.set_health(pod, True)
    return state


def picker_for(state: RouterState, policy: str = "affinity") -> Picker:
    settings = RouterSettings(policy=policy)  # type: ignore[arg-type]
    load = Backlog()
    return Picker(state, build_policy(settings), load, RouterMetrics(state, load, cacheshard="default/epp"))


class Envoy(EnvoyClient):
    """Envoy's ext_proc client on loopback (one stream per HTTP request), plus whole requests."""

    def __init__(self, port: int) -> None:
        super().__init__(f"127.0.0.1:{port}")

    async def route(self, body: bytes, **options: Any) -> list[pb.ProcessingResponse]:
        """A whole request: the answers to its request phase, then a 200 and the end of the stream."""
        call, answers = await self.request(body, **options)
        if answers[-1].HasField("immediate_response"):
            await call.done_writing()
        else:
            await self.finish(call, 200)
        return answers


async def respond(call: Any, status: int, served: str | None = None) -> pb.ProcessingResponse:
    """The upstream's response headers, as Envoy forwards them to the picker; returns its answer."""
    await call.write(response_headers(status, served))
    answer: pb.ProcessingResponse = await call.read()
    assert answer.HasField("response_headers")
    return answer


def immediate(answers: list[pb.ProcessingResponse]) -> tuple[int, dict[str, Any]]:
    assert len(answers) == 1 and answers[0].HasField("immediate_response"), answers
    response = answers[0].immediate_response
    return int(response.status.code), json.loads(response.body)


@pytest.fixture
async def served() -> AsyncIterator[tuple[Picker, Envoy, int]]:
    """The picker over :func:`world`, serving ext_proc on a free port, and an Envoy talking to it."""
    picker = picker_for(world())
    port = free_port()
    server = await start_grpc(picker, "127.0.0.1", port)
    envoy = Envoy(port)
    yield picker, envoy, port
    await envoy.close()
    await server.stop(grace=None)


# ------------------------------------------------------------------------------------------ the protocol


async def test_a_warm_pod_is_picked_by_header_and_envoy_lb_metadata_with_the_same_endpoint(
    served: tuple[Picker, Envoy, int],
) -> None:
    picker, envoy, _ = served
    call, answers = await envoy.request(A_BODY, chunk=7)  # the body streamed in pieces
    headers, body = answers
    assert headers.HasField("request_headers") and body.HasField("request_body")
    mutation = {h.header.key: h.header.raw_value.decode() for h in headers.request_headers.response.header_mutation.
                set_headers}
    chosen = mutation[DESTINATION]
    assert chosen in (ENDPOINT["a"], ENDPOINT["c"])  # both hold cluster 0 warm
    assert headers.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value == chosen
    assert headers.request_headers.response.clear_route_cache  # Envoy re-picks the route for the new host
    streamed = body.request_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (A_BODY, True)  # the body goes on unchanged
    pod = mutation["x-kvshard-pod"]
    assert ENDPOINT[pod] == chosen and mutation["x-kvshard-generation"] == "1"
    assert picker.load.get(pod) == 1.0  # in flight until the stream ends

    await respond(call, 200)
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    assert picker.load.get(pod) == 0.0
    text = (await _scrape(picker))
    assert metric(text, "kvshard_router_requests_total", cacheshard="default/epp", pod=pod, code="2xx") == 1


async def test_each_request_goes_to_the_pod_holding_its_clusters(served: tuple[Picker, Envoy, int]) -> None:
    _, envoy, _ = served
    assert destination(await envoy.route(B_BODY)) == ENDPOINT["b"]
    picks = {destination(await envoy.route(A_BODY)) for _ in range(4)}
    assert picks == {ENDPOINT["a"], ENDPOINT["c"]}  # equal replicas share the traffic


async def test_a_cold_pod_gets_no_traffic_while_a_warm_one_can_take_it() -> None:
    picker = picker_for(world(c_warming=1))
    port = free_port()
    server = await start_grpc(picker, "127.0.0.1", port)
    envoy = Envoy(port)
    try:
        assert {destination(await envoy.route(A_BODY)) for _ in range(4)} == {ENDPOINT["a"]}
    finally:
        await envoy.close()
        await server.stop(grace=None)


async def test_a_draining_pod_that_withdrew_its_report_is_not_picked(served: tuple[Picker, Envoy, int]) -> None:
    picker, envoy, _ = served
    state = picker.state
    state.set_reports({pod: report for pod, report in state.reports.items() if pod != "a"})
    assert {destination(await envoy.route(A_BODY)) for _ in range(4)} == {ENDPOINT["c"]}


async def test_failed_pods_are_skipped_and_none_eligible_is_an_immediate_503(served: tuple[Picker, Envoy, int]) -> None:
    picker, envoy, _ = served
    state = picker.state
    state.set_health("a", False, "refused")
    state.set_health("c", False, "refused")
    assert destination(await envoy.route(A_BODY)) == ENDPOINT["b"]  # the only healthy pod
    state.set_health("b", False, "refused")
    status, body = immediate(await envoy.route(A_BODY))
    assert status == 503 and body["error"]["field"] == "pods"
    state.set_health("a", True)
    assert destination(await envoy.route(A_BODY)) == ENDPOINT["a"]


async def test_the_subset_hint_restricts_the_pick_and_an_ineligible_subset_is_503(
    served: tuple[Picker, Envoy, int],
) -> None:
    picker, envoy, _ = served
    assert destination(await envoy.route(A_BODY, subset=[ENDPOINT["b"]])) == ENDPOINT["b"]
    assert destination(await envoy.route(A_BODY, subset=[ENDPOINT["b"], ENDPOINT["c"]])) == ENDPOINT["c"]
    for subset in ([], ["10.9.9.9:8100"]):
        status, body = immediate(await envoy.route(A_BODY, subset=subset))
        assert status == 503 and "subset hint" in body["error"]["message"]
    picker.state.set_health("b", False, "refused")
    assert immediate(await envoy.route(A_BODY, subset=[ENDPOINT["b"]]))[0] == 503


@pytest.mark.parametrize(
    ("body", "content_type", "status", "field"),
    [
        (b"{not json", "application/json", 400, "body"),
        (b'{"user_id": "u1"}', "application/json", 400, "candidates"),
        (b'{"candidates": ["a0"]}', "application/json", 400, "user_id"),
        (b"", "application/json", 400, "body"),
        (A_BODY, "text/plain", 415, "body"),
    ],
)
async def test_a_bad_body_is_an_immediate_4xx_and_the_picker_keeps_serving(
    served: tuple[Picker, Envoy, int], body: bytes, content_type: str, status: int, field: str,
) -> None:
    picker, envoy, _ = served
    got, error = immediate(await envoy.route(body, headers={"content-type": content_type}))
    assert (got, error["error"]["field"]) == (status, field)
    assert destination(await envoy.route(B_BODY)) == ENDPOINT["b"]
    text = await _scrape(picker)
    assert metric(text, "kvshard_router_requests_total", cacheshard="default/epp", pod="none", code="4xx") == 1


async def test_before_any_placement_every_request_is_503_with_retry_after() -> None:
    state = RouterState()
    picker = picker_for(state)
    port = free_port()
    server = await start_grpc(picker, "127.0.0.1", port)
    envoy = Envoy(port)
    try:
        answers = await envoy.route(A_BODY)
        status, body = immediate(answers)
        assert status == 503 and body["error"]["field"] == "placement"
        headers = {h.header.key: h.header.raw_value for h in answers[0].immediate_response.headers.set_headers}
        assert headers["retry-after"] == b"1"
    finally:
        await envoy.close()
        await server.stop(grace=None)


async def test_the_served_endpoint_is_remembered_as_holding_the_blocks(served: tuple[Picker, Envoy, int]) -> None:
    """Envoy reports which endpoint served (it may have retried down its list); a 2xx there teaches the
    affinity policy that that pod now holds the request's blocks."""
    picker, envoy, _ = served
    body = json.dumps({"user_id": "u2", "candidates": ["b0", "b1", "b2", "b3"]}).encode()
    call, answers = await envoy.request(body)
    assert destination(answers) == ENDPOINT["b"]
    await respond(call, 200, served=ENDPOINT["a"])  # the gateway ended up on a
    await call.done_writing()
    snapshot = picker.state.snapshot
    recent = picker.policy.recent  # type: ignore[attr-defined]
    assert snapshot is not None and recent is not None
    held = recent.held_tokens(["b0"], snapshot.clusters_of(["b0"]), 16, snapshot).tolist()
    assert held == [16.0, 0.0, 0.0]  # a (which does not hold cluster 1 by placement) has b0 now


async def test_a_buffered_body_gets_the_destination_on_the_body_answer(served: tuple[Picker, Envoy, int]) -> None:
    _, envoy, _ = served
    call = envoy.open()
    messages = request_messages(B_BODY)
    config = pb.ProtocolConfiguration(request_body_mode=processing_mode_pb2.ProcessingMode.BUFFERED,
                                      response_body_mode=processing_mode_pb2.ProcessingMode.BUFFERED)
    messages[0].protocol_config.CopyFrom(config)
    await call.write(messages[0])
    first = await call.read()
    assert first.HasField("request_headers") and not first.request_headers.response.header_mutation.set_headers
    await call.write(messages[1])
    answer = await call.read()
    assert answer.HasField("request_body") and destination([answer]) == ENDPOINT["b"]
    assert answer.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value == ENDPOINT["b"]
    await call.done_writing()


async def test_a_streamed_response_body_passes_through_the_picker(served: tuple[Picker, Envoy, int]) -> None:
    _, envoy, _ = served
    call, _ = await envoy.request(B_BODY)
    await respond(call, 200)
    for piece, last in ((b'{"ranking"', False), (b': []}', True)):
        await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=piece, end_of_stream=last)))
        streamed = (await call.read()).response_body.response.body_mutation.streamed_response
        assert (streamed.body, streamed.end_of_stream) == (piece, last)
    await call.done_writing()


async def test_a_picker_restart_mid_stream_fails_that_stream_and_the_next_one_works() -> None:
    picker = picker_for(world())
    port = free_port()
    server = await start_grpc(picker, "127.0.0.1", port)
    envoy = Envoy(port)
    try:
        call = envoy.open()
        first, *_ = request_messages(A_BODY)
        await call.write(first)  # headers sent, the body not yet: the picker holds the stream open
        await server.stop(grace=None)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await call.read()
        assert failed.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)

        server = await start_grpc(picker_for(world()), "127.0.0.1", port)  # a fresh process state
        assert destination(await envoy.route(B_BODY)) == ENDPOINT["b"]  # the same channel reconnects
    finally:
        await envoy.close()
        await server.stop(grace=None)


def test_the_endpoint_is_host_and_port_of_the_reported_url() -> None:
    assert endpoint_of("http://10.1.2.3:8100") == "10.1.2.3:8100"
    assert endpoint_of("http://10.1.2.3") == "10.1.2.3:80"
    assert endpoint_of("https://pod.example") == "pod.example:443"
    assert endpoint_of("http://[fd00::5]:8100/") == "[fd00::5]:8100"
    assert endpoint_of("http://:8100") is None


async def _scrape(picker: Picker) -> str:
    from prometheus_client import generate_latest

    return generate_latest(picker.metrics.registry).decode()


# ------------------------------------------------------------------------------------------ `kvshard router epp`


async def test_the_epp_app_follows_etcd_checks_pods_and_picks_over_grpc(etcd_server: EtcdServer) -> None:
    """The whole ``kvshard router epp`` process minus argv: placement and warm reports from a real etcd,
    health checks against real loopback pods, ``/readyz`` once the snapshot is loaded, ext_proc picks."""
    a, b = FakePod("a"), FakePod("b")
    await a.start()
    await b.start()
    shard = "default/epp"
    settings = RouterSettings(port=free_port(), epp_port=free_port(), etcd_endpoints=(etcd_server.endpoint,),
                              cacheshard=shard, health_interval_seconds=0.2, **_tls(etcd_server))
    runner = web.AppRunner(build_epp_app(settings, EtcdStore([etcd_server.endpoint], tls=settings.etcd_tls())))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", settings.port).start()
    envoy = Envoy(settings.epp_port)
    http = f"http://127.0.0.1:{settings.port}"
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{http}/readyz") as resp:
                assert resp.status == 503  # no placement yet
            assert immediate(await envoy.route(A_BODY))[0] == 503
            await publish(etcd_server, shard, Placement(1, {0: ("a",), 1: ("b",)}, ITEMS, pods=("a", "b")),
                          {"a": WarmReport(1, (0,), a.url), "b": WarmReport(1, (1,), b.url)})

            async def two_healthy() -> bool:
                async with session.get(f"{http}/readyz") as resp:
                    return resp.status == 200 and len((await resp.json())["healthy_pods"]) == 2

            await eventually(two_healthy, what="the picker ready with both pods healthy")
            assert destination(await envoy.route(A_BODY)) == endpoint_of(a.url)
            assert destination(await envoy.route(B_BODY)) == endpoint_of(b.url)
            await b.stop()  # b's health checks fail: its requests go to a
            await eventually(lambda: not runner.app[ROUTER_APP].state.routable("b"), what="b unhealthy")
            assert destination(await envoy.route(B_BODY)) == endpoint_of(a.url)
            async with session.get(f"{http}/metrics") as resp:
                text = await resp.text()
            assert metric(text, "kvshard_router_requests_total", cacheshard=shard, pod="a", code="2xx") == 2
            assert metric(text, "kvshard_router_decision_seconds_count", cacheshard=shard) == 3
    finally:
        await envoy.close()
        await runner.cleanup()
        await a.stop()
        await b.stop()


def _tls(etcd: EtcdServer) -> dict[str, Any]:
    certs = etcd.certificates
    return {} if certs is None else {"etcd_ca_file": certs.ca, "etcd_cert_file": certs.client_cert,
                                     "etcd_key_file": certs.client_key}


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "kvshard router epp: --etcd-endpoints is required"),
        (["--etcd-endpoints", "127.0.0.1:2379", "--cacheshard", "default/x", "--epp-port", "0"],
         "epp_port must be in 1..65535"),
    ],
)
def test_kvshard_router_epp_refuses_bad_settings_like_serve(argv: list[str], says: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router", "epp", *argv]) == 2
    assert says in capsys.readouterr().err


def test_the_epp_port_comes_from_its_flag_or_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = build_parser(["router", "epp"])
    assert from_args(parser.parse_args(["router", "epp"])).epp_port == 9002
    monkeypatch.setenv("KVSHARD_ROUTER_EPP_PORT", "9100")
    assert from_args(parser.parse_args(["router", "epp"])).epp_port == 9100
    assert from_args(parser.parse_args(["router", "epp", "--epp-port", "9200"])).epp_port == 9200
