"""The router tells the decode worker when no decode leg will run (security review 2026-12, H6):
router/flow/disaggregation.py's generate_disaggregated with fake workers (tests/fakes.py), in
after-prefill mode; a request the prefill's first token ends (max_tokens 1, or EOS first), one
whose client leaves between the legs, and one whose prefill worker fails each cancel the
transfer on the decode worker exactly once; one whose decode leg runs cancels nothing. No
engine, no network."""

import asyncio

from pdserve.protocol import worker_pb2
from router.flow import disaggregation
from router.flow.disaggregation import PrefillOutcome, generate_disaggregated
from router.http.errors import worker_failed
from tests.fakes import FakeWorker


def request(max_tokens: int) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id="cmpl-1",
        prompt_token_ids=[11, 12, 13],
        sampling=worker_pb2.SamplingParams(max_tokens=max_tokens),
    )


def run(prefill: FakeWorker, decode: FakeWorker, max_tokens: int, take: int | None = None):
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


def first_token(finish_reason: str = "length") -> FakeWorker:
    return FakeWorker(
        "prefill-a",
        chunks=[worker_pb2.GenerateChunk(token_ids=[1], text="Hi", finish_reason=finish_reason)],
    )


def decoding() -> FakeWorker:
    return FakeWorker(
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
    prefill = FakeWorker("prefill-a", error=worker_failed("engine died"))
    decode = decoding()
    run(prefill, decode, max_tokens=16)
    assert [transfer for transfer, _ in decode.cancelled] == ["cmpl-1"]
    assert "prefill worker failed" in decode.cancelled[0][1]


def test_a_first_token_without_text_yet_is_sampled_again_by_the_decode_worker():
    """The prefill's first token is the first byte of a character (no text yet): the decode
    worker does not go on from it (its detokenizer, started on a prompt ending in a part of a
    character, would put the whole prompt in the answer) but samples it itself."""
    prefill = FakeWorker("prefill-a", chunks=[worker_pb2.GenerateChunk(token_ids=[40303])])
    decode = decoding()
    chunks = run(prefill, decode, max_tokens=16)
    assert [c.text for c in chunks] == ["!"]  # the decode worker's, from the first token on
    (sent,) = decode.requests
    assert (list(sent.prompt_token_ids), sent.sampling.max_tokens) == ([11, 12, 13], 16)
    assert decode.cancelled == []
