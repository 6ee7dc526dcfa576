"""What a fetch from another host's KV pool costs (docs/kv-pool.md#across-hosts): two real
stores, blocks written into one as an engine writes them, and the other's worker side fetching
them over real gRPC on loopback from the first's worker service (no engine: ReadPoolBlocks needs
only the pool). Both ends run in this process, on one event loop, so its CPU time is both
ends' work: the source's copy out of its pool and the message, gRPC, the fetching side's copy
into its pool and its digest check.

    python scripts/bench_kv_pool_fetch.py [--block-mib 5.6] [--blocks 8] [--rounds 5]

Prints, per round and as the median: the fetch's wall time, GB/s, and CPU ms per MiB (what
the workers' API processes spend; a SmolLM2 block of 128 tokens in float32 is 5.6 MiB).
"""

import argparse
import asyncio
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kv_transfer.pool.client import PoolClient
from kv_transfer.pool.copy import PoolMemory, store_blocks
from kv_transfer.pool.wire import CompleteStore, PrepareStore
from pdserve.cluster.local_services import start_kv_pool
from pdserve.core.pool_keys import block_keys
from pdserve.protocol import GRPC_OPTIONS, worker_pb2, worker_pb2_grpc
from pdserve.worker.engine_stats import EngineStats
from pdserve.worker.pool_peers import PoolPeers
from pdserve.worker.processes import free_port, stop_group
from pdserve.worker.service import WorkerService

BLOCK_TOKENS = 16
NONE_HASH = b"n" * 32


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-mib", type=float, default=5.6, help="bytes of a block, MiB")
    parser.add_argument("--blocks", type=int, default=8, help="blocks a fetch brings")
    parser.add_argument("--rounds", type=int, default=5, help="fetches, each of new blocks")
    args = parser.parse_args()
    slot = int(args.block_mib * 2**20) // 4096 * 4096
    budget = slot * args.blocks * (args.rounds + 1)
    stores = []
    try:
        addresses = []
        for _ in range(2):
            address = f"@pdserve-kv-pool-bench-{secrets.token_hex(4)}"
            log_path = Path(tempfile.mkdtemp(prefix="kv-pool-")) / "kv-pool.log"
            stores.append(start_kv_pool(log_path, budget, address)[1])
            addresses.append(address)
        rows = asyncio.run(fetches(addresses, slot, args.blocks, args.rounds))
    finally:
        for process in stores:
            stop_group(process.pid, process=process)
    mib = slot * args.blocks / 2**20
    print(f"{args.blocks} blocks of {slot / 2**20:.2f} MiB a fetch ({mib:.1f} MiB)")
    print("| round | wall ms | GB/s | CPU ms per MiB |")
    print("|---|---|---|---|")
    medians = (statistics.median(w for w, _ in rows), statistics.median(c for _, c in rows))
    for name, (wall, cpu) in [*enumerate(rows), ("median", medians)]:
        rate = mib * 2**20 / wall / 1e9
        print(f"| {name} | {wall * 1e3:.1f} | {rate:.2f} | {cpu * 1e3 / mib:.2f} |")
    return 0


async def fetches(addresses: list[str], slot: int, blocks: int, rounds: int) -> list:
    here, there = addresses
    source_engine = PoolClient(there, "bench", slot)
    fetching_engine = PoolClient(here, "bench", slot)
    assert source_engine.connected() and fetching_engine.connected()
    service = WorkerService("source", "colocated", "m", kv_pool=there)
    service.pool_peers = PoolPeers(there, BLOCK_TOKENS, NONE_HASH, EngineStats())
    server = grpc.aio.server(options=GRPC_OPTIONS)
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    source = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(source)
    await server.start()
    peers = PoolPeers(here, BLOCK_TOKENS, NONE_HASH, EngineStats())
    rows = []
    try:
        for number in range(rounds):
            prompt = [number * 100_000 + i for i in range(blocks * BLOCK_TOKENS)]
            keys = tuple(block_keys(prompt, BLOCK_TOKENS, NONE_HASH))
            page = torch.randint(0, 256, (blocks, slot), dtype=torch.uint8)
            slots = source_engine.call(PrepareStore(keys)).stored.slots
            memory = PoolMemory.over(
                source_engine.memory, source_engine.header_bytes, source_engine.slots
            )
            store_blocks([page], list(range(blocks)), memory, slots, keys)
            source_engine.call(CompleteStore(keys, success=True))
            wall, cpu = time.perf_counter(), time.process_time()
            fetch = worker_pb2.PoolFetch(source=source, tokens=len(prompt))
            fetched = await peers.fetch(prompt, fetch)
            rows.append((time.perf_counter() - wall, time.process_time() - cpu))
            assert fetched == len(prompt), f"fetched {fetched} of {len(prompt)} tokens"
    finally:
        await peers.close()
        await service.pool_peers.close()
        await server.stop(grace=None)
    return rows


if __name__ == "__main__":
    sys.exit(main())
