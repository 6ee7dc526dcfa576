"""The routers' shared state (router/shared_state.py, router/state_sync.py) against what a Redis
restart and a Redis writer without the cluster secret do to it (review 2026-12: H5, M2, L5),
over real redis-servers started here. The routers are tests/unit/test_shared_state.py's."""

import asyncio
import io

import pytest
import redis.exceptions

from pdserve.cluster import cli, local_services
from pdserve.worker.processes import stop_group
from router.api_keys import is_authorized
from router.shared_state import key_digest
from tests.integration.processes import group_members
from tests.unit.test_shared_state import Router

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
