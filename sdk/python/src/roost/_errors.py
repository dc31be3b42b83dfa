"""Errors as types: one exception class per stable API error code.

Every API error is a :class:`ApiError` subclass chosen by the envelope's
``code`` (``{"error":{"code","message","details","request_id"}}``), so a
caller branches with ``except QuotaExceeded`` rather than on messages.
A code this SDK does not know yet (a newer server) is a plain
:class:`ApiError` with its ``code`` set.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Type

__all__ = [
    "ApiError",
    "Fenced",
    "IdempotencyConflict",
    "IdempotencyInProgress",
    "InsufficientStorage",
    "InternalError",
    "InvalidRequest",
    "InvalidState",
    "NotFound",
    "PayloadTooLarge",
    "Quarantined",
    "QuotaExceeded",
    "RoostError",
    "TransportError",
    "Unauthenticated",
    "Unavailable",
    "UnsupportedCapability",
    "WaitTimeout",
    "UnexpectedState",
]


class RoostError(Exception):
    """Everything this SDK raises."""


class TransportError(RoostError):
    """The server could not be reached (or answered garbage) and the retry
    budget is spent; ``__cause__`` is the last httpx error."""


class WaitTimeout(RoostError, TimeoutError):
    """A wait ran out of time before the state was reached."""


class UnexpectedState(RoostError):
    """A wait ended in another state that makes the one waited for
    unreachable (e.g. ``failed`` while waiting for ``running``). ``record``
    is the sandbox, command or snapshot as it ended."""

    def __init__(self, message: str, record: Any) -> None:
        super().__init__(message)
        self.record = record


class ApiError(RoostError):
    """The API refused a call: ``status``, stable ``code``, ``message``,
    ``details`` and the ``request_id`` to quote in a report."""

    code: str = ""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        details: Optional[Mapping[str, Any]],
        request_id: Optional[str],
        retry_after: Optional[float] = None,
    ) -> None:
        super().__init__(f"{code} ({status}): {message} (request {request_id or '-'})")
        self.status = status
        self.code = code
        self.message = message
        self.details: Dict[str, Any] = dict(details or {})
        self.request_id = request_id
        self.retry_after = retry_after


class InvalidRequest(ApiError):
    code = "invalid_request"


class Unauthenticated(ApiError):
    code = "unauthenticated"


class NotFound(ApiError):
    code = "not_found"


class InvalidState(ApiError):
    code = "invalid_state"


class IdempotencyConflict(ApiError):
    """The same ``Idempotency-Key`` was used with another request body."""

    code = "idempotency_conflict"


class IdempotencyInProgress(ApiError):
    code = "idempotency_in_progress"


class Fenced(ApiError):
    code = "fenced"


class Quarantined(ApiError):
    """An operator froze the sandbox: stop, start, delete and exec are refused."""

    code = "quarantined"


class PayloadTooLarge(ApiError):
    code = "payload_too_large"


class UnsupportedCapability(ApiError):
    """Nothing in the deployment enforces what was asked; ``missing`` names it
    (e.g. ``["storage_class:durable"]``, ``["runner"]``)."""

    code = "unsupported_capability"

    @property
    def missing(self) -> List[str]:
        return [str(m) for m in self.details.get("missing", [])]


class QuotaExceeded(ApiError):
    """A quota is reached: ``metric``, ``limit``, ``current``, ``retry_after`` (s)."""

    code = "quota_exceeded"

    @property
    def _quota(self) -> Dict[str, Any]:
        quota = self.details.get("quota")
        return quota if isinstance(quota, dict) else {}

    @property
    def metric(self) -> Optional[str]:
        value = self._quota.get("metric")
        return None if value is None else str(value)

    @property
    def limit(self) -> Optional[int]:
        value = self._quota.get("limit")
        return None if value is None else int(value)

    @property
    def current(self) -> Optional[int]:
        value = self._quota.get("current")
        return None if value is None else int(value)


class Unavailable(ApiError):
    code = "unavailable"


class InsufficientStorage(ApiError):
    code = "insufficient_storage"


class InternalError(ApiError):
    code = "internal"


class RangeNotSatisfiable(ApiError):
    """A read starting at or past a file's end; ``size`` is the file's."""

    code = "range_not_satisfiable"

    @property
    def size(self) -> Optional[int]:
        value = self.details.get("size")
        return None if value is None else int(value)


_BY_CODE: Dict[str, Type[ApiError]] = {
    cls.code: cls
    for cls in (
        InvalidRequest,
        Unauthenticated,
        NotFound,
        InvalidState,
        IdempotencyConflict,
        IdempotencyInProgress,
        Fenced,
        Quarantined,
        PayloadTooLarge,
        UnsupportedCapability,
        QuotaExceeded,
        Unavailable,
        InsufficientStorage,
        InternalError,
        RangeNotSatisfiable,
    )
}


def error_class(code: str) -> Type[ApiError]:
    """The exception class of a stable error code (unknown: :class:`ApiError`)."""
    return _BY_CODE.get(code, ApiError)


def from_response(
    status: int, body: Any, request_id: Optional[str], retry_after: Optional[float]
) -> ApiError:
    """The typed error of an error answer; a body that is not the envelope
    (a proxy's page) still gives an error naming the status."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        code = "unavailable" if status in (502, 503, 504) else ("internal" if status >= 500 else "http_error")
        return error_class(code)(status, code, f"HTTP {status} without an error envelope", None, request_id, retry_after)
    code = str(error.get("code", ""))
    details = error.get("details")
    return error_class(code)(
        status,
        code,
        str(error.get("message", "")),
        details if isinstance(details, dict) else None,
        str(error.get("request_id") or request_id or "") or None,
        retry_after,
    )
