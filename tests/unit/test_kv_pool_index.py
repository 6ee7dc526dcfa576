"""The host KV pool's index (kv_transfer/pool/index.py): a byte budget it never exceeds,
pinned and half-written blocks never evicted, eviction by recency weighted by reuse, and a dead
client's holdings released."""

from kv_transfer.pool import index as pool_index
from kv_transfer.pool.index import PoolIndex

A, B, C, D = b"a", b"b", b"c", b"d"


def stored(index: PoolIndex, keys: list[bytes], owner: int = 1) -> list[int]:
    slots = index.prepare_store(keys, owner)
    index.complete_store(slots.keys, owner, success=True)
    return slots.slots


def test_a_block_is_readable_only_once_its_store_completes():
    index = PoolIndex(4)
    plan = index.prepare_store([A, B], owner=1)
    assert plan.keys == (A, B) and len(set(plan.slots)) == 2 and plan.evicted == ()
    assert index.lookup([A, B]) == 0
    assert index.prepare_load([A], owner=2) is None
    index.complete_store([A, B], owner=1, success=True)
    assert index.lookup([A, B, C]) == 2
    assert index.prepare_load([A, B], owner=2) == plan.slots


def test_lookup_counts_the_prefix_up_to_the_first_miss():
    index = PoolIndex(4)
    stored(index, [A, C])
    assert index.lookup([A, B, C]) == 1
    assert index.lookup([B, A]) == 0


def test_a_failed_store_frees_its_slots():
    index = PoolIndex(2)
    plan = index.prepare_store([A, B], owner=1)
    index.complete_store(plan.keys, owner=1, success=False)
    assert index.used == 0
    assert index.prepare_store([C, D], owner=1).evicted == ()


def test_keys_already_stored_are_not_written_again():
    index = PoolIndex(4)
    stored(index, [A])
    plan = index.prepare_store([A, B], owner=1)
    assert plan.keys == (B,) and len(plan.slots) == 1


def test_the_budget_holds_and_the_least_recently_used_block_goes_first():
    index = PoolIndex(2)
    stored(index, [A])
    stored(index, [B])
    index.touch([A])  # B is now the least recently used
    plan = index.prepare_store([C], owner=1)
    assert plan.evicted == (B,)
    assert index.used == 2


def test_a_block_read_since_it_came_up_outlives_one_that_was_not():
    index = PoolIndex(2)
    stored(index, [A])
    stored(index, [B])
    index.prepare_load([A], owner=2)
    index.complete_load([A], owner=2)
    index.touch([B])  # B more recent, but A was reused
    assert index.prepare_store([C], owner=1).evicted == (B,)
    assert index.lookup([A]) == 1


def test_pinned_and_half_written_blocks_are_never_evicted():
    index = PoolIndex(2)
    stored(index, [A])
    index.prepare_load([A], owner=2)  # pinned by a reader
    index.prepare_store([B], owner=3)  # being written
    assert index.prepare_store([C], owner=1) is None
    assert index.lookup([A]) == 1 and index.used == 2
    index.complete_load([A], owner=2)
    assert index.prepare_store([C], owner=1).evicted == (A,)


def test_a_store_larger_than_the_pool_is_refused_and_changes_nothing():
    index = PoolIndex(2)
    stored(index, [A])
    assert index.prepare_store([B, C, D], owner=1) is None
    assert index.lookup([A]) == 1 and index.used == 1


def test_a_dropped_block_is_not_readable_and_is_freed_when_its_reads_end():
    index = PoolIndex(2)
    stored(index, [A, B])
    index.prepare_load([A], owner=2)
    index.drop([A, B])
    assert index.lookup([A]) == 0 and index.lookup([B]) == 0
    assert index.used == 1  # A still being read
    index.complete_load([A], owner=2)
    assert index.used == 0 and index.dropped == 2
    assert stored(index, [A])  # and can be stored again


def test_a_clients_pins_and_unfinished_writes_go_with_it():
    index = PoolIndex(2)
    stored(index, [A])
    index.prepare_load([A], owner=2)
    index.prepare_store([B], owner=2)
    index.release_owner(2)
    assert index.used == 1  # B discarded
    assert index.prepare_store([C, D], owner=1).evicted == (A,)  # A no longer pinned


def contents(index: PoolIndex, since: int) -> tuple[set[bytes], set[bytes], bool]:
    changes = index.contents_since(since)
    return set(changes.added), set(changes.removed), changes.reset


def test_contents_follow_what_is_loadable_stored_evicted_and_dropped():
    index = PoolIndex(2)
    index.prepare_store([A], owner=1)
    assert contents(index, 0) == (set(), set(), False)  # written, not loadable yet
    index.complete_store([A], owner=1, success=True)
    stored(index, [B])
    assert contents(index, 0) == ({A, B}, set(), False)
    seen = index.sequence
    stored(index, [C])  # evicts A, the least recently used
    assert contents(index, seen) == ({C}, {A}, False)
    index.prepare_load([B], owner=2)
    index.drop([B])  # pinned: unloadable at once, removed when its read ends
    index.complete_load([B], owner=2)
    assert contents(index, seen) == ({C}, {A, B}, False)
    assert contents(index, index.sequence) == (set(), set(), False)


def test_a_reader_too_far_behind_or_of_another_index_gets_every_loadable_key(monkeypatch):
    index = PoolIndex(4)
    monkeypatch.setattr(index, "_changes", type(index._changes)(maxlen=2))
    stored(index, [A])
    stored(index, [B])
    stored(index, [C])
    index.drop([C])
    assert contents(index, 0) == ({A, B}, set(), True)  # 4 changes, 2 logged
    assert contents(index, 2) == (set(), {C}, False)  # C stored and dropped: removed
    assert contents(index, index.sequence + 5) == ({A, B}, set(), True)  # another index's


def test_a_reset_names_at_most_as_many_keys_as_the_log_holds_the_most_recently_used(monkeypatch):
    """One answer stays bounded whatever the pool's size: a copy built from it may lack old
    keys (it underestimates), never names one the pool lacks."""
    monkeypatch.setattr(pool_index, "MAX_LOGGED_CHANGES", 2)
    index = PoolIndex(4)
    for key in (A, B, C):
        stored(index, [key])
    index.touch([A])  # least recently used first: B, C, A
    assert contents(index, -1) == ({A, C}, set(), True)
