"""The local cluster's Kubernetes API as a process of its own (:mod:`kvshard_local.apiserver`).

No real API server runs without a container engine, so ``kvshard up`` runs this one: kmock's server
answering like a real API server for the kinds the cluster uses (CacheShards with their CRD's
printer columns, OpenAPI schema and validation; Pods, ConfigMaps, Secrets, Events, Namespaces), so
the operator, the kubelet loop and ``kubectl`` all talk to it over real HTTP. It runs in its own
process rather than a thread of ``kvshard up`` so it dies with its process group like every other
part of the cluster.

    python -m kvshard_local.emulator --port 6443 --kubeconfig run/kubeconfig
    KUBECONFIG=run/kubeconfig kubectl get cacheshards

The kubeconfig is written once the port listens, so its existence means the API answers. The
namespaces given (``--namespace``, default ``default``) exist from the start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger("kvshard_local.emulator")


def kubeconfig(url: str) -> dict[str, object]:
    """A kubeconfig for ``url``; the local API accepts any token."""
    return {
        "apiVersion": "v1", "kind": "Config", "current-context": "kvshard-local",
        "clusters": [{"name": "kvshard-local", "cluster": {"server": url}}],
        "users": [{"name": "kvshard-local", "user": {"token": "local"}}],
        "contexts": [{"name": "kvshard-local", "context": {"cluster": "kvshard-local", "user": "kvshard-local"}}],
    }


async def serve(port: int, config_path: Path | None, host: str = "127.0.0.1",
                namespaces: Sequence[str] = ("default",)) -> None:
    """Serve the local API until SIGTERM/SIGINT."""
    import kmock

    from kvshard_local.apiserver import LocalKubeApi

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    api = LocalKubeApi(namespaces=tuple(namespaces))
    async with api, kmock.Server(api, host=host, port=port or None) as server:
        url = str(server.url).rstrip("/")
        if config_path is not None:
            tmp = config_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(kubeconfig(url), indent=2))
            tmp.replace(config_path)  # atomic: readers never see half a file
        log.info("local Kubernetes API serving on %s", url)
        await stop.wait()
    log.info("local Kubernetes API stopped")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvshard_local.emulator",
                                     description="The local cluster's Kubernetes API, with the kvshard resources.")
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
