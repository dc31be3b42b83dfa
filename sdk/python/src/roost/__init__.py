"""roost: a Python client for roost sandboxes (sync :class:`Roost`, async
:class:`AsyncRoost`), with retries that just work and errors as types."""

from __future__ import annotations

from ._async import AsyncCommandStream, AsyncPaginator, AsyncRoost, AsyncSandbox
from ._core import (
    CommandFailed,
    CommandResult,
    ConfigError,
    OutputChunk,
    Page,
    RetryPolicy,
    Stats,
)
from ._errors import (
    ApiError,
    Fenced,
    IdempotencyConflict,
    IdempotencyInProgress,
    InsufficientStorage,
    InternalError,
    InvalidRequest,
    InvalidState,
    NotFound,
    PayloadTooLarge,
    Quarantined,
    QuotaExceeded,
    RoostError,
    TransportError,
    Unauthenticated,
    Unavailable,
    UnexpectedState,
    UnsupportedCapability,
    WaitTimeout,
    error_class,
)
from ._sync import CommandStream, Paginator, Roost, Sandbox
from ._wire import Command, Event, Image, KeptCopy, Resources, SaveStatus, SecretRecord, Snapshot
from ._wire import Sandbox as SandboxRecord

__version__ = "0.1.0"

__all__ = [
    "ApiError",
    "AsyncCommandStream",
    "AsyncPaginator",
    "AsyncRoost",
    "AsyncSandbox",
    "Command",
    "CommandFailed",
    "CommandResult",
    "CommandStream",
    "ConfigError",
    "Event",
    "Fenced",
    "IdempotencyConflict",
    "IdempotencyInProgress",
    "Image",
    "InsufficientStorage",
    "InternalError",
    "InvalidRequest",
    "InvalidState",
    "KeptCopy",
    "NotFound",
    "OutputChunk",
    "Page",
    "Paginator",
    "PayloadTooLarge",
    "Quarantined",
    "QuotaExceeded",
    "Resources",
    "RetryPolicy",
    "Roost",
    "RoostError",
    "Sandbox",
    "SandboxRecord",
    "SaveStatus",
    "SecretRecord",
    "Snapshot",
    "Stats",
    "TransportError",
    "Unauthenticated",
    "Unavailable",
    "UnexpectedState",
    "UnsupportedCapability",
    "WaitTimeout",
    "error_class",
]
