"""Helpers of the end-to-end operator tests: the local cluster's Kubernetes API (kmock-based,
admission and status subresources as in a real server) served from its own thread, so tests stay
synchronous while KopfRunner runs the operator in another, and object helpers over real HTTP."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvshard_local.apiserver import LocalKubeApi
from kvshard_local.testing_servers import EtcdServer

CACHESHARDS = "/apis/kvshard.io/v1alpha1/namespaces/{ns}/cacheshards"
PODS = "/api/v1/namespaces/{ns}/pods"
CONFIGMAPS = "/api/v1/namespaces/{ns}/configmaps"
SECRETS = "/api/v1/namespaces/{ns}/secrets"
ETCD_TLS_SECRET = "etcd-client-tls"


def etcd_spec(etcd: EtcdServer) -> dict[str, Any]:
    """``spec.etcd`` for the test etcd: its endpoint, over TLS with the client certificate in the
    Secret :data:`ETCD_TLS_SECRET` (:meth:`EmulatedCluster.trust_etcd` creates it)."""
    return {"endpoints": [etcd.endpoint], "tls": {"secretRef": {"name": ETCD_TLS_SECRET}}}


class EmulatedCluster:
    """The local Kubernetes API on a loopback port, served from a background thread, plus small
    blocking helpers to create, patch, read and delete objects over real HTTP."""

    def __init__(self) -> None:
        self.url = ""
        self.api: LocalKubeApi | None = None
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
        self.api = LocalKubeApi()
        async with self.api, kmock.Server(self.api) as server:
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
        self.request("POST", CACHESHARDS.format(ns=ns), body)

    def store_unchecked_shard(self, body: dict[str, Any], ns: str = "default") -> None:
        """Put a CacheShard into the API's store past admission, as one stored before a CRD
        upgrade tightened its schema would be (the API refuses invalid ones at create)."""
        assert self.api is not None
        api = self.api
        body = json.loads(json.dumps(body))
        body.setdefault("metadata", {})["namespace"] = ns

        async def put() -> None:
            api.put_unchecked(api.type_of("cacheshards", "kvshard.io"), body)

        asyncio.run_coroutine_threadsafe(put(), self._loop).result(timeout=10)

    def shard(self, name: str, ns: str = "default") -> Any:
        return self.get(CACHESHARDS.format(ns=ns) + f"/{name}")

    def patch_spec(self, name: str, spec: dict[str, Any], ns: str = "default") -> None:
        self.request("PATCH", CACHESHARDS.format(ns=ns) + f"/{name}", {"spec": spec})

    def delete_shard(self, name: str, ns: str = "default") -> None:
        self.request("DELETE", CACHESHARDS.format(ns=ns) + f"/{name}")

    def create_pod(self, name: str, labels: dict[str, str], *, ready: bool = True, ns: str = "default") -> None:
        self.request("POST", PODS.format(ns=ns), {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": {"containers": [{"name": "engine", "image": "kvshard"}]},
        })
        self.set_pod_ready(name, ready, ns)

    def set_pod_ready(self, name: str, ready: bool, ns: str = "default") -> None:
        """What a kubelet does: the pod's status, through the status subresource."""
        self.request("PATCH", PODS.format(ns=ns) + f"/{name}/status", {
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
        })

    def delete_pod(self, name: str, ns: str = "default") -> None:
        self.request("DELETE", PODS.format(ns=ns) + f"/{name}")

    def create_secret(self, name: str, data: dict[str, bytes], ns: str = "default") -> None:
        self.request("POST", SECRETS.format(ns=ns), {
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": ns},
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()}})

    def trust_etcd(self, etcd: EtcdServer, ns: str = "default") -> None:
        """The Secret :func:`etcd_spec` names: the test etcd's CA and client certificate."""
        self.create_secret(ETCD_TLS_SECRET, etcd.tls_secret_data(), ns)

    def create_configmap(self, name: str, data: dict[str, str], ns: str = "default") -> None:
        self.request("POST", CONFIGMAPS.format(ns=ns), {
            "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": ns}, "data": data})


def edit_configmap(cluster: EmulatedCluster, name: str, data: dict[str, str], ns: str = "default") -> None:
    """What ``kubectl edit cm`` does: replace the ConfigMap's data (a merge patch)."""
    cluster.request("PATCH", CONFIGMAPS.format(ns=ns) + f"/{name}", {"data": data})


def condition(obj: Any, type_: str) -> dict[str, Any]:
    for c in (obj or {}).get("status", {}).get("conditions", []):
        if c["type"] == type_:
            return dict(c)
    return {}


def read_current(etcd: EtcdServer, name: str, ns: str = "default") -> Any:
    """The CacheShard's current placement generation in the test etcd (None before the first)."""
    async def read() -> Any:
        async with etcd.store(timeout=2, attempts=1) as store:
            return await store.read_current(ns, name)
    return asyncio.run(read())
