"""A real OTLP/gRPC trace collector on 127.0.0.1, in the test process: the router and the
workers export to it as to any collector, and a test reads what arrived."""

import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.waiting import wait_for


class TraceCollector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []  # (service.name, the span's proto)
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(
                    (
                        a.value.string_value
                        for a in resource_spans.resource.attributes
                        if a.key == "service.name"
                    ),
                    "",
                )
                for scope_spans in resource_spans.scope_spans:
                    self.spans += [(service, span) for span in scope_spans.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: bytes) -> list[tuple[str, object]]:
        with self.lock:
            return [(service, span) for service, span in self.spans if span.trace_id == trace_id]

    def wait_for_spans(self, trace_id: bytes, counts: dict[str, int], timeout_s: float = 30):
        """The trace's spans once at least `counts[name]` of each name have arrived (each
        process exports in batches, every few seconds)."""

        def arrived():
            spans = self.trace(trace_id)
            names = [span.name for _, span in spans]
            return spans if all(names.count(n) >= c for n, c in counts.items()) else None

        return wait_for(arrived, timeout_s, f"spans {counts} of the trace")

    def stop(self) -> None:
        self.server.stop(grace=1).wait(5)
