"""The gRPC status codes a worker's Generate fails with where the router must tell them apart:
both mean the engine ended the request, for different reasons (router/workers/client.py maps them
to the error kinds the client and the metrics see)."""

import grpc

# A decode leg's KV did not arrive (deadline, cancelled, refused) under the `fail` policy.
KV_TRANSFER_FAILED = grpc.StatusCode.ABORTED
# The engine ended the request with an error of its own.
ENGINE_FAILED = grpc.StatusCode.INTERNAL
