"""What a launcher and its fork server (pdserve/worker/fork_server.py) say to each other over
their two pipes: one frozen dataclass per message, one JSON line each, and one `encode` /
`decode` pair. A line that is no message of this protocol (not JSON, an unknown kind, a field
missing, unknown or of the wrong type) is a ForkMessageError on arrival, never a KeyError in the
server's loop or the launcher's reader thread."""

import json
from dataclasses import asdict, dataclass, fields
from typing import TypeVar

Message = TypeVar("Message")


class ForkMessageError(ValueError):
    """A line that is no message of the fork server's protocol."""


@dataclass(frozen=True)
class Fork:
    """Launcher -> server: fork a child that runs `module` as its main module."""

    module: str
    argv: tuple[str, ...]  # its arguments (sys.argv[1:])
    env: dict[str, str]  # exactly its environment
    log: str  # the file its output goes to
    title: str  # its command line, as process listings show it


@dataclass(frozen=True)
class Ready:
    """Server -> launcher, once: the imports are done, it takes requests."""


@dataclass(frozen=True)
class Forked:
    """The answer to a Fork: the child's pid."""

    pid: int


@dataclass(frozen=True)
class ForkFailed:
    """The answer to a Fork the server could not serve."""

    error: str


@dataclass(frozen=True)
class Exited:
    """Server -> launcher, whenever a child exits: its exit code as Popen's returncode says it
    (-N: killed by signal N)."""

    pid: int
    code: int


KINDS: dict[str, type] = {
    "fork": Fork,
    "ready": Ready,
    "forked": Forked,
    "fork_failed": ForkFailed,
    "exited": Exited,
}
_NAMES = {kind: name for name, kind in KINDS.items()}
_FIELD_TYPES = {kind: {f.name: f.type for f in fields(kind)} for kind in KINDS.values()}


def encode(message) -> bytes:
    """One line of a pipe: the message's kind and fields."""
    return (json.dumps({"kind": _NAMES[type(message)], **asdict(message)}) + "\n").encode()


def decode(line: bytes | str, expecting: type[Message] | tuple[type, ...]) -> Message:
    """The message on `line`, one of `expecting`'s types; ForkMessageError if it is not."""
    try:
        body = json.loads(line)
    except (ValueError, RecursionError) as error:
        raise ForkMessageError(f"not JSON: {str(line)[:80]}") from error
    if type(body) is not dict:
        raise ForkMessageError(f"not a JSON object: {str(line)[:80]}")
    kind = KINDS.get(body.pop("kind", None))
    if kind is None or not issubclass(kind, expecting):
        raise ForkMessageError(f"not a message expected here: {str(line)[:80]}")
    types = _FIELD_TYPES[kind]
    if body.keys() != types.keys():
        raise ForkMessageError(f"{kind.__name__}: fields {sorted(body)}, not {sorted(types)}")
    for name, value in body.items():
        body[name] = _checked(f"{kind.__name__}.{name}", types[name], value)
    return kind(**body)


def _checked(where: str, hint, value):
    """`value` as a field of type `hint` holds it; exact types (a bool is no int here)."""
    if hint in (str, int) and type(value) is hint:
        return value
    if hint == tuple[str, ...] and type(value) is list and all(type(v) is str for v in value):
        return tuple(value)
    if (
        hint == dict[str, str]
        and type(value) is dict
        and all(type(v) is str for v in value.values())
    ):
        return value
    raise ForkMessageError(f"{where}: {value!r:.80} is not {hint}")
