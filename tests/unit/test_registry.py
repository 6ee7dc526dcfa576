"""The Redis registry against a real redis-server started here: records, expiry, clearing,
records not signed with the cluster secret ignored, and bad or newer records that never stop the
others from being read."""

import asyncio
import json
import time
from dataclasses import replace

import pytest

from pdserve.cluster import local_services
from pdserve.protocol import worker_pb2
from pdserve.protocol.registry import IDENTITY_FIELDS, Registry, WorkerRecord, recorded_load
from pdserve.settings.cluster_secret import SECRET_ENV, signature
from pdserve.worker.processes import stop_group
from tests.integration.processes import group_members


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    url, group = local_services.start_redis(tmp_path_factory.mktemp("redis") / "redis.log")
    yield url
    stop_group(group)
    assert group_members(group) == []


def record(worker_id: str, role: str = "decode") -> WorkerRecord:
    return WorkerRecord(
        worker_pb2.HealthReply(
            worker_id=worker_id,
            role=role,
            kv_address="127.0.0.1:1",
            kv_compatibility="abc",
            max_num_seqs=8,
        ),
        address=f"127.0.0.1:{len(worker_id)}",
        node="n1",
        gpu_ids=("3",),
        load=worker_pb2.StatsReply(running_requests=2, kv_blocks_total=9),
    )


def test_records_round_trip_and_expire_without_a_heartbeat(redis_url):
    async def scenario():
        registry = Registry(redis_url, "expiry")
        try:
            await registry.put(record("decode-0"), ttl_s=0.5)
            await registry.put(record("prefill-0", "prefill"), ttl_s=30)
            members = await registry.members()
            assert [m.identity.worker_id for m in members] == ["decode-0", "prefill-0"]
            assert members[0] == record("decode-0")
            started = time.monotonic()
            while "decode-0" in [m.identity.worker_id for m in await registry.members()]:
                assert time.monotonic() - started < 2.0, "the record outlived its TTL"
                await asyncio.sleep(0.05)
            assert [m.identity.worker_id for m in await registry.members()] == ["prefill-0"]
            await registry.remove("prefill-0")
            assert await registry.members() == []
        finally:
            await registry.close()

    asyncio.run(scenario())


def test_clusters_do_not_see_each_other_and_clear_removes_only_its_own(redis_url):
    async def scenario():
        one, two = Registry(redis_url, "one"), Registry(redis_url, "two")
        try:
            await one.put(record("decode-0"), ttl_s=30)
            await two.put(record("decode-0"), ttl_s=30)
            await two.put(record("decode-1"), ttl_s=30)
            assert len(await one.members()) == 1
            assert await two.clear() == 2
            assert await two.members() == []
            assert len(await one.members()) == 1
        finally:
            await one.clear()
            await one.close()
            await two.close()

    asyncio.run(scenario())


def test_a_record_not_signed_with_the_cluster_secret_is_ignored_and_counted(redis_url, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "the-cluster-secret")

    async def scenario():
        registry = Registry(redis_url, "signed")
        try:
            await registry.put(record("decode-0"), ttl_s=30)
            forged = json.dumps({"record": record("decode-9").to_json(), "mac": "0" * 64})
            await registry.redis.set(registry.prefix + "decode-9", forged)
            await registry.redis.set(registry.prefix + "decode-8", record("decode-8").to_json())
            assert [m.identity.worker_id for m in await registry.members()] == ["decode-0"]
            assert registry.refused == 2
            monkeypatch.setenv(SECRET_ENV, "another-clusters-secret")
            assert await registry.members() == []  # signed, but not with this secret
        finally:
            await registry.clear()
            await registry.close()

    asyncio.run(scenario())


def test_the_server_run_id_is_the_same_until_redis_restarts(redis_url):
    async def scenario():
        registry = Registry(redis_url, "run-id")
        try:
            first, second = await registry.server_run_id(), await registry.server_run_id()
        finally:
            await registry.close()
        return first, second

    first, second = asyncio.run(scenario())
    assert first == second and len(first) == 40  # Redis's run id: 40 hex characters


def test_a_record_with_load_figures_this_version_lacks_still_reads():
    """A newer worker's record (more load figures) during a rolling upgrade: read, the figures
    this version knows kept."""
    data = json.loads(record("decode-0").to_json())
    data["load"]["a_later_figure"] = 1.5
    assert WorkerRecord.from_json(json.dumps(data)).load == record("decode-0").load


def test_a_record_keeps_the_load_figures_of_the_workers_stats_reply():
    """One load shape: the record carries the worker's Stats reply, less what is not load (its
    id, its KV pool's contents), under the names the records always had."""
    stats = worker_pb2.StatsReply(
        worker_id="decode-0",
        running_requests=3,
        waiting_requests=1,
        prefill_seconds_per_token=0.002,
        decode_step_base_seconds=0.01,
        kv_pool_contents=worker_pb2.KvPoolContents(store_id="s"),
    )
    load = recorded_load(stats)
    assert load == worker_pb2.StatsReply(
        running_requests=3, waiting_requests=1, prefill_seconds_per_token=0.002
    )
    data = json.loads(replace(record("decode-0"), load=load).to_json())
    assert data["load"] == {
        "running_requests": 3,
        "waiting_requests": 1,
        "kv_blocks_used": 0,
        "kv_blocks_total": 0,
        "outstanding_prefill_tokens": 0,
        "prefill_seconds_per_token": 0.002,
        "kv_pool_load_seconds_per_token": 0.0,
        "kv_pool_fetch_seconds_per_token": 0.0,
    }
    assert WorkerRecord.from_json(json.dumps(data)).load == load


def test_a_record_carries_the_identity_whole_under_the_health_replys_names():
    """One name per field: the JSON names each field as the Health reply does (the KV
    fingerprint is kv_compatibility), and the identity read back is the one written."""
    data = json.loads(record("decode-0").to_json())
    assert set(IDENTITY_FIELDS) <= data.keys() and "compatibility_hash" not in data
    assert (data["kv_compatibility"], data["max_num_seqs"]) == ("abc", 8)
    assert WorkerRecord.from_json(json.dumps(data)).identity == record("decode-0").identity


def signed(text: str) -> str:
    return json.dumps({"record": text, "mac": signature(text)})


def test_a_bad_record_is_skipped_and_counted_and_a_newer_workers_record_reads(
    redis_url, monkeypatch
):
    """Review M1: one record that anyone able to write to Redis can put there (no secret
    needed), or a newer worker's during a rolling upgrade, made members() raise, and every
    router kept its last membership for as long as the record lived."""
    monkeypatch.setenv(SECRET_ENV, "the-cluster-secret")
    newer = json.loads(record("decode-1").to_json())
    newer["a_later_field"] = {"any": "thing"}
    written = json.loads(record("decode-2").to_json())
    wrong_type = {**written, "address": 5}
    poison = [
        json.dumps({"record": "x", "mac": 1}),  # the review's PoC
        json.dumps({"record": "x", "mac": "\u00e9"}),
        json.dumps({"record": "x", "mac": None}),
        json.dumps({"record": 7, "mac": "0" * 64}),
        json.dumps([1, 2]),
        "not json",
        b"\xff\xfe",
        "[" * 100_000,  # deeper than json's recursion limit
        signed("[1]"),  # signed, but not a record
        signed(json.dumps({"worker_id": "decode-3"})),  # signed, fields missing
        signed(json.dumps(wrong_type)),  # signed, a field of the wrong type
        signed(json.dumps({**written, "max_num_seqs": "8"})),  # ... of the identity
        signed(json.dumps({**written, "max_num_seqs": True})),
        signed(json.dumps({**written, "max_num_seqs": -1})),
        signed(json.dumps({**written, "kv_compatibility": None})),
        signed(json.dumps({**written, "role": ""})),  # signed, no role
        signed(json.dumps({**newer, "load": "busy"})),
        *(  # a load figure of the wrong type
            signed(json.dumps({**written, "load": {**written["load"], **wrong}}))
            for wrong in (
                {"running_requests": True},
                {"running_requests": 1.5},
                {"kv_blocks_used": -1},
                {"kv_blocks_total": None},
                {"prefill_seconds_per_token": False},
                {"prefill_seconds_per_token": "0.1"},
            )
        ),
    ]

    async def scenario():
        registry = Registry(redis_url, "poison")
        try:
            await registry.put(record("decode-0"), ttl_s=30)
            await registry.redis.set(registry.prefix + "decode-1", signed(json.dumps(newer)))
            for i, value in enumerate(poison):
                await registry.redis.set(f"{registry.prefix}bad-{i}", value)
            members = await registry.members()
            assert members == [record("decode-0"), record("decode-1")]
            assert registry.refused == len(poison)
        finally:
            await registry.clear()
            await registry.close()

    asyncio.run(scenario())
