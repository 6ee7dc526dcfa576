"""The standard gRPC health service (grpc.health.v1) on the worker's gRPC port, so Kubernetes'
native gRPC probes (and grpc_health_probe) can ask a worker how it is; with mutual TLS on that
port (which kubelet's probes do not speak), alone in plaintext on --health-port too.

Two service names, read live from the worker's state (pdserve/worker/service.py):
- "" (readiness): SERVING only once the engine is READY; STARTING, DRAINING and FAILED answer
  NOT_SERVING, so a loading or leaving worker gets no traffic through a Service.
- "liveness": SERVING while the process answers and its engine has not failed (a worker that
  loads its model for minutes is alive, not stuck).

Probes carry no metadata, so these calls are let through the cluster-secret gate: they reveal
one status and run nothing.
"""

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.worker.protocol import worker_pb2
from pdserve.worker.secret_check import SecretCheck

State = worker_pb2.HealthReply.State
Status = health_pb2.HealthCheckResponse.ServingStatus
READINESS = ""
LIVENESS = "liveness"
WATCH_POLL_S = 0.5  # Watch re-reads the state this often; probes use Check
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

    async def Check(self, request, context):
        status = serving_status(request.service, self.worker.state)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request, context):
        """Sends the status, then each change, until the caller cancels."""
        last = None
        while True:
            status = serving_status(request.service, self.worker.state)
            if status is None:
                status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(WATCH_POLL_S)


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
