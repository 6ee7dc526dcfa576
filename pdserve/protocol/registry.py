"""Pool membership in Redis: who is in the prefill and decode pools right now.

Each worker writes its own record under `pdserve:<cluster>:worker:<id>` with a time to live of
`TTL_HEARTBEATS` heartbeats and rewrites it every heartbeat, load included. A worker that dies
stops writing, and its record expires: it leaves the pools within two heartbeats without anyone
having to notice the death. A draining worker deletes its record first. The router reads the
records every 0.1 s (`follow_registry` in router/workers/pool.py).

A record is signed with the cluster secret (HMAC-SHA256 over its JSON,
pdserve/settings/cluster_secret.py's `signature`): a reader that has the secret ignores, and
counts in `refused`, a record without a valid signature, so a process that can write to Redis
but is not part of the cluster cannot register a worker and receive prompts. A record that
cannot be read (malformed, or fields of the wrong type) is ignored and counted the same way:
one bad record never stops the others from being read. A newer worker's record reads here:
fields this version does not know are left out.
"""

import asyncio
import json
import logging
from dataclasses import dataclass, field, fields

from pdserve.protocol import worker_pb2
from pdserve.settings.cluster_secret import signature, signature_valid
from pdserve.settings.redis_url import connect, masked

log = logging.getLogger("pdserve.registry")
TTL_HEARTBEATS = 2


# A worker's load as its record carries it: these fields of its Stats reply at its last
# heartbeat (worker.proto's StatsReply; a newer worker's other figures are left out). The
# router's live view of a worker is router/workers/load.py's WorkerLoad, over the same reply.
LOAD_FIELDS = (
    "running_requests",
    "waiting_requests",
    "kv_blocks_used",
    "kv_blocks_total",
    "outstanding_prefill_tokens",
    "prefill_seconds_per_token",  # learned from its engine steps (0: not yet)
    "kv_pool_load_seconds_per_token",  # a load from its host KV pool (0: none yet)
    "kv_pool_fetch_seconds_per_token",  # a fetch from another host's (0: none yet)
)


def recorded_load(stats: worker_pb2.StatsReply) -> worker_pb2.StatsReply:
    """What a record keeps of a worker's Stats reply: its LOAD_FIELDS."""
    return worker_pb2.StatsReply(**load_figures(stats))


def load_figures(load: worker_pb2.StatsReply) -> dict[str, int | float]:
    """A record's load as plain data, by LOAD_FIELDS' names (its JSON, `pdserve status`'s)."""
    return {name: getattr(load, name) for name in LOAD_FIELDS}


# A worker's identity: its Health reply less the state and message (worker.proto's HealthReply).
IDENTITY_FIELDS = tuple(
    f.name for f in worker_pb2.HealthReply.DESCRIPTOR.fields if f.name not in ("state", "message")
)

PLACEMENT_FIELDS = ("address", "node")  # the record's str fields beside the identity's


@dataclass(frozen=True)
class WorkerRecord:
    """A worker's entry. Its identity is the one its Health answers, kept whole; in the JSON its
    fields stand beside the others under the Health reply's names (so a reader of an older
    version still finds worker_id, role, address, kv_address and tensor_parallel_size)."""

    identity: worker_pb2.HealthReply  # worker_id, role, kv_address, kv_compatibility, ...
    address: str  # the worker's gRPC address, host:port
    node: str = ""  # where it runs: the Ray node id, or the host name
    gpu_ids: tuple[str, ...] = ()  # the accelerator ids this worker may see
    load: worker_pb2.StatsReply = field(default_factory=worker_pb2.StatsReply)  # LOAD_FIELDS

    def to_json(self) -> str:
        return json.dumps(
            {
                **{name: getattr(self.identity, name) for name in IDENTITY_FIELDS},
                **{name: getattr(self, name) for name in PLACEMENT_FIELDS},
                "gpu_ids": self.gpu_ids,
                "load": load_figures(self.load),
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> "WorkerRecord":
        """The record `text` holds; fields this version does not know (a newer worker's) are
        left out. ValueError (or TypeError, for a missing field) when it is not a record."""
        data = json.loads(text)
        load = data.get("load", {}) if isinstance(data, dict) else None
        gpu_ids = data.get("gpu_ids", ()) if isinstance(data, dict) else None
        if not isinstance(load, dict) or not isinstance(gpu_ids, list | tuple):
            raise ValueError("not a worker record")
        identity = {k: v for k, v in data.items() if k in IDENTITY_FIELDS}
        if any(value is None for value in identity.values()):  # protobuf reads None as unset
            raise ValueError("a field of the identity is null")
        figures = {k: v for k, v in load.items() if k in LOAD_FIELDS}
        if not all(type(value) in (int, float) for value in figures.values()):
            raise ValueError("a load figure is not a number")  # protobuf takes a bool for one
        record = cls(
            worker_pb2.HealthReply(**identity),  # TypeError or ValueError: a wrong type
            **{k: v for k, v in data.items() if k in PLACEMENT_FIELDS},
            gpu_ids=tuple(gpu_ids),
            load=worker_pb2.StatsReply(**figures),  # TypeError: a float for a count
        )
        _check_types(record)
        if not all(isinstance(gpu, str) for gpu in record.gpu_ids):
            raise ValueError("gpu_ids: not strings")
        if not record.identity.worker_id or not record.identity.role:
            raise ValueError("worker_id or role: missing")
        return record


def _check_types(record) -> None:
    """ValueError unless each str, int or float field of the dataclass `record` holds one (an
    int stands for a float; a bool for neither)."""
    for f in fields(record):
        value = getattr(record, f.name)
        allowed = {str: (str,), int: (int,), float: (int, float)}.get(f.type)
        if allowed and (not isinstance(value, allowed) or isinstance(value, bool)):
            raise ValueError(f"{f.name}: not a {f.type.__name__}")


class Registry:
    """The membership records of one cluster in one Redis database (asyncio client)."""

    def __init__(self, url: str, cluster: str) -> None:
        self.url = masked(url)  # for messages
        self.prefix = f"pdserve:{cluster}:worker:"
        self.redis = connect(url)
        self.refused = 0  # records read without a valid signature, ignored
        self._refused_keys: set[bytes] = set()  # logged once each

    async def put(self, record: WorkerRecord, ttl_s: float) -> None:
        text = record.to_json()
        signed = json.dumps({"record": text, "mac": signature(text)})
        await self.redis.set(
            self.prefix + record.identity.worker_id, signed, px=max(1, round(ttl_s * 1000))
        )

    async def remove(self, worker_id: str) -> None:
        await self.redis.delete(self.prefix + worker_id)

    async def server_run_id(self) -> str:
        """The Redis server's run id: a new one means it restarted (and, without persistence,
        lost every record until the workers' next heartbeats)."""
        return (await self.redis.info("server"))["run_id"]

    async def members(self) -> list[WorkerRecord]:
        keys = [key async for key in self.redis.scan_iter(match=self.prefix + "*", count=1000)]
        if not keys:
            return []
        values = await self.redis.mget(keys)
        # A record can expire between SCAN and MGET: it is simply gone.
        records = [self._verified(k, v) for k, v in zip(keys, values, strict=True) if v]
        return sorted((r for r in records if r is not None), key=lambda r: r.identity.worker_id)

    def _verified(self, key: bytes, value: bytes) -> WorkerRecord | None:
        """The record `value` holds, if signed with the cluster secret and readable; else None,
        counted in `refused` (whatever `value` is: written by anyone who can write to Redis)."""
        why = "not signed with the cluster secret"
        try:
            signed = json.loads(value)
            text, mac = signed["record"], signed["mac"]
            if isinstance(text, str) and text and signature_valid(text, mac):
                return WorkerRecord.from_json(text)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
            why = f"unreadable ({type(error).__name__}: {str(error)[:200]})"
        self.refused += 1
        if key not in self._refused_keys and len(self._refused_keys) < 1000:
            self._refused_keys.add(key)
            log.warning("ignored registry record %s: %s", key.decode(errors="replace"), why)
        return None

    async def clear(self) -> int:
        """Delete every record of this cluster (`pdserve down`); returns how many there were."""
        keys = [key async for key in self.redis.scan_iter(match=self.prefix + "*", count=1000)]
        return await self.redis.delete(*keys) if keys else 0

    async def close(self) -> None:
        await self.redis.aclose()


def read_members(url: str, cluster: str) -> list[WorkerRecord]:
    """The membership now, for the command-line tools (which are not asyncio programs)."""
    return asyncio.run(_once(url, cluster, Registry.members))


def clear_members(url: str, cluster: str) -> int:
    return asyncio.run(_once(url, cluster, Registry.clear))


async def _once(url: str, cluster: str, action):
    registry = Registry(url, cluster)
    try:
        return await action(registry)
    finally:
        await registry.close()
