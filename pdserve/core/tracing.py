"""Traces an operator can follow: OpenTelemetry, one trace per request across the router and
its workers, exported over OTLP/gRPC when `--otlp-endpoint` is set.

The router makes a request's span (joining a trusted client's `traceparent`, if it sent one;
an untrusted client's is only linked from a new root: `from_client`) with children for its wait
in the admission queue, its path choice, each worker call (the prefill leg, the decode leg, a
migration's continuation), and the KV transfer; the W3C `traceparent`
of each call goes to its worker in the gRPC metadata. A worker's span for the call is that
call's child, and vLLM's own request span (`llm_request`: queue, prefill and decode times) is
the worker span's child, since the worker hands vLLM the trace headers and vLLM exports to the
same endpoint (its `otlp_traces_endpoint`).

With no endpoint nothing is installed: the OpenTelemetry API's tracer is a no-op, and
`traceparent` is neither read nor sent.
"""

import functools
import os
from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

TRACER = "pdserve"
TRACEPARENT = "traceparent"
SERVICE_NAME_ENV = "OTEL_SERVICE_NAME"  # the resource's service.name, also vLLM's
_EXPORTING = False  # set once this process exports spans


def export_to(endpoint: str, service: str) -> None:
    """Export this process's spans to `endpoint` (http://HOST:PORT: plain gRPC; https: TLS)
    as `service` (the router; in a worker vLLM's engine installs the exporter: `engine_exports`);
    with no endpoint, nothing."""
    global _EXPORTING
    if not endpoint:
        return
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=1000))
    trace.set_tracer_provider(provider)
    _EXPORTING = True


def engine_exports(service: str) -> None:
    """In a worker whose vLLM engine exports to the endpoint (its `otlp_traces_endpoint`: vLLM
    installs the tracer provider, which reads the service's name from OTEL_SERVICE_NAME)."""
    global _EXPORTING
    os.environ.setdefault(SERVICE_NAME_ENV, service)
    _EXPORTING = True


def tracing() -> bool:
    return _EXPORTING


@functools.cache
def tracer() -> trace.Tracer:
    """Made once: OpenTelemetry's `get_tracer` reads os.environ on every call (1.8 µs, four
    calls a request in the router). The tracer it gives before `export_to` (a proxy) uses the
    provider installed later, so one kept from before exports all the same."""
    return trace.get_tracer(TRACER)


def joined(headers: Mapping[str, str]) -> otel_context.Context | None:
    """The context a caller's `traceparent` header or metadata names (None without one, or
    when this process does not export)."""
    if not _EXPORTING or TRACEPARENT not in headers:
        return None
    return propagate.extract({TRACEPARENT: headers[TRACEPARENT]})


def from_client(headers: Mapping[str, str], trusted: bool) -> dict:
    """Where a request's span starts (`start_span`'s context and links), from its client's
    `traceparent`: a trusted client's trace goes on (the span is a child of its span); any
    other's is only linked from a new root, so that a client chooses neither the trace id nor,
    by clearing its sampled flag, whether the request is traced."""
    context = joined(headers)
    if context is None or trusted:
        return {"context": context}
    parent = trace.get_current_span(context).get_span_context()
    links = [trace.Link(parent)] if parent.is_valid else []
    return {"context": otel_context.Context(), "links": links}


def trace_headers(span: trace.Span) -> dict[str, str]:
    """`span`'s W3C trace context, for the next process's metadata ({} when not exporting)."""
    if not _EXPORTING:
        return {}
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return {key: value for key, value in carrier.items() if key == TRACEPARENT}


def flush(timeout_s: float = 5.0) -> None:
    """Export what is pending (at stop)."""
    provider = trace.get_tracer_provider()
    if _EXPORTING and hasattr(provider, "force_flush"):
        provider.force_flush(round(timeout_s * 1000))
