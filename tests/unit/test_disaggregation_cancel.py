"""The router tells the decode worker when no decode leg will run (security review 2026-12, H6):
router/flow/disaggregation.py's generate_disaggregated with fake workers, in after-prefill mode; a
request the prefill's first token ends (max_tokens 1, or EOS first), one whose client leaves
between the legs, and one whose prefill worker fails each cancel the transfer on the decode
worker exactly once; one whose decode leg runs cancels nothing. No engine, no network."""

import asyncio
import contextlib

from pdserve.protocol import worker_pb2
from router.flow import disaggregation
from router.flow.disaggregation import PrefillOutcome, generate_disaggregated
from router.http.errors import worker_failed


class Worker:
    """Stands in for router.workers.client.WorkerClient."""

    def __init__(self, name: str, chunks=(), error=None) -> None:
        self.worker_id = name
        self.kv_address = f"{name}:6000"
        self.tensor_parallel_size = 1
        self.kv_transport, self.host_id, self.device = "grpc", "", "cpu"
        self.users = 0
        self.chunks = list(chunks)
        self.error = error
        self.requests: list[worker_pb2.GenerateRequest] = []
        self.cancelled: list[tuple[str, str]] = []  # (transfer id, reason)

    @contextlib.contextmanager
    def in_use(self):
        self.users += 1
        try:
            yield self
        finally:
            self.users -= 1

    async def cancel_transfer(self, transfer_id: str, reason: str) -> None:
        await asyncio.sleep(0)  # a real call suspends
        self.cancelled.append((transfer_id, reason))

    async def generate(self, request, timeout: float):
        self.requests.append(request)
        for chunk in self.chunks:
            yield chunk
        if self.error is not None:
            raise self.error


def request(max_tokens: int) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id="cmpl-1",
        prompt_token_ids=[11, 12, 13],
        sampling=worker_pb2.SamplingParams(max_tokens=max_tokens),
    )


def run(prefill: Worker, decode: Worker, max_tokens: int, take: int | None = None):
    """Stream the request (the first `take` chunks only, then the client leaves); the chunks,
    once every cancel the router started is done."""

    async def go():
        chunks = []
        stream = generate_disaggregated(
            prefill, decode, request(max_tokens), 5.0, 30.0, PrefillOutcome()
        )
        try:
            async for chunk in stream:
                chunks.append(chunk)
                if take is not None and len(chunks) >= take:
                    break
        finally:
            await stream.aclose()
        while disaggregation._cancelling:
            await asyncio.gather(*disaggregation._cancelling)
        return chunks

    return asyncio.run(go())


def first_token(finish_reason: str = "length") -> Worker:
    return Worker(
        "prefill-a",
        chunks=[worker_pb2.GenerateChunk(token_ids=[1], text="Hi", finish_reason=finish_reason)],
    )


def decoding() -> Worker:
    return Worker(
        "decode-a",
        chunks=[worker_pb2.GenerateChunk(token_ids=[2], text="!", finish_reason="length")],
    )


def test_a_request_its_first_token_ends_cancels_the_transfer_once():
    prefill, decode = first_token(), decoding()
    chunks = run(prefill, decode, max_tokens=1)
    assert [c.text for c in chunks] == ["Hi"] and decode.requests == []
    assert [transfer for transfer, _ in decode.cancelled] == ["cmpl-1"]
    assert "first token ended the request" in decode.cancelled[0][1]
    assert decode.users == 0


def test_eos_as_the_first_token_cancels_the_transfer_once():
    prefill, decode = first_token("stop"), decoding()
    chunks = run(prefill, decode, max_tokens=16)
    assert [c.finish_reason for c in chunks] == ["stop"] and decode.requests == []
    assert [transfer for transfer, _ in decode.cancelled] == ["cmpl-1"]


def test_a_client_gone_between_the_legs_cancels_the_transfer_once():
    prefill, decode = first_token(""), decoding()
    chunks = run(prefill, decode, max_tokens=16, take=1)  # the client left after "Hi"
    assert [c.text for c in chunks] == ["Hi"] and decode.requests == []
    assert [transfer for transfer, _ in decode.cancelled] == ["cmpl-1"]
    assert "ended before it" in decode.cancelled[0][1]


def test_a_request_whose_decode_leg_runs_cancels_nothing():
    prefill, decode = first_token(""), decoding()
    chunks = run(prefill, decode, max_tokens=16)
    assert [c.text for c in chunks] == ["Hi", "!"]
    assert len(decode.requests) == 1 and decode.cancelled == []


def test_a_failed_prefill_cancels_the_transfer_once_even_as_its_task_is_cancelled():
    prefill = Worker("prefill-a", error=worker_failed("engine died"))
    decode = decoding()
    run(prefill, decode, max_tokens=16)
    assert [transfer for transfer, _ in decode.cancelled] == ["cmpl-1"]
    assert "prefill worker failed" in decode.cancelled[0][1]
