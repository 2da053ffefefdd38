"""A running ``kvshard sidecar serve`` process and a tiny JSON client for it (shared by the sidecar tests)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from kvshard.processes import ManagedProcess

PEER_TOKEN = "test-peer-token"


class Sidecar:
    """A running sidecar and a tiny JSON client for it."""

    def __init__(self, process: ManagedProcess, url: str) -> None:
        self.process = process
        self.url = url

    def call(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
             raw: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        request = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None and "Content-Type" not in (headers or {}):
            request.add_header("Content-Type", "application/json")
        for name, value in (headers or {}).items():
            request.add_header(name, value)
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), error.read()

    def json(self, method: str, path: str, body: Any = None, **kwargs: Any) -> tuple[int, Any]:
        status, _, payload = self.call(method, path, body, **kwargs)
        return status, json.loads(payload) if payload else None

    def metrics(self) -> str:
        return self.call("GET", "/metrics")[2].decode()


SidecarFactory = Callable[..., Sidecar]
