"""API errors carrying the `Status` object the real apiserver would send.

TEST STAND-IN, never product code. Kubernetes API conventions, "Response
Status Kind": every failure is a `Status` with `status: Failure`, a `reason`
(NotFound, AlreadyExists, Conflict, Invalid, Gone/Expired, TooManyRequests,
InternalError, ...), `code` equal to the HTTP status, and `details`.
"""

from __future__ import annotations

from typing import Any

JSON = dict[str, Any]


class ApiError(Exception):
    """Raised by the store and the router; the HTTP layer turns it into a response."""

    def __init__(self, code: int, reason: str, message: str,
                 details: JSON | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details
        self.headers = headers or {}

    def status(self) -> JSON:
        return status_object(self.code, self.reason, self.message, self.details)


def status_object(code: int, reason: str, message: str, details: JSON | None = None) -> JSON:
    out: JSON = {"kind": "Status", "apiVersion": "v1", "metadata": {},
                 "status": "Success" if code < 300 else "Failure", "message": message,
                 "reason": reason, "code": code}
    if details is not None:
        out["details"] = details
    if code < 300:
        out.pop("message")
        out.pop("reason")
    return out


def details(name: str, group: str, kind: str) -> JSON:
    """StatusDetails as the apiserver encodes them: empty fields left out (omitempty),
    so a core kind's details have no ``group``."""
    return {k: v for k, v in (("name", name), ("group", group), ("kind", kind)) if v}


def not_found(qualified: str, name: str, group: str = "", kind: str = "") -> ApiError:
    return ApiError(404, "NotFound", f'{qualified} "{name}" not found',
                    details(name, group, kind))


def already_exists(qualified: str, name: str, group: str = "", kind: str = "") -> ApiError:
    return ApiError(409, "AlreadyExists", f'{qualified} "{name}" already exists',
                    details(name, group, kind))


def conflict(qualified: str, name: str, why: str, group: str = "", kind: str = "") -> ApiError:
    return ApiError(409, "Conflict",
                    f'Operation cannot be fulfilled on {qualified} "{name}": {why}',
                    details(name, group, kind))


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def expired(message: str) -> ApiError:
    return ApiError(410, "Expired", message)
