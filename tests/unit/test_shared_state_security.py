"""The routers' shared state (router/shared/state.py, router/shared/sync.py) against what a Redis
restart and a Redis writer without the cluster secret do to it (review 2026-12: H5, M2, L5),
over real redis-servers started here. The routers are tests/unit/test_shared_state.py's."""

import asyncio
import io
import os

import pytest
import redis.exceptions

from pdserve import cli
from pdserve.cluster import local_services
from pdserve.settings.cluster_secret import SECRET_ENV
from pdserve.worker.processes import stop_group
from router.http.api_keys import is_authorized
from router.shared import state as shared_state
from router.shared.state import key_digest
from router.workers.prefix_index import CHUNK_TOKENS
from tests.integration.processes import group_members
from tests.unit.shared_routers import Router

pytestmark = pytest.mark.timeout(60)


async def once(router: Router, tries: int = 5) -> None:
    """One round of the router's sync; the first command after a Redis restart may find its
    connection closed (the next one reconnects)."""
    for attempt in range(tries):
        try:
            return await router.sync.once()
        except redis.exceptions.ConnectionError:
            if attempt == tries - 1:
                raise
            await asyncio.sleep(0.2)


def test_a_revoked_key_stays_refused_after_redis_restarts_empty(tmp_path, monkeypatch):
    """Review H5: the routers replaced their revoked set with Redis's, and Redis keeps nothing
    on disk: a restart un-revoked every key. Now each router keeps what it saw and writes back
    what Redis lost, so a router started after the restart refuses the key too."""
    keys = ("sk-kept", "sk-leaked")
    url, group = local_services.start_redis(tmp_path / "redis.log")
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    monkeypatch.setattr("sys.stdin", io.StringIO("sk-leaked\n"))

    async def scenario() -> tuple[frozenset, frozenset, set]:
        nonlocal group
        router = Router(url, "h5", "one", [])
        await once(router)
        assert not is_authorized("Bearer sk-leaked", keys, router.sync.revoked)
        stop_group(group)  # no persistence: it comes back empty
        group = local_services.start_redis(tmp_path / "redis-2.log", port=port)[1]
        for _ in range(2):  # the next presence rounds, a second apart
            router.sync.presence_at = -10.0
            await once(router)
        started_since = Router(url, "h5", "two", [])
        await once(started_since)
        stored = await started_since.sync.shared.redis.smembers("pdserve:h5:revoked-keys")
        await started_since.close()
        await router.close()
        return router.sync.revoked, started_since.sync.revoked, stored

    try:
        assert cli.main(["revoke-key", "--registry", url, "--cluster", "h5"]) == 0
        revoked, revoked_since, stored = asyncio.run(scenario())
        assert not is_authorized("Bearer sk-leaked", keys, revoked)
        assert not is_authorized("Bearer sk-leaked", keys, revoked_since)
        assert is_authorized("Bearer sk-kept", keys, revoked_since)
        assert stored == {key_digest("sk-leaked").encode()}
    finally:
        stop_group(group)
        assert group_members(group) == []


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    url, group = local_services.start_redis(tmp_path_factory.mktemp("redis") / "redis.log")
    yield url
    stop_group(group)
    assert group_members(group) == []


@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "this-clusters-secret")


async def keys_of_type(router: Router, kind: str) -> list[bytes]:
    """The cluster's keys of a Redis type, whatever this version names them: what a Redis
    writer sees there."""
    pattern = router.sync.shared.base + "*"
    found = [key async for key in router.sync.shared.redis.scan_iter(match=pattern)]
    return [key for key in found if (await router.sync.shared.redis.type(key)) == kind.encode()]


def test_presences_not_signed_or_stale_do_not_cut_the_admission_share(redis_url, secret):
    """Review M2: 1,000 `router:*` keys cut every router's share of the admission capacity to
    1 (429 for everyone)."""

    async def scenario():
        one = Router(redis_url, "m2-peers", "one", [])
        other = Router(redis_url, "m2-peers", "other", [])
        try:
            await one.sync.once()
            redis, base = one.sync.shared.redis, one.sync.shared.base
            async with redis.pipeline(transaction=False) as pipe:
                for i in range(1000):
                    pipe.set(f"{base}router:fake-{i}", "1")
                await pipe.execute()
            await other.sync.once()
            assert other.peers.routers == 2
            assert other.peers.share(100) == 50
            assert other.sync.shared.refused == 1000
            stale = f"{base}router:replayed"  # signed, but written long ago (a replay)
            await redis.set(stale, one.sync.shared._sealed("1000", stale))
            other.sync.presence_at = -10.0
            await other.sync.once()
            assert other.peers.routers == 2
            assert other.sync.shared.refused == 2001
        finally:
            await one.close()
            await other.close()

    asyncio.run(scenario())


def test_roles_and_split_not_signed_or_not_valid_are_ignored_and_replaced(redis_url, secret):
    """Review M2: a Redis writer moved every flex worker to standby; a split value that is not
    a number stopped every router's sync."""
    workers = ["w0", "w1", "w2"]

    async def scenario():
        one = Router(redis_url, "m2-roles", "one", workers)
        try:
            await one.sync.once()
            wanted, redis = one.split(), one.sync.shared.redis
            hashes = await keys_of_type(one, "hash")
            assert len(hashes) == 2  # the roles and the split
            for key in hashes:
                fields = await redis.hkeys(key)
                moved = "standby" if b"w0" in fields else "99"  # every worker; a split
                await redis.hset(key, mapping=dict.fromkeys(fields, moved))
            await one.sync.once()
            assert one.split() == wanted
            assert one.sync.shared.refused == 3 + 2
            for key in hashes:
                await redis.hset(key, "prefill", "junk")
            roles_key = one.sync.shared.base + "flex-roles"  # signed, but not a role
            await redis.hset(roles_key, "w9", one.sync.shared._sealed("leader", roles_key, "w9"))
            await redis.sadd(one.sync.shared.base + "revoked-keys", "not a digest")
            await one.sync.once()  # no longer the split as it was read: replaced
            assert one.split() == wanted
            assert "not a digest" not in one.sync.revoked
            fresh = Router(redis_url, "m2-roles", "fresh", workers)
            await fresh.sync.once()
            assert fresh.split() == wanted
            await fresh.close()
        finally:
            await one.close()

    asyncio.run(scenario())


def test_a_ratio_lease_not_signed_is_held_by_nobody(redis_url, secret):
    async def scenario():
        one = Router(redis_url, "m2-lease", "one", ["w0", "w1"], auto=True)
        lease = one.sync.shared.base + "ratio-lease"
        await one.sync.shared.redis.set(lease, "attacker")  # no time to live
        await one.sync.once()
        assert one.roles.leads_ratio
        other = Router(redis_url, "m2-lease", "other", ["w0", "w1"], auto=True)
        await other.sync.once()
        assert not other.roles.leads_ratio  # signed, and held by one
        await one.close()
        await other.close()

    asyncio.run(scenario())


def test_prefix_entries_not_signed_or_for_non_members_are_not_learned(redis_url, secret):
    """Review M2: entries under any address were learned, one dict per address, without
    limit: a flood of fake addresses ran the routers out of memory."""
    member = "10.0.0.7:50051"
    hashes = [os.urandom(16) for _ in range(3)]

    async def scenario():
        one = Router(redis_url, "m2-prefix", "one", [member])
        other = Router(redis_url, "m2-prefix", "other", [member])
        try:
            await one.sync.once()
            await other.sync.once()
            one.index.sent(member, hashes)
            one.index.sent("10.0.0.8:50051", hashes)  # not a member (of the other's pools)
            await one.sync.once()
            await other.sync.once()
            assert other.index.cached_tokens(member, hashes) == 3 * CHUNK_TOKENS
            assert set(other.index._chunks) == {member}
            (stream,) = await keys_of_type(one, "stream")
            redis, forged = one.sync.shared.redis, [os.urandom(16) for _ in range(4)]
            async with redis.pipeline(transaction=False) as pipe:
                for i in range(1000):
                    address = member if i == 0 else f"10.6.{i // 250}.{i % 250}:1"
                    fields = {"router": "x", "address": address, "hashes": b"".join(forged)}
                    pipe.xadd(stream, {**fields, "mac": "0" * 64})
                pipe.xadd(stream, {"router": "x", "address": member})
                await pipe.execute()
            await other.sync.once()
            assert set(other.index._chunks) == {member}
            assert other.index.cached_tokens(member, forged) == 0
            assert other.sync.shared.refused == 1001
        finally:
            await one.close()
            await other.close()

    asyncio.run(scenario())


def test_roles_of_workers_gone_leave_the_shared_roles(redis_url):
    """Review L5: the roles hash was never pruned, and K8s names a restarted pod anew."""

    async def scenario():
        one = Router(redis_url, "l5-roles", "one", ["w0", "w1", "w2"])
        one.sync.prune_after_s = 0.3
        try:
            await one.sync.once()
            (roles,) = [
                key
                for key in await keys_of_type(one, "hash")
                if await one.sync.shared.redis.hexists(key, "w0")
            ]
            one.roles.pool.workers.pop()  # w2 left
            await one.sync.once()
            assert await one.sync.shared.redis.hexists(roles, "w2")  # not at once
            await asyncio.sleep(0.4)
            await one.sync.once()
            assert sorted(await one.sync.shared.redis.hkeys(roles)) == [b"w0", b"w1"]
        finally:
            await one.close()

    asyncio.run(scenario())


def test_the_prefix_stream_is_bounded_in_bytes(redis_url, monkeypatch):
    """Review L5: the stream's bound counted entries: at 32 KiB of chunk hashes per 128k-token
    prompt, 100,000 of them are 3 GiB against Redis's 512 MiB."""
    monkeypatch.setattr(shared_state, "PREFIX_STREAM_BYTES", 1 << 20, raising=False)
    member = "10.0.0.7:50051"
    prompts = [[os.urandom(16) for _ in range(2048)] for _ in range(100)]  # 128k tokens each

    async def scenario():
        one = Router(redis_url, "l5-stream", "one", [member])
        other = Router(redis_url, "l5-stream", "other", [member])
        try:
            await one.sync.once()
            await other.sync.once()
            for prompt in prompts:
                one.index.sent(member, prompt)
            await one.sync.once()
            (stream,) = await keys_of_type(one, "stream")
            used = await one.sync.shared.redis.memory_usage(stream, samples=0)
            assert used < 1.25 * (1 << 20), used
            await other.sync.once()
            assert other.index.cached_tokens(member, prompts[-1]) == 2048 * CHUNK_TOKENS
        finally:
            await one.close()
            await other.close()

    asyncio.run(scenario())
