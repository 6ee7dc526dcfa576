"""Traces across processes: a disaggregated request sent with a client's `traceparent` to the
default cluster (which exports to a real OTLP collector in this process) is one trace, from the
router (the request, its admission wait, its path choice, both legs, the KV transfer) through
both workers' calls down to vLLM's own request spans."""

import secrets

from tests.integration.conftest import SERVED_MODEL
from tests.integration.http_client import HTTP
from tests.integration.prompts import PROMPTS

ROUTER_SPANS = {
    "pdserve completions",
    "pdserve.admission",
    "pdserve.route",
    "pdserve.prefill_leg",
    "pdserve.decode_leg",
    "pdserve.kv_transfer",
}


def attribute(span, key: str):
    for item in span.attributes:
        if item.key == key:
            value = item.value
            return value.string_value or value.int_value or value.bool_value
    return None


def test_a_disaggregated_request_is_one_trace_from_the_router_to_vllm_on_both_workers(
    server, trace_collector
):
    trace_id, client_span = secrets.token_bytes(16), secrets.token_bytes(8)
    reply = HTTP.post(
        f"{server.base_url}/completions",
        json={"model": SERVED_MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0},
        headers={
            "traceparent": f"00-{trace_id.hex()}-{client_span.hex()}-01",
            "x-pdserve-route": "disaggregated",
        },
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    both_workers = {"pdserve.worker.generate": 2, "llm_request": 2}
    spans = trace_collector.wait_for_spans(trace_id, dict.fromkeys(ROUTER_SPANS, 1) | both_workers)
    by_id = {span.span_id: (service, span) for service, span in spans}

    def parent(span):
        return by_id.get(span.parent_span_id, ("", None))

    (root,) = [span for _, span in spans if span.name == "pdserve completions"]
    assert root.parent_span_id == client_span  # the client's trace, continued
    assert attribute(root, "pdserve.request_id") == reply.headers["x-request-id"]
    for service, span in spans:
        if span.name in ROUTER_SPANS - {"pdserve completions"}:
            assert service == "pdserve-router" and parent(span)[1] is root, span.name
    workers = [(service, span) for service, span in spans if span.name == "pdserve.worker.generate"]
    legs = {attribute(span, "pdserve.leg"): service for service, span in workers}
    assert legs == {"prefill": "pdserve-prefill", "decode": "pdserve-decode"}
    for _, span in workers:  # each the child of the router's call to it
        assert parent(span)[1].name == f"pdserve.{attribute(span, 'pdserve.leg')}_leg"
    engine_spans = [(service, span) for service, span in spans if span.name == "llm_request"]
    assert {service for service, _ in engine_spans} == {"pdserve-prefill", "pdserve-decode"}
    for service, span in engine_spans:  # vLLM's, under its worker's span
        assert parent(span)[1].name == "pdserve.worker.generate" and parent(span)[0] == service
    (transfer,) = [span for _, span in spans if span.name == "pdserve.kv_transfer"]
    assert attribute(transfer, "pdserve.kv_bytes") > 0
    assert transfer.end_time_unix_nano >= transfer.start_time_unix_nano
    print(f"one trace: {len(spans)} spans from {sorted({s for s, _ in spans})}")
