"""Helpers of the end-to-end operator tests: kmock's Kubernetes emulator served from its own
thread (so tests stay synchronous while KopfRunner runs the operator in another), object helpers
over real HTTP, and polling for observable facts."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from kvshard.local.emulator import register_resources

CACHESHARDS = "/apis/kvshard.io/v1alpha1/namespaces/{ns}/cacheshards"
PODS = "/api/v1/namespaces/{ns}/pods"
CONFIGMAPS = "/api/v1/namespaces/{ns}/configmaps"


class EmulatedCluster:
    """kmock's KubernetesEmulator on a loopback port, served from a background thread, plus
    small blocking helpers to create, patch, read and delete objects over real HTTP."""

    def __init__(self) -> None:
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        import kmock

        self._stop = asyncio.Event()
        emulator = kmock.KubernetesEmulator()
        register_resources(emulator)
        async with emulator, kmock.Server(emulator) as server:
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> EmulatedCluster:
        self._thread.start()
        if not self._ready.wait(timeout=20):
            raise RuntimeError("kmock did not start")
        Path(os.environ["KUBECONFIG"]).write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "kmock", "user": {"token": "test"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
        }))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)

    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        content_type = "application/merge-patch+json" if method == "PATCH" else "application/json"
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": content_type})
        with urllib.request.urlopen(req, timeout=10) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def get(self, path: str) -> Any:
        try:
            return self.request("GET", path)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    # ---- CacheShards and pods

    def create_shard(self, body: dict[str, Any], ns: str = "default") -> None:
        body = json.loads(json.dumps(body))
        meta = body.setdefault("metadata", {})
        meta.update({"namespace": ns, "uid": str(uuid.uuid4()), "generation": 1,
                     "creationTimestamp": "2026-01-01T00:00:00Z", "resourceVersion": "1"})
        self.request("POST", CACHESHARDS.format(ns=ns), body)

    def shard(self, name: str, ns: str = "default") -> Any:
        return self.get(CACHESHARDS.format(ns=ns) + f"/{name}")

    def patch_spec(self, name: str, spec: dict[str, Any], ns: str = "default") -> None:
        generation = int(self.shard(name, ns)["metadata"].get("generation", 1)) + 1
        self.request("PATCH", CACHESHARDS.format(ns=ns) + f"/{name}",
                     {"metadata": {"generation": generation}, "spec": spec})

    def delete_shard(self, name: str, ns: str = "default") -> None:
        self.request("DELETE", CACHESHARDS.format(ns=ns) + f"/{name}")

    def create_pod(self, name: str, labels: dict[str, str], *, ready: bool = True, ns: str = "default") -> None:
        self.request("POST", PODS.format(ns=ns), {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": labels, "uid": str(uuid.uuid4())},
            "spec": {"containers": [{"name": "engine", "image": "kvshard"}]},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
        })

    def set_pod_ready(self, name: str, ready: bool, ns: str = "default") -> None:
        self.request("PATCH", PODS.format(ns=ns) + f"/{name}", {
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
        })

    def delete_pod(self, name: str, ns: str = "default") -> None:
        self.request("DELETE", PODS.format(ns=ns) + f"/{name}")

    def create_configmap(self, name: str, data: dict[str, str], ns: str = "default") -> None:
        self.request("POST", CONFIGMAPS.format(ns=ns), {
            "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": ns}, "data": data})


def condition(obj: Any, type_: str) -> dict[str, Any]:
    for c in (obj or {}).get("status", {}).get("conditions", []):
        if c["type"] == type_:
            return dict(c)
    return {}



