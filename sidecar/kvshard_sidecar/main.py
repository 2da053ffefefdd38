"""``kvshard sidecar serve``: run the sidecar API until SIGTERM/Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import sys

from aiohttp import web

from kvshard.etcd_tls import EtcdTLSConfigError
from kvshard.settings import SettingsError, describe
from kvshard_sidecar import settings as sidecar_settings

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sidecar_settings.add_arguments(parser)


def serve(args: argparse.Namespace) -> int:
    from kvshard_sidecar.app import build_app
    from kvshard_sidecar.service import SidecarService

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
