"""What gRPC costs the router per request and per streamed token, today and with one
multiplexed stream per worker (issue 49: is that change worth making?). A gRPC server in another
process on another core; this process is the router's side, pinned to core 0, and its CPU (the
event loop's thread and gRPC's own threads) is what is counted.

    python scripts/bench_grpc_messages.py [--requests 100] [--tokens 400]

- a call per request, one message: what a short request's call costs (today's unary-stream
  Generate, each call answered with one chunk);
- a call per request, a message per token: what a streamed token costs (each message parsed
  into a GenerateChunk);
- one multiplexed stream, K chunks a message: the worker sends, in one message, the chunks of
  every request that are ready (K requests' tokens of one engine step); the router parses each
  and puts it on its request's queue, where the request's task awaits it.

No new protocol: raw-bytes handlers, a multiplexed message is K length-prefixed serialized
GenerateChunks, each with its request's number.
"""

import argparse
import asyncio
import os
import struct
import subprocess
import sys
from pathlib import Path

import grpc
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.protocol import GRPC_OPTIONS, worker_pb2
from pdserve.worker.processes import free_port

CHUNK = worker_pb2.GenerateChunk(token_ids=[42], text=" a").SerializeToString()
HEADER = struct.Struct("<HI")  # the chunk's request, its length
SERVICE = "bench.Messages"
READY_TIMEOUT_S = 60


def serve(port: int) -> None:
    async def each(request: bytes, context):
        for _ in range(int(request)):
            yield CHUNK

    async def multiplexed(requests, context):
        async for request in requests:  # b"R,K,T": R requests, K chunks a message, T tokens each
            count, per_message, tokens = map(int, request.decode().split(","))
            messages = [
                b"".join(
                    HEADER.pack((number * per_message + i) % count, len(CHUNK)) + CHUNK
                    for i in range(per_message)
                )
                for number in range(count)
            ]
            for number in range(count * tokens // per_message):
                yield messages[number % count]
            return

    async def main() -> None:
        server = grpc.aio.server(options=GRPC_OPTIONS)
        handlers = {
            "Each": grpc.unary_stream_rpc_method_handler(each),
            "Multiplexed": grpc.stream_stream_rpc_method_handler(multiplexed),
        }
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    uvloop.run(main())


def cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


async def measure(port: int, requests: int, tokens: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as channel:
        await asyncio.wait_for(channel.channel_ready(), READY_TIMEOUT_S)
        each = channel.unary_stream(f"/{SERVICE}/Each")
        multiplexed = channel.stream_stream(f"/{SERVICE}/Multiplexed")

        async def call(count: int) -> None:
            async for raw in each(str(count).encode()):
                worker_pb2.GenerateChunk.FromString(raw)

        async def per_call(count: int, calls: int, concurrent: int) -> float:
            began = cpu_seconds()
            for _ in range(calls // concurrent):
                await asyncio.gather(*(call(count) for _ in range(concurrent)))
            return 1e6 * (cpu_seconds() - began) / (calls * count)

        async def shared(per_message: int) -> float:
            queues = [asyncio.Queue() for _ in range(requests)]

            async def relay(queue: asyncio.Queue) -> None:
                for _ in range(tokens):
                    await queue.get()

            relays = [asyncio.create_task(relay(queue)) for queue in queues]
            began = cpu_seconds()
            async for message in multiplexed(iter([f"{requests},{per_message},{tokens}".encode()])):
                at = 0
                while at < len(message):
                    number, size = HEADER.unpack_from(message, at)
                    at += HEADER.size
                    chunk = worker_pb2.GenerateChunk.FromString(message[at : at + size])
                    queues[number].put_nowait(chunk)
                    at += size
            await asyncio.gather(*relays)
            return 1e6 * (cpu_seconds() - began) / (requests * tokens)

        for number in range(2):
            short = await per_call(1, 20 * requests, 50)
            print(f"round {number}: a call per request, one message: {short:.0f} µs a call")
            streamed = await per_call(tokens, requests, requests)
            print(
                f"round {number}: a call per request, a message per token: "
                f"{streamed:.1f} µs a token"
            )
            for per_message in (1, 10, 100):
                cost = await shared(per_message)
                print(
                    f"round {number}: one multiplexed stream, {per_message} chunks a message: "
                    f"{cost:.1f} µs a token"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the server process's port
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    port = free_port()
    others = set(range(1, os.cpu_count() or 2)) or {0}
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port)],
        preexec_fn=lambda: os.sched_setaffinity(0, others),
    )
    os.sched_setaffinity(0, {0})
    try:
        uvloop.run(measure(port, args.requests, args.tokens))
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
