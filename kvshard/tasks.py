"""Stopping background asyncio tasks.

Why a helper: every long-running component (the sidecar's prefill queue, shadow checker and
placement follower, the router's health prober and co-request publisher) owns a loop task and must
stop it the same way — cancel, then wait until it has actually finished, so nothing it does runs
after ``stop()`` returns — without the expected ``CancelledError`` escaping into the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait until it has finished (``None`` or a finished task: nothing to do)."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
