"""``kvshard sidecar serve``: run the sidecar API until SIGTERM/Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from aiohttp import web

from kvshard.etcd_tls import EtcdTLSConfigError
from kvshard.settings import SettingsError, describe
from kvshard_sidecar import settings as sidecar_settings

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sidecar_settings.add_arguments(parser)


def serve(args: argparse.Namespace) -> int:
    from kvshard_sidecar.api.app import build_app
    from kvshard_sidecar.serving.service import SidecarService

    try:
        settings = sidecar_settings.from_args(args)
        settings.etcd_tls()  # unreadable TLS files stop the start, not every etcd session later
    except (SettingsError, EtcdTLSConfigError) as error:
        print(f"kvshard sidecar serve: {error}", file=sys.stderr)
        return 2
    log.info("sidecar settings: %s", describe(settings))
    if settings.etcd_endpoints:
        from kvshard.log_filters import quiet_watch_reconnects

        quiet_watch_reconnects()
    app = build_app(SidecarService(settings))
    web.run_app(app, host=settings.host, port=settings.port, print=lambda line: log.info("%s", line),
                access_log=None, shutdown_timeout=5)
    return 0


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvshard sidecar vllm``: what differs between pods; the rest follows from the model."""
    parser.add_argument("--model", required=True, help="model name (late, scorer, …) or Hugging Face folder")
    parser.add_argument("--port", type=int, default=8000, help="vLLM's HTTP port (default: %(default)s)")
    parser.add_argument("--served-model-name", default="", help="name vLLM serves (default: the folder's name)")
    parser.add_argument("--block-dir", type=Path, required=True,
                        help="the pod's disk tier (the sidecar's --disk-dir): the connector loads and stores "
                             "blocks here")
    parser.add_argument("--exchange-dir", type=Path, default=Path("/dev/shm/kvshard-exchange"),
                        help="the KV exchange shared with the sidecar (default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=2048, help="vLLM --max-model-len (default: %(default)s)")


def vllm(args: argparse.Namespace) -> int:
    """Become the pod's vLLM server for a scorer model, with kvshard's connector reading the pod's block
    store and the prefix cache on (:func:`~kvshard_sidecar.vllm.client.server_command`): one place that
    knows the connector's configuration, for the local cluster as for a user's own pod."""
    import os

    from kvshard.models import resolve_model
    from kvshard_sidecar.vllm.client import server_command

    model = resolve_model(args.model)
    command = server_command(sys.executable, model, args.port, exchange_dir=args.exchange_dir, prefix_caching=True,
                             served_name=args.served_model_name or model.name, block_dir=args.block_dir,
                             max_model_len=args.max_model_len)
    log.info("exec %s", " ".join(command))
    os.execv(command[0], command)  # the same pid and process group: whoever started us stops vLLM
