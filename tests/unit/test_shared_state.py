"""Several routers' shared state (router/shared/state.py, router/shared/sync.py) over a real
redis-server with a password: the flex split set through one router in effect at another, a
restarted router taking the split it was given, one --flex-auto decider at a time, prefix-index
additions crossing routers, the admission capacity split by the live routers, API keys revoked
everywhere, and changes made while Redis was away shared once it is back. The routers' flex
workers are tests/fakes.py's."""

import asyncio
import io
import os
import time

import pytest
import redis.exceptions

from pdserve import cli
from pdserve.cluster import local_services
from pdserve.settings.redis_url import PASSWORD_ENV, connect, masked
from pdserve.worker.processes import free_port, stop_group
from router.http.api_keys import is_authorized
from router.shared.state import SharedState
from router.workers.prefix_index import CHUNK_TOKENS, chunk_hashes
from tests.integration.processes import group_members
from tests.unit.shared_routers import Router

PASSWORD = "s3cret-for-this-test"
pytestmark = pytest.mark.timeout(60)  # a hung Redis command fails here, not at the suite's 600 s


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    url, group = local_services.start_redis(
        tmp_path_factory.mktemp("redis") / "redis.log", password=PASSWORD
    )
    before = os.environ.get(PASSWORD_ENV)
    os.environ[PASSWORD_ENV] = PASSWORD
    yield url
    if before is None:
        del os.environ[PASSWORD_ENV]
    else:
        os.environ[PASSWORD_ENV] = before
    stop_group(group)
    assert group_members(group) == []


def test_the_password_is_required_and_never_shown(redis_url):
    async def without_password():
        client = connect(redis_url)
        try:
            await client.ping()
        finally:
            await client.aclose()

    os.environ.pop(PASSWORD_ENV)
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):
            asyncio.run(without_password())
    finally:
        os.environ[PASSWORD_ENV] = PASSWORD
    asyncio.run(without_password())  # with it, from the environment
    assert PASSWORD not in redis_url
    assert masked(f"redis://:{PASSWORD}@10.0.0.1:6379/0") == "redis://:***@10.0.0.1:6379/0"


def test_a_split_set_through_one_router_is_in_effect_at_the_other(redis_url):
    workers = ["w0", "w1", "w2"]

    async def scenario():
        one = Router(redis_url, "split", "one", workers)
        other = Router(redis_url, "split", "other", list(reversed(workers)))
        try:
            await one.sync.once()
            await other.sync.once()
            assert one.split() == other.split()  # the first to place a worker decided
            assert sorted(one.split().values()) == ["decode", "decode", "prefill"]
            follow = asyncio.create_task(other.sync.follow(0.1))
            one.roles.set_split(2, None, by="manual")
            await one.sync.once()
            changed_at = time.monotonic()
            while other.split() != one.split() and time.monotonic() - changed_at < 5:
                await asyncio.sleep(0.01)
            seconds = time.monotonic() - changed_at
            other.sync.stop()
            await asyncio.wait_for(follow, 5)
            assert other.split() == one.split(), (other.split(), one.split())
            assert seconds < 1.0, seconds
            restarted = Router(redis_url, "split", "restarted", workers)
            await restarted.sync.once()
            assert restarted.split() == one.split()  # not the initial 1 prefill, 2 decode
            assert restarted.roles.wanted["prefill"] == 2
            await restarted.close()
            redis = one.sync.shared.redis  # Redis restarted empty: the routers put it back
            await redis.delete("pdserve:split:flex-roles", "pdserve:split:flex-split")
            await one.sync.once()  # sees it empty
            await one.sync.once()  # writes its view back
            fresh = Router(redis_url, "split", "fresh", workers)
            await fresh.sync.once()
            assert fresh.split() == one.split() and fresh.roles.wanted["prefill"] == 2
            await fresh.close()
        finally:
            await one.close()
            await other.close()

    asyncio.run(scenario())


def test_one_router_at_a_time_decides_the_automatic_ratio(redis_url):
    async def scenario():
        one = Router(redis_url, "lease", "one", ["w0", "w1"], auto=True)
        other = Router(redis_url, "lease", "other", ["w0", "w1"], auto=True)
        await one.sync.once()
        await other.sync.once()
        assert (one.roles.leads_ratio, other.roles.leads_ratio) == (True, False)
        await one.sync.once()
        assert one.roles.leads_ratio  # renewed by its holder
        await one.close()  # the leader stops: the next router takes over at its next round
        await other.sync.once()
        assert other.roles.leads_ratio
        await other.close()

    asyncio.run(scenario())


def test_prefix_additions_cross_routers(redis_url):
    prompt = list(range(3 * CHUNK_TOKENS + 5))
    hashes = chunk_hashes(prompt)

    async def scenario():
        one = Router(redis_url, "prefix", "one", ["10.0.0.7:50051"])  # the member's address
        other = Router(redis_url, "prefix", "other", ["10.0.0.7:50051"])
        try:
            await one.sync.once()
            await other.sync.once()
            one.index.sent("10.0.0.7:50051", hashes)
            assert other.index.cached_tokens("10.0.0.7:50051", hashes) == 0
            await one.sync.once()
            await other.sync.once()
            assert other.index.cached_tokens("10.0.0.7:50051", hashes) == 3 * CHUNK_TOKENS
            assert other.index.cached_tokens("10.0.0.8:50051", hashes) == 0
        finally:
            await one.close()
            await other.close()

    asyncio.run(scenario())


def test_the_admission_capacity_is_split_between_the_live_routers(redis_url):
    async def scenario():
        one = Router(redis_url, "peers", "one", [])
        other = Router(redis_url, "peers", "other", [])
        await one.sync.once()
        await other.sync.once()
        assert other.peers.routers == 2
        assert (other.peers.share(5), other.peers.share(1), other.peers.share(0)) == (3, 1, 0)
        await one.close()
        other.sync.presence_at = -10.0  # its next round counts again
        await other.sync.once()
        assert other.peers.routers == 1 and other.peers.share(5) == 5
        await other.close()

    asyncio.run(scenario())


def test_a_revoked_key_is_refused_by_every_router(redis_url, monkeypatch):
    keys = ("sk-kept", "sk-revoked")
    monkeypatch.setattr("sys.stdin", io.StringIO("sk-revoked\n"))
    assert cli.main(["revoke-key", "--registry", redis_url, "--cluster", "keys"]) == 0

    async def scenario():
        router = Router(redis_url, "keys", "one", [])
        await router.sync.once()
        await router.close()
        return router.sync.revoked

    revoked = asyncio.run(scenario())
    assert not is_authorized("Bearer sk-revoked", keys, revoked)
    assert is_authorized("Bearer sk-kept", keys, revoked)
    assert "sk-revoked" not in "".join(revoked)  # digests only
    monkeypatch.setattr("sys.stdin", io.StringIO("\n"))
    assert cli.main(["revoke-key", "--registry", redis_url]) == 2


def test_changes_made_while_redis_is_away_are_shared_once_it_answers(redis_url):
    async def scenario():
        one = Router(redis_url, "outage", "one", ["w0", "w1", "w2"])
        other = Router(redis_url, "outage", "other", ["w0", "w1", "w2"])
        await one.sync.once()
        await other.sync.once()
        reachable = one.sync.shared
        one.sync.shared = SharedState(f"redis://127.0.0.1:{free_port()}/0", "outage", "one")
        one.roles.set_split(2, None, by="manual")
        with pytest.raises(redis.exceptions.ConnectionError):
            await one.sync.once()
        await one.sync.shared.close()
        one.sync.shared = reachable
        await other.sync.once()
        assert other.split() != one.split()  # not shared yet
        await one.sync.once()
        await other.sync.once()
        assert other.split() == one.split()
        await one.close()
        await other.close()

    asyncio.run(scenario())


def test_a_read_begun_before_a_change_is_shared_does_not_undo_it(redis_url):
    """The race a clean-clone CI run hit: a round read the split, a role change was asked and
    shared meanwhile, and the round then put the old split back."""

    async def scenario():
        one = Router(redis_url, "race", "one", ["w0", "w1", "w2"])
        await one.sync.once()
        read_roles = one.sync.shared.roles
        read, release = asyncio.Event(), asyncio.Event()

        async def slow_read():
            roles = await read_roles()
            read.set()
            await release.wait()
            return roles

        one.sync.shared.roles = slow_read
        round_before = asyncio.create_task(one.sync.once())
        await read.wait()  # the round holds the split as it was
        one.roles.set_split(2, None, by="manual")
        wanted = one.split()
        shared = asyncio.create_task(one.sync.share_roles_now())
        await asyncio.sleep(0.05)
        release.set()
        await asyncio.gather(round_before, shared)
        assert one.split() == wanted
        one.sync.shared.roles = read_roles
        await one.sync.once()
        other = Router(redis_url, "race", "other", ["w0", "w1", "w2"])
        await other.sync.once()
        assert one.split() == wanted == other.split()
        await one.close()
        await other.close()

    asyncio.run(scenario())
