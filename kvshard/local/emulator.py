"""A Kubernetes API for the local cluster: kmock's emulator as a process of its own.

No real API server runs without a container engine, and the operator only needs the API's
behaviour (list, watch, patch, status subresources), which kmock's ``KubernetesEmulator`` gives.
It runs in its own process rather than a thread of ``kvshard up`` so the operator, the kubelet
loop and ``kubectl``-style clients all talk to it over real HTTP, and it dies with its process
group like every other part of the cluster.

    python -m kvshard.local.emulator --port 6443 --kubeconfig run/kubeconfig

The resources are those the operator watches or reads: namespaces, pods (with ``status``),
configmaps, events and cacheshards (with ``status``). The kubeconfig is written once the port
listens, so its existence means the API answers.

Namespaces (``--namespace``) are created inside the emulator at start: kmock 0.8 misparses the
cluster-scoped paths ``/api/v1/namespaces[/<name>]`` (it reads the name as a namespace), so they
cannot be created over HTTP; the operator runs cluster-wide and never needs to list them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("kvshard.local.emulator")

VERBS = frozenset({"list", "watch", "get", "patch", "create", "delete", "update"})


def kubeconfig(url: str) -> dict[str, object]:
    """A kubeconfig for ``url``; the emulator accepts any token."""
    return {
        "apiVersion": "v1", "kind": "Config", "current-context": "kvshard-local",
        "clusters": [{"name": "kvshard-local", "cluster": {"server": url}}],
        "users": [{"name": "kvshard-local", "user": {"token": "local"}}],
        "contexts": [{"name": "kvshard-local", "context": {"cluster": "kvshard-local", "user": "kvshard-local"}}],
    }


def register_resources(emulator: Any) -> None:
    """Teach a ``kmock.KubernetesEmulator`` the resources the operator uses (namespaces, pods with
    status, configmaps, events, CacheShards with status); the operator tests use the same set."""
    import kmock

    verbs = set(VERBS)
    emulator.resources["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", namespaced=False, verbs=verbs)
    emulator.resources["v1/pods"] = kmock.ResourceInfo(kind="Pod", namespaced=True, verbs=verbs,
                                                       subresources={"status"})
    emulator.resources["v1/configmaps"] = kmock.ResourceInfo(kind="ConfigMap", namespaced=True, verbs=verbs)
    emulator.resources["v1/events"] = kmock.ResourceInfo(kind="Event", namespaced=True, verbs=verbs)
    emulator.resources["kvshard.io/v1alpha1/cacheshards"] = kmock.ResourceInfo(
        kind="CacheShard", namespaced=True, verbs=verbs, subresources={"status"},
        shortnames={"cs"}, categories={"kvshard"})


async def serve(port: int, config_path: Path | None, host: str = "127.0.0.1",
                namespaces: Sequence[str] = ("default",)) -> None:
    """Serve the emulator until SIGTERM/SIGINT."""
    import kmock

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    emulator = kmock.KubernetesEmulator()
    register_resources(emulator)
    for namespace in namespaces:
        emulator.objects[kmock.resource("v1/namespaces"), None, namespace] = {
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": namespace, "uid": str(uuid.uuid4()), "resourceVersion": "1"},
            "status": {"phase": "Active"}}
    async with emulator, kmock.Server(emulator, host=host, port=port or None) as server:
        url = str(server.url).rstrip("/")
        if config_path is not None:
            tmp = config_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(kubeconfig(url), indent=2))
            tmp.replace(config_path)  # atomic: readers never see half a file
        log.info("Kubernetes API emulator serving on %s", url)
        await stop.wait()
    log.info("Kubernetes API emulator stopped")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvshard.local.emulator",
                                     description="kmock's Kubernetes API emulator with the kvshard resources.")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: any free port)")
    parser.add_argument("--kubeconfig", type=Path, default=None, help="write a kubeconfig for this API here")
    parser.add_argument("--namespace", action="append", default=None,
                        help="namespace to create at start (repeatable; default: default)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args.port, args.kubeconfig, args.host, args.namespace or ("default",)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
