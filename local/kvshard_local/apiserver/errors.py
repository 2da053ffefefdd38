"""Every error the local Kubernetes API answers, as a Kubernetes ``Status`` object.

Clients (kubectl, kopf, the ``kubernetes`` client) read the ``reason`` and ``details`` of a
``Status``, not just the HTTP code: kubectl prints ``The CacheShard "x" is invalid: spec.clusters: …``
from ``details.causes`` and kopf retries a conflicting JSON patch on 422. So each error here carries
the code, reason and details a real API server would send::

    ApiError
     ├── BadRequest            400  malformed body, name/namespace that disagree with the URL
     ├── NotFound              404  no such object, resource or path
     ├── MethodNotAllowed      405  a verb the resource does not serve
     ├── Conflict              409  AlreadyExists, or a stale resourceVersion
     ├── Expired               410  a watch from a resourceVersion no longer kept
     ├── UnsupportedMediaType  415  a patch type the resource does not accept
     └── Invalid               422  admission refused the object; one cause per field
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ApiError(Exception):
    """An answer other than success; :meth:`status` is the body to send."""

    code = 500
    reason = "InternalError"

    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                "message": self.message, "reason": self.reason, "code": self.code}
        if self.details:
            body["details"] = self.details
        return body


class BadRequest(ApiError):
    code, reason = 400, "BadRequest"


class NotFound(ApiError):
    code, reason = 404, "NotFound"

    @classmethod
    def object(cls, qualified: str, name: str) -> NotFound:
        """``cacheshards.kvshard.io "x" not found``, as kubectl prints it."""
        return cls(f'{qualified} "{name}" not found', {"name": name, "kind": qualified.split(".")[0]})

    @classmethod
    def path(cls) -> NotFound:
        return cls("the server could not find the requested resource", {})


class MethodNotAllowed(ApiError):
    code, reason = 405, "MethodNotAllowed"


class Conflict(ApiError):
    code, reason = 409, "Conflict"

    @classmethod
    def exists(cls, qualified: str, name: str) -> Conflict:
        error = cls(f'{qualified} "{name}" already exists', {"name": name, "kind": qualified.split(".")[0]})
        error.reason = "AlreadyExists"
        return error

    @classmethod
    def stale(cls, qualified: str, name: str) -> Conflict:
        return cls(f'Operation cannot be fulfilled on {qualified} "{name}": the object has been modified; '
                   "please apply your changes to the latest version and try again",
                   {"name": name, "kind": qualified.split(".")[0]})


class Expired(ApiError):
    code, reason = 410, "Expired"


class UnsupportedMediaType(ApiError):
    code, reason = 415, "UnsupportedMediaType"


class Invalid(ApiError):
    """Admission refused the object. ``causes`` are ``(field, message)`` pairs; kubectl prints
    ``The <Kind> "<name>" is invalid: <field>: <message>`` from them."""

    code, reason = 422, "Invalid"

    def __init__(self, kind: str, group: str, name: str, causes: Sequence[tuple[str, str]]) -> None:
        listed = [f"{field}: {message}" for field, message in causes]
        summary = listed[0] if len(listed) == 1 else "[" + ", ".join(listed) + "]"
        subject = f"{kind}.{group}" if group else kind
        super().__init__(f'{subject} "{name}" is invalid: {summary}',
                         {"name": name, "group": group, "kind": kind,
                          "causes": [{"reason": "FieldValueInvalid", "field": field, "message": message}
                                     for field, message in causes]})
