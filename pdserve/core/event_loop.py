"""The event loop pdserve's processes run on: uvloop's (libuv's, a pdserve dependency; vLLM's own
API server runs on it too). A router's requests and streamed tokens, and a worker's gRPC calls
and engine outputs, are mostly event-loop work, and at a low rate every token is a wake-up of
the loop, which uvloop does in C (docs/benchmarking.md, the router's section)."""

from collections.abc import Coroutine


def run_on_fastest_loop(main: Coroutine):
    """asyncio.run on uvloop's event loop; `main`'s result."""
    import uvloop

    return uvloop.run(main)
