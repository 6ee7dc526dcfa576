"""The worker's gRPC gate: every call must carry the cluster secret in its metadata
(pdserve/settings/cluster_secret.py), or it is answered UNAUTHENTICATED before the service sees
it. Refusals are logged at most once every log_limit.LOG_EVERY_S (with how many were not), so a
caller without the secret cannot flood the log."""

import logging

import grpc

from kv_transfer.log_limit import LogLimit
from pdserve.settings.cluster_secret import METADATA_KEY, secret_matches

log = logging.getLogger("pdserve.worker")
REFUSAL = "refused: the call did not carry this cluster's secret"


class SecretCheck(grpc.aio.ServerInterceptor):
    def __init__(self, secret: str) -> None:
        self.secret = secret
        self.refusals = LogLimit(log)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        offered = dict(details.invocation_metadata or ()).get(METADATA_KEY, "")
        if handler is None or secret_matches(offered, self.secret):
            return handler
        self.refusals.error(
            "no-secret", "a %s call without this cluster's secret: refused", details.method
        )

        async def refuse(request_or_requests, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

        # refuse() serves every kind of call: it reads nothing and answers at once.
        if handler.stream_stream:
            make = grpc.stream_stream_rpc_method_handler
        elif handler.unary_stream:
            make = grpc.unary_stream_rpc_method_handler
        else:
            make = grpc.unary_unary_rpc_method_handler
        return make(refuse, handler.request_deserializer, handler.response_serializer)
