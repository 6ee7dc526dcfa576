"""`python -m pdserve.worker.drain`: drain the worker on this host before it is stopped, the preStop
hook of a worker pod (deploy/k8s). The worker leaves the pools, keeps serving for a grace
while the routers' view catches up, finishes what is in flight, and only then does Kubernetes
send SIGTERM, so a scale-down or a rolling update fails no request.

It reads the cluster secret and TLS folder from the environment, as the worker does, and exits
0 when nothing was left in flight, 1 otherwise (Kubernetes stops the worker either way).
"""

import argparse
import sys

import grpc

from pdserve.protocol import worker_pb2, worker_pb2_grpc
from pdserve.settings import tls
from pdserve.settings.cluster_secret import secret_metadata

GRACE_S = 2.0  # the routers read membership every 0.1 s; margin for a busy host


def request_drain(address: str, timeout_s: float) -> worker_pb2.DrainReply:
    """The worker's Drain, with the grace the routers need to stop sending it requests (the
    one call `pdserve scale` and the preStop hook both make; raises grpc.RpcError)."""
    with tls.channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Drain(
            worker_pb2.DrainRequest(grace_seconds=GRACE_S, timeout_seconds=timeout_s),
            timeout=timeout_s + GRACE_S + 30,
            metadata=secret_metadata(),
        )


def drain(address: str, timeout_s: float) -> bool:
    try:
        reply = request_drain(address, timeout_s)
    except grpc.RpcError as error:
        print(f"drain {address}: {error.code().name}: {error.details()}", file=sys.stderr)
        return False
    print(f"drain {address}: {reply.seconds:.1f} s, {reply.requests_left} request(s) left")
    return reply.drained


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.worker.drain", description=__doc__)
    parser.add_argument("--address", default="127.0.0.1:50051", help="the worker's gRPC address")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds to wait for in-flight requests"
    )
    args = parser.parse_args()
    return 0 if drain(args.address, args.timeout) else 1


if __name__ == "__main__":
    sys.exit(main())
