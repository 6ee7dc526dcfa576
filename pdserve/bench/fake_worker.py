"""A fake worker, for measuring the router alone (scripts/bench_router.py): a real gRPC server
speaking the worker protocol that runs no engine. Health says READY (colocated), Stats answers at
once, a request (a Session's, as the router sends them, or a Generate call) streams `max_tokens`
token ids, one chunk each, the last one finished: each at the next tick of a clock of period
`token_interval_s` shared by all requests, as an engine's decode step gives every running request
its token at once (none when 0: as fast as they go). So whatever limits a run is the router and the
client.

    python -m pdserve.bench.fake_worker --port 50061 [--port 50062 ...] [--token-interval-s 0.01]
"""

import argparse
import asyncio
import time

import grpc

from pdserve.protocol import GRPC_OPTIONS, worker_pb2, worker_pb2_grpc
from pdserve.worker.session import ServesSessions

MAX_MODEL_LEN = 2048
TOKEN_ID = 42  # what every fake token is


class FakeWorker(ServesSessions, worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker_id: str, token_interval_s: float) -> None:
        self.worker_id = worker_id
        self.token_interval_s = token_interval_s
        self.running = 0

    async def Health(self, request, context):
        return worker_pb2.HealthReply(
            state=worker_pb2.HealthReply.READY,
            worker_id=self.worker_id,
            role="colocated",
            model="fake",
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=1024,
            device="cpu",
        )

    async def Stats(self, request, context):
        return worker_pb2.StatsReply(
            worker_id=self.worker_id, running_requests=self.running, kv_blocks_total=1024
        )

    async def Abort(self, request, context):
        return worker_pb2.AbortReply()

    async def Generate(self, request, context):
        async for chunk in self.run(request, {}):
            yield chunk

    async def run(self, request, trace_headers):
        self.running += 1
        try:
            tokens = max(1, request.sampling.max_tokens)
            for index in range(tokens):
                if self.token_interval_s:
                    await self._next_tick()
                chunk = worker_pb2.GenerateChunk(token_ids=[TOKEN_ID], text=" a")
                if index == 0:
                    chunk.prompt_tokens = len(request.prompt_token_ids)
                if index == tokens - 1:
                    chunk.finish_reason = "length"
                yield chunk
        finally:
            self.running -= 1

    async def _next_tick(self) -> None:
        now = time.monotonic()
        await asyncio.sleep(self.token_interval_s - now % self.token_interval_s)


async def serve(ports: list[int], token_interval_s: float, host: str = "127.0.0.1") -> None:
    servers = []
    for port in ports:
        server = grpc.aio.server(options=GRPC_OPTIONS)
        worker = FakeWorker(f"fake@{host}:{port}", token_interval_s)
        worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
        if server.add_insecure_port(f"{host}:{port}") == 0:
            raise OSError(f"cannot listen on {host}:{port}")
        await server.start()
        servers.append(server)
    print("fake workers ready", flush=True)
    await asyncio.gather(*(server.wait_for_termination() for server in servers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, action="append", required=True)
    parser.add_argument("--token-interval-s", type=float, default=0.0)
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.token_interval_s))


if __name__ == "__main__":
    main()
