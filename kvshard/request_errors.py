"""The one shape of a client mistake, shared by every HTTP API (router and sidecar).

A rejected request is answered ``{"error": {"field": ..., "message": ...}}`` with a 4xx status, the
field as a JSON path (``candidates[3]``), so a client learns exactly what to fix whichever component
refused it.
"""

from __future__ import annotations

from typing import Any


def error_body(field: str, message: str) -> dict[str, Any]:
    """``{"error": {"field": field, "message": message}}``: every error answer of every API, the
    server's own (503, 502, 504) included, so clients parse one shape."""
    return {"error": {"field": field, "message": message}}


class RequestError(ValueError):
    """A client mistake: answered with ``status`` and a message that names ``field``."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.status = status

    def body(self) -> dict[str, Any]:
        return error_body(self.field, self.message)
