"""Waiting for observable facts in end-to-end tests: poll, and fail with what was last seen."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest


def wait_until(fact: Callable[[], Any], timeout: float = 30.0, what: str = "", every: float = 0.2) -> Any:
    """Poll ``fact`` until it returns something truthy (and return that); fail naming ``what`` and the
    last value after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = fact()
        if last:
            return last
        time.sleep(every)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what or fact}: last {last!r}")
