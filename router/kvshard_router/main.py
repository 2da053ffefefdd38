"""``kvshard router serve`` (route ``/v1/recommend``) and ``kvshard router epp`` (pick endpoints for a Gateway
API Inference Extension gateway): follow placement in etcd until SIGTERM/Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

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

    return _run(args, "serve", build_app)


def epp(args: argparse.Namespace) -> int:
    """``kvshard router epp``: the same router core as a Gateway API Inference Extension endpoint picker
    (Envoy ext_proc gRPC on ``--epp-port``; health and metrics over HTTP on ``--port``)."""
    from kvshard_router.epp import build_epp_app

    return _run(args, "epp", build_epp_app)


def _run(args: argparse.Namespace, verb: str,
         build: Callable[[router_settings.RouterSettings, EtcdStore | None], web.Application]) -> int:
    try:
        settings = router_settings.from_args(args)
        if not settings.etcd_endpoints:
            raise SettingsError("--etcd-endpoints is required: the router routes by the placement published in etcd")
        tls = settings.etcd_tls()
    except (SettingsError, EtcdTLSConfigError) as error:
        print(f"kvshard router {verb}: {error}", file=sys.stderr)
        return 2
    log.info("router settings: %s", describe(settings))
    quiet_watch_reconnects()
    store = EtcdStore(settings.etcd_endpoints, username=settings.etcd_username or None,
                      password=settings.etcd_password or None, tls=tls)
    web.run_app(build(settings, store), host=settings.host, port=settings.port,
                print=lambda line: log.info("%s", line), access_log=None, shutdown_timeout=5)
    return 0
