"""One ``/v1/recommend`` through the router: parse, choose a pod, forward, fail over once.

Failure rules (a client sees exactly one of these):

* bad body → 400/415 naming the field, nothing forwarded;
* no placement yet, or no healthy pod → 503 with ``Retry-After``;
* the chosen pod cannot be reached (refused, reset, connect timeout, disconnected) or answers 503
  (not ready) → it is marked unhealthy at once (passive health check) and the request is re-sent
  **once** to the best other healthy pod; if that fails too → 502 naming both pods. A connection
  failure with no other healthy pod → 502; a 503 with no other pod is passed through (it carries the
  sidecar's own ``Retry-After``);
* any other answer of the pod, 4xx/5xx included, is passed through unchanged and not retried (the
  sidecar validated the request; sending it elsewhere would give the same answer);
* the pod takes longer than ``request_timeout_seconds`` → 504 (not retried: it may still be working).

Every answer from a pod carries ``X-Kvshard-Pod`` and ``X-Kvshard-Generation``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any

import aiohttp
from aiohttp import web

from kvshard.request_errors import error_body
from kvshard_router.metrics import NO_POD, status_class
from kvshard_router.picker import Pick, Picker, Refusal
from kvshard_router.policies import POLICIES, RoutingPolicy
from kvshard_router.state import RouterState

log = logging.getLogger(__name__)

POD_HEADER = "X-Kvshard-Pod"
GENERATION_HEADER = "X-Kvshard-Generation"
PASSED_HEADERS = ("Content-Type", "Retry-After")
RETRY_AFTER_SECONDS = "1"
# Failures before or while talking to the pod that say nothing about the request itself.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    aiohttp.ClientConnectorError,    # refused, unreachable, DNS
    aiohttp.ConnectionTimeoutError,  # connect timeout
    aiohttp.ServerDisconnectedError,  # closed before answering
    aiohttp.ClientOSError,           # reset
    aiohttp.ClientPayloadError,      # reset in the middle of the answer
    aiohttp.InvalidURL,              # a warm report with a URL aiohttp cannot use
)


@dataclasses.dataclass(frozen=True)
class Upstream:
    """A pod's whole answer."""

    pod: str
    status: int
    body: bytes
    headers: dict[str, str]


@dataclasses.dataclass(frozen=True)
class Failure:
    """A pod that could not be used for this request (connection failure or 503)."""

    pod: str
    reason: str
    answer: Upstream | None = None


def error_response(status: int, field: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(field, message), status=status, headers=headers)


def refusal_response(refusal: Refusal) -> web.Response:
    """The picker's refusal as the API's JSON error (with ``Retry-After`` and the generation when known)."""
    headers = {"Retry-After": RETRY_AFTER_SECONDS} if refusal.retry_after else {}
    if refusal.generation is not None:
        headers[GENERATION_HEADER] = str(refusal.generation)
    return error_response(refusal.status, refusal.field, refusal.message, headers or None)


class Router:
    """Routes requests by ``picker`` (parse, one-lookup decision, counts) and forwards them to the pods."""

    def __init__(self, picker: Picker, session: aiohttp.ClientSession, *, request_timeout: float,
                 connect_timeout: float) -> None:
        self.picker = picker
        self.state = picker.state
        self.policy = picker.policy
        self.load = picker.load
        self.metrics = picker.metrics
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=request_timeout, sock_connect=connect_timeout)

    def _count(self, pod: str | None, status: int) -> None:
        self.metrics.requests.labels(pod or NO_POD, status_class(status)).inc()

    async def recommend(self, raw: bytes, content_type: str) -> web.Response:
        """Answer one ``POST /v1/recommend`` whose body is ``raw``."""
        response = await self._recommend(raw, content_type)
        self._count(response.headers.get(POD_HEADER), response.status)
        return response

    async def _recommend(self, raw: bytes, content_type: str) -> web.Response:
        if content_type != "application/json":
            return error_response(415, "body", "Content-Type must be application/json")
        first = self.picker.pick(raw)
        if isinstance(first, Refusal):
            return refusal_response(first)
        generation = {GENERATION_HEADER: str(first.snapshot.generation)}
        tried = await self._forward(first.pod, raw, content_type, first.work)
        if isinstance(tried, Upstream):
            return self._reply(tried, first)
        self.state.set_health(first.pod, False, tried.reason)
        other = self.picker.again(first, self.state.snapshot or first.snapshot)
        if other is None:
            if tried.answer is not None:
                return self._reply(tried.answer, first)
            return error_response(502, "pods", f"pod {first.pod} {tried.reason}; no other pod is healthy",
                                  {"Retry-After": RETRY_AFTER_SECONDS, **generation})
        self.metrics.retries.inc()
        log.warning("pod %s %s; sending the request to %s instead", first.pod, tried.reason, other.pod)
        second = await self._forward(other.pod, raw, content_type, other.work)
        if isinstance(second, Upstream):
            return self._reply(second, other)
        self.state.set_health(other.pod, False, second.reason)
        return error_response(502, "pods", f"pod {first.pod} {tried.reason}; pod {other.pod} {second.reason}",
                              {"Retry-After": RETRY_AFTER_SECONDS, **generation})

    def _reply(self, answer: Upstream, pick: Pick) -> web.Response:
        if 200 <= answer.status < 300:
            self.picker.answered(pick, answer.pod)
        headers = {**answer.headers, POD_HEADER: answer.pod, GENERATION_HEADER: str(pick.snapshot.generation)}
        return web.Response(status=answer.status, body=answer.body, headers=headers)

    async def _forward(self, pod: str, raw: bytes, content_type: str, work: float) -> Upstream | Failure:
        url = self.state.url(pod)
        if url is None:
            return Failure(pod, "has no URL any more")
        self.load.start(pod, work)
        started = time.perf_counter()
        try:
            async with self.session.post(f"{url}/v1/recommend", data=raw, timeout=self.timeout,
                                         headers={"Content-Type": content_type}, allow_redirects=False) as resp:
                body = await resp.read()
                headers = {name: resp.headers[name] for name in PASSED_HEADERS if name in resp.headers}
                answer = Upstream(pod, resp.status, body, headers)
        except CONNECTION_ERRORS as error:
            return Failure(pod, f"could not be reached ({type(error).__name__}: {error})")
        except TimeoutError:
            answer = Upstream(pod, 504, _json_error("pods", f"pod {pod} did not answer within "
                                                    f"{self.timeout.total:g} s"),
                              {"Content-Type": "application/json"})
        finally:
            self.load.finish(pod, work)
            self.metrics.upstream.labels(pod).observe(time.perf_counter() - started)
        if answer.status == 503:
            return Failure(pod, f"answered 503 ({_message(answer.body)})", answer)
        return answer

    def placement_view(self) -> dict[str, Any]:
        """What the router routes by, for ``GET /v1/placement``."""
        state = self.state
        snapshot = state.snapshot
        pods = []
        for pod in state.pods():
            assigned = state.placement.clusters_of(pod) if state.placement is not None else []
            pods.append({
                "name": pod,
                "url": state.url(pod),
                "healthy": state.routable(pod),
                "reason": None if state.routable(pod) else _unhealthy_reason(state, pod),
                "inflight": self.load.get(pod),
                "warm": sorted(state.warm(pod)),
                "assigned": assigned,
            })
        return {
            "generation": state.generation,
            "updated_at": state.updated_at,
            "policy": _policy_name(self.policy),
            "clusters": snapshot.clusters if snapshot is not None else 0,
            "items": len(snapshot.items) if snapshot is not None else 0,
            "pods": pods,
        }


def _unhealthy_reason(state: RouterState, pod: str) -> str:
    if state.url(pod) is None:
        return "no usable URL in its warm report"
    return state.health_reason.get(pod) or "not checked yet"


def _policy_name(policy: RoutingPolicy) -> str:
    return next((name for name, cls in POLICIES.items() if type(policy) is cls), type(policy).__name__)


def _json_error(field: str, message: str) -> bytes:
    return json.dumps(error_body(field, message)).encode()


def _message(body: bytes) -> str:
    """The ``error.message`` of a JSON error body, else its first 200 characters."""
    try:
        doc = json.loads(body)
        return str(doc["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace") or "empty body"
