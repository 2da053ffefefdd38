"""A tiny blocking client of the local Kubernetes API (the emulator), over real HTTP.

The kubelet loop and ``LocalCluster`` need four calls — create, patch, get and delete — so plain
``urllib`` does, and the core stays free of the ``kubernetes`` client. Patches are JSON merge
patches; like a real API server, the local one takes a pod's status only through ``/status``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

CACHESHARDS = "/apis/kvshard.io/v1alpha1/namespaces/{ns}/cacheshards"
PODS = "/api/v1/namespaces/{ns}/pods"


class KubeApiError(RuntimeError):
    """The API answered an error status; the message carries its reason."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class KubeApi:
    """Blocking JSON calls against one API server URL."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        content_type = "application/merge-patch+json" if method == "PATCH" else "application/json"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            try:
                detail = str(json.loads(detail).get("message", detail))
            except (json.JSONDecodeError, AttributeError):
                pass
            raise KubeApiError(exc.code, f"{method} {path}: {exc.code} {detail[:300]}") from None
        return json.loads(raw) if raw else None

    def get(self, path: str) -> Any:
        """The object at ``path``, or ``None`` when it does not exist."""
        try:
            return self.request("GET", path)
        except KubeApiError as exc:
            if exc.status == 404:
                return None
            raise

    def create(self, collection: str, obj: Mapping[str, Any]) -> Any:
        """POST ``obj``; the API fills in uid, generation and the timestamps, as a real one does."""
        return self.request("POST", collection, obj)

    def patch(self, path: str, patch: Mapping[str, Any]) -> Any:
        """A JSON merge patch; ``status`` is written only through ``<path>/status``."""
        return self.request("PATCH", path, patch)

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)


def timestamp() -> str:
    """Now as the API server writes times: ``2026-12-01T10:30:00Z``."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod_status(ready: bool, restarts: int, pod_ip: str = "127.0.0.1") -> dict[str, Any]:
    """The ``status`` of a running pod whose one container is (not) ready."""
    flag = "True" if ready else "False"
    now = timestamp()
    return {
        "phase": "Running", "podIP": pod_ip, "hostIP": pod_ip,
        "conditions": [{"type": "Ready", "status": flag, "lastTransitionTime": now},
                       {"type": "ContainersReady", "status": flag, "lastTransitionTime": now}],
        "containerStatuses": [{"name": "sidecar", "ready": ready, "restartCount": restarts}],
    }


def condition(obj: Mapping[str, Any] | None, type_: str) -> dict[str, Any]:
    """The status condition ``type_`` of ``obj`` ({} when absent)."""
    for c in ((obj or {}).get("status") or {}).get("conditions") or ():
        if c.get("type") == type_:
            return dict(c)
    return {}
