"""Where gRPC waits for its sockets in pdserve's processes: on the thread that waits for its
calls' completions (gRPC's I/O manager), not on EventEngine threads of its own (its default since
1.6x). With EventEngine every message in or out of a grpc.aio process wakes one of its threads,
which then wakes the thread that completes the call, which wakes the event loop. Without them a
colocated router is woken less than half as often and its worker a quarter less, and the router
spends ~2.5% less CPU a request and a token; the engine's steps measured no faster for it
(docs/benchmarking.md, "Wake-ups on the engine's cores"). gRPC reads the setting once, when it is
imported, from `GRPC_EXPERIMENTS`; an environment that sets it, even to nothing (gRPC's own
default), keeps its value."""

import os

GRPC_EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def poll_on_callers_thread() -> None:
    """GRPC_EXPERIMENTS for this process and every process it starts, unless already set. It
    takes effect in this process only if grpc has not been imported yet."""
    os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)
