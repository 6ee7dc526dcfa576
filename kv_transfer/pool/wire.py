"""What a pool store (kv_transfer/pool/store.py) and its clients (kv_transfer/pool/client.py) say
to each other over its Unix socket: one frozen dataclass per request and per reply, and one
`encode` / `decode` pair for the socket's JSON lines (keys travel in hex). Each request names
the reply it gets (`PoolRequest[Found]`), so a client's call is typed by what it asks, and a
reply of any other shape is refused on arrival. Both sides import this; neither imports the other.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from types import NoneType, UnionType
from typing import Any, ClassVar, Generic, TypeVar, get_args, get_origin, get_type_hints

from kv_transfer.pool.index import Changes, Stored

HELLO_BYTES = 4096  # a hello answer fits (it is read with the descriptor, in one recv)
PEER = "*"  # a hello's namespace that takes the pool's own (kv_transfer/pool/peer.py)

Keys = tuple[bytes, ...]  # vLLM's block hashes, in a prompt's order
Reply = TypeVar("Reply")
Message = TypeVar("Message")


def socket_address(address: str) -> str:
    """ "@name" is the abstract socket "\\0name"; anything else is a path."""
    return "\0" + address[1:] if address.startswith("@") else address


class WireError(ValueError):
    """A line that is no message of this protocol: not JSON, an unknown op, a field missing,
    unknown or of the wrong type."""


# Replies.


@dataclass(frozen=True)
class Refused:
    """What the store answers a request it will not serve: a hello it cannot join (`later`: a
    peer's, before any engine said what the pool holds: ask again), an op not allowed on this
    connection, or a line that is no request."""

    error: str
    later: bool = False


@dataclass(frozen=True)
class Joined:
    """The answer to an engine's or a peer's hello, sent with the memory's descriptor: its
    layout, the store's identity (a new store has new memory) and what the pool holds."""

    owner: int  # the connection's number: what it pins and writes is released with it
    slots: int
    slot_bytes: int
    parts: int
    header_bytes: int
    store_id: str
    namespace: str


@dataclass(frozen=True)
class Observing:
    """The answer to an observer's hello: no memory, stats and contents only."""


@dataclass(frozen=True)
class Found:
    blocks: int  # how many of the keys, from the first, are loadable


@dataclass(frozen=True)
class Pinned:
    slots: tuple[int, ...] | None  # None: one is not loadable any more, nothing was pinned


@dataclass(frozen=True)
class Reserved:
    stored: Stored | None  # None: no room for all of them, nothing changed


@dataclass(frozen=True)
class Done:
    """A request that changes the index and has nothing to say back."""


@dataclass(frozen=True)
class PoolStats:
    """The pool's figures; zeros (and no namespace) before its first engine joined."""

    namespace: str | None
    budget_bytes: int
    slots: int
    used: int  # blocks held
    slot_bytes: int
    bytes: int  # bytes held
    hits: int
    evictions: int
    dropped: int  # blocks whose bytes failed a reader's check


@dataclass(frozen=True)
class Contents:
    store_id: str  # the changes' numbers are this store's
    changes: Changes


# Requests.


class PoolRequest(Generic[Reply]):
    """A request after the hello; `reply` is the type the store answers it with (its type
    argument)."""

    op: ClassVar[str]
    reply: ClassVar[type]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.reply = get_args(cls.__orig_bases__[0])[0]


@dataclass(frozen=True)
class Hello:
    """A connection's first line: an engine's (its namespace, slot size and tensor-parallel
    parts), a peer's (namespace PEER) or an observer's (namespace None)."""

    op = "hello"
    namespace: str | None
    slot_bytes: int = 0
    parts: int = 1


@dataclass(frozen=True)
class Lookup(PoolRequest[Found]):
    op = "lookup"
    keys: Keys


@dataclass(frozen=True)
class PrepareLoad(PoolRequest[Pinned]):
    """Pin the keys' blocks for this connection until CompleteLoad."""

    op = "prepare_load"
    keys: Keys


@dataclass(frozen=True)
class CompleteLoad(PoolRequest[Done]):
    op = "complete_load"
    keys: Keys


@dataclass(frozen=True)
class PrepareStore(PoolRequest[Reserved]):
    """Slots for the keys not held yet, this connection's until CompleteStore."""

    op = "prepare_store"
    keys: Keys


@dataclass(frozen=True)
class CompleteStore(PoolRequest[Done]):
    op = "complete_store"
    keys: Keys
    success: bool  # True: loadable now; False: their slots are freed


@dataclass(frozen=True)
class Drop(PoolRequest[Done]):
    """Forget blocks whose bytes failed a reader's check."""

    op = "drop"
    keys: Keys


@dataclass(frozen=True)
class GetStats(PoolRequest[PoolStats]):
    op = "stats"


@dataclass(frozen=True)
class GetContents(PoolRequest[Contents]):
    """The keys that became or stopped being loadable after change `since` of store
    `store_id` (every loadable key when that is another store's: kv_transfer/pool/index.py)."""

    op = "contents"
    store_id: str
    since: int


REQUESTS: dict[str, type] = {
    kind.op: kind
    for kind in (
        Hello,
        Lookup,
        PrepareLoad,
        CompleteLoad,
        PrepareStore,
        CompleteStore,
        Drop,
        GetStats,
        GetContents,
    )
}


REPLIES = (Refused, Joined, Observing, Found, Pinned, Reserved, Done, PoolStats, Contents)


# A line's own encoder and decoder: messages hold no cycles (no check for them: a third of a
# small line's encoding time), and raw_decode skips json.loads' wrapper (most of its time).
_to_json = json.JSONEncoder(check_circular=False, separators=(",", ":")).encode
_from_json = json.JSONDecoder().raw_decode


def encode(message) -> bytes:
    """One line of the socket: a request's op and fields, or a reply's fields."""
    return (_to_json(_body(message)) + "\n").encode()


def decode(line: bytes, expecting: type[Message]) -> Message | Refused:
    """The message on `line`: a request by its op (`expecting`: Hello, PoolRequest or one
    request's type), a reply as `expecting` or the store's Refused. WireError: anything else."""
    try:
        text = line.decode()
        body, end = _from_json(text)
        if text[end:].strip():
            raise WireError(f"more than one JSON value: {line[:80]!r}")
        if type(body) is not dict:
            raise WireError(f"not a JSON object: {line[:80]!r}")
        if "op" in body:
            op = body.pop("op")
            kind = REQUESTS.get(op) if type(op) is str else None
            if kind is None:
                raise WireError(f"unknown op {op!r}")
            if not issubclass(kind, expecting):
                raise WireError(f"{op!r} is not a {expecting.__name__}")
        elif issubclass(expecting, (Hello, PoolRequest)):
            raise WireError(f"no op: {line[:80]!r}")
        else:
            kind = Refused if "error" in body else expecting
        return _build(kind, body)
    except (ValueError, TypeError, KeyError, RecursionError) as error:
        if isinstance(error, WireError):
            raise
        raise WireError(f"{type(error).__name__}: {error}") from error


def _body(message) -> dict:
    """A message's JSON object (a nested one's too)."""
    shape = _SHAPES[type(message)]
    body = {**shape.head, **message.__dict__}
    for name, to_json, _ in shape.converted:
        body[name] = to_json(body[name])
    return body


def _build(kind: type, body: dict):
    """A `kind` from its fields' JSON values, each checked against its type (KeyError: one is
    missing; TypeError: one is not `kind`'s)."""
    shape = _SHAPES[kind]
    for name, checked in shape.plain:
        if type(body[name]) is not checked:  # exactly: a bool is no int here
            raise WireError(f"{kind.__name__}.{name}: {body[name]!r} is not {checked.__name__}")
    for name, _, from_json in shape.converted:
        body[name] = from_json(body[name])
    return kind(**body)


@dataclass(frozen=True)
class _Shape:
    """How a message's fields go to JSON and back: `plain` ones as they are (their exact type
    checked on arrival), `converted` ones through their pair of functions (bytes as hex)."""

    head: dict  # {"op": ...} for a request
    plain: tuple[tuple[str, type], ...]
    converted: tuple[tuple[str, Callable, Callable], ...]


def _shape(kind: type) -> _Shape:
    hints = get_type_hints(kind)
    plain, converted = [], []
    for field in fields(kind):
        hint = hints[field.name]
        if hint in (int, bool, str):
            plain.append((field.name, hint))
        else:
            converted.append((field.name, *_codec(hint)))
    head = {"op": kind.op} if kind in REQUESTS.values() else {}
    return _Shape(head, tuple(plain), tuple(converted))


def _codec(hint) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """How a field of type `hint` goes to JSON and back, checked."""
    if get_origin(hint) is UnionType and NoneType in get_args(hint):  # X | None
        (inner,) = (arg for arg in get_args(hint) if arg is not NoneType)
        to_json, from_json = _codec(inner)
        return (
            lambda value: None if value is None else to_json(value),
            lambda value: None if value is None else from_json(value),
        )
    if hint == Keys:
        return _hex_keys, _keys
    if hint == tuple[int, ...]:
        return (lambda numbers: numbers), _numbers
    if hint in (int, bool, str):
        return (lambda value: value), _checked(hint)
    if is_dataclass(hint):
        return _body, lambda body: _build(hint, dict(_checked(dict)(body)))
    raise TypeError(f"no wire form for {hint}")


def _checked(kind: type) -> Callable[[Any], Any]:
    def check(value):
        if type(value) is not kind:  # exactly: a bool is no int here
            raise WireError(f"{value!r} is not {kind.__name__}")
        return value

    return check


def _hex_keys(keys: Keys) -> list[str]:
    return [key.hex() for key in keys]


def _keys(value) -> Keys:
    if type(value) is not list:
        raise WireError(f"{value!r} is not a list of keys")
    return tuple(map(bytes.fromhex, value))  # TypeError: one is not a str


def _numbers(value) -> tuple[int, ...]:
    if type(value) is not list or not all(type(number) is int for number in value):
        raise WireError(f"{value!r} is not a list of ints")
    return tuple(value)


_SHAPES = {kind: _shape(kind) for kind in (*REQUESTS.values(), *REPLIES, Stored, Changes)}
