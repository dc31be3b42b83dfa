"""The wire: every record the SDK reads and every operation it calls.

Hand-written, not generated, and checked against the server's own
``/v1/openapi.json`` by ``tests/test_openapi.py``: every operation, query
parameter and body field declared here must exist there with the same
type, and every model field must be a property of its schema with the same
JSON type. Requests are built only through :class:`Operation`, which
refuses a parameter or field it does not declare, so the SDK cannot use
anything the check has not seen.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Type, TypeVar

__all__ = [
    "Command",
    "DirectoryMade",
    "Event",
    "FileEntry",
    "FileList",
    "FileRemoved",
    "FileWritten",
    "Image",
    "KeptCopy",
    "Mount",
    "Operation",
    "Resources",
    "Sandbox",
    "SaveStatus",
    "SecretRecord",
    "Snapshot",
    "decode",
]


@dataclass(frozen=True)
class Resources:
    """Limits the runtime enforces; ``None`` means the runner's default."""

    memory_mib: Optional[int] = None
    cpus: Optional[float] = None
    pids: Optional[int] = None
    home_mib: Optional[int] = None
    """The most the home (``/workspace``) may hold on its runner: past it a
    write fails "Disk quota exceeded" in the sandbox. Refused
    (``unsupported_capability``) where no runner bounds homes."""

    def to_json(self) -> Dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Mount:
    """A shared filesystem's existing directory mounted into a sandbox:
    ``path`` is ``/workspace`` (the sandbox's own home then is ``/private``)
    or below ``/mnt``; ``read_only`` as asked (records: as enforced)."""

    filesystem: str
    path: str
    subpath: str = ""
    read_only: bool = False

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SaveStatus:
    """A durable sandbox's saves (``state``: ok, delayed or failing)."""

    interval_s: int
    state: str
    last_completed_at: Optional[str] = None
    last_attempt_at: Optional[str] = None
    last_error: Optional[str] = None
    bytes_pending: Optional[int] = None
    root: Optional[str] = None
    last_unchanged_at: Optional[str] = None
    """When a scheduled save last found the home as the last completed
    save left it and so stored nothing (a parked sandbox);
    ``last_completed_at`` does not move for it."""


@dataclass(frozen=True)
class KeptCopy:
    """A copy of a home a runner set aside instead of deleting it."""

    id: str
    runner_id: str
    kept_at: str
    bytes: int
    reason: str


@dataclass(frozen=True)
class Sandbox:
    """A sandbox record: ``state`` is observed, ``desired`` is what was asked."""

    id: str
    org_id: str
    state: str
    desired: str
    epoch: int
    image: str
    storage_class: str
    resources: Resources
    network: str
    placement: str
    env: Dict[str, str]
    labels: Dict[str, str]
    quarantined: bool
    created_at: str
    updated_at: str
    state_reason: Optional[str] = None
    state_message: Optional[str] = None
    runner_id: Optional[str] = None
    expires_at: Optional[str] = None
    ended_at: Optional[str] = None
    save: Optional[SaveStatus] = None
    from_snapshot: Optional[str] = None
    kept_copies: List[KeptCopy] = field(default_factory=list)
    mounts: List[Mount] = field(default_factory=list)
    idle_timeout_s: int = 0
    """Seconds without activity before it goes to sleep (an ordinary stop,
    ``state_reason`` ``idle``); ``0``: never."""
    auto_wake: bool = True
    """A command sent while it is stopped starts it (under the same id)."""
    last_activity_at: Optional[str] = None
    last_activity: Optional[str] = None
    """What that activity was: created, started, command, command_running,
    command_ended, stdin, attach, files or keepalive."""
    idle_deadline: Optional[str] = None
    """When it goes to sleep unless something happens first (only while
    ``running`` with a timeout)."""


@dataclass(frozen=True)
class Command:
    """A command record; ``state`` is honest: see :attr:`ended`."""

    id: str
    sandbox_id: str
    argv: List[str]
    env: Dict[str, str]
    state: str
    stdout_bytes: int
    stderr_bytes: int
    created_at: str
    cwd: Optional[str] = None
    timeout: Optional[int] = None
    state_reason: Optional[str] = None
    exit_code: Optional[int] = None
    signal: Optional[str] = None
    epoch: Optional[int] = None
    started_at: Optional[str] = None
    ended_at: Optional[str] = None
    pid: Optional[int] = None
    """Its pid inside the sandbox while the sandbox's agent runs it."""
    stdin: bool = False
    waited_for_wake: bool = False
    """Created while its sandbox was not running (asleep, stopped,
    stopping): it waited for the sandbox to wake, then ran."""
    stdout_truncated: bool = False
    """It wrote more to stdout than its record keeps (32 MiB a stream):
    ``stdout_bytes`` are the first ones, the rest was not stored."""
    stderr_truncated: bool = False
    """The same for stderr."""

    @property
    def ended(self) -> bool:
        return self.state in COMMAND_END_STATES


@dataclass(frozen=True)
class Snapshot:
    """A snapshot receipt: ``durability`` pending → local → replicated, or failed."""

    id: str
    sandbox_id: str
    requested: str
    durability: str
    created_at: str
    updated_at: str
    reason: Optional[str] = None
    deadline: Optional[str] = None
    root: Optional[str] = None
    files: Optional[int] = None
    logical_bytes: Optional[int] = None
    captured_at: Optional[str] = None


@dataclass(frozen=True)
class Image:
    """An image imported into the org's store."""

    name: str
    root: str
    files: int
    logical_bytes: int
    created_at: str
    updated_at: str


@dataclass(frozen=True)
class SecretRecord:
    """An org secret as the API shows it: never its value."""

    name: str
    version: int
    created_at: str
    updated_at: str


@dataclass(frozen=True)
class Event:
    """One state change of a sandbox."""

    seq: int
    at: str
    state: str
    epoch: int
    reason: Optional[str] = None
    message: Optional[str] = None
    runner_id: Optional[str] = None


@dataclass(frozen=True)
class FileEntry:
    """One entry of a sandbox's directory (a symlink is itself, never
    followed): ``type`` is file, directory, symlink or other; ``mode`` the
    permission bits in octal (``"0644"``)."""

    path: str
    type: str
    size: int
    mode: str
    modified_at: str
    link_target: Optional[str] = None


@dataclass(frozen=True)
class FileList:
    """A listing sorted by path; ``truncated`` past 10,000 entries."""

    entries: List[FileEntry]
    truncated: bool


@dataclass(frozen=True)
class FileWritten:
    """A file now in place in the sandbox, whole."""

    path: str
    size: int


@dataclass(frozen=True)
class FileRemoved:
    path: str


@dataclass(frozen=True)
class DirectoryMade:
    """``created`` is false when the directory existed (with ``parents``)."""

    path: str
    created: bool


#: The end states of a command (DESIGN.md §4); ``unknown`` means "possibly run".
COMMAND_END_STATES = frozenset(
    [
        "exited",
        "timed_out",
        "resource_exhausted",
        "interrupted",
        "launch_failed",
        "not_launched",
        "infrastructure_lost",
        "unknown",
    ]
)
#: Sandbox states from which no wait for another state can succeed.
SANDBOX_TERMINAL_STATES = frozenset(["failed", "terminated", "deleted"])
#: A long-poll's longest server-side wait, in seconds.
LONG_POLL_MAX_S = 25

M = TypeVar("M")

# Per model: (field name, converter) pairs, built once on first use, so
# decoding a record costs a dict lookup per field (the SDK's overhead per
# call is measured in BENCHMARKS.md).
_PLANS: Dict[type, List[Tuple[str, Optional[Callable[[Any], Any]]]]] = {}
MODELS: Tuple[type, ...] = (
    Resources,
    SaveStatus,
    KeptCopy,
    Mount,
    Sandbox,
    Command,
    Snapshot,
    Image,
    SecretRecord,
    Event,
    FileEntry,
    FileList,
    FileWritten,
    FileRemoved,
    DirectoryMade,
)


def _converter(annotation: Any) -> Optional[Callable[[Any], Any]]:
    """How to turn a JSON value into a field's type: nested models only."""
    args = getattr(annotation, "__args__", ())
    if annotation in MODELS:
        model = annotation
        return lambda value: decode(model, value)
    if getattr(annotation, "__origin__", None) in (list, List) and args and args[0] in MODELS:
        item = args[0]
        return lambda values: [decode(item, v) for v in values]
    for arg in args:  # Optional[Model]
        if arg in MODELS:
            inner = _converter(arg)
            assert inner is not None
            return lambda value: None if value is None else inner(value)
    return None


def field_types(model: type) -> Dict[str, Any]:
    """The resolved annotations of a model's fields."""
    import typing

    return typing.get_type_hints(model, vars(sys.modules[__name__]))


def decode(model: Type[M], data: Mapping[str, Any]) -> M:
    """A record from its JSON object; fields the SDK does not know are ignored
    (a newer server may add some), absent optional ones take their default."""
    plan = _PLANS.get(model)
    if plan is None:
        hints = field_types(model)
        plan = [(f.name, _converter(hints[f.name])) for f in dataclasses.fields(model)]  # type: ignore[arg-type]
        _PLANS[model] = plan
    values: Dict[str, Any] = {}
    for name, convert in plan:
        if name in data:
            value = data[name]
            values[name] = convert(value) if convert is not None and value is not None else value
    return model(**values)


@dataclass(frozen=True)
class Operation:
    """One API operation the SDK calls, as declared in the OpenAPI document."""

    method: str
    path: str
    query: Tuple[str, ...] = ()
    body: Optional[Dict[str, Any]] = None
    """Request body fields and their JSON types (as in the schema)."""
    idempotency_key: bool = False
    """Whether the document declares an ``Idempotency-Key`` header."""
    response: Optional[type] = None
    """The model the success body is (``None``: raw bytes or a list wrapper)."""
    list_field: Optional[str] = None
    """For list answers: the array property holding ``response`` records."""
    once: bool = False
    """Never retried (a repeat could repeat its effect)."""
    headers: Tuple[str, ...] = ()
    """Request headers the SDK sets (besides authorization and the key)."""

    def url(self, **path_args: str) -> str:
        return self.path.format(**{k: _segment(v) for k, v in path_args.items()})

    def check(
        self,
        params: Optional[Mapping[str, Any]],
        body: Optional[Mapping[str, Any]],
        headers: Optional[Mapping[str, str]] = None,
    ) -> None:
        """Refuses a parameter, field or header this operation does not declare."""
        for name in params or ():
            if name not in self.query:
                raise AssertionError(f"{self.method} {self.path} has no query parameter {name!r}")
        for name in headers or ():
            if name not in self.headers:
                raise AssertionError(f"{self.method} {self.path} has no header {name!r}")
        for name in body or ():
            if self.body is None or name not in self.body:
                raise AssertionError(f"{self.method} {self.path} has no body field {name!r}")


def _segment(value: str) -> str:
    from urllib.parse import quote

    return quote(value, safe="")


CREATE_SANDBOX = Operation(
    "POST",
    "/v1/sandboxes",
    body={
        "image": "string",
        "storage_class": "string",
        "resources": "object",
        "network": "string",
        "ttl": "integer",
        "placement": "string",
        "env": "object",
        "labels": "object",
        "save_interval_s": "integer",
        "from_snapshot": "string",
        "mounts": "array",
        "secrets": "array",
        "idle_timeout_s": "integer",
        "auto_wake": "boolean",
    },
    idempotency_key=True,
    response=Sandbox,
)
GET_SANDBOX = Operation("GET", "/v1/sandboxes/{id}", query=("wait_for", "timeout"), response=Sandbox)
LIST_SANDBOXES = Operation(
    "GET", "/v1/sandboxes", query=("state", "label", "limit", "cursor"), response=Sandbox, list_field="sandboxes"
)
STOP_SANDBOX = Operation("POST", "/v1/sandboxes/{id}/stop", response=Sandbox)
START_SANDBOX = Operation("POST", "/v1/sandboxes/{id}/start", response=Sandbox)
DELETE_SANDBOX = Operation("DELETE", "/v1/sandboxes/{id}", response=Sandbox)
# The idle policy: absent fields stay as they are; the same body twice
# leaves the same record, so a retry is harmless.
UPDATE_SANDBOX = Operation(
    "PATCH", "/v1/sandboxes/{id}", body={"idle_timeout_s": "integer", "auto_wake": "boolean"}, response=Sandbox
)
# Activity that keeps a running sandbox awake (409 on a stopped one: it
# does not wake it); a repeat only moves the deadline again.
KEEPALIVE_SANDBOX = Operation("POST", "/v1/sandboxes/{id}/keepalive", response=Sandbox)
SANDBOX_EVENTS = Operation("GET", "/v1/sandboxes/{id}/events", response=Event, list_field="events")
CREATE_COMMAND = Operation(
    "POST",
    "/v1/sandboxes/{id}/commands",
    body={"argv": "array", "env": "object", "cwd": "string", "timeout": "integer", "stdin": "boolean"},
    idempotency_key=True,
    response=Command,
)
GET_COMMAND = Operation(
    "GET", "/v1/sandboxes/{id}/commands/{command_id}", query=("wait_for", "timeout"), response=Command
)
LIST_COMMANDS = Operation(
    "GET", "/v1/sandboxes/{id}/commands", query=("limit", "cursor", "state"), response=Command, list_field="commands"
)
COMMAND_STDIN = Operation("POST", "/v1/sandboxes/{id}/commands/{command_id}/stdin", query=("close",), once=True)
COMMAND_OUTPUT = Operation(
    "GET", "/v1/sandboxes/{id}/commands/{command_id}/output", query=("stream", "offset", "timeout")
)
SIGNAL_COMMAND = Operation(
    "POST", "/v1/sandboxes/{id}/commands/{command_id}/signal", body={"signal": "string"}, response=Command
)
CREATE_SNAPSHOT = Operation(
    "POST",
    "/v1/sandboxes/{id}/snapshots",
    body={"durability": "string", "deadline": "integer"},
    idempotency_key=True,
    response=Snapshot,
)
GET_SNAPSHOT = Operation("GET", "/v1/snapshots/{id}", query=("wait_for", "timeout"), response=Snapshot)
LIST_SNAPSHOTS = Operation(
    "GET", "/v1/snapshots", query=("sandbox_id", "limit", "cursor"), response=Snapshot, list_field="snapshots"
)
DELETE_SNAPSHOT = Operation("DELETE", "/v1/snapshots/{id}", response=Snapshot)
LIST_IMAGES = Operation("GET", "/v1/images", response=Image, list_field="images")
GET_IMAGE = Operation("GET", "/v1/images/{name}", response=Image)
SET_SECRET = Operation("PUT", "/v1/secrets/{name}", body={"value": "string"}, response=SecretRecord)
LIST_SECRETS = Operation("GET", "/v1/secrets", response=SecretRecord, list_field="secrets")
DELETE_SECRET = Operation("DELETE", "/v1/secrets/{name}", response=SecretRecord)
WRITE_FILE = Operation("PUT", "/v1/sandboxes/{id}/files", query=("path", "mode", "parents"), response=FileWritten)
READ_FILE = Operation("GET", "/v1/sandboxes/{id}/files", query=("path",), headers=("Range",))
LIST_FILES = Operation("GET", "/v1/sandboxes/{id}/files/list", query=("path", "depth"), response=FileList)
REMOVE_FILE = Operation("DELETE", "/v1/sandboxes/{id}/files", query=("path", "recursive"), response=FileRemoved)
# A repeated move or mkdir would fail on what the first did: never retried.
MOVE_FILE = Operation(
    "POST",
    "/v1/sandboxes/{id}/files/move",
    body={"from": "string", "to": "string", "overwrite": "boolean"},
    once=True,
)
MAKE_DIRECTORY = Operation(
    "POST",
    "/v1/sandboxes/{id}/files/mkdir",
    body={"path": "string", "parents": "boolean", "mode": "string"},
    response=DirectoryMade,
    once=True,
)

#: Every operation the SDK calls (checked against the OpenAPI document).
OPERATIONS: Tuple[Operation, ...] = (
    CREATE_SANDBOX,
    GET_SANDBOX,
    LIST_SANDBOXES,
    STOP_SANDBOX,
    START_SANDBOX,
    DELETE_SANDBOX,
    UPDATE_SANDBOX,
    KEEPALIVE_SANDBOX,
    SANDBOX_EVENTS,
    CREATE_COMMAND,
    GET_COMMAND,
    LIST_COMMANDS,
    COMMAND_OUTPUT,
    SIGNAL_COMMAND,
    CREATE_SNAPSHOT,
    GET_SNAPSHOT,
    LIST_SNAPSHOTS,
    DELETE_SNAPSHOT,
    LIST_IMAGES,
    GET_IMAGE,
    SET_SECRET,
    LIST_SECRETS,
    DELETE_SECRET,
    WRITE_FILE,
    READ_FILE,
    LIST_FILES,
    REMOVE_FILE,
    MOVE_FILE,
    MAKE_DIRECTORY,
)
