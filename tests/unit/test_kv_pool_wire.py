"""The pool's socket language (kv_transfer/pool/wire.py): every message survives its line, a
line that is no message is refused with WireError, and the store answers every request with
the reply type the request names (the store's PoolStore, in this process)."""

import os

import pytest

from kv_transfer.pool.index import Changes, Stored
from kv_transfer.pool.store import PoolStore
from kv_transfer.pool.wire import (
    REQUESTS,
    CompleteLoad,
    CompleteStore,
    Contents,
    Done,
    Drop,
    Found,
    GetContents,
    GetStats,
    Hello,
    Joined,
    Lookup,
    Observing,
    Pinned,
    PoolRequest,
    PoolStats,
    PrepareLoad,
    PrepareStore,
    Refused,
    Reserved,
    WireError,
    decode,
    encode,
)

KEYS = (b"\x00k1", b"\xffk2")
REQUESTS_ONE_EACH = [
    Lookup(KEYS),
    PrepareLoad(KEYS),
    CompleteLoad(KEYS),
    PrepareStore(KEYS),
    CompleteStore(KEYS, success=False),
    Drop(KEYS),
    GetStats(),
    GetContents("a store", since=7),
]
REPLIES_ONE_EACH = [
    Refused("no", later=True),
    Joined(3, 16, 4096, 2, 4096, "a store", "a namespace"),
    Observing(),
    Found(2),
    Pinned(None),
    Pinned((4, 1)),
    Reserved(None),
    Reserved(Stored(KEYS, (0, 5), (b"old",))),
    Done(),
    PoolStats(None, 1 << 20, 0, 0, 0, 0, 0, 0, 0),
    Contents("a store", Changes(9, reset=True, added=KEYS, removed=())),
]


def test_every_request_op_has_one_class_and_every_request_is_covered_here():
    assert {type(request) for request in REQUESTS_ONE_EACH} | {Hello} == set(REQUESTS.values())


@pytest.mark.parametrize("request_", [*REQUESTS_ONE_EACH, Hello(None), Hello("ns", 4096, 2)])
def test_a_request_survives_its_line(request_):
    line = encode(request_)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode(line, Hello if isinstance(request_, Hello) else PoolRequest) == request_


@pytest.mark.parametrize("reply", REPLIES_ONE_EACH)
def test_a_reply_survives_its_line(reply):
    assert decode(encode(reply), type(reply)) == reply


def test_keys_travel_in_hex():
    assert encode(Lookup(KEYS)) == b'{"op":"lookup","keys":["006b31","ff6b32"]}\n'


@pytest.mark.parametrize(
    "line, expecting",
    [
        (b"", PoolRequest),
        (b"{", PoolRequest),
        (b'"lookup"', PoolRequest),
        (b"{}", PoolRequest),  # no op
        (b'{"op": "stats"} {"op": "stats"}', PoolRequest),  # two on one line
        (b'{"op": "grow"}', PoolRequest),
        (b'{"op": ["lookup"]}', PoolRequest),
        (b'{"op": "lookup", "keys": ["6b", 7]}', PoolRequest),
        (b'{"op": "lookup", "keys": ["6"]}', PoolRequest),  # odd hex
        (b'{"op": "contents", "store_id": "s", "since": "0"}', PoolRequest),
        (b'{"op": "contents", "store_id": "s", "since": false}', PoolRequest),  # a bool
        (b'{"op": "hello", "namespace": "ns"}', PoolRequest),  # a hello after the hello
        (b'{"op": "lookup", "keys": []}', Hello),  # no hello first
        (b'{"op": "stats"}', Found),  # a request where a reply is due
        (b'{"found": 1}', Found),  # another field
        (b'{"blocks": 1, "slots": []}', Found),  # one too many
        (b'{"slots": [1, null]}', Pinned),
        (b'{"stored": {"keys": [], "slots": []}}', Reserved),  # a nested field missing
        (b'{"error": 1, "later": false}', Found),
        (b'{"error": "full"}', Found),  # every field is on the line, defaults too
    ],
)
def test_a_line_that_is_no_such_message_is_refused(line, expecting):
    with pytest.raises(WireError):
        decode(line, expecting)


def test_a_store_error_is_read_as_refused_whatever_was_expected():
    assert decode(b'{"error": "full", "later": false}\n', Found) == Refused("full")


@pytest.fixture
def store():
    store = PoolStore(budget_bytes=4 * 4096)
    yield store
    if store.fd >= 0:  # its memory, made by the first hello
        os.close(store.fd)


def test_the_store_answers_each_request_with_the_reply_type_it_names(store):
    owner = store.join(Hello("ns", 4096)).owner
    store.answer(PrepareStore(KEYS), owner)
    store.answer(CompleteStore(KEYS, success=True), owner)
    for request in REQUESTS_ONE_EACH:
        reply = store.answer(request, owner)
        assert isinstance(reply, type(request).reply), (request, reply)
        assert decode(encode(reply), type(request).reply) == reply


def test_an_observer_is_answered_stats_and_contents_only(store):
    assert isinstance(store.answer(GetStats(), None), PoolStats)
    assert isinstance(store.answer(GetContents("", 0), None), Contents)
    assert isinstance(store.answer(Lookup(KEYS), None), Refused)
    store.join(Hello("ns", 4096))
    assert isinstance(store.answer(PrepareStore(KEYS), None), Refused)
