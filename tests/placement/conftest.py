"""A real etcd per test module for the placement store tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvshard.testing_servers import EtcdNotInstalledError, EtcdServer


@pytest.fixture(scope="module")
def etcd_server() -> Iterator[EtcdServer]:
    try:
        server = EtcdServer()
    except EtcdNotInstalledError as exc:
        pytest.skip(str(exc))
    with server:
        yield server
