"""Tracing off (no --otlp-endpoint, the default) costs nothing and sends nothing: no
`traceparent` is read from a client or put in a worker call's metadata. Tracing on is tested
end to end in tests/integration/test_tracing.py."""

from pdserve import tracing

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_without_an_endpoint_no_trace_context_is_read_or_sent():
    assert not tracing.tracing()
    assert tracing.joined({"traceparent": TRACEPARENT}) is None
    span = tracing.tracer().start_span("pdserve.generate", context=None)
    assert not span.is_recording()
    assert tracing.trace_headers(span) == {}
    span.end()
