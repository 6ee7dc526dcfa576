"""The standard gRPC health service (grpc.health.v1) on the worker's gRPC port, so Kubernetes'
native gRPC probes (and grpc_health_probe) can ask a worker how it is; with mutual TLS on that
port (which kubelet's probes do not speak), alone in plaintext on --health-port too.

Two service names, read live from the worker's state (pdserve/worker/service.py):
- "" (readiness): SERVING only once the engine is READY; STARTING, DRAINING and FAILED answer
  NOT_SERVING, so a loading or leaving worker gets no traffic through a Service.
- "liveness": SERVING while the process answers and its engine has not failed (a worker that
  loads its model for minutes is alive, not stuck).

Probes carry no metadata, so these calls are let through the cluster-secret gate: they reveal
one status and run nothing. `Watch` (which no probe uses: kubelet and grpc_health_probe call
`Check`) holds a stream and wakes every WATCH_POLL_S on the event loop that relays every
Generate stream, so at most MAX_WATCHES run at once, each for WATCH_MAX_S at most; others are
refused (RESOURCE_EXHAUSTED), the refusals logged at most once every log_limit.LOG_EVERY_S.
"""

import asyncio
import logging
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kv_transfer.log_limit import LogLimit
from pdserve.protocol import worker_pb2
from pdserve.worker.secret_check import SecretCheck

log = logging.getLogger("pdserve.worker")

State = worker_pb2.HealthReply.State
Status = health_pb2.HealthCheckResponse.ServingStatus
READINESS = ""
LIVENESS = "liveness"
WATCH_POLL_S = 0.5  # Watch re-reads the state this often; probes use Check
MAX_WATCHES = 8  # Watch streams at once, on each server (no probe uses them)
WATCH_MAX_S = 300.0  # a Watch ends after this long (a client that still wants one calls again)
TOO_MANY_WATCHES = f"refused: {MAX_WATCHES} health watches run already (probes use Check)"
HEALTH_METHODS = "/grpc.health.v1.Health/"


def serving_status(service_name: str, state: int) -> Status | None:
    """The status a health check answers for a worker in `state`; None: unknown service."""
    if service_name == READINESS:
        ready = state == State.READY
    elif service_name == LIVENESS:
        ready = state != State.FAILED
    else:
        return None
    return (
        health_pb2.HealthCheckResponse.SERVING
        if ready
        else (health_pb2.HealthCheckResponse.NOT_SERVING)
    )


class WorkerHealth(health_pb2_grpc.HealthServicer):
    def __init__(self, worker_service) -> None:
        self.worker = worker_service
        self.watching = 0  # Watch streams running (one event loop: no lock)
        self.refusals = LogLimit(log)

    async def Check(self, request, context):
        status = serving_status(request.service, self.worker.state)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request, context):
        """Sends the status, then each change, until the caller cancels or WATCH_MAX_S have
        passed; refused while MAX_WATCHES run."""
        if self.watching >= MAX_WATCHES:
            peer = context.peer()
            self.refusals.warning("watches", "a health Watch from %s: %s", peer, TOO_MANY_WATCHES)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, TOO_MANY_WATCHES)
        self.watching += 1
        try:
            last = None
            ends = time.monotonic() + WATCH_MAX_S
            while time.monotonic() < ends:
                status = serving_status(request.service, self.worker.state)
                if status is None:
                    status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
                if status != last:
                    yield health_pb2.HealthCheckResponse(status=status)
                    last = status
                await asyncio.sleep(WATCH_POLL_S)
        finally:
            self.watching -= 1


class SecretCheckButHealth(SecretCheck):
    """The cluster-secret gate for every worker call except the health service's."""

    async def intercept_service(self, continuation, details):
        if details.method.startswith(HEALTH_METHODS):
            return await continuation(details)
        return await super().intercept_service(continuation, details)


def add_health(server, worker_service) -> None:
    health_pb2_grpc.add_HealthServicer_to_server(WorkerHealth(worker_service), server)


async def serve_health_alone(worker_service, address: str) -> grpc.aio.Server:
    """A plaintext server with the health service and nothing else (no secret, no TLS): what
    it tells is one status, what it runs is nothing."""
    server = grpc.aio.server()
    add_health(server, worker_service)
    if server.add_insecure_port(address) == 0:
        raise OSError(f"the health port {address} cannot be bound")
    await server.start()
    return server
