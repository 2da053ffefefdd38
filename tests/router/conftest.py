"""Fixtures shared by the router's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from router_helpers import FakePod


@pytest.fixture
async def pods() -> AsyncIterator[tuple[FakePod, FakePod]]:
    """Two real loopback pods, ``a`` and ``b``, answering health checks and recommendations."""
    a, b = FakePod("a"), FakePod("b")
    await a.start()
    await b.start()
    yield a, b
    await a.stop()
    await b.stop()
