"""``kvshard operator run``: kopf's ``run`` with our settings, as a function the CLI can call.

The CLI stays in the shared core and dispatches here lazily (``add_arguments`` + ``main``), so the
core never imports kopf. ``run(argv)`` is the same for ``python -m kvshard_operator``. Every setting of
:class:`~kvshard_operator.settings.Settings` is a flag; the handlers get them all through
:func:`~kvshard_operator.settings.configure` before they are imported.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import threading
from collections.abc import Sequence

from kvshard_operator import settings as settings_mod

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvshard operator run``."""
    settings_mod.add_arguments(parser)
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")


def configure(args: argparse.Namespace) -> settings_mod.Settings:
    """The settings of this run (flags, then ``KVSHARD_OPERATOR_*``, then defaults), handed to the handlers.

    Handlers read their settings at import (kopf fixes timer intervals at registration), so this runs
    before :mod:`kvshard_operator.handlers` is imported."""
    settings = settings_mod.Settings.from_args(args)
    settings_mod.configure(settings)
    return settings


def main(args: argparse.Namespace, *, stop_flag: threading.Event | None = None) -> int:
    """Run the operator until interrupted (or until ``stop_flag`` is set, for embedding it in
    ``kvshard up`` and tests); returns the exit code."""
    settings = configure(args)
    logging.basicConfig(level=logging.DEBUG if getattr(args, "verbose", False) else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import kopf

    from kvshard_operator import handlers  # registers the handlers

    stale = [f.name for f in dataclasses.fields(settings)
             if getattr(handlers.SETTINGS, f.name) != getattr(settings, f.name)]
    if stale:  # only when something imported the handlers earlier in this process (tests)
        log.warning("the handlers were imported before `operator run` configured them; they keep %s of that import",
                    ", ".join(stale))
    if settings.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port)
    kopf.run(
        clusterwide=not settings.namespaces,
        namespaces=settings.namespaces,
        standalone=not settings.peering,
        liveness_endpoint=settings.liveness_endpoint or None,
        loop=asyncio.new_event_loop(),
        stop_flag=stop_flag,
    )
    return 0


def run(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (``kvshard operator run`` options) and run the operator."""
    parser = argparse.ArgumentParser(prog="kvshard operator run",
                                     description="Run the kvshard operator: place CacheShards and publish to etcd.")
    add_arguments(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(run())
