"""``kvshard router serve``: follow placement in etcd and route ``/v1/recommend`` until SIGTERM/Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import sys

from aiohttp import web

from kvshard.etcd_store import EtcdStore
from kvshard.etcd_tls import EtcdTLSConfigError
from kvshard.log_filters import quiet_watch_reconnects
from kvshard.settings import SettingsError, describe
from kvshard_router import settings as router_settings

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    router_settings.add_arguments(parser)


def serve(args: argparse.Namespace) -> int:
    from kvshard_router.app import build_app

    try:
        settings = router_settings.from_args(args)
        if not settings.etcd_endpoints:
            raise SettingsError("--etcd-endpoints is required: the router routes by the placement published in etcd")
        tls = settings.etcd_tls()
    except (SettingsError, EtcdTLSConfigError) as error:
        print(f"kvshard router serve: {error}", file=sys.stderr)
        return 2
    log.info("router settings: %s", describe(settings))
    quiet_watch_reconnects()
    store = EtcdStore(settings.etcd_endpoints, username=settings.etcd_username or None,
                      password=settings.etcd_password or None, tls=tls)
    web.run_app(build_app(settings, store), host=settings.host, port=settings.port,
                print=lambda line: log.info("%s", line), access_log=None, shutdown_timeout=5)
    return 0
