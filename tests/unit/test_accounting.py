"""What a request counts (router/flow/accounting.py): pdserve_requests_total once per HTTP request
whatever its prompts, and a disaggregated request's KV metrics labelled by what carried the KV
(gloo between CPU workers) next to the transport the router chose. Fake workers, no network."""

import asyncio
import time

from pdserve.core.kinds import RoutePath, RouteReason, Transport
from pdserve.costs.path_prices import RouteDecision
from pdserve.protocol import worker_pb2
from router.flow.accounting import Accounting, timing_breakdown
from router.flow.disaggregation import PrefillOutcome
from router.flow.request_run import Admitted, RequestRun
from router.flow.route_choice import Attempt
from router.http.responses import CompletionShape, OutputOptions, Prompt
from router.metrics import RouterMetrics
from tests.fakes import FakeWorker, answering, router_over

PROMPT = [11, 12, 13, 14, 15]


def batch(size: int) -> Admitted:
    """A /v1/completions request with `size` prompts."""
    runs = [RequestRun(f"cmpl-1-{n}", len(PROMPT), time.monotonic()) for n in range(size)]
    requests = [
        worker_pb2.GenerateRequest(
            request_id=run.request_id,
            prompt_token_ids=PROMPT,
            sampling=worker_pb2.SamplingParams(max_tokens=3),
        )
        for run in runs
    ]
    prompts = [Prompt(list(PROMPT)) for _ in runs]
    return Admitted("cmpl-1", runs, requests, prompts, OutputOptions(), False, False)


def requests_total(flow, status: str) -> float | None:
    labels = {"endpoint": "completions", "status": status}
    return flow.metrics.registry.get_sample_value("pdserve_requests_total", labels)


def test_a_batch_is_one_request_in_the_status_count_when_it_succeeds():
    flow = router_over(answering("decode-a"))
    admitted = batch(3)

    async def go():
        started = await flow.starter.start_all(admitted)
        shape = CompletionShape("cmpl-1", "m")
        return await flow.relay.collect(admitted, started, shape, "completions")

    body = asyncio.run(go())
    assert len(body["choices"]) == 3
    assert requests_total(flow, "200") == 1
    prompt_tokens = flow.metrics.registry.get_sample_value("pdserve_prompt_tokens_total")
    assert prompt_tokens == 3 * len(PROMPT)  # the runs are each counted in the token totals


def test_a_batch_is_one_request_in_the_status_count_when_its_stream_fails():
    aborting = FakeWorker(
        "decode-a",
        chunks=[
            worker_pb2.GenerateChunk(token_ids=[1], text="Hi"),
            worker_pb2.GenerateChunk(finish_reason="abort"),
        ],
    )
    flow = router_over(aborting)
    admitted = batch(2)

    async def go():
        started = await flow.starter.start_all(admitted)
        shape = CompletionShape("cmpl-1", "m")
        return [event async for event in flow.relay.stream(admitted, started, shape, "completions")]

    events = asyncio.run(go())
    assert '"code":"worker_error"' in events[-2] and events[-1] == "data: [DONE]\n\n"
    assert requests_total(flow, "502") == 1
    assert requests_total(flow, "200") is None


def disaggregated_run(carried_by: str, chosen: Transport) -> RequestRun:
    decision = RouteDecision(RoutePath.DISAGGREGATED, RouteReason.HEADER)
    attempt = Attempt(FakeWorker("decode-a"), FakeWorker("prefill-a", "prefill"), decision)
    run = RequestRun("cmpl-1", len(PROMPT), time.monotonic(), attempt=attempt)
    run.prefill = PrefillOutcome(transport=chosen, chunk=worker_pb2.GenerateChunk())
    run.prefill.done.set()
    run.cached_tokens = len(PROMPT)  # the decode worker computed none of the prompt
    run.last_chunk = worker_pb2.GenerateChunk(
        finish_reason="length",
        kv=worker_pb2.KvTransferStats(bytes=1 << 20, seconds=0.01, transport=carried_by),
    )
    return run


def test_kv_over_gloo_is_labelled_gloo_where_it_is_measured_and_nccl_where_chosen():
    metrics = RouterMetrics()
    run = disaggregated_run("gloo", Transport.NCCL)
    Accounting(metrics).finish(run)
    sample = metrics.registry.get_sample_value
    assert sample("pdserve_kv_transfer_bytes_count", {"transport": "gloo"}) == 1
    assert sample("pdserve_kv_transfer_seconds_count", {"transport": "gloo"}) == 1
    assert sample("pdserve_kv_transfer_bytes_count", {"transport": "nccl"}) is None
    chosen = {"transport": "nccl", "outcome": "loaded"}
    assert sample("pdserve_kv_transfers_total", chosen) == 1
    breakdown = timing_breakdown(run)
    assert (breakdown["kv_transport"], breakdown["kv_backend"]) == ("nccl", "gloo")


def test_kv_over_nccl_between_gpus_is_labelled_nccl_throughout():
    metrics = RouterMetrics()
    Accounting(metrics).finish(disaggregated_run("nccl", Transport.NCCL))
    sample = metrics.registry.get_sample_value
    assert sample("pdserve_kv_transfer_bytes_count", {"transport": "nccl"}) == 1
    assert sample("pdserve_kv_transfers_total", {"transport": "nccl", "outcome": "loaded"}) == 1
