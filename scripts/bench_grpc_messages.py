"""What gRPC costs the router per request and per streamed token, today and with one
multiplexed stream per worker (issue 49: is that change worth making?). A gRPC server in another
process on another core; this process is the router's side, pinned to core 0, and its CPU (the
event loop's thread and gRPC's own threads) is what is counted.

    python scripts/bench_grpc_messages.py [--requests 100] [--tokens 400] [--gap-ms 1]

- a call per request, one message: what a short request's call costs (today's unary-stream
  Generate, each call answered with one chunk);
- a call per request, a message per token: what a streamed token costs (each message parsed
  into a GenerateChunk);
- one multiplexed stream, K chunks a message: the worker sends, in one message, the chunks of
  every request that are ready (K requests' tokens of one engine step); the router parses each
  and puts it on its request's queue, where the request's task awaits it.

- one message up and one down at a time, `--gap-ms` apart (a router's short requests arriving
  one by one: each message finds gRPC's threads asleep), over one gRPC stream and over a plain
  asyncio TCP stream of length-prefixed messages: what a short request's start and its answer
  cost on a session, and what a transport without gRPC's threads would (the CPU of the same
  loop without messages taken off).

No new protocol: raw-bytes handlers, a multiplexed message is K length-prefixed serialized
GenerateChunks, each with its request's number.
"""

import argparse
import asyncio
import contextlib
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
LENGTH = struct.Struct(">I")  # a plain stream's message length
START = worker_pb2.SessionUp(
    starts=[
        worker_pb2.RequestStart(
            stream_id=1,
            request=worker_pb2.GenerateRequest(
                request_id="cmpl-0123456789abcdef0123456789abcdef",
                prompt_token_ids=[19556],
                sampling=worker_pb2.SamplingParams(max_tokens=1),
            ),
        )
    ]
).SerializeToString()


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

    async def echo(requests, context):
        async for _ in requests:
            yield CHUNK

    async def plain_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                (size,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
                await reader.readexactly(size)
                writer.write(LENGTH.pack(len(CHUNK)) + CHUNK)

    async def main() -> None:
        server = grpc.aio.server(options=GRPC_OPTIONS)
        handlers = {
            "Each": grpc.unary_stream_rpc_method_handler(each),
            "Multiplexed": grpc.stream_stream_rpc_method_handler(multiplexed),
            "Echo": grpc.stream_stream_rpc_method_handler(echo),
        }
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
        await asyncio.start_server(plain_echo, "127.0.0.1", port + 1)  # before gRPC's is ready
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    uvloop.run(main())


def cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


async def measure(port: int, requests: int, tokens: int, gap_s: float) -> None:
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

        async def spaced(round_trip, count: int, gap_s: float) -> float:
            """CPU per round trip, less that of the same loop without one."""
            began = cpu_seconds()
            for _ in range(count):
                await asyncio.sleep(gap_s)
            idle = cpu_seconds() - began
            began = cpu_seconds()
            for _ in range(count):
                await round_trip()
                await asyncio.sleep(gap_s)
            return 1e6 * (cpu_seconds() - began - idle) / count

        echo = channel.stream_stream(f"/{SERVICE}/Echo")(metadata=())
        reader, writer = await asyncio.open_connection("127.0.0.1", port + 1)

        async def over_grpc() -> None:
            await echo.write(START)
            worker_pb2.GenerateChunk.FromString(await echo.read())

        async def over_plain_stream() -> None:
            writer.write(LENGTH.pack(len(START)) + START)
            (size,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
            worker_pb2.GenerateChunk.FromString(await reader.readexactly(size))

        for number in range(2):
            for name, round_trip in (("gRPC", over_grpc), ("plain asyncio", over_plain_stream)):
                cost = await spaced(round_trip, 20 * requests, gap_s)
                print(
                    f"round {number}: one message each way, {gap_s * 1e3:g} ms apart, over "
                    f"a {name} stream: {cost:.0f} µs a round trip"
                )
        echo.cancel()
        writer.close()

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
    parser.add_argument("--gap-ms", type=float, default=1.0)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the server process's port
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    port = free_port(count=2)  # gRPC's, the plain stream's
    others = set(range(1, os.cpu_count() or 2)) or {0}
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port)],
        preexec_fn=lambda: os.sched_setaffinity(0, others),
    )
    os.sched_setaffinity(0, {0})
    try:
        uvloop.run(measure(port, args.requests, args.tokens, args.gap_ms / 1e3))
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
