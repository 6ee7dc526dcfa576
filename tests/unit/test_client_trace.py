"""Review L4: a client's `traceparent` is continued only for a trusted caller (an operator or
admin key, or anyone on a router with no keys); any other client's is linked from a new root
span, so it picks neither the trace id nor, with its sampled flag, whether the request is
traced. An in-memory SDK tracer stands in for the OTLP exporter."""

import pytest
from opentelemetry.sdk.trace import TracerProvider

from pdserve.core import tracing

TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
SPAN_ID = 0xB7AD6B7169203331
UNSAMPLED = {"traceparent": f"00-{TRACE_ID:032x}-{SPAN_ID:016x}-00"}
SAMPLED = {"traceparent": f"00-{TRACE_ID:032x}-{SPAN_ID:016x}-01"}


@pytest.fixture
def tracer(monkeypatch):
    monkeypatch.setattr(tracing, "_EXPORTING", True)  # as with --otlp-endpoint
    return TracerProvider().get_tracer("test")


def test_an_untrusted_clients_traceparent_is_a_link_from_a_new_sampled_root(tracer):
    span = tracer.start_span("pdserve completions", **tracing.from_client(UNSAMPLED, False))
    assert span.parent is None
    assert span.context.trace_id != TRACE_ID
    assert span.is_recording() and span.context.trace_flags.sampled  # its flag cleared nothing
    [link] = span.links
    assert (link.context.trace_id, link.context.span_id) == (TRACE_ID, SPAN_ID)
    span.end()


def test_a_trusted_clients_trace_goes_on(tracer):
    span = tracer.start_span("pdserve completions", **tracing.from_client(SAMPLED, True))
    assert span.context.trace_id == TRACE_ID and span.parent.span_id == SPAN_ID
    assert not span.links
    span.end()


def test_without_a_traceparent_or_tracing_a_request_starts_its_own_trace(tracer, monkeypatch):
    assert tracing.from_client({}, False) == {"context": None}
    monkeypatch.setattr(tracing, "_EXPORTING", False)
    assert tracing.from_client(UNSAMPLED, False) == {"context": None}


def test_through_the_app_only_an_operator_keys_trace_goes_on(monkeypatch, tmp_path):
    from fastapi.testclient import TestClient
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pdserve.settings.router import RouterSettings
    from router import app as router_app
    from router.http.api_keys import ADMIN_ENV, ENV, OPERATOR_ENV
    from tests.fakes import FakeTokenizer

    for name in (ENV, OPERATOR_ENV, ADMIN_ENV):
        monkeypatch.delenv(name, raising=False)
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_EXPORTING", True)
    monkeypatch.setattr(tracing, "tracer", lambda: provider.get_tracer("pdserve"))
    monkeypatch.setattr(router_app, "PromptTokenizer", FakeTokenizer)
    operators = tmp_path / "operators"
    operators.write_text("sk-op\n")
    settings = RouterSettings(
        model="m", worker_addresses=[], api_key=["sk-client"], operator_api_key_file=str(operators)
    )
    traces = {}
    with TestClient(router_app.create_app(settings, "models/m")) as client:
        for key in ("sk-client", "sk-op"):
            exporter.clear()
            headers = {"authorization": f"Bearer {key}", **SAMPLED}
            body = {"prompt": "ab", "max_tokens": 1}
            assert client.post("/v1/completions", json=body, headers=headers).status_code == 503
            [span] = [s for s in exporter.get_finished_spans() if s.name == "pdserve completions"]
            traces[key] = span.context.trace_id
    assert traces["sk-client"] != TRACE_ID and traces["sk-op"] == TRACE_ID
