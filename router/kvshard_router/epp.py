"""``kvshard router epp``: the router's policy core as a Gateway API Inference Extension endpoint picker.

Envoy-based gateways ask an *endpoint picker* (EPP) which model-server pod of an ``InferencePool`` a
request goes to, over Envoy's external-processing (``ext_proc``) gRPC stream, one stream per HTTP
request. This module speaks that protocol — the GIE Endpoint Picker Protocol **v1.0.0**
(kubernetes-sigs/gateway-api-inference-extension, docs/proposals/004-endpoint-picker-protocol) — and
nothing else: the choice itself is :class:`~kvshard_router.picker.Picker`'s, the one
``kvshard router serve`` uses (same snapshot, policies, warm gating, drain and load), so a request
goes to the same pod through either front end. It is the only module of the router that imports
gRPC or Envoy's protos (an import-linter contract keeps it so).

One stream, as the protocol has it (``FULL_DUPLEX_STREAMED`` request body, the mode GIE requires):

* request headers: remembered (and the subset hint, ``envoy.lb.subset_hint`` →
  ``x-gateway-destination-endpoint-subset`` in the filter metadata, if the data plane sends one);
* request body chunks: buffered until ``end_of_stream``; then the pick, answered with a headers
  response setting ``x-gateway-destination-endpoint: <ip:port>`` (and clearing the route cache) whose
  ``dynamic_metadata`` carries the same value under ``envoy.lb``, then the whole body back as one
  streamed body response. With a ``BUFFERED`` body (announced in ``protocol_config``) the headers are
  let through at once and the mutation rides on the body response;
* no pod eligible (none healthy, none in the subset, no placement yet) → ``ImmediateResponse`` 503;
  a body the router cannot route (not JSON, no ``candidates``, …) → ``ImmediateResponse`` 400 (415 for
  a non-JSON content type) with the router's JSON error; the picker keeps serving other streams;
* response headers: the served endpoint (``envoy.lb`` → ``x-gateway-destination-endpoint-served``,
  else the picked one) answered; on 2xx the affinity policy remembers the blocks it now holds;
* the request's work counts in the pod's backlog from the pick until the stream ends.

The destination is ``host:port`` of the pod's reported URL (its sidecar, ``http://$(POD_IP):8100`` in a
pod), one endpoint: GIE's fallback list is optional and a second choice would cost a second decision.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import grpc
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from kvshard.etcd_store import EtcdStore
from kvshard.request_errors import error_body
from kvshard_router.app import ROUTER_APP, RouterApp, add_status_routes, errors_as_json
from kvshard_router.metrics import NO_POD, status_class
from kvshard_router.picker import Pick, Picker, Refusal
from kvshard_router.settings import RouterSettings
from kvshard_router.state import RouterState

log = logging.getLogger(__name__)

PROTOCOL_VERSION = "v1.0.0"
"""The GIE Endpoint Picker Protocol version implemented (its version history's latest, 2025-07-29)."""
DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
POD_HEADER = "x-kvshard-pod"
GENERATION_HEADER = "x-kvshard-generation"
STREAMED = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED


def endpoint_of(url: str) -> str | None:
    """``host:port`` of a pod's base URL (``[v6]:port`` for IPv6), the scheme's port when it names none."""
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    host = parts.hostname
    if not host:
        return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Endpoints:
    """Pod ↔ ``ip:port``, rebuilt only when the warm reports (which carry the URLs) change."""

    def __init__(self, state: RouterState) -> None:
        self.state = state
        self._for: object = None
        self._of_pod: dict[str, str] = {}
        self._pod_at: dict[str, str] = {}

    def _refresh(self) -> None:
        if self._for is not self.state.reports:
            self._for = self.state.reports
            self._of_pod = {pod: ep for pod, report in self.state.reports.items()
                            if (ep := endpoint_of(report.url)) is not None}
            self._pod_at = {ep: pod for pod, ep in self._of_pod.items()}

    def of(self, pod: str) -> str | None:
        self._refresh()
        return self._of_pod.get(pod)

    def pods_at(self, endpoints: Iterable[str]) -> set[str]:
        self._refresh()
        return {pod for ep in endpoints if (pod := self._pod_at.get(ep)) is not None}

    def pod_at(self, endpoint: str) -> str | None:
        self._refresh()
        return self._pod_at.get(endpoint)


def _headers(message: pb.HttpHeaders) -> dict[str, str]:
    return {h.key.lower(): (h.raw_value.decode(errors="replace") if h.raw_value else h.value)
            for h in message.headers.headers}


def _metadata_value(metadata: base_pb2.Metadata, namespace: str, key: str) -> struct_pb2.Value | None:
    if namespace not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[namespace].fields
    return fields[key] if key in fields else None


def immediate(status: int, field: str, message: str, *, retry_after: bool = False) -> pb.ProcessingResponse:
    """An ``ImmediateResponse``: Envoy answers the client with it and does not forward the request."""
    headers = [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="content-type",
                                                                     raw_value=b"application/json"))]
    if retry_after:
        headers.append(base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="retry-after", raw_value=b"1")))
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        headers=pb.HeaderMutation(set_headers=headers),
        body=json.dumps(error_body(field, message)).encode(),
        details=f"kvshard-epp: {field}: {message}"))


@dataclass
class _Phase:
    """How Envoy sends this stream's bodies (``protocol_config`` on the first message; GIE's default)."""

    request_body: int = STREAMED
    response_body: int = STREAMED


class ExtProcStream:
    """One HTTP request's ext_proc stream: Envoy's messages in (:meth:`handle`), the answers out.

    No I/O: the gRPC servicer below feeds it, and so can a test or the routing simulator."""

    def __init__(self, picker: Picker, endpoints: Endpoints, *, account_load: bool = True) -> None:
        self.picker = picker
        self.endpoints = endpoints
        self.account_load = account_load
        """Count the request's work in the pod's backlog from the pick to the stream's end (off only
        where the caller does, as the routing simulator does on its simulated clock)."""
        self.phase = _Phase()
        self.headers: dict[str, str] = {}
        self.subset: list[str] | None = None
        self.body = bytearray()
        self.pick: Pick | None = None
        self.endpoint: str | None = None
        self.finished = False
        """An immediate response was sent (or the request is done): later messages are ignored."""
        self._counted = False

    def handle(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The answers to one message from Envoy (possibly none yet, possibly several in order)."""
        if message.HasField("protocol_config"):
            config = message.protocol_config
            self.phase = _Phase(config.request_body_mode or STREAMED, config.response_body_mode or STREAMED)
        if self.finished:
            return []
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return self._request_headers(message)
        if kind == "request_body":
            self.body += message.request_body.body
            if not message.request_body.end_of_stream:
                return []
            return self._decide()
        if kind == "request_trailers":
            return [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_headers":
            return self._response_headers(message)
        if kind == "response_body":
            chunk = message.response_body
            if self.phase.response_body == STREAMED:
                mutation = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                    body=chunk.body, end_of_stream=chunk.end_of_stream))
                return [pb.ProcessingResponse(response_body=pb.BodyResponse(
                    response=pb.CommonResponse(body_mutation=mutation)))]
            return [pb.ProcessingResponse(response_body=pb.BodyResponse())]
        if kind == "response_trailers":
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    def _request_headers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.headers = _headers(message.request_headers)
        hint = _metadata_value(message.metadata_context, SUBSET_NAMESPACE, SUBSET)
        if hint is not None:
            if hint.HasField("list_value"):
                self.subset = [v.string_value for v in hint.list_value.values]
            else:  # tolerate one comma-separated string
                self.subset = [e.strip() for e in hint.string_value.split(",") if e.strip()]
        content_type = self.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if content_type != "application/json":
            return self._refuse(Refusal(415, "body", "Content-Type must be application/json"))
        if message.request_headers.end_of_stream:  # no body: nothing to route by
            return self._decide()
        if self.phase.request_body == BUFFERED:
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]
        return []  # streamed: the headers answer waits for the pick

    def _decide(self) -> list[pb.ProcessingResponse]:
        only = None if self.subset is None else self.endpoints.pods_at(self.subset)
        result = self.picker.pick(bytes(self.body), only=only)
        if isinstance(result, Pick):
            endpoint = self.endpoints.of(result.pod)
            if endpoint is None:  # its report lost its URL since the snapshot (it is not routable then)
                result = Refusal(503, "pods", f"pod {result.pod} has no usable URL", retry_after=True)
            else:
                return self._route(result, endpoint)
        return self._refuse(result)

    def _route(self, pick: Pick, endpoint: str) -> list[pb.ProcessingResponse]:
        self.pick, self.endpoint = pick, endpoint
        if self.account_load:
            self.picker.load.start(pick.pod, pick.work)
        set_headers = [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()))
                       for k, v in ((DESTINATION, endpoint), (POD_HEADER, pick.pod),
                                    (GENERATION_HEADER, str(pick.snapshot.generation)))]
        metadata = struct_pb2.Struct()
        metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value = endpoint
        routed = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=set_headers), clear_route_cache=True)
        if self.phase.request_body == BUFFERED:
            return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=routed), dynamic_metadata=metadata)]
        # streamed: the body passes through the picker, so it goes back to Envoy after the headers
        body = pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=bytes(self.body), end_of_stream=True))
        return [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=routed), dynamic_metadata=metadata),
                pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=body)))]

    def _refuse(self, refusal: Refusal) -> list[pb.ProcessingResponse]:
        self.finished = True
        self._count(None, refusal.status)
        return [immediate(refusal.status, refusal.field, refusal.message, retry_after=refusal.retry_after)]

    def _response_headers(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        status = _headers(message.response_headers).get(":status", "")
        served = _metadata_value(message.metadata_context, LB_NAMESPACE, SERVED)
        pick = self.pick
        if pick is not None and status.isdigit():
            pod = pick.pod
            if served is not None and served.string_value and served.string_value != self.endpoint:
                pod = self.endpoints.pod_at(served.string_value) or pod
            if 200 <= int(status) < 300:
                self.picker.answered(pick, pod)
            self._count(pod, int(status))
        return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]

    def _count(self, pod: str | None, status: int) -> None:
        if not self._counted:
            self._counted = True
            self.picker.metrics.requests.labels(pod or NO_POD, status_class(status)).inc()

    def close(self) -> None:
        """The stream ended (the request is done, or Envoy gave up): its work leaves the pod's backlog."""
        if self.pick is not None and not self.finished and self.account_load:
            self.picker.load.finish(self.pick.pod, self.pick.work)
        self.finished = True


class EndpointPickerService(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]  # untyped protos
    """The gRPC ``envoy.service.ext_proc.v3.ExternalProcessor`` over :class:`ExtProcStream`."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.endpoints = Endpoints(picker.state)

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],  # noqa: N802 (gRPC's name)
                      context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
                      ) -> AsyncIterator[pb.ProcessingResponse]:
        stream = ExtProcStream(self.picker, self.endpoints)
        try:
            async for message in request_iterator:
                for answer in stream.handle(message):
                    yield answer
        finally:
            stream.close()


async def start_grpc(picker: Picker, host: str, port: int) -> grpc.aio.Server:
    """The ext_proc server on ``host:port``, started (on the running event loop: the snapshot is only
    mutated there, so the servicer reads it without locks)."""
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(EndpointPickerService(picker), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if server.add_insecure_port(address) == 0:
        raise OSError(f"cannot listen on {address} for ext_proc")
    await server.start()
    return server


async def readyz(request: web.Request) -> web.StreamResponse:
    """Ready once a placement snapshot is loaded (with no healthy pod the picker still answers: 503s,
    as the protocol says)."""
    state = request.app[ROUTER_APP].state
    snapshot = state.snapshot
    if snapshot is None:
        return web.json_response(error_body("placement", "no placement loaded yet"), status=503)
    healthy = [pod for pod in state.pods() if state.routable(pod)]
    return web.json_response({"status": "ready", "generation": snapshot.generation, "healthy_pods": healthy,
                              "protocol": f"gateway-api-inference-extension endpoint picker {PROTOCOL_VERSION}"})


GRPC_SERVER = web.AppKey("epp_grpc", grpc.aio.Server)


def build_epp_app(settings: RouterSettings, store: EtcdStore | None) -> web.Application:
    """The EPP's HTTP side (``/healthz``, ``/readyz``, ``/metrics``, ``/v1/placement`` on ``port``) with
    the router core and the ext_proc gRPC server (on ``epp_port``) started and stopped with it."""
    app = web.Application(middlewares=[errors_as_json])
    router_app = RouterApp(settings, store)
    app[ROUTER_APP] = router_app
    add_status_routes(app, readyz)

    async def start(app: web.Application) -> None:
        await router_app.start()
        assert router_app.picker is not None
        app[GRPC_SERVER] = await start_grpc(router_app.picker, settings.host, settings.epp_port)
        log.info("endpoint picker (GIE protocol %s) serving ext_proc on %s:%d", PROTOCOL_VERSION, settings.host,
                 settings.epp_port)

    async def stop(app: web.Application) -> None:
        server = app.get(GRPC_SERVER)
        if server is not None:
            await server.stop(grace=2.0)
        await router_app.stop()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app


def request_messages(body: bytes, *, headers: Mapping[str, str] | None = None, chunk: int = 0,
                     subset: Iterable[str] | None = None) -> list[pb.ProcessingRequest]:
    """What Envoy sends for one ``POST`` with ``body`` (streamed in ``chunk``-byte pieces, 0: one):
    for tests and the routing benchmark, which play Envoy."""
    sent = {":method": "POST", ":path": "/v1/recommend", "content-type": "application/json", **(headers or {})}
    first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in sent.items()])))
    if subset is not None:
        first.metadata_context.filter_metadata[SUBSET_NAMESPACE].fields[SUBSET].list_value.extend(list(subset))
    size = chunk or max(1, len(body))
    pieces = [body[i:i + size] for i in range(0, len(body), size)] or [b""]
    return [first, *(pb.ProcessingRequest(request_body=pb.HttpBody(body=p, end_of_stream=k == len(pieces) - 1))
                     for k, p in enumerate(pieces))]


def destination(answers: Iterable[pb.ProcessingResponse]) -> str | None:
    """The endpoint the answers route to (the header; None for an immediate response or none yet)."""
    for answer in answers:
        if answer.HasField("request_headers") or answer.HasField("request_body"):
            which = answer.request_headers if answer.HasField("request_headers") else answer.request_body
            for option in which.response.header_mutation.set_headers:
                if option.header.key == DESTINATION:
                    return str(option.header.raw_value.decode())
    return None



def response_headers(status: int, served: str | None = None) -> pb.ProcessingRequest:
    """What Envoy sends when the upstream's response headers come (``served``: the endpoint that
    answered, in ``envoy.lb``)."""
    message = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":status", raw_value=str(status).encode())])))
    if served is not None:
        message.metadata_context.filter_metadata[LB_NAMESPACE].fields[SERVED].string_value = served
    return message


class EnvoyClient:
    """Plays Envoy's side of ext_proc over a real gRPC channel, one stream per HTTP request: for the
    tests and the routing benchmark (nothing in a deployment uses it)."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)

    def open(self) -> grpc.aio.StreamStreamCall[pb.ProcessingRequest, pb.ProcessingResponse]:
        """A new stream (one HTTP request)."""
        call: grpc.aio.StreamStreamCall[pb.ProcessingRequest, pb.ProcessingResponse] = self.stub.Process()
        return call

    async def request(self, body: bytes, **options: Any,
                      ) -> tuple[grpc.aio.StreamStreamCall[pb.ProcessingRequest, pb.ProcessingResponse],
                                 list[pb.ProcessingResponse]]:
        """One request's headers and body (``options``: as :func:`request_messages`) on a new stream:
        the stream and the answers up to the body's, or the immediate response."""
        call = self.open()
        for message in request_messages(body, **options):
            await call.write(message)
        return call, await read_request_phase(call)

    async def finish(self, call: grpc.aio.StreamStreamCall[pb.ProcessingRequest, pb.ProcessingResponse],
                     status: int, served: str | None = None) -> pb.ProcessingResponse:
        """The upstream answered ``status``: send its response headers, read the answer, end the stream."""
        await call.write(response_headers(status, served))
        answer: pb.ProcessingResponse = await call.read()
        await call.done_writing()
        return answer

    async def close(self) -> None:
        await self.channel.close()


async def read_request_phase(call: grpc.aio.StreamStreamCall[pb.ProcessingRequest, pb.ProcessingResponse],
                             ) -> list[pb.ProcessingResponse]:
    """Answers until the request body's (or an immediate response); a stream that ends first is an error."""
    answers: list[pb.ProcessingResponse] = []
    while not answers or not (answers[-1].HasField("request_body") or answers[-1].HasField("immediate_response")):
        answer = await call.read()
        if answer is grpc.aio.EOF:
            raise ConnectionError(f"the ext_proc stream ended after {len(answers)} answers")
        answers.append(answer)
    return answers
