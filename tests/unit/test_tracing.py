"""Tracing off (no --otlp-endpoint, the default) costs nothing and sends nothing: no
`traceparent` is read from a client or put in a worker call's metadata. Tracing on is tested
end to end in tests/integration/test_tracing.py."""

from opentelemetry import trace

from pdserve.core import tracing

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_without_an_endpoint_no_trace_context_is_read_or_sent():
    provider = trace.get_tracer_provider()
    tracing.export_to("", "pdserve-router")  # what the router does with no --otlp-endpoint
    assert trace.get_tracer_provider() is provider  # no exporter installed
    assert not tracing.tracing()
    assert tracing.joined({"traceparent": TRACEPARENT}) is None
    span = tracing.tracer().start_span("pdserve.generate", context=None)
    assert not span.is_recording()
    assert tracing.trace_headers(span) == {}
    span.end()
